"""Exact step traces of every scheduling policy, driven through the real Engine.

No model: a fake executor returns token 7 (never EOS) for each chunk that reaches
the end of its sequence, else None, and advances a virtual clock 1.0 s per step.
Expected traces are derived by hand in the comments as (kind, seq_ids,
num_new_tokens). The first output token is sampled at the end of the prefill,
so max_tokens=N means N-1 decode steps.
"""

from __future__ import annotations

import random
import re

import pytest

from quanta.config import SchedulerConfig
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.policies import (
    POLICIES,
    BatchedScheduler,
    BudgetScheduler,
    ChunkedScheduler,
    ContinuousScheduler,
    StaticScheduler,
)
from quanta.engine.sampling import SamplingParams
from quanta.engine.sequence import Sequence

P, D, M = "prefill", "decode", "mixed"


class FakeExecutor(Executor):
    """Checks each plan, records its kind as executed; owns the virtual clock ``t``
    (seconds), advanced 1.0 s per step."""

    def __init__(self, scheduler, check=None) -> None:
        self.scheduler, self.check, self.t = scheduler, check, 0.0
        self.kinds: list[str] = []

    def execute(self, plan, interrupt=None):
        seqs = [c.seq for c in plan.chunks]
        assert plan.chunks and len(set(map(id, seqs))) == len(seqs) <= self.scheduler.max_num_seqs
        for c in plan.chunks:
            assert c.seq.slot is not None and 1 <= c.num_new_tokens
            assert c.seq.num_computed_tokens + c.num_new_tokens <= c.seq.num_tokens
        if self.check:
            self.check(plan)
        self.kinds.append(plan.kind)  # before the engine advances the sequences
        self.t += 1.0
        return StepResult([7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None for c in plan.chunks])


def run(scheduler, requests, check=None, preset=None):
    """Run (prompt_len, max_tokens) requests, all arriving at t=0, to completion.

    ``preset`` maps request index -> num_computed_tokens set before stepping.
    """
    ex = FakeExecutor(scheduler, check)
    engine = Engine(scheduler, ex, max_model_len=20_000, clock=lambda: ex.t)
    seqs = [engine.add_request([1] * n, SamplingParams(max_tokens=m, temperature=0)) for n, m in requests]
    for i, pos in (preset or {}).items():
        seqs[i].num_computed_tokens = pos
    for _ in range(100_000):  # bounded: a stuck policy fails instead of hanging
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work()
    assert [len(s.output_token_ids) for s in seqs] == [m for _, m in requests]
    recs = list(engine.trace.records)
    assert [(r.start, r.end) for r in recs] == [(float(i), i + 1.0) for i in range(len(recs))]
    return engine, ex


def steps(scheduler, requests, **kw):
    """``engine.trace.records`` as [(kind, seq_ids, num_new_tokens)]."""
    engine, _ = run(scheduler, requests, **kw)
    return [(r.kind, tuple(r.seq_ids), tuple(r.num_new_tokens)) for r in engine.trace.records]


def counts(trace):
    return {k: sum(s[0] == k for s in trace) for k in (P, D, M)}


def test_static_admits_only_into_an_empty_engine():
    # 3 slots; prompts 5,3,4,2; max_tokens 2,3,1,2. Seq 2 ends at its prefill and
    # seq 0 after one decode, but seq 3 waits until seq 1 (3 tokens) is done too.
    trace = steps(StaticScheduler(3), [(5, 2), (3, 3), (4, 1), (2, 2)])
    assert trace == [(P, (0, 1, 2), (5, 3, 4)), (D, (0, 1), (1, 1)), (D, (1,), (1,)),
                     (P, (3,), (2,)), (D, (3,), (1,))]


@pytest.mark.parametrize("max_tokens, decodes", [(65, 512), (64, 504)])
def test_continuous_k_equal_to_slots_is_static(max_tokens, decodes):
    # 256 requests, 32 slots: 8 batches, each 1 prefill call + (max_tokens - 1) decodes,
    # so 64 decode steps per batch (512 in all) need max_tokens = 65.
    work = [(4, max_tokens)] * 256
    static = steps(StaticScheduler(32), work)
    cont = steps(ContinuousScheduler(32, admit_k=32), work)
    assert counts(static) == counts(cont) == {P: 8, D: decodes, M: 0}
    assert cont == static
    assert static[0] == (P, tuple(range(32)), (4,) * 32)
    assert static[max_tokens] == (P, tuple(range(32, 64)), (4,) * 32)


