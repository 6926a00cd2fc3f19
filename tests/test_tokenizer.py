"""Tokenizer loading (GGUF, HF directory), chat template, streaming detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import IncrementalDetokenizer, Tokenizer, _plain_copy

MULTIBYTE = "Hello 世界! 🎉🇯🇵 naïve café — 東京タワー 👩‍👩‍👧 ok.\n  Ω≈ç√ 🤖"
CHAT = [{"role": "user", "content": "What is 2+2? 🤔"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Built from the embedded GGUF's metadata."""
    return Tokenizer.from_path(embedded_model_path())


# ------------------------------------------------------------------ loading


def test_hf_directory(tok: Tokenizer, tmp_path: Path) -> None:
    tok._hf.save_pretrained(tmp_path)
    loaded = Tokenizer.from_path(tmp_path, eos_token_ids=[7])
    assert loaded.encode(MULTIBYTE) == tok.encode(MULTIBYTE)
    assert loaded.eos_token_ids == tok.eos_token_ids | {7}


def test_bad_paths_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_path(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither"):
        Tokenizer.from_path(tmp_path / "weights.bin")


# ----------------------------------------------------------------- behaviour


@pytest.mark.parametrize("text", ["Hello, world!", MULTIBYTE, "  leading and trailing  ", ""])
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_vocab_size_matches_embedding_rows(tok: Tokenizer) -> None:
    from quanta.model.gguf_header import GGUFHeader

    header = GGUFHeader(embedded_model_path())
    assert tok.vocab_size == len(header.fields["tokenizer.ggml.tokens"].value)


def test_eos_includes_tokenizer_eos_and_caller_ids(tok: Tokenizer) -> None:
    (im_end,) = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end in tok.eos_token_ids
    extra = Tokenizer.from_path(embedded_model_path(), eos_token_ids=[5, 6])
    assert extra.eos_token_ids == tok.eos_token_ids | {5, 6}


def test_encode_text_spells_special_tokens_out(tok: Tokenizer) -> None:
    """encode_text's tokenizer is the backend in all but the special-token flag (the same JSON state)."""
    assert tok._plain.to_str() == tok._backend.to_str()
    (im_end,) = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end in tok.encode("a<|im_end|>") and im_end not in tok.encode_text("a<|im_end|>")
    assert tok.encode_text("a<|im_end|>") == tok.encode_text("a<|im_") + tok.encode_text("end|>")


def test_plain_copy_keeps_normalizer_added_tokens_truncation_and_padding() -> None:
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.normalizer = tokenizers.normalizers.Lowercase()
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_tokens(["zz", tokenizers.AddedToken("Yy", normalized=True)])
    backend.add_special_tokens(["<s>"])
    backend.enable_truncation(4, stride=1, direction="left")
    backend.enable_padding(length=6, pad_id=2, pad_token="[UNK]")
    plain, round_trip = _plain_copy(backend), tokenizers.Tokenizer.from_str(backend.to_str())
    round_trip.encode_special_tokens = True
    assert plain.to_str() == backend.to_str()
    assert backend.encode("a <s> YY b").ids == [0, 5, 4, 1, 2, 2]
    # "<s>" as "<", "s", ">"; truncated from the left, padded
    assert plain.encode("a <s> YY b").ids == round_trip.encode("a <s> YY b").ids == [2, 2, 4, 1, 2, 2]


def test_chat_template(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template(CHAT)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is 2+2? 🤔<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    reference = tok._hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
    assert ids == reference["input_ids"]


def test_missing_chat_template_raises(tok: Tokenizer, tmp_path: Path) -> None:
    tok._hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer.from_path(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHAT)


# ------------------------------------------------------- incremental decoding


def _stream(tok: Tokenizer, ids: list[int], step: int = 1, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(ids[i:i + step] if step > 1 else ids[i]) for i in range(0, len(ids), step)]
    return deltas + [detok.flush()]


def test_streamed_deltas_add_up_one_token_at_a_time(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    # The text really splits characters across tokens, so holding back is exercised.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = _stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing left over after complete text
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE


@pytest.mark.parametrize("step", [2, 3, 7])
def test_streamed_deltas_add_up_several_tokens_at_a_time(tok: Tokenizer, step: int) -> None:
    ids = tok.encode(MULTIBYTE)
    deltas = _stream(tok, ids, step=step)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_truncated_character_is_held_until_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")[:-1]  # cut inside the emoji's bytes
    full = tok.decode(ids)
    assert full.endswith("\ufffd")
    deltas = _stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas[:-1])
    assert "".join(deltas) == full


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_in_stream(tok: Tokenizer, skip_special_tokens: bool) -> None:
    ids = tok.apply_chat_template(CHAT) + tok.encode("4 🎉") + sorted(tok.eos_token_ids)
    deltas = _stream(tok, ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode(MULTIBYTE * 8)
    assert len(ids) > 200
    windows: list[int] = []
    real_decode = tok.decode

    def spy(window, skip_special_tokens=True):
        windows.append(len(window))
        return real_decode(window, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    deltas = _stream(tok, ids)
    monkeypatch.undo()
    assert "".join(deltas) == tok.decode(ids)
    # A character spans at most 4 byte-level tokens: prefix chunk + pending <= 8.
    assert max(windows) <= 8
