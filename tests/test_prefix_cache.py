"""Prefix reuse across KV slots.

1. Slot choice of :class:`SlotPrefixCache` (pure Python).
2. Scheduling with reuse through the real Engine on a fake executor: only the
   uncached tail is prefilled, the prefill-cap split starts from where the
   tail starts, every policy benefits, running sequences are never taken.
3. The real model: greedy outputs of growing multi-turn sessions are the same
   with and without reuse, under several policies (fp32).
4. The live server: a second chat turn reports ``cached_tokens`` and moves the
   prefix-cache counters of ``/metrics``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.policies import POLICIES
from quanta.engine.prefix_cache import SlotPrefixCache, common_prefix_len
from quanta.engine.sampling import SamplingParams
from quanta.flags import configs_from_args, parse_serve_flags
from quanta.launch import build_engine, load_model

# --------------------------------------------------------------------------- slot choice


def test_common_prefix_len():
    assert common_prefix_len([], [1, 2]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    long = list(range(1000))
    assert common_prefix_len(long, long + [5]) == 1000
    assert common_prefix_len(long, long[:700] + [-1] + long[701:]) == 700


def test_empty_cache_takes_the_lowest_free_slot():
    cache = SlotPrefixCache(4)
    assert cache.choose([1, 2, 3], [5, 6, 7]) == (1, 0)
    assert (cache.queries, cache.hits) == (3, 0)


def test_continuation_goes_to_the_slot_holding_its_context():
    cache = SlotPrefixCache(3)
    cache.release(0, [9, 9, 9])
    cache.release(2, [1, 2, 3, 4])
    slot, cached = cache.choose([0, 1, 2], [1, 2, 3, 4, 5, 6])
    assert (slot, cached) == (2, 4)
    assert (cache.queries, cache.hits) == (6, 4)


def test_at_least_one_prompt_token_is_left_to_compute():
    cache = SlotPrefixCache(2)
    cache.release(1, [1, 2, 3, 4])
    assert cache.choose([0, 1], [1, 2, 3, 4]) == (1, 3)
    assert cache.choose([1], [1]) == (1, 0)


def test_a_shared_system_prompt_does_not_evict_a_long_session():
    # slot 0 holds a long session whose first 3 tokens are a shared system prompt;
    # a new session that shares only those goes to the empty slot 1.
    cache = SlotPrefixCache(2)
    cache.release(0, [1, 2, 3] + list(range(100, 140)))
    assert cache.choose([0, 1], [1, 2, 3, 7, 7]) == (1, 0)


def test_without_a_cheap_slot_the_least_recently_used_one_is_reused():
    cache = SlotPrefixCache(3)
    cache.release(1, [1, 2, 3, 10, 11, 12, 13])  # older
    cache.release(0, [1, 2, 3, 20, 21, 22, 23])
    cache.release(2, [1, 2, 3, 30, 31, 32, 33])
    slot, cached = cache.choose([0, 1, 2], [1, 2, 3, 7, 7])
    assert (slot, cached) == (1, 3)  # LRU, and its common prefix still counts


def test_longest_cheap_prefix_wins_and_ties_go_to_the_least_recently_used():
    cache = SlotPrefixCache(4)
    cache.release(3, [1, 2])
    cache.release(1, [1, 2, 3])
    cache.release(2, [1, 2, 3])
    assert cache.choose([1, 2, 3], [1, 2, 3, 4]) == (1, 3)
    cache.claim(1, 3)  # slot 1 is now the most recently used
    assert cache.choose([2, 3], [1, 2, 3, 4]) == (2, 3)


def test_claim_keeps_only_the_reused_prefix():
    cache = SlotPrefixCache(1)
    cache.release(0, [1, 2, 3, 4])
    cache.claim(0, 2)
    assert cache.held(0) == [1, 2]


def test_no_prefix_cache_flag():
    cfg, _ = configs_from_args(parse_serve_flags(["--no-prefix-cache"]))
    assert cfg.prefix_cache is False
    cfg, _ = configs_from_args(parse_serve_flags([]))
    assert cfg.prefix_cache is True


# --------------------------------------------------------------------------- scheduling (fake executor)


class EchoExecutor(Executor):
    """Samples token 7 for each chunk that reaches its sequence's end; records
    (seq_id, slot, start, num_new) of every chunk."""

    def __init__(self) -> None:
        self.chunks: list[tuple[int, int, int, int]] = []

    def execute(self, plan):
        out = []
        for c in plan.chunks:
            assert c.seq.slot is not None and c.num_new_tokens >= 1
            self.chunks.append((c.seq.seq_id, c.seq.slot, c.seq.num_computed_tokens, c.num_new_tokens))
            out.append(7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None)
        return StepResult(out)


def fake_engine(sched: SchedulerConfig, reuse: bool = True) -> tuple[Engine, EchoExecutor]:
    scheduler = sched.build()
    if reuse:
        scheduler.enable_prefix_cache()
    ex = EchoExecutor()
    return Engine(scheduler, ex, max_model_len=10_000), ex


def drain(engine: Engine, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def test_only_the_tail_is_prefilled_and_the_cap_split_starts_there():
    # batched, quantum 8, cap 8. Turn 1: 10-token prompt, 3 output tokens -> the slot
    # holds the 10 prompt tokens (outputs' K/V come from the decode kernels and are not
    # reused). Turn 2 extends turn 1 by 12: the tail starts at 10, so the chunks are 6 (to
    # the cap boundary 16), 2 (to the quantum's end, 10 + 8) and 4.
    engine, ex = fake_engine(SchedulerConfig("batched", 2, {"prefill_quantum": 8, "mixed_prefill_quantum": 8, "prefill_cap": 8}))
    first = engine.add_request(list(range(100, 110)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    drain(engine)
    assert engine.scheduler.prefix_cache.held(0) == list(range(100, 110))
    ex.chunks.clear()
    second = engine.add_request(list(range(100, 110)) + [7, 7] + list(range(200, 210)),
                                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert second.slot is None and second.num_cached_tokens == 10
    assert [(start, n) for _, slot, start, n in ex.chunks][:3] == [(10, 6), (16, 2), (18, 4)]
    assert {slot for _, slot, _, _ in ex.chunks} == {0}
    assert all(o.num_cached_tokens == 10 for o in outs) and outs[-1].finished
    assert first.num_cached_tokens == 0


def test_without_reuse_the_same_turn_is_prefilled_whole():
    engine, ex = fake_engine(SchedulerConfig("batched", 2, {"prefill_quantum": 8, "mixed_prefill_quantum": 8, "prefill_cap": 8}),
                             reuse=False)
    engine.add_request(list(range(100, 110)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    drain(engine)
    ex.chunks.clear()
    second = engine.add_request(list(range(100, 110)) + [7, 7] + list(range(200, 210)),
                                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    drain(engine)
    assert [(start, n) for _, _, start, n in ex.chunks][:3] == [(0, 8), (8, 8), (16, 6)]
    assert second.num_cached_tokens == 0


POLICY_KNOBS = {
    "batched": {"prefill_quantum": 4, "mixed_prefill_quantum": 4, "prefill_cap": 8},
    "static": {},
    "continuous": {"admit_k": 1},
    "chunked": {"admit_k": 1, "chunk": 4, "prefill_cap": 8},
    "budget": {"max_num_batched_tokens": 5},
}


def test_policy_cases_cover_every_policy():
    assert set(POLICY_KNOBS) == set(POLICIES)


@pytest.mark.parametrize("name", sorted(POLICY_KNOBS))
def test_every_policy_prefills_only_the_tail(name):
    engine, ex = fake_engine(SchedulerConfig(name, 2, POLICY_KNOBS[name]))
    engine.add_request(list(range(100, 110)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    drain(engine)
    ex.chunks.clear()
    second = engine.add_request(list(range(100, 110)) + [7, 7] + list(range(200, 206)),
                                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    drain(engine)
    prompt_tokens = sum(n for s, _, start, n in ex.chunks if s == second.seq_id and start < 18)
    assert second.num_cached_tokens == 10
    assert prompt_tokens == 8  # the tail only: the previous answer and the new tokens
    assert min(start for s, _, start, _ in ex.chunks if s == second.seq_id) == 10


def test_an_aborted_prefill_leaves_only_its_computed_tokens():
    engine, ex = fake_engine(SchedulerConfig("chunked", 1, {"admit_k": 1, "chunk": 4, "prefill_cap": 8}))
    seq = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    engine.step()
    assert seq.num_computed_tokens == 8
    engine.abort(seq.seq_id)
    assert engine.scheduler.prefix_cache.held(0) == list(range(100, 108))
    again = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    assert again.num_cached_tokens == 8


def test_a_running_sequence_is_never_evicted():
    # one slot, busy: a request whose prefix it holds waits, then reuses it.
    engine, ex = fake_engine(SchedulerConfig("continuous", 1, {"admit_k": 1}))
    busy = engine.add_request(list(range(100, 110)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.step()
    waiting = engine.add_request(list(range(100, 110)) + [7] * 3, SamplingParams(max_tokens=2, temperature=0))
    for _ in range(3):
        engine.step()
        assert waiting.slot is None and busy.slot == 0 and len(busy.output_token_ids) < 5
    drain(engine)
    assert len(busy.output_token_ids) == 5
    assert waiting.num_cached_tokens == 10  # the 10 prompt tokens; outputs are recomputed as prompt


# --------------------------------------------------------------------------- the real model

#: tool-output-sized blocks appended turn after turn (short, to keep the test quick)
BLOCKS = [
    "ls -la src/\ntotal 24\n-rw-r--r-- 1 dev dev 812 main.py\n-rw-r--r-- 1 dev dev 2301 utils.py\n",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Traceback (most recent call last):\n  File \"main.py\", line 3\nNameError: name 'x' is not defined\n",
]
SESSIONS = ["You are a coding agent. Fix the bug.\n", "You are a coding agent. Add tests.\n", "Summarise the repository.\n"]
TURNS = 3
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def loaded():
    """The embedded model in fp32, run on one thread: these steps are a few
    tokens each, and two threads on a shared 2-core machine are ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(None, torch.float32)
    torch.set_num_threads(threads)