def test_continuous_admits_when_k_slots_free():
    # 3 slots, K=2, prompts 2, max_tokens 2,4,6,3,2.
    # s0 free 3>=2: prefill 0,1,2 (1st tokens). s1 decode: 0 done -> free 1 < K and 2 waiting.
    # s2,s3 decode 1,2: 1 done at s3 -> free 2. s4 prefill 3,4. s5 decode 2,3,4: 4 done.
    # s6 decode 2,3: both done.
    trace = steps(ContinuousScheduler(3, admit_k=2), [(2, 2), (2, 4), (2, 6), (2, 3), (2, 2)])
    assert trace == [(P, (0, 1, 2), (2, 2, 2)), (D, (0, 1, 2), (1, 1, 1)), (D, (1, 2), (1, 1)),
                     (D, (1, 2), (1, 1)), (P, (3, 4), (2, 2)), (D, (2, 3, 4), (1, 1, 1)), (D, (2, 3), (1, 1))]


def test_continuous_k1_refills_as_soon_as_one_slot_frees():
    # Same work, K=1. s1 decode: 0 done -> s2 prefill 3 alone. s3 decode 1,2,3.
    # s4 decode 1,2,3: 1 and 3 done -> s5 prefill 4. s6 decode 2,4: 4 done. s7 decode 2.
    trace = steps(ContinuousScheduler(3, admit_k=1), [(2, 2), (2, 4), (2, 6), (2, 3), (2, 2)])
    assert trace == [(P, (0, 1, 2), (2, 2, 2)), (D, (0, 1, 2), (1, 1, 1)), (P, (3,), (2,)),
                     (D, (1, 2, 3), (1, 1, 1)), (D, (1, 2, 3), (1, 1, 1)), (P, (4,), (2,)),
                     (D, (2, 4), (1, 1)), (D, (2,), (1,))]


def test_continuous_admits_fewer_than_k_waiting_once_all_fit():
    # 4 slots, K=3, max_tokens 2,3,5,5,2,3. s0 prefill 0-3. s1 decode: 0 done, free 1,
    # 2 waiting < K but 1 free < 2: no admission. s2 decode 1,2,3: 1 done, free 2 >= 2
    # waiting: s3 prefill 4,5 (free 2 < K). s4 decode 2,3,4,5: 4 done. s5 decode 2,3,5.
    trace = steps(ContinuousScheduler(4, admit_k=3), [(2, m) for m in (2, 3, 5, 5, 2, 3)])
    assert trace == [(P, (0, 1, 2, 3), (2,) * 4), (D, (0, 1, 2, 3), (1,) * 4), (D, (1, 2, 3), (1,) * 3),
                     (P, (4, 5), (2, 2)), (D, (2, 3, 4, 5), (1,) * 4), (D, (2, 3, 5), (1,) * 3)]


def test_chunked_64_token_prompt_with_chunk_8_takes_8_calls():
    # Nothing decodes meanwhile, so the 8 chunks run back to back; then 1 decode (max_tokens 2).
    trace = steps(ChunkedScheduler(1, admit_k=1, chunk=8, prefill_cap=4096), [(64, 2)])
    assert trace == [(P, (0,), (8,))] * 8 + [(D, (0,), (1,))]


def test_chunked_decodes_once_between_chunks_while_something_decodes():
    # 2 slots, chunk 8: r0 prompt 2 (max 6), r1 prompt 24 (max 2), one group.
    # s0 chunks 2 and 8: r0 decodes from now on, so one decode of r0 between chunks of r1;
    # s4 ends r1's prompt; s5 decodes both (r1 done); s6, s7 decode r0 (tokens 5, 6).
    trace = steps(ChunkedScheduler(2, admit_k=1, chunk=8, prefill_cap=4096), [(2, 6), (24, 2)])
    assert trace == [(P, (0, 1), (2, 8)), (D, (0,), (1,)), (P, (1,), (8,)), (D, (0,), (1,)),
                     (P, (1,), (8,)), (D, (0, 1), (1, 1)), (D, (0,), (1,)), (D, (0,), (1,))]


