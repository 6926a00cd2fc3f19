"""The KV block pool: its bookkeeping, the budget flags, block accounting and
preemption under every policy (a fake executor: no model), and greedy answers
unchanged by preemption (the embedded model)."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.block_pool import BlockPool
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.kv_budget import format_bytes, num_blocks, parse_bytes
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model

BLOCK = 8
POLICIES = [
    ("static", {}), ("continuous", {"admit_k": 2}), ("chunked", {"admit_k": 1, "chunk": 5, "prefill_cap": 16}),
    ("budget", {"max_num_batched_tokens": 12}), ("batched", {"prefill_quantum": 6, "mixed_prefill_quantum": 3, "prefill_cap": 16}),
]


def test_pool_counts_holders_and_frees_a_block_at_zero():
    pool = BlockPool(4, BLOCK)
    a = pool.allocate(3)
    assert (pool.num_free, pool.num_used) == (1, 3)
    pool.share(a[0])
    pool.release(a)
    assert pool.num_free == 3 and pool.refs(a[0]) == 1
    pool.release([a[0]])
    assert pool.num_free == 4 and all(pool.refs(b) == 0 for b in range(4))
    with pytest.raises(MemoryError):
        pool.allocate(5)
    assert pool.num_free == 4  # nothing taken
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a[0]])
    with pytest.raises(ValueError, match="free"):
        pool.share(a[1])


@pytest.mark.parametrize("text, size", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096),
                                        ("3 kib", 3072)])
def test_sizes_parse(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["2 gigs", "0", "-1GiB", "GiB", ""])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_the_budget_in_blocks():
    assert num_blocks(1000, 32, 100, 4, tokens=200) == 7
    assert num_blocks(1000, 32, 100, 4, memory=10_500) == 10
    assert num_blocks(1000, 32, 100, 4) == 16  # 4 sequences of 100 tokens (4 blocks each); far below half the memory
    with pytest.raises(ValueError, match="--kv-cache-memory 3000 bytes holds 96 tokens"):
        num_blocks(1000, 32, 100, 4, memory=3000)
    with pytest.raises(ValueError, match="--kv-cache-tokens 90"):
        num_blocks(1000, 32, 100, 4, tokens=90)


class BlockCheckingExecutor(Executor):
    """Returns token 7 for each chunk that reaches its sequence's end; checks before every step
    that each chunk's positions have blocks and that no block is in two running tables."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[tuple] = []

    def execute(self, plan, interrupt=None):
        held = [b for s in self.scheduler.running for b in s.block_ids]
        pool = self.scheduler.blocks.pool
        assert all(pool.refs(b) >= held.count(b) for b in held)  # shared blocks: one reference per table
        written = [b for s in self.scheduler.running for b in s.block_ids[s.num_computed_tokens // BLOCK:]]
        assert len(written) == len(set(written)) and all(pool.refs(b) == 1 for b in written)  # written blocks: private
        for c in plan.chunks:
            assert len(c.seq.block_ids) * BLOCK >= c.seq.num_computed_tokens + c.num_new_tokens
        self.steps.append((plan.kind, tuple(c.seq.seq_id for c in plan.chunks), tuple(c.num_new_tokens for c in plan.chunks)))
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None for c in plan.chunks])


def _engine(name: str, knobs: dict, blocks: int | None, prefix_cache: bool = True, seqs: int = 4) -> Engine:
    sched = SchedulerConfig(name, seqs, knobs).build()
    if blocks is not None:
        sched.use_blocks(BlockPool(blocks, BLOCK), prefix_cache)
    return Engine(sched, BlockCheckingExecutor(sched), max_model_len=64)


def _drive(engine: Engine, rng: random.Random, requests: int, cancel: float) -> list:
    """Add ``requests`` random requests a few at a time (prompts drawn from a few shared prefixes),
    cancel each live one with probability ``cancel`` a step, run to the end."""
    prefixes = [[rng.randint(0, 50) for _ in range(40)] for _ in range(3)]
    seqs, added = [], 0
    for _ in range(100_000):
        for _ in range(rng.randint(0, 3)):
            if added < requests:
                n = rng.randint(1, 40)
                prompt = rng.choice(prefixes)[:rng.randint(0, n)] + [rng.randint(0, 50) for _ in range(n)]
                prompt = prompt[:44]
                seqs.append(engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 64 - len(prompt)), temperature=0)))
                added += 1
        live = list(engine.sequences)
        if live and rng.random() < cancel:
            engine.abort(rng.choice(live))
        if not engine.has_work() and added == requests:
            break
        engine.step()
    assert added == requests and not engine.has_work()
    return seqs


@pytest.mark.parametrize("name, knobs", POLICIES, ids=[p[0] for p in POLICIES])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_no_block_leaks_after_1000_random_requests_with_cancels(name, knobs, prefix_cache):
    engine = _engine(name, knobs, 24, prefix_cache)
    seqs = _drive(engine, random.Random(name), 1000, cancel=0.2)
    blocks = engine.scheduler.blocks
    pool = blocks.pool
    assert pool.num_free + blocks.num_cached == pool.num_blocks  # every block free or cached
    assert sum(pool.refs(b) for b in range(pool.num_blocks)) == blocks.num_cached  # a cached block's one holder: the cache
    assert blocks.num_cached == 0 or prefix_cache
    assert all(s.block_ids == [] for s in seqs)
    assert engine.scheduler.num_preemptions > 0  # 24 blocks for 4 sequences of up to 8: the pool ran short
    done = [s for s in seqs if s.finish_reason != "abort"]
    assert done and all(len(s.output_token_ids) == s.params.max_tokens for s in done)


