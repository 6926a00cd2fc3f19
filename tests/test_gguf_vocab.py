"""Tokenizers built from a GGUF's own metadata, checked against llama.cpp's vocabulary test cases.

Each ``models/ggml-vocab-*.gguf`` of llama.cpp's tree comes with ``.inp`` (texts separated by
``\\n__ggml_vocab_test__\\n``) and ``.out`` (the ids llama.cpp's ``test-tokenizer-0`` expects, one
line of space-separated ids per text, tokenized without BOS/EOS and with special-token text as
plain text). The embedded SmolLM2 model must tokenize as Hugging Face's conversion of the same
GGUF does once that conversion is given SmolLM2's own pre-tokenizer (digits split first).
"""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest
import transformers
from tokenizers import pre_tokenizers

from llama_cpp_material import llama_cpp_tree, vocab_cases
from quanta.model.gguf_vocab import read_vocab
from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import Tokenizer

_SEPARATOR = "\n__ggml_vocab_test__\n"
#: vocabularies refused at load, with the reason the error gives (see docs/ARCHITECTURE.md)
REFUSED: dict[str, str] = {}
#: vocabularies whose decoding cannot give the text back (WordPiece lower-cases and drops spaces)
LOSSY = {"bert-bge"}


def _cases(path: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of ``path``'s ``.inp`` / ``.out`` files."""
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts), f"{path.name}: fewer expected lines than texts"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def _name(path: Path | None) -> str:
    return "unavailable" if path is None else path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")


@pytest.mark.parametrize("path", vocab_cases() or [None], ids=_name)
def test_vocab_matches_llama_cpp(path: Path | None) -> None:
    if path is None:
        llama_cpp_tree()  # skips with the reason printed
        pytest.skip("no vocabulary cases in llama.cpp's tree")
    name = _name(path)
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            Tokenizer.from_path(path)
        return
    tok = Tokenizer.from_path(path)
    cases = _cases(path)
    assert len(cases) > 10
    wrong = [(text, want, got) for text, want in cases if (got := tok.encode_text(text)) != want]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} differ, first: {wrong[0]!r}"
    if name not in LOSSY:
        unround = [text for text, want in cases if tok.decode(want, skip_special_tokens=False) != text]
        assert not unround, f"{name}: decoding does not give back {unround[:3]!r}"


def test_at_most_two_vocabularies_refused() -> None:
    assert len(REFUSED) <= 2


def _vocab_path(name: str) -> Path:
    path = llama_cpp_tree() / "models" / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        pytest.skip(f"{path.name} not in llama.cpp's tree")
    return path


@pytest.mark.parametrize(("name", "first", "last"), [
    ("llama-spm", [1], []),  # SentencePiece: BOS by default
    ("gpt-2", [], []),  # byte-level BPE: nothing unless the file asks
    ("llama-bpe", [128000], []),  # llama3 pre-tokenizer: BOS
    ("bert-bge", [101], [102]),  # WordPiece: CLS ... SEP
])
def test_special_tokens_added_as_the_file_says(name: str, first: list[int], last: list[int]) -> None:
    tok = Tokenizer.from_path(_vocab_path(name))
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert plain and tok.encode("Hello world") == first + plain + last


def test_control_text_is_special_only_where_asked() -> None:
    tok = Tokenizer.from_path(_vocab_path("phi-3"))
    end = tok.hf.convert_tokens_to_ids("<|end|>")
    assert tok.encode("a<|end|>", add_special_tokens=False)[-1] == end
    assert end not in tok.encode_text("a<|end|>")
    assert tok.decode(tok.encode("a<|end|>", add_special_tokens=False)) == "a"


def _write_gguf(path: Path, model: str, pre: str | None) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("model", "pre", "named"), [
    ("rwkv", None, "tokenizer model 'rwkv' is not supported"),
    ("gpt2", "kimi-k2", "pre-tokenizer 'kimi-k2' is not supported"),
])
def test_unsupported_tokenizer_is_one_line_error(tmp_path: Path, model: str, pre: str | None, named: str) -> None:
    path = _write_gguf(tmp_path / "v.gguf", model, pre)
    with pytest.raises(ValueError, match=named) as err:
        Tokenizer.from_path(path)
    assert "\n" not in str(err.value) and "v.gguf" in str(err.value)


def test_tiny_bpe_vocabulary_from_a_written_file(tmp_path: Path) -> None:
    tok = Tokenizer.from_path(_write_gguf(tmp_path / "v.gguf", "gpt2", "gpt-2"))
    assert tok.encode_text("ab") == [2] and tok.encode_text("ba") == [1, 0]
    assert read_vocab(tmp_path / "v.gguf").pre == "gpt-2"
    assert tok.hf.name_or_path == "v"  # what errors about the file's chat template name


# ------------------------------------------------------- the embedded model, as before

PIECES = ["Hello", " world", "  ", "\n", "\n\n", "\t", "世界", "🎉", "naïve", "'s", "'LL", "123456", " 3.14",
          "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "def f(x):\n    return x",
          "    ", "\r\n", "Ωmega", "—", "ÄÖÜ", "x=1;y=2", "https://a.b/c?d=e", "   \n  ", "'", "\"quoted\"",
          "\u00a0", "\u3000", "e\u0301", "<s>", "</s>", "<think>", " 42", "\n\n7"]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, Tokenizer]:
    """(built from the GGUF here, transformers' conversion with SmolLM2's own pre-tokenizer)."""
    path = embedded_model_path()
    converted = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    # transformers' converter splits words with GPT-2's pattern only; SmolLM2 (and llama.cpp's
    # ``smollm``) split digits off first
    converted.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return Tokenizer.from_path(path), Tokenizer(converted)


def test_embedded_model_tokenizes_as_converted(smollm2: tuple[Tokenizer, Tokenizer]) -> None:
    new, ref = smollm2
    rng = random.Random(7)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25))) for _ in range(250)]
    assert sum(map(len, texts)) > 5000
    for text in texts:
        assert new.encode(text) == ref.encode(text), text
        assert new.encode_text(text) == ref.encode_text(text), text
        ids = new.encode(text)
        assert new.decode(ids) == ref.decode(ids) and new.decode(ids, False) == ref.decode(ids, False) == text
    every = list(range(new.vocab_size))
    assert new.decode(every) == ref.decode(every) and new.decode(every, False) == ref.decode(every, False)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 🤔 <|im_end|>"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 + 3?"}]
    assert new.apply_chat_template(chat) == ref.apply_chat_template(chat)
    assert new.chat_template == ref.chat_template
    assert (new.vocab_size, new.eos_token_ids) == (ref.vocab_size, ref.eos_token_ids)
    for role in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(new.hf, role) == getattr(ref.hf, role)


def test_embedded_model_splits_digits_first(smollm2: tuple[Tokenizer, Tokenizer]) -> None:
    new, _ = smollm2
    # "   " before a digit is one piece once the digit is split off (GPT-2's pattern alone
    # would give "  " and " 3")
    assert new.encode_text("x   3") == new.encode_text("x   ") + new.encode_text("3")