def test_chunked_admits_nothing_while_a_group_prefills():
    # 2 slots: r0 prompt 2 (max 2), r1 prompt 24 (max 1), r2 prompt 16 (max 1).
    # s1 decode ends r0, freeing a slot, but r2 waits until r1's prompt is done (s3);
    # with nothing decoding the chunks run back to back.
    trace = steps(ChunkedScheduler(2, admit_k=1, chunk=8, prefill_cap=4096), [(2, 2), (24, 1), (16, 1)])
    assert trace == [(P, (0, 1), (2, 8)), (D, (0,), (1,)), (P, (1,), (8,)), (P, (1,), (8,)),
                     (P, (2,), (8,)), (P, (2,), (8,))]


def test_chunked_decodes_between_groups_too():
    # r0 prompt 2 (max 10), r1 prompt 8 (max 1), r2 prompt 8 (max 1); 2 slots.
    # s0 chunks r0, r1 (r1 done, slot free). s1 must decode r0 before the next group.
    # s2 prefills r2; then r0's tokens 3..10 take 8 decodes.
    trace = steps(ChunkedScheduler(2, admit_k=1, chunk=8, prefill_cap=4096), [(2, 10), (8, 1), (8, 1)])
    assert trace == [(P, (0, 1), (2, 8)), (D, (0,), (1,)), (P, (2,), (8,))] + [(D, (0,), (1,))] * 8


def test_chunked_chunks_stop_at_cap_multiples():
    # chunk 3, cap 4, prompt 10: 0-3, 3-4 (boundary), 4-7, 7-8 (boundary), 8-10.
    trace = steps(ChunkedScheduler(1, admit_k=1, chunk=3, prefill_cap=4), [(10, 1)])
    assert [s[2] for s in trace] == [(3,), (1,), (3,), (1,), (2,)]


def test_batched_round_robin_resumes_after_the_sequence_that_left():
    # 3 slots, quantum 4, r0/r2 prompt 8, r1/r3 prompt 4, all max_tokens 1 (no decodes).
    # s0 r0; s1 r1 (done, slot freed, r3 admitted); s2 r2 (next after r1 in admission
    # order, not r0 again); s3 r3 (done); s4 r0 (done); s5 r2 (done).
    trace = steps(BatchedScheduler(3, 4, 4, 64), [(8, 1), (4, 1), (8, 1), (4, 1)])
    assert trace == [(P, (i,), (4,)) for i in (0, 1, 2, 3, 0, 2)]


def test_batched_decode_first_cycle_and_quantum_switch():
    # 2 slots, prefill quantum 8, mixed quantum 2. r0 prompt 2 (max 3), r1 prompt 12 (max 1).
    # s0 r0 whole (nothing decodes: quantum 8). Cycles: decode r0, then 2 tokens of r1
    # (mixed quantum); s3 decode ends r0, so r1 continues with the prefill quantum 8, then 2.
    trace = steps(BatchedScheduler(2, 8, 2, 64), [(2, 3), (12, 1)])
    assert trace == [(P, (0,), (2,)), (D, (0,), (1,)), (P, (1,), (2,)), (D, (0,), (1,)),
                     (P, (1,), (8,)), (P, (1,), (2,))]


def test_batched_cap_split_from_position_1539():
    # From 1539 (quantum 2048, cap 4096): 1539+2048 = 3587; the next quantum crosses 4096
    # after 509 and continues with 1539 back to back (-> 5635); 5635+2048 = 7683; 509; 1539.
    trace = steps(BatchedScheduler(1, 2048, 2048, 4096), [(1539 + 8192, 1)], preset={0: 1539})
    assert [s[2][0] for s in trace] == [2048, 509, 1539, 2048, 509, 1539]