@pytest.mark.parametrize("name, knobs", POLICIES, ids=[p[0] for p in POLICIES])
def test_with_blocks_to_spare_every_policy_plans_exactly_as_without_a_pool(name, knobs):
    traces = []
    for blocks in (None, 4 * 8):  # 4 slots x 64 positions: never short; no prefix cache (it changes plans)
        engine = _engine(name, knobs, blocks, prefix_cache=False)
        if blocks is None:
            engine.executor.execute = _unchecked(engine.executor)
        _drive(engine, random.Random(7), 200, cancel=0.0)
        traces.append([(r.kind, tuple(r.seq_ids), tuple(r.num_new_tokens)) for r in engine.trace.records])
        assert engine.scheduler.num_preemptions == 0
    assert traces[0] == traces[1] and len(traces[0]) > 200


def _unchecked(ex: BlockCheckingExecutor):
    def execute(plan, interrupt=None):
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None for c in plan.chunks])
    return execute


def test_the_most_recently_admitted_is_preempted_and_resumes_first():
    """Two slots; two sequences of 8 prompt tokens and 20 outputs in 4 blocks of 8, a third queued behind:
    the second admitted loses its blocks when the first needs a third block (position 16), waits
    at the queue's head until its 17 tokens fit, and is recomputed (its prompt as prefill, its
    outputs so far as decode rows that sample nothing) once the first ends; the third, admitted
    with it, is preempted in turn when the second needs its fourth block."""
    engine = _engine("continuous", {"admit_k": 1}, 4, prefix_cache=False, seqs=2)
    sched = engine.scheduler
    victims, preempt = [], sched.preempt
    sched.preempt = lambda seq: (victims.append((seq.seq_id, seq.num_computed_tokens)), preempt(seq))
    a, b = (engine.add_request([i + 1] * 8, SamplingParams(max_tokens=20, temperature=0)) for i in range(2))
    third = engine.add_request([9] * 8, SamplingParams(max_tokens=12, temperature=0))
    while engine.has_work():
        engine.step()
    steps = engine.executor.steps
    assert [len(s.output_token_ids) for s in (a, b, third)] == [20, 20, 12]
    assert [v[0] for v in victims] == [b.seq_id, third.seq_id] and victims[0][1] == 16 and sched.num_preemptions == 2
    assert steps[0] == ("prefill", (a.seq_id, b.seq_id), (8, 8))
    first_alone = next(i for i, s in enumerate(steps) if s[1] == (a.seq_id,))
    assert steps[first_alone - 1] == ("decode", (a.seq_id, b.seq_id), (1, 1))
    back = next(i for i, s in enumerate(steps) if i > first_alone and b.seq_id in s[1])
    assert all(a.seq_id in s[1] for s in steps[:back])  # b returns only after a ended
    assert steps[back] == ("prefill", (b.seq_id, third.seq_id), (8, 8))  # b first: it kept the queue's head
    recompute = [s for s in steps[back + 1:back + 10] if b.seq_id in s[1]]
    assert len(recompute) == 9 and all(kind == "decode" for kind, _, _ in recompute)  # 8 known outputs, then a new one


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32)


def _greedy(loaded, engine_cfg: EngineConfig) -> tuple[list[list[int]], int]:
    engine = build_engine(loaded, engine_cfg, SchedulerConfig("batched", 4, {"prefill_quantum": 16, "mixed_prefill_quantum": 8}))
    rng = random.Random(3)
    prompts = [[rng.randint(100, 40000) for _ in range(n)] for n in (20, 9, 27, 14)]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.output_token_ids for s in seqs], engine.scheduler.num_preemptions


def test_preemption_changes_no_greedy_token(loaded):
    ample, preempted = _greedy(loaded, EngineConfig(max_model_len=48, block_size=8)), \
        _greedy(loaded, EngineConfig(max_model_len=48, block_size=8, kv_cache_tokens=48))
    assert ample[1] == 0 and preempted[1] > 0
    assert preempted[0] == ample[0]


def test_metrics_and_config_expose_the_pool(server):
    body = {"prompt": "Count to five: " + "one two three four five " * 12, "max_tokens": 4}
    httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).raise_for_status()
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    used, cached, free, total = (values[f"quanta:kv_blocks_{k}"] for k in ("used", "cached", "free", "total"))
    config = httpx.get(server.base_url + "/v1/config", timeout=10).json()
    assert used + cached + free == total == config["kv_cache_blocks"] > 0 and cached > 0  # the prompt's full blocks stay cached
    assert config["kv_cache_tokens"] == total * config["block_size"]
    assert config["kv_cache_dtype"] == {"bfloat16": "bfloat16", "float32": "float16"}[config["dtype"]]  # auto
    assert values["quanta:num_preemptions"] == 0
    assert values["quanta:kv_usage_ratio"] == values["quanta:kv_cache_usage_perc"] == used / total
    assert values["process_resident_memory_bytes"] > 50 * 2**20  # the server process itself (prometheus_client)


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (23040, "22.5 KiB"),
                                    (3 * 2**30 // 2, "1.50 GiB"), (12 * 2**20, "12.0 MiB"), (2**41, "2.00 TiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text
