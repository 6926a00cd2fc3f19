"""A ``tokenizers.Tokenizer`` built from a GGUF file's own ``tokenizer.ggml.*`` metadata.

llama.cpp tokenizes with the vocabulary a GGUF carries: the token list, their types (normal,
unknown, control, user-defined, unused, byte), scores or merges, the special ids and flags.
:func:`load_gguf_tokenizer` reads the same keys (the header only, :func:`~quanta.model.gguf_header.read_header`) and
assembles the equivalent from ``tokenizers``' own parts, per ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE over the merges, words split by the patterns of the file's
  ``tokenizer.ggml.pre`` (:mod:`quanta.model.gguf_pretokenizers`);
- ``gemma4``: BPE over raw UTF-8 with spaces written ``▁``, lines split from newline runs,
  unknown bytes as ``<0xXX>`` tokens;
- ``llama`` (SentencePiece BPE): a space before the text (``add_space_prefix``), spaces written
  ``▁``, pieces merged in the order of their scores, unknown bytes as ``<0xXX>`` tokens;
- ``bert`` (WordPiece): lower-casing and accent stripping as the file says, longest-match
  word pieces (the file writes a word's first piece ``▁x`` and the others ``x``);
- ``t5`` (Unigram): the file's precompiled character map, spaces written ``▁``.

Control and unknown tokens become special added tokens (found in text only where special
tokens are parsed, skipped when decoding with ``skip_special_tokens``); user-defined tokens
become plain added tokens, found in any text before it is split, as llama.cpp does.
``add_bos_token`` / ``add_eos_token`` (and BERT's CLS/SEP) make the post-processor.
Decoding gives back the text exactly (no clean-up of spaces).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from quanta.model.gguf_header import read_header
from quanta.model.gguf_pretokenizers import ADD_BOS, IGNORE_MERGES, NO_BOS, split_patterns

__all__ = ["GGUFTokenizerFast", "GGUFVocab", "build_tokenizer", "load_gguf_tokenizer", "read_vocab"]

# token types, as llama.cpp's ``llama_token_type``
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SUPPORTED_MODELS = ("bert", "gemma4", "gpt2", "llama", "t5")
_SPACE = "\u2581"

#: the ids llama.cpp assumes when a file gives none, per tokenizer model
_DEFAULT_IDS: dict[str, dict[str, int]] = {
    "llama": {"bos": 1, "eos": 2, "unk": 0},
    "bert": {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103},
    "gpt2": {"bos": 11, "eos": 11},
    "t5": {"eos": 1, "unk": 2, "pad": 0},
    "gemma4": {},
}
#: (add_bos, add_eos) llama.cpp assumes when a file gives none, per tokenizer model
_DEFAULT_ADD = {"llama": (True, False), "bert": (True, False), "gpt2": (False, False),
                "t5": (False, True), "gemma4": (True, False)}
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "sep": "seperator_token_id", "pad": "padding_token_id", "mask": "mask_token_id"}


@dataclass
class GGUFVocab:
    """What a GGUF says about its tokenizer (``tokenizer.ggml.*`` and the chat template)."""

    model: str
    pre: str
    tokens: list[str]
    types: np.ndarray
    scores: np.ndarray | None = None
    merges: list[str] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/sep/pad/mask -> id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    remove_extra_whitespaces: bool = False
    lowercase: bool = True
    strip_accents: bool = True
    charsmap: bytes | None = None
    chat_template: str | dict[str, str] | None = None
    name: str = ""
    arch: str = ""

    def token(self, role: str) -> str | None:
        """Text of the ``role`` token (``bos``, ``eos``, ...), None if the file has none."""
        i = self.ids.get(role)
        return self.tokens[i] if i is not None else None


def read_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer metadata of GGUF ``path``.

    Raises:
        ValueError: the file has no tokenizer, or one of a model quanta does not build.
    """
    header = read_header(path)  # parsed once a load: the config has read it

    def get(key: str, default=None):
        f = header.get_field(key)
        return default if f is None else f.contents()

    model = get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        what = "has no tokenizer.ggml.model" if model is None else f"tokenizer model {model!r} is not supported"
        raise ValueError(f"{Path(path).name}: GGUF {what} (supported: {', '.join(SUPPORTED_MODELS)})")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(get("tokenizer.ggml.tokens", []))]
    types_field = header.get_field("tokenizer.ggml.token_type")
    types = (np.asarray(types_field.value, dtype=np.int32) if types_field is not None
             else np.full(len(tokens), NORMAL, dtype=np.int32))
    scores_field = header.get_field("tokenizer.ggml.scores")
    pre = get("tokenizer.ggml.pre", "") or ("gemma4" if model == "gemma4" else "")
    ids = _special_ids(model, pre, len(tokens), get)
    add_bos, add_eos = _DEFAULT_ADD[model]
    if model == "gpt2" and pre in ADD_BOS:
        add_bos = True
    add_bos = bool(get("tokenizer.ggml.add_bos_token", add_bos)) or model == "gemma4"
    add_eos = bool(get("tokenizer.ggml.add_eos_token", add_eos))
    lowercase = bool(get("tokenizer.ggml.normalizer.lowercase", True))
    charsmap = get("tokenizer.ggml.precompiled_charsmap")
    return GGUFVocab(
        model=model, pre=pre, tokens=tokens, types=types,
        scores=None if scores_field is None else np.asarray(scores_field.value, dtype=np.float32),
        merges=get("tokenizer.ggml.merges", []), ids=ids, add_bos=add_bos, add_eos=add_eos,
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", model in ("llama", "t5"))),
        remove_extra_whitespaces=bool(get("tokenizer.ggml.remove_extra_whitespaces", False)),
        lowercase=lowercase, strip_accents=bool(get("tokenizer.ggml.normalizer.strip_accents", lowercase)),
        charsmap=None if charsmap is None else np.asarray(charsmap, dtype=np.uint8).tobytes(),
        chat_template=_chat_templates(get), name=str(get("general.name", "")),
        arch=str(get("general.architecture", "")),
    )