def _pieces(start: int, length: int, quantum: int, cap: int) -> list[int]:
    """Chunk sizes the batched scheduler plans for one lone prompt of ``length`` from ``start``."""
    sched = BatchedScheduler(1, quantum, quantum, cap)
    seq = Sequence(0, [1] * length, SamplingParams(max_tokens=1, temperature=0))
    sched.add(seq)
    seq.num_computed_tokens, out = start, []
    while seq.is_prefilling:
        (chunk,) = sched.schedule().chunks
        out.append(chunk.num_new_tokens)
        seq.num_computed_tokens += chunk.num_new_tokens
    return out


def test_batched_cap_split_property():
    rng = random.Random(1539)
    cases = [(s, q, c) for c in range(1, 10) for q in range(1, c + 1) for s in range(2 * c + 1)]
    cases += [(rng.randrange(3 * c), rng.randint(1, c), c) for c in (64, 100, 4096) for _ in range(60)]
    for start, quantum, cap in cases:
        length = start + rng.randint(1, 3 * cap + 5)
        pos, pieces = start, iter(_pieces(start, length, quantum, cap))
        while pos < length:  # each quantum: 1 piece, or 2 split exactly at a cap multiple
            want, got = min(quantum, length - pos), []
            while sum(got) < want:
                n = next(pieces)
                assert pos // cap == (pos + n - 1) // cap, (start, quantum, cap, pos, n)
                got.append(n)
                pos += n
            assert sum(got) == want and len(got) <= 2, (start, quantum, cap, got)
            assert len(got) == 1 or (pos - got[1]) % cap == 0
        assert next(pieces, None) is None


def test_budget_exact_fused_steps():
    # 3 slots, B=8. r0 prompt 3 (max 4), r1 prompt 10 (max 2), r2 prompt 6 (max 2), r3 prompt 2 (max 1).
    # s0: admit r0 (3), r1 (5 of 10) = 8.   s1: decode r0 (1), r1's last 5, admit r2 (2) = 8.
    # s2: decode r0, r1 (2), r2's last 4 = 6 (r1 done, r3 can't fit in s2: no free slot then).
    # s3: decode r0, r2 (2), admit r3 whole (2) = 4: r0, r2, r3 all done.
    trace = steps(BudgetScheduler(3, max_num_batched_tokens=8), [(3, 4), (10, 2), (6, 2), (2, 1)])
    assert trace == [(P, (0, 1), (3, 5)), (M, (0, 1, 2), (1, 5, 2)), (M, (0, 1, 2), (1, 1, 4)),
                     (M, (0, 2, 3), (1, 1, 2))]


@pytest.mark.parametrize("slots, budget", [(1, 1), (4, 4), (4, 7), (8, 32), (5, 512)])
def test_budget_never_exceeds_b_and_never_starves_decodes(slots, budget):
    sched = BudgetScheduler(slots, max_num_batched_tokens=budget)
    def check(plan):
        assert plan.num_tokens <= budget
        assert {id(c.seq) for c in plan.chunks if c.is_decode} == set(map(id, sched.decoding()))  # no starvation
        flags = [c.is_decode for c in plan.chunks]
        assert flags == sorted(flags, reverse=True)  # decodes first
        prefills = [c for c in plan.chunks if not c.is_decode]
        assert all(c.num_new_tokens == c.seq.num_prompt_tokens_left for c in prefills[:-1])  # FCFS
        if plan.num_tokens < budget:  # work-conserving: nothing runnable left out
            assert len(prefills) == len(sched.prefilling()) and not (sched.waiting and sched.num_free_slots)

    rng = random.Random(slots * 1000 + budget)
    work = [(rng.randint(1, 3 * budget), rng.randint(1, 12)) for _ in range(25)]
    assert counts(steps(sched, work, check=check))[M] > 0 or slots == 1


@pytest.mark.parametrize("name, knobs", [
    ("static", {}), ("continuous", {"admit_k": 3}), ("chunked", {"admit_k": 2, "chunk": 5, "prefill_cap": 7}),
    ("budget", {"max_num_batched_tokens": 9}), ("batched", {"prefill_quantum": 6, "mixed_prefill_quantum": 3, "prefill_cap": 8}),
])
def test_every_policy_completes_random_work(name, knobs):
    rng = random.Random(name)
    work = [(rng.randint(1, 40), rng.randint(1, 10)) for _ in range(30)]
    run(SchedulerConfig(name, 4, knobs).build(), work)  # run() asserts all outputs, plan sanity


