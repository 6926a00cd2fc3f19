"""The simulated engine's KV block pool (:mod:`quanta.sim.pool`) and ``quanta advise``'s pool advice.

The scheduler, block tables and prefix cache are the engine's own; these tests check that the simulator
gives them the budget ``quanta serve`` would, plans exactly as a plain engine over the same pool, charges
only the tokens it computes, and reports what the pool did. Every time is virtual.
"""

from __future__ import annotations

import json

import pytest

from quanta import cli
from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.engine.block_pool import BlockPool
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.kv_budget import KVBudgetError
from quanta.engine.sampling import SamplingParams
from quanta.moe.advisor import advise_pool, format_pool_advice
from quanta.sim import Profile
from quanta.sim.compare import condition_pool
from quanta.sim.pool import PoolSpec, block_bytes, pool_from_flags
from quanta.sim.run import Simulation, simulate

#: SmolLM2-135M's KV geometry, bf16 cache: 2 x 30 x 3 x 32 x 64 x 2 bytes a block
KV = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"}
BLOCK_BYTES = 2 * 30 * 3 * 32 * 64 * 2


def prof(**meta) -> Profile:
    return Profile(prefill_points=[(128, 4e-3), (1024, 2e-3)], decode_points=[(1, 0.05), (4, 0.08)], overhead_s=0.01,
                   prefill_ctx=1e-7, decode_ctx=1e-6, meta=meta)


class Recorder(Executor):
    """No cost model: the scheduler's own plans, each chunk's (start, tokens) recorded."""

    def __init__(self):
        self.steps = []

    def execute(self, plan, interrupt=None):
        self.steps.append([(c.seq.seq_id, c.seq.num_computed_tokens, c.num_new_tokens) for c in plan.chunks])
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens >= c.seq.num_tokens else None for c in plan.chunks])


def _key(trace):
    return [(r["kind"], r["seq_ids"], r["num_new_tokens"], r["num_emitted"]) for r in trace]


# --------------------------------------------------------------------------- budget from the serve flags


def test_the_budget_in_blocks_is_the_one_quanta_serve_computes():
    p = prof(kv=KV)
    assert block_bytes(KV, 32) == BLOCK_BYTES and block_bytes(KV, 32, "float32") == 2 * BLOCK_BYTES
    assert pool_from_flags(p, 4, kv_cache_memory=40 * BLOCK_BYTES + 5).num_blocks == 40
    assert pool_from_flags(p, 4, kv_cache_memory=40 * BLOCK_BYTES, kv_cache_dtype="float32").num_blocks == 20
    assert pool_from_flags(p, 4, kv_cache_tokens=1000) == PoolSpec(32, 32, True, 1024)  # length limit: the pool
    assert pool_from_flags(p, 4, kv_cache_tokens=1000, max_model_len=500, prefix_cache=False) == PoolSpec(32, 32, False, 500)
    assert pool_from_flags(p, 4, max_model_len=100, block_size=16) == PoolSpec(4 * 7, 16, True, 100)  # serve's default
    assert pool_from_flags(p, 4).num_blocks is None  # nothing bounds it: never short
    with pytest.raises(KVBudgetError, match="--kv-cache-tokens 1000"):
        pool_from_flags(p, 4, kv_cache_tokens=1000, max_model_len=2000)
    with pytest.raises(ValueError, match="KV geometry"):
        pool_from_flags(prof(), 4, kv_cache_memory=10**9)
    with pytest.raises(ValueError, match="kv needs"):
        Profile.from_dict({**prof(kv={**KV, "dtype": "int3"}).to_dict()})


def test_compare_runs_a_condition_on_the_pool_its_server_reported():
    applied = {"kv_cache_blocks": 10, "block_size": 16, "prefix_cache": False, "max_model_len": 160}
    assert condition_pool(prof(), 4, ["--max-num-seqs", "4"], applied) == PoolSpec(10, 16, False, 160)
    flags = ["--kv-cache-tokens", "320", "--max-model-len", "160"]
    assert condition_pool(prof(), 4, flags, {"max_model_len": 160}) == PoolSpec(10, 32, True, 160)
    assert condition_pool(prof(), 4, ["--max-model-len", "256", "--no-prefix-cache"], None) == PoolSpec(32, 32, False, 256)


# --------------------------------------------------------------------------- admission, preemption, cost


@pytest.mark.parametrize("sched", [SchedulerConfig("batched", 4, {"prefill_quantum": 128, "mixed_prefill_quantum": 64}),
                                   SchedulerConfig("continuous", 4, {"admit_k": 2})], ids=lambda c: c.name)
