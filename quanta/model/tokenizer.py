"""Tokenizers (GGUF-embedded or Hugging Face directory) and streaming detokenization."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers

if TYPE_CHECKING:  # transformers takes ~1.5 s to import: loaded by from_path, on the thread that builds the tokenizer
    from transformers import PreTrainedTokenizerBase

#: What a byte-level decoder yields for an incomplete UTF-8 sequence.
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop ids.

    Decoding never applies ``clean_up_tokenization_spaces``: the text is
    exactly what the model produced, and streamed deltas
    (:class:`IncrementalDetokenizer`) add up to :meth:`decode` of all ids.

    Safe to share between threads: no call changes a setting of the Hugging
    Face tokenizer. Its ``split_special_tokens`` option is a flag on the one
    Rust tokenizer that every thread encodes with, so :meth:`encode_text`
    (special-token text as plain text) uses a second Rust tokenizer, a copy
    built once with that flag set, and :meth:`encode` calls the first one
    directly (Hugging Face's ``encode`` rewrites the flag on each call).
    The copy shares the first one's model (:func:`_plain_copy`).

    Attributes:
        eos_token_ids: ids that end generation: the tokenizer's EOS plus the
            ids given at construction (e.g. ``ModelConfig.eos_token_ids``).
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int] = ()) -> None:
        self._hf = hf_tokenizer
        self._backend: tokenizers.Tokenizer | None = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._plain: tokenizers.Tokenizer | None = None  # the copy that spells special tokens out
        if self._backend is not None:
            self._plain = _plain_copy(self._backend)
        # transformers' len() asks the Rust tokenizer, which counts the whole
        # vocabulary each time (~20 ms at 128k tokens): read once, it never changes.
        self._vocab_size = len(hf_tokenizer)
        self.eos_token_ids: set[int] = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(hf_tokenizer.eos_token_id)

    @classmethod
    def from_path(cls, path: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load the tokenizer of a ``.gguf`` file or a Hugging Face directory, offline.

        A GGUF's tokenizer is built from its own ``tokenizer.ggml.*`` metadata
        (:func:`quanta.model.gguf_vocab.load_gguf_tokenizer`), tokenizing as
        llama.cpp does.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: ``path`` is neither a ``.gguf`` file nor a directory, or
                its GGUF tokenizer model or pre-tokenizer is not supported.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at {path}")
        if path.is_dir():
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        elif path.suffix == ".gguf":
            from quanta.model.gguf_vocab import load_gguf_tokenizer

            hf = load_gguf_tokenizer(path)
        else:
            raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face directory")
        return cls(hf, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added/special tokens included.

        May be smaller than the model's embedding rows (padded vocabularies).
        """
        return self._vocab_size

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token id decodes to, over the whole vocabulary (special tokens
        included; a partial UTF-8 byte decodes to one character), which bounds a prompt's text;
        computed once, ~0.15 s at a 128k vocabulary (:func:`quanta.launch.load_model` has it
        computed on the thread that builds the tokenizer, beside the weights).

        Where the Hugging Face tokenizer's ``decode`` only hands the ids to its Rust tokenizer (a fast
        tokenizer whose class keeps transformers' ``decode`` and ``_decode``; :meth:`decode` turns
        the clean-up off), the Rust tokenizer decodes each id itself: the same text in a third of the time.
        """
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        decode = self.decode
        if type(self._hf).decode is PreTrainedTokenizerBase.decode and (
                getattr(type(self._hf), "_decode", None) is TokenizersBackend._decode):
            decode = self._hf.backend_tokenizer.decode
        return max(len(decode([i], skip_special_tokens=False)) for i in range(self.vocab_size))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, special-token text (``<|im_start|>``) as its special token;
        ``add_special_tokens`` adds BOS etc. as the tokenizer is configured to."""
        if self._backend is None:  # a slow (Python) tokenizer takes the option per call
            return self._hf.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=False)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of client ``text`` with special-token text spelled out as plain text (no BOS)."""
        if self._plain is None:
            return self._hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self._hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template text (None if it ships none)."""
        template = self._hf.chat_template
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        return template or None

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The underlying Hugging Face tokenizer (for grammar engines that build their own vocabulary)."""
        return self._hf

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for a chat: ``messages`` rendered with the model's own Jinja
        template, ending with the assistant generation prompt.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]`` (assistant
                messages may carry ``tool_calls``, as Hugging Face templates take them).
            tools: OpenAI-style function tools, passed to the template as its
                ``tools`` variable (templates that do not read it ignore them).

        Raises:
            ValueError: the model ships no chat template.
        """
        if not self._hf.chat_template:
            raise ValueError(
                "this model has no chat template; use plain completions instead of chat"
            )
        text = self._hf.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        # The template writes BOS and other specials itself.
        return self.encode(text, add_special_tokens=False)


def _plain_copy(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A tokenizer that encodes special-token text as plain text and otherwise as ``backend`` does:
    its model, normalizer, pre-tokenizer, post-processor and decoder are ``backend``'s own objects
    (a JSON round trip, ``from_str(backend.to_str())``, takes ~0.3 s at a 128k vocabulary), its
    added tokens, truncation and padding copies of them."""
    plain = tokenizers.Tokenizer(backend.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        if (value := getattr(backend, part)) is not None:
            setattr(plain, part, value)
    # in id order, after the normalizer (added tokens are matched on normalized text), as from_str adds them
    plain.add_tokens([token for _, token in sorted(backend.get_added_tokens_decoder().items())])
    if backend.truncation is not None:
        plain.enable_truncation(**backend.truncation)
    if backend.padding is not None:
        plain.enable_padding(**backend.padding)
    plain.encode_special_tokens = True
    return plain


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas.

    Each :meth:`add` decodes only a short window: the ids from
    ``prefix_offset`` (start of the last emitted chunk, kept as context so
    leading-space and byte-merging rules see the previous token) to the end,
    and returns what that text adds beyond the already emitted part of the
    window. Text ending in U+FFFD (half a UTF-8 character) is held back until
    the following ids complete it. The concatenation of all deltas plus
    :meth:`flush` equals ``tokenizer.decode(all_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: first id of the last emitted chunk
        self._read_offset = 0  # ids before this are emitted

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append one or several ids; return the newly completed text ('' if none yet)."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
        else:
            self._ids.extend(token_ids)
        emitted, text = self._window_texts()
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(emitted):]

    def flush(self) -> str:
        """Return whatever is still held back (possibly ending in U+FFFD); call once at the end."""
        emitted, text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(emitted):]

    def _window_texts(self) -> tuple[str, str]:
        """``(emitted, full)``: decoded ids[prefix:read] and ids[prefix:]."""
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        emitted = decode(window[: self._read_offset - self._prefix_offset], self._skip_special_tokens)
        return emitted, decode(window, self._skip_special_tokens)