def test_trace_kind_is_the_kind_executed():
    # A prompt-completing prefill chunk is a prefill (kind read before the sequence advances).
    engine, ex = run(StaticScheduler(1), [(4, 2)])
    assert [r.kind for r in engine.trace.records] == ex.kinds == [P, D]
    engine, ex = run(BudgetScheduler(2, 4), [(1, 2), (1, 1)])  # s0 prefills both; s1 decodes r0
    assert [r.kind for r in engine.trace.records] == ex.kinds == [P, D]


def test_config_defaults_build_every_policy():
    expected = {"static": StaticScheduler, "continuous": ContinuousScheduler, "chunked": ChunkedScheduler,
                "budget": BudgetScheduler, "batched": BatchedScheduler}
    for name, cls in expected.items():
        cfg = SchedulerConfig(name)
        assert type(cfg.build()) is cls and cfg.knobs == {k.name: k.default for k in POLICIES[name].knobs}
    assert SchedulerConfig("chunked").knobs == {"admit_k": 1, "chunk": 512, "prefill_cap": 4096}
    assert SchedulerConfig("budget").describe() == "scheduler=budget max_num_seqs=8 max_num_batched_tokens=512"
    SchedulerConfig("chunked", 8, {"admit_k": 8, "chunk": 4096})  # the limits themselves are accepted
    SchedulerConfig("budget", 16, {"max_num_batched_tokens": 16})


@pytest.mark.parametrize("name, seqs, knobs, message", [
    ("fifo", 8, {}, "unknown scheduler 'fifo'"),
    ("continuous", 8, {"chunk": 8}, "--chunk does not apply to --scheduler continuous"),
    ("static", 8, {"admit_k": 1}, "--admit-k does not apply to --scheduler static (it takes: no knobs)"),
    ("budget", 8, {"prefill_cap": 64}, "--prefill-cap does not apply"),
    ("static", 0, {}, "--max-num-seqs must be a positive integer, got 0"),
    ("continuous", 8, {"admit_k": 0}, "--admit-k must be a positive integer, got 0"),
    ("chunked", 8, {"chunk": -8}, "--chunk must be a positive integer, got -8"),
    ("budget", 8, {"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be a positive integer"),
    ("chunked", 8, {"chunk": True}, "--chunk must be a positive integer, got True"),
    ("chunked", 8, {"chunk": 5000}, "--chunk (5000) is larger than --prefill-cap (4096)"),
    ("chunked", 8, {"chunk": 9, "prefill_cap": 8}, "--chunk (9) is larger than --prefill-cap (8)"),
    ("continuous", 8, {"admit_k": 9}, "--admit-k (9) is larger than --max-num-seqs (8)"),
    ("budget", 16, {"max_num_batched_tokens": 15}, "--max-num-batched-tokens (15) is smaller than --max-num-seqs (16)"),
])
def test_config_errors(name, seqs, knobs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SchedulerConfig(name, seqs, knobs)


def test_default_quanta_follow_a_smaller_cap_explicit_ones_do_not():
    """``--prefill-cap 1024`` alone lowers the default quanta/chunk to the cap; an explicit larger one is an error."""
    assert SchedulerConfig("batched", 8, {"prefill_cap": 1024}).knobs == {
        "prefill_quantum": 1024, "mixed_prefill_quantum": 1024, "prefill_cap": 1024}
    assert SchedulerConfig("chunked", 8, {"prefill_cap": 256}).knobs["chunk"] == 256
    assert SchedulerConfig("batched", 8, {"prefill_cap": 8192}).knobs["prefill_quantum"] == 2048
    with pytest.raises(ValueError, match="--mixed-prefill-quantum"):
        SchedulerConfig("batched", 8, {"prefill_cap": 1024, "mixed_prefill_quantum": 2048})


def test_a_zero_cap_is_named_not_the_quanta_derived_from_it():
    with pytest.raises(ValueError, match="--prefill-cap must be a positive integer"):
        SchedulerConfig("batched", 8, {"prefill_cap": 0})