def run_sessions(loaded, sched: SchedulerConfig, reuse: bool) -> tuple[list[list[list[int]]], list[list[int]], object]:
    """Three sessions, each turn = its previous prompt + output + a new block.

    Turns are submitted as soon as the session's previous turn finishes, so the
    sessions overlap and their turns are staggered. Returns outputs and cached
    token counts per [session][turn], and the trace.
    """
    engine = build_engine(loaded, EngineConfig(max_model_len=512, prefix_cache=reuse), sched)
    tok = loaded.tokenizer
    outputs = [[] for _ in SESSIONS]
    cached = [[] for _ in SESSIONS]
    context = [tok.encode(s) for s in SESSIONS]
    live = {}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    def submit(i: int) -> None:
        turn = len(outputs[i])
        context[i] = context[i] + tok.encode(BLOCKS[(i + turn) % len(BLOCKS)], add_special_tokens=False)
        live[i] = engine.add_request(context[i], params)

    submit(0)
    for step in range(100_000):
        if step == 3:
            submit(1)
        if step == 6:
            submit(2)
        engine.step()
        for i, seq in list(live.items()):
            if seq.finish_reason is not None:
                del live[i]
                outputs[i].append(list(seq.output_token_ids))
                cached[i].append(seq.num_cached_tokens)
                context[i] = context[i] + seq.output_token_ids
                if len(outputs[i]) < TURNS:
                    submit(i)
        if not live and step > 6:
            break
    assert all(len(o) == TURNS for o in outputs)
    return outputs, cached, engine.trace