def _special_ids(model: str, pre: str, n_tokens: int, get) -> dict[str, int]:
    """Role -> id: llama.cpp's defaults for ``model``, then the file's keys; ids outside the vocabulary dropped."""
    ids = dict(_DEFAULT_IDS[model])
    for role, key in _ID_KEYS.items():
        value = get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < n_tokens:
            ids[role] = int(value)
    if pre in NO_BOS:
        ids.pop("bos", None)
    return {role: i for role, i in ids.items() if 0 <= i < n_tokens}


def _chat_templates(get) -> str | dict[str, str] | None:
    """``tokenizer.chat_template``, or a dict with its named variants (``tool_use``) as ``default`` beside them."""
    default = get("tokenizer.chat_template")
    names = get("tokenizer.chat_templates") or []
    named = {n: t for n in names if (t := get(f"tokenizer.chat_template.{n}")) is not None}
    if not named:
        return default
    return ({"default": default} if default is not None else {}) | named


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer of GGUF ``path`` as a Hugging Face fast tokenizer (special tokens and chat template set).

    Raises:
        ValueError: the file's tokenizer model or pre-tokenizer is not one quanta builds.
    """
    vocab = read_vocab(path)
    try:
        backend = build_tokenizer(vocab)
    except ValueError as e:
        raise ValueError(f"{Path(path).name}: {e}") from None
    roles = {f"{role}_token": text for role in ("bos", "eos", "unk", "pad", "sep", "mask")
             if (text := vocab.token(role)) is not None}
    if vocab.model == "bert" and "bos_token" in roles:
        roles["cls_token"] = roles["bos_token"]
    # name_or_path: the file's name, which errors about its chat template cite
    return GGUFTokenizerFast(backend, chat_template=vocab.chat_template, clean_up_tokenization_spaces=False,
                             name_or_path=Path(path).stem, **roles)


class GGUFTokenizerFast(PreTrainedTokenizerFast):
    """A fast tokenizer over a backend built here, taken as is: ``tokenizer_object=`` would
    deep-copy it (a JSON round trip, ~0.5 s for a 128k vocabulary)."""

    def __init__(self, backend: tokenizers.Tokenizer, **kwargs) -> None:
        self._tokenizer = backend
        super().__init__(**kwargs)

    @classmethod
    def _patch_mistral_regex(cls, tokenizer: tokenizers.Tokenizer, *args, **kwargs) -> tokenizers.Tokenizer:
        """As built: its pre-tokenizer is llama.cpp's for the file's ``tokenizer.ggml.pre``.
        (transformers' own, for a vocabulary over 100k, asks the Hugging Face Hub whether a model
        named as the file is a Mistral one: a request on every start where a network is reachable.)"""
        return tokenizer


def build_tokenizer(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` equivalent to llama.cpp's for ``vocab``.

    Raises:
        ValueError: an unsupported pre-tokenizer, or a vocabulary without what its model needs.
    """
    build = {"gpt2": _byte_level_bpe, "gemma4": _spaced_bpe, "llama": _sentencepiece_bpe,
             "bert": _wordpiece, "t5": _unigram}[vocab.model]
    tok = build(vocab)
    tok.add_tokens(_added_tokens(vocab, special=False))
    tok.add_special_tokens(_added_tokens(vocab, special=True))
    tok.post_processor = _post_processor(vocab)
    return tok


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    """Text -> id (a repeated text keeps its last id, as llama.cpp's lookup does)."""
    return {t: i for i, t in enumerate(tokens)}


