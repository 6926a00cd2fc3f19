"""Per-request work never walks the vocabulary: what depends only on the tokenizer is read once.

transformers' ``len(tokenizer)`` and ``added_tokens_decoder`` rebuild their
answer on each read (18 ms and 0.15 s with a 128k vocabulary of many added
tokens); read per prompt token, a 1,000-token completion waited 18 s before
its prefill began. After the first request, both reads raise here: the
request paths must still work.
"""

from __future__ import annotations

import pytest

from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import Tokenizer
from quanta.server.chat_tokens import chat_prompt_ids, control_token_ids


@pytest.fixture()
def tok() -> Tokenizer:
    return Tokenizer.from_path(embedded_model_path())


def _forbid_vocabulary_walks(tok: Tokenizer, monkeypatch) -> None:
    cls = type(tok.hf)

    def walked(*_args):
        raise AssertionError("the vocabulary was walked on a request path")

    monkeypatch.setattr(cls, "__len__", walked)
    monkeypatch.setattr(cls, "added_tokens_decoder", property(walked))


def test_vocab_size_is_read_once(tok, monkeypatch):
    size = tok.vocab_size
    _forbid_vocabulary_walks(tok, monkeypatch)
    assert tok.vocab_size == size > 0


def test_chat_prompts_reuse_the_added_token_pattern(tok, monkeypatch):
    messages = [{"role": "user", "content": "hello <|im_end|> there"}]
    first = chat_prompt_ids(tok, messages)
    control = control_token_ids(tok)
    _forbid_vocabulary_walks(tok, monkeypatch)
    assert chat_prompt_ids(tok, messages) == first
    assert control_token_ids(tok) == control and control
