"""What ``quanta serve`` does before it answers ``/health``: the modules it imports before the model
loads, and the vocabulary bound the prompt checks take (``Tokenizer.max_token_chars``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quanta.model.gguf_vocab import GGUFTokenizerFast
from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import Tokenizer

#: imported later than the server modules: transformers by the tokenizer (on the thread that builds it,
#: beside the weights), llguidance's tokenizer bridge by the first grammar
LATER = ("transformers", "llguidance.hf")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(embedded_model_path())


def test_serve_imports_its_server_without_transformers():
    """Behaviour, not timing (``benchmarks/cli_startup.py --serve-model`` times it): a lazy import turned
    eager shows here; the tokenizer then imports transformers (so the check sees it when it is there)."""
    code = ("import sys\nimport quanta.cli, quanta.launch, quanta.server.run\n"
            f"print(sorted(m for m in {LATER!r} if m in sys.modules))\n"
            "from quanta.model.loader import embedded_model_path\n"
            "quanta.launch.Tokenizer.from_path(embedded_model_path())\n"
            "print('transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-2:] == ["[]", "True"], proc.stdout + proc.stderr


def test_max_token_chars_is_the_longest_decoded_token(tok):
    each = [len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size)]
    assert tok.max_token_chars == max(each)


class _Marked(GGUFTokenizerFast):
    """A tokenizer class with its own decoding (as some of transformers' model tokenizers have)."""

    def _decode(self, token_ids, **kwargs) -> str:
        return super()._decode(token_ids, **kwargs) + "<<marked>>"


def test_a_tokenizer_class_that_decodes_its_own_way_is_asked_itself(tok):
    hf = Tokenizer.from_path(embedded_model_path()).hf
    hf.__class__ = _Marked
    assert Tokenizer(hf).max_token_chars == tok.max_token_chars + len("<<marked>>")


def test_the_model_loads_with_the_collector_on_and_the_imports_frozen(monkeypatch, capsys):
    """``quanta serve`` imports with the garbage collector off, turns it on with the imported objects
    frozen before the load, and leaves the collector as it found it when the command ends."""
    import gc

    import quanta.server.run
    from quanta import cli
    from quanta.launch import ModelLoadError

    seen = {}

    def load_model(*args, **kwargs):
        seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
        raise ModelLoadError("--model: stopped by the test")

    monkeypatch.setattr(quanta.server.run, "load_model", load_model)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--port", str(_free_port())])
    assert info.value.code == 2 and "stopped by the test" in capsys.readouterr().err
    assert seen["enabled"] and seen["frozen"] > 10_000, seen
    assert gc.isenabled() and gc.get_freeze_count() == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_load_computes_the_prompt_bound_beside_the_weights(monkeypatch):
    """``max_token_chars`` (a decode of every id) is computed on the tokenizer's thread during the
    load, not by the server after it; the GIL changes hands more often while both threads run, and
    as before after."""
    import torch

    from quanta import launch

    seen, build = [], launch.load_block_model
    monkeypatch.setattr(launch, "load_block_model", lambda *args: seen.append(sys.getswitchinterval()) or build(*args))
    interval = sys.getswitchinterval()
    assert "max_token_chars" in vars(launch.load_model(None, torch.float32, "auto", prompt_weights="auto").tokenizer)
    assert seen and seen[0] < interval and sys.getswitchinterval() == interval