def _split_merge(merge: str) -> tuple[str, str] | None:
    """``"a b"`` -> ``("a", "b")``, split at the first space after the first character."""
    pos = merge.find(" ", 1)
    return None if pos < 0 else (merge[:pos], merge[pos + 1:])


def _merges(vocab: GGUFVocab, known: dict[str, int]) -> list[tuple[str, str]]:
    """The file's merges whose parts and result are tokens."""
    out = []
    for m in vocab.merges:
        pair = _split_merge(m)
        if pair is not None and pair[0] in known and pair[1] in known and pair[0] + pair[1] in known:
            out.append(pair)
    return out


def _byte_level_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """``gpt2``: byte-level BPE, words split by the pre-tokenizer's patterns."""
    patterns = split_patterns(vocab.pre)
    known = _vocab_dict(vocab.tokens)
    tok = tokenizers.Tokenizer(models.BPE(known, _merges(vocab, known), ignore_merges=vocab.pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spaced_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """``gemma4``: BPE over UTF-8 text with spaces as ``▁``, split only around newline runs."""
    known = _vocab_dict(vocab.tokens)
    bpe = models.BPE(known, _merges(vocab, known), byte_fallback=True, unk_token=vocab.token("unk"))
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _sentencepiece_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """``llama``: SentencePiece BPE; merges ranked by the merged piece's score (highest first)."""
    if vocab.scores is None:
        raise ValueError("a SentencePiece vocabulary needs tokenizer.ggml.scores")
    known = _vocab_dict(vocab.tokens)
    has_bytes = bool((vocab.types == BYTE).any())
    bpe = models.BPE(known, _score_merges(vocab.tokens, vocab.scores, known), unk_token=vocab.token("unk"),
                     byte_fallback=has_bytes, fuse_unk=True)
    tok = tokenizers.Tokenizer(bpe)
    steps = [normalizers.Prepend(_SPACE)] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    parts = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(parts)
    return tok


def _score_merges(tokens: list[str], scores: np.ndarray, known: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, the highest-scoring result first (ties: lower id)."""
    found: list[tuple[float, int, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if known.get(piece) != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = known.get(left), known.get(right)
            if li is not None and ri is not None:
                found.append((-float(scores[i]), i, li, ri, left, right))
    found.sort(key=lambda m: m[:4])
    return [(m[4], m[5]) for m in found]


def _wordpiece(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """``bert``: WordPiece; the file's ``▁word`` / ``piece`` spellings back to ``word`` / ``##piece``."""
    names = []
    for text, kind in zip(vocab.tokens, vocab.types.tolist()):
        if kind in (CONTROL, UNKNOWN) or (text.startswith("[") and text.endswith("]")):
            names.append(text)
        elif text.startswith(_SPACE):
            names.append(text[1:] or _SPACE)
        else:
            names.append("##" + text)
    unk = vocab.token("unk") or "[UNK]"
    tok = tokenizers.Tokenizer(models.WordPiece(_vocab_dict(names), unk_token=unk, max_input_chars_per_word=1 << 30))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=vocab.strip_accents, lowercase=vocab.lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return tok


def _unigram(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """``t5``: a Unigram model over the file's scores, normalized by its precompiled character map."""
    if vocab.scores is None:
        raise ValueError("a Unigram vocabulary needs tokenizer.ggml.scores")
    pieces = list(zip(vocab.tokens, vocab.scores.tolist()))
    tok = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=vocab.ids.get("unk"), byte_fallback=False))
    steps = [normalizers.Precompiled(vocab.charsmap)] if vocab.charsmap else []
    if vocab.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(steps)
    scheme = "always" if vocab.add_space_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=scheme, split=False)
    tok.decoder = decoders.Metaspace(replacement=_SPACE, prepend_scheme=scheme, split=False)
    return tok


def _added_tokens(vocab: GGUFVocab, special: bool) -> list[AddedToken]:
    """Control and unknown tokens (``special``) or user-defined ones, with llama.cpp's strip rules."""
    kinds = (CONTROL, UNKNOWN) if special else (USER_DEFINED,)
    chosen = np.flatnonzero(np.isin(vocab.types, kinds)).tolist()
    rstrip, lstrip = _strip_rules(vocab, chosen)
    return [AddedToken(vocab.tokens[i], special=special, normalized=False,
                       rstrip=vocab.tokens[i] in rstrip, lstrip=vocab.tokens[i] in lstrip) for i in chosen]


def _strip_rules(vocab: GGUFVocab, chosen: list[int]) -> tuple[set[str], set[str]]:
    """Texts of the added tokens that swallow the spaces after (``rstrip``) or before (``lstrip``) them."""
    name = vocab.name.lower()
    if "phi-3" in name or "phi3" in name:
        rstrip = {vocab.tokens[i] for i in chosen} | {"</s>"}
        return rstrip - {"<unk>", "<s>", "<|endoftext|>"}, set()
    if vocab.pre in ("jina-v2-de", "jina-v2-es", "jina-v2-code") or vocab.arch in ("nomic-bert-moe", "jina-bert-v3"):
        return set(), {"<mask>"}
    if "modern-bert" in name:
        return set(), {"[MASK]"}
    return set(), set()


def _post_processor(vocab: GGUFVocab) -> processors.TemplateProcessing:
    """BOS / EOS (BERT: CLS and SEP) around the text, as ``add_special_tokens`` asks."""
    first, last = [], []
    if vocab.model == "bert":
        first, last = ["bos"], ["sep"]
    else:
        first = ["bos"] if vocab.add_bos else []
        last = ["eos"] if vocab.add_eos else []
    first = [r for r in first if r in vocab.ids]
    last = [r for r in last if r in vocab.ids]
    texts = [vocab.tokens[vocab.ids[r]] for r in first + last]
    single = [*texts[:len(first)], "$A", *texts[len(first):]]
    pair = [*single, "$B:1", *texts[len(first):]]
    return processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=list({vocab.tokens[vocab.ids[r]]: vocab.ids[r] for r in first + last}.items()))