REAL_CASES = {
    "batched": {"prefill_quantum": 16, "mixed_prefill_quantum": 8, "prefill_cap": 24},
    "chunked": {"admit_k": 1, "chunk": 8, "prefill_cap": 24},
    "budget": {"max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("name", sorted(REAL_CASES))
def test_greedy_outputs_are_the_same_with_and_without_reuse(loaded, name):
    sched = SchedulerConfig(name, 4, REAL_CASES[name])
    with_reuse, cached, trace = run_sessions(loaded, sched, reuse=True)
    without, no_cached, plain_trace = run_sessions(loaded, sched, reuse=False)
    assert with_reuse == without
    assert all(row[0] == 0 for row in cached)
    assert all(c > 0 for i in range(len(SESSIONS)) for c in cached[i][1:])  # every later turn reused its context
    assert all(c == 0 for row in no_cached for c in row)
    computed = sum(n for r in trace.records for n in r.num_new_tokens)
    plain = sum(n for r in plain_trace.records for n in r.num_new_tokens)
    assert plain - computed == sum(map(sum, cached))  # exactly the cached tokens were not recomputed


# --------------------------------------------------------------------------- live server


def _metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} missing from /metrics")


def test_live_second_turn_reports_cached_tokens(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)
    turn1 = [{"role": "user", "content": "List three prime numbers."}]
    first = client.chat.completions.create(model=server.model, messages=turn1, max_tokens=8, temperature=0)
    queries, hits = _metric(server, "quanta:prefix_cache_queries_total"), _metric(server, "quanta:prefix_cache_hits_total")
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now three even numbers."}]
    second = client.chat.completions.create(model=server.model, messages=turn2, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert _metric(server, "quanta:prefix_cache_queries_total") - queries == second.usage.prompt_tokens
    assert _metric(server, "quanta:prefix_cache_hits_total") - hits == cached
