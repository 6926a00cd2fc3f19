"""A synthetic MoE preset end to end: made by ``quanta make-model``, checked
against transformers, served by ``quanta serve --mixed-prefill-quantum auto``
with expert statistics in the trace and /metrics."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from quanta import cli
from quanta.model.attention import AttentionBatch
from quanta.model.llama import LlamaModel
from quanta.model.loader import load_checkpoint
from slot_cache import SlotCache

from moe_helpers import tiny_moe_dir


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return tiny_moe_dir(tmp_path_factory)


def test_make_model_writes_a_labelled_hf_directory_transformers_agrees_with(tiny_moe):
    hf = json.loads((tiny_moe / "config.json").read_text())
    assert "random weights" in hf["quanta_synthetic"] and hf["quanta_preset"] == "tiny-moe"
    assert (hf["n_routed_experts"], hf["num_experts_per_tok"], hf["n_shared_experts"]) == (64, 6, 1)
    assert (tiny_moe / "tokenizer.json").is_file()
    cfg, state = load_checkpoint(tiny_moe)
    assert cfg.synthetic == hf["quanta_synthetic"] and cfg.is_moe and cfg.router_scoring == "sigmoid"
    ours = LlamaModel(cfg)
    ours.load_hf_state_dict(state)
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    kv = SlotCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 64, cfg.head_dim, torch.float32)
    got = ours.compute_logits(ours(ids, AttentionBatch([kv.seq(0, 0, 24)], kv)))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_make_model_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "x").write_text("keep me")
    assert cli.main(["make-model", "--preset", "tiny-moe", "--out", str(tmp_path)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "x").read_text() == "keep me"


def test_serve_synthetic_moe_with_auto_quantum(tiny_moe, launch_server):
    server = launch_server("--model", str(tiny_moe), "--mixed-prefill-quantum", "auto", "--prefill-cap", "1024",
                           "--max-model-len", "1024", "--max-num-seqs", "2", "--dtype", "bf16")
    try:
        log = server.log()
        # 48 tokens per expert x 64 experts / 6 per token = 512, a power of two dividing 1024
        assert re.search(r"mixed_prefill_quantum=auto -> 512: E=64 routed experts, K=6", log), log[-3000:]
        assert "mixed_prefill_quantum=512" in log  # the startup line shows the resolved value
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            assert client.get("/v1/config").json()["mixed_prefill_quantum"] == 512
            reply = client.post("/v1/completions", json={"model": server.model, "prompt": "The experts are",
                                                          "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
            records = client.get("/v1/trace").json()
            records = records.get("records", records) if isinstance(records, dict) else records
            stats = [r["experts"] for r in records if r.get("experts")]
            assert stats and all(1 <= s["unique_experts"] <= 64 and s["num_layers"] == 2 for s in stats)
            decode = [s for r, s in zip(records, stats) if r["kind"] == "decode"]
            assert all(s["num_tokens"] == 1 and s["unique_experts"] == 6 for s in decode)  # one token hits exactly K
            metrics = client.get("/metrics").text
        count = re.search(r"^quanta:moe_unique_experts_count (\S+)$", metrics, re.M)
        assert count and float(count.group(1)) == len(stats), metrics[-2000:]
        assert re.search(r"^quanta:moe_last_tokens_per_expert \S+$", metrics, re.M)
    finally:
        server.stop()