def test_a_short_pool_preempts_step_for_step_as_the_engine_scheduler_and_charges_what_it_computes(sched):
    lengths, outputs, blocks = [200, 150, 260, 90, 180, 120], [40, 60, 30, 50, 45, 35], 24
    w = Workload(kind="burst", num_requests=len(lengths), prompt_words=1, max_tokens=1)
    run = Simulation(prof(), sched, w, prompt_lengths=lengths, output_lengths=outputs,
                     pool=PoolSpec(blocks, 32, prefix_cache=False)).run()
    scheduler = sched.build()
    scheduler.use_blocks(BlockPool(blocks, 32), prefix_cache=False)
    engine = Engine(scheduler, Recorder(), 1 << 20)
    for i, (n, m) in enumerate(zip(lengths, outputs)):
        engine.add_request([i + 1] * n, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert _key(run["trace"]) == _key(engine.trace.to_dicts())  # the same plans, preemptions included
    pool = run["kv_pool"]
    assert pool["preemptions"] == scheduler.num_preemptions > 0
    assert pool["blocks"] == blocks and pool["bounded"] and 0 < pool["peak_blocks"] <= blocks
    # every step's time is the cost model's of the chunks it ran: recomputed ones too, cached ones never
    p = prof()
    for rec, chunks in zip(run["trace"], engine.executor.steps):
        pre = [(start, n) for sid, start, n in chunks if start < lengths[sid]]
        dec = [start for sid, start, n in chunks if start >= lengths[sid]]
        assert rec["end"] - rec["start"] == pytest.approx(p.step_cost(pre, dec))
    computed = sum(sum(r["num_new_tokens"]) for r in run["trace"])
    assert pool["computed_tokens"] == computed
    assert computed - pool["recomputed_tokens"] == sum(n + m - 1 for n, m in zip(lengths, outputs))  # each position once
    assert pool["recomputed_tokens"] > 0
    assert all(s["completion_tokens"] == m for s, m in zip(run["samples"], outputs))


def test_with_blocks_to_spare_the_pool_changes_nothing():
    w = Workload(kind="poisson", num_requests=12, prompt_words=300, max_tokens=20, rate=5)
    sched = SchedulerConfig("batched", 4)
    free = simulate(prof(), sched, w)
    ample = simulate(prof(), sched, w, pool=PoolSpec(4 * 10, 32))
    assert _key(free["trace"]) == _key(ample["trace"]) and ample["kv_pool"]["preemptions"] == 0
    assert free["kv_pool"]["peak_blocks"] == ample["kv_pool"]["peak_blocks"] <= 40


def test_a_request_longer_than_max_model_len_fails_as_the_servers_400():
    w = Workload(kind="burst", num_requests=2, prompt_words=1, max_tokens=10)
    run = Simulation(prof(), SchedulerConfig("batched", 2), w, prompt_lengths=[50, 300],
                     pool=PoolSpec(8, 32, max_model_len=256)).run()
    ok, too_long = run["samples"]
    assert ok["error"] is None and ok["completion_tokens"] == 10
    assert too_long["error"] == "http_400" and "max_model_len (256)" in too_long["error_detail"]


def test_a_shared_prefix_is_computed_once_and_counted_as_hits():
    prefix = list(range(1, 331))  # 10 full blocks of 32, and 10 tokens more
    runs = {}
    for cache in (True, False):
        sim = Simulation(prof(), SchedulerConfig("batched", 2), Workload(kind="burst", num_requests=0), pool=PoolSpec(40, 32, cache))
        for i, t in enumerate((0.0, 100.0)):
            sim.schedule(t, 400, 2, prompt_ids=prefix + [1000 + i] * 70)
        runs[cache] = sim.run()
    hit, miss = runs[True], runs[False]
    assert [s["cached_tokens"] for s in hit["samples"]] == [0, 320]
    assert hit["kv_pool"]["cached_tokens"] == 320 and hit["kv_pool"]["prefix_hit_share"] == pytest.approx(320 / 800)
    assert miss["kv_pool"]["prefix_hit_share"] == 0
    second = [r for r in hit["trace"] if r["seq_ids"] == [1] and r["kind"] == "prefill"]
    assert sum(n for r in second for n in r["num_new_tokens"]) == 80  # only the uncached tail is computed ...
    assert second[0]["end"] - second[0]["start"] == pytest.approx(prof().step_cost([(320, 80)], []))  # ... and charged
    assert hit["kv_pool"]["computed_tokens"] == miss["kv_pool"]["computed_tokens"] - 320


# --------------------------------------------------------------------------- the command line


def test_simulate_reports_the_pool_in_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "pool"
    assert cli.main(["simulate", "--profile", "profiles/ds4_m3_ultra_seed.json", "--workload", "burst", "--num-requests", "8",
                     "--prompt-words", "500", "--max-tokens", "64", "--max-num-seqs", "4", "--kv-cache-tokens", "1100",
                     "--max-model-len", "1100", "--out", str(out), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "holds 1 of them at full context" in err  # quanta advise's check of the budget
    pool = json.loads(out.with_name("pool.json").read_text())["conditions"][0]["runs"][0]["kv_pool"]
    assert pool["blocks"] == 35 and pool["preemptions"] > 0 and pool["recomputed_tokens"] > 0
    md = out.with_name("pool.md").read_text()
    assert "## KV block pool" in md and f"| batched | 35 x 32 | {pool['peak_blocks']} " in md


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-memory", "1GiB"], "KV geometry"),
    (["--kv-cache-tokens", "100", "--max-model-len", "4096"], "--kv-cache-tokens 100"),
    (["--kv-cache-tokens", "4096", "--kv-cache-memory", "1GiB"], "not both"),
    (["--block-size", "12"], "--block-size"),
])
def test_simulate_refuses_a_budget_it_cannot_size(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--profile", "profiles/ds4_m3_ultra_seed.json", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


# --------------------------------------------------------------------------- quanta advise


def test_advise_pool_counts_a_shared_prefix_once():
    a = advise_pool(8, 1024, 32, budget_tokens=4096)
    assert (a.needed_blocks, a.max_num_seqs, a.fits) == (256, 4, False)
    shared = advise_pool(8, 1024, 32, budget_tokens=4096, shared_prefix=520)  # 16 full blocks shared, 16 own each
    assert (shared.needed_blocks, shared.max_num_seqs) == (16 + 8 * 16, 7)
    assert advise_pool(8, 1024, 32, budget_tokens=8192).fits and advise_pool(8, 1024, 32).max_num_seqs == 8
    assert "--max-num-seqs 7 or --kv-cache-tokens 4608" in format_pool_advice(shared, 8)


def test_the_advised_max_num_seqs_runs_without_preemption_and_one_more_does_not():
    """Sequences of 200 + 200 tokens (13 blocks) in a pool of 125 blocks: advise says 9 fit at full context.
    Simulated with 9 slots nothing is preempted; with 10, every prompt is admitted (7 blocks each) and the
    pool runs short as they decode."""
    advice = advise_pool(16, 400, 32, budget_tokens=4000)
    assert advice.max_num_seqs == 9
    w = Workload(kind="burst", num_requests=20, prompt_words=200, max_tokens=200)
    preemptions = {}
    for seqs in (advice.max_num_seqs, advice.max_num_seqs + 1):
        run = simulate(prof(), SchedulerConfig("batched", seqs), w, pool=pool_from_flags(prof(), seqs, kv_cache_tokens=4000))
        preemptions[seqs] = run["kv_pool"]["preemptions"]
        assert run["metrics"]["client"]["num_ok"] == 20
    assert preemptions == {9: 0, 10: preemptions[10]} and preemptions[10] > 0


def test_advise_command_prints_the_pool_advice(capsys):
    assert cli.main(["advise", "--max-num-seqs", "8", "--context", "4096", "--kv-cache-tokens", "16384",
                     "--shared-prefix", "2000"]) == 0
    out = capsys.readouterr().out
    assert "need 590 blocks of 32: --kv-cache-tokens 18880" in out and "holds 6 of them" in out
    assert "mixed prefill quantum" not in out  # no model, no experts: the pool advice alone


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "8"], "--max-num-seqs and --context"),
    (["--max-num-seqs", "8", "--context", "100", "--shared-prefix", "200"], "--shared-prefix"),
    (["--max-num-seqs", "0", "--context", "100"], "positive"),
])
def test_advise_refuses_bad_pool_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["advise", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def _not_modelled(md: str) -> str:
    return md.split("## What a simulation does not model")[1].split("\n## ")[0]


def test_the_report_lists_a_kv_budget_as_not_modelled_only_for_a_pool_without_one(tmp_path, capsys):
    """The pool table and the list of what a simulation leaves out agree: a budget's pool is modelled
    (it preempts); a run without a budget says its pool never ran short."""
    base = ["simulate", "--profile", "profiles/ds4_m3_ultra_seed.json", "--workload", "burst", "--num-requests", "8",
            "--prompt-words", "500", "--max-tokens", "64", "--max-num-seqs", "4", "--no-plots", "--out"]
    assert cli.main([*base, str(tmp_path / "short"), "--kv-cache-tokens", "1100", "--max-model-len", "1100"]) == 0
    assert cli.main([*base, str(tmp_path / "free")]) == 0
    capsys.readouterr()
    short, free = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("short", "free"))
    assert short["conditions"][0]["runs"][0]["kv_pool"]["preemptions"] > 0
    assert not free["conditions"][0]["runs"][0]["kv_pool"]["bounded"]
    short_md, free_md = ((tmp_path / f"{n}.md").read_text() for n in ("short", "free"))
    assert "## KV block pool" in short_md and "## KV block pool" in free_md
    assert "KV budget" not in _not_modelled(short_md) and "slot count" not in _not_modelled(short_md)
    assert "a KV budget for every condition" in _not_modelled(free_md)
    assert "| batched | unbounded |" in free_md
