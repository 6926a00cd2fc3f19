"""Prefix sharing over the KV block pool.

1. :class:`PrefixCache` and the chain names of blocks (pure Python).
2. Scheduling with reuse through the real Engine on a fake executor: only the
   uncached tail is prefilled, the prefill-cap split starts from where the
   tail starts, every policy benefits, blocks are shared across running
   sequences and kept after they end.
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
from quanta.engine.block_pool import BlockPool
from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.policies import POLICIES
from quanta.engine.prefix_cache import PrefixCache, block_hashes
from quanta.engine.sampling import SamplingParams
from quanta.flags import configs_from_args, parse_serve_flags
from quanta.launch import build_engine, load_model

# --------------------------------------------------------------------------- the block cache


def test_a_block_is_named_by_everything_before_it_and_its_namespace():
    tokens = list(range(40))
    names = block_hashes(tokens, 8, None)
    assert len(names) == 5 and len(set(names)) == 5  # full blocks only
    assert block_hashes(tokens[:39], 8, None) == names[:4]
    assert block_hashes(tokens + [1, 2], 8, None) == names  # a partial block has no name
    changed = block_hashes([99] + tokens[1:], 8, None)
    assert not set(changed) & set(names)  # a change in block 0 renames every block after it
    assert block_hashes(tokens, 8, "") != names and block_hashes(tokens, 8, "a") != block_hashes(tokens, 8, "b")


def _cache_with(tokens: list[int], pool: BlockPool) -> tuple[PrefixCache, list[int]]:
    """A cache whose blocks hold ``tokens``' full blocks, released by the sequence that computed them."""
    cache = PrefixCache(pool)
    blocks = pool.allocate(len(tokens) // pool.block_size)
    for block, name in zip(blocks, block_hashes(tokens, pool.block_size, None)):
        cache.register(block, name)
    pool.release(blocks)
    cache.released(blocks)
    return cache, blocks


def test_lookup_finds_the_longest_cached_run_and_leaves_a_token_to_compute():
    pool = BlockPool(8, 8)
    tokens = list(range(24))
    cache, blocks = _cache_with(tokens, pool)
    assert cache.num_evictable == 3 and all(pool.refs(b) == 1 for b in blocks)  # the cache holds them
    assert cache.lookup(block_hashes(tokens + [5], 8, None), 25) == blocks
    assert cache.lookup(block_hashes(tokens, 8, None), 24) == blocks[:2]  # the last token is computed
    assert cache.lookup(block_hashes(tokens[:8] + [0] * 16, 8, None), 24) == blocks[:1]
    assert cache.lookup(block_hashes(tokens + [5], 8, "salt"), 25) == []


def test_shared_blocks_are_not_evictable_and_the_least_recently_used_goes_first():
    pool = BlockPool(8, 8)
    cache, blocks = _cache_with(list(range(24)), pool)
    cache.acquire(blocks[:1])
    assert cache.num_evictable == 2 and pool.refs(blocks[0]) == 2
    assert cache.evict_one() and pool.refs(blocks[1]) == 0  # the oldest evictable: block 1 (block 0 is in use)
    pool.release(blocks[:1])
    cache.released(blocks[:1])  # block 0 is evictable again, as the most recently used
    assert cache.evict_one() and pool.refs(blocks[2]) == 0
    assert cache.evict_one() and pool.refs(blocks[0]) == 0
    assert not cache.evict_one() and pool.num_free == 8


def test_a_second_copy_of_a_named_block_stays_private():
    pool = BlockPool(8, 8)
    cache, blocks = _cache_with(list(range(8)), pool)
    other = pool.allocate(1)
    cache.register(other[0], block_hashes(list(range(8)), 8, None)[0])
    assert pool.refs(other[0]) == 1  # only its sequence: freed when it ends


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

    def execute(self, plan, interrupt=None):
        out = []
        for c in plan.chunks:
            assert c.seq.slot is not None and c.num_new_tokens >= 1
            self.chunks.append((c.seq.seq_id, c.seq.slot, c.seq.num_computed_tokens, c.num_new_tokens))
            out.append(7 if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None)
        return StepResult(out)


def fake_engine(sched: SchedulerConfig, reuse: bool = True) -> tuple[Engine, EchoExecutor]:
    """An engine over a pool of 256 blocks of 8 positions."""
    scheduler = sched.build()
    scheduler.use_blocks(BlockPool(256, 8), prefix_cache=reuse)
    ex = EchoExecutor()
    return Engine(scheduler, ex, max_model_len=10_000), ex


def drain(engine: Engine, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def test_only_the_tail_is_prefilled_and_the_cap_split_starts_there():
    # batched, quantum 8, cap 12, blocks of 8. Turn 1: 10-token prompt, 3 output tokens ->
    # its one full prompt block stays cached (the rest of the prompt fills no block; outputs'
    # K/V come from the decode kernels and are never named). Turn 2 extends turn 1 by 12:
    # the tail starts at 8, so the chunks are 4 (to the cap boundary 12), 4 (to the
    # quantum's end, 8 + 8) and 6.
    engine, ex = fake_engine(SchedulerConfig("batched", 2, {"prefill_quantum": 8, "mixed_prefill_quantum": 8, "prefill_cap": 12}))
    first = engine.add_request(list(range(100, 110)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    drain(engine)
    assert engine.scheduler.blocks.num_cached == 1
    ex.chunks.clear()
    second = engine.add_request(list(range(100, 110)) + [7, 7] + list(range(200, 210)),
                                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert second.slot is None and second.num_cached_tokens == 8
    assert [(start, n) for _, slot, start, n in ex.chunks][:3] == [(8, 4), (12, 4), (16, 6)]
    assert all(o.num_cached_tokens == 8 for o in outs) and outs[-1].finished
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
    assert second.num_cached_tokens == 8  # the first prompt's full block
    assert prompt_tokens == 10  # the tail only: the rest of the first prompt, the previous answer, the new tokens
    assert min(start for s, _, start, _ in ex.chunks if s == second.seq_id) == 8


def test_an_aborted_prefill_leaves_only_its_computed_tokens():
    engine, ex = fake_engine(SchedulerConfig("chunked", 1, {"admit_k": 1, "chunk": 4, "prefill_cap": 8}))
    seq = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    engine.step()
    assert seq.num_computed_tokens == 8
    engine.abort(seq.seq_id)
    assert engine.scheduler.blocks.num_cached == 1  # the one full block it computed
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
    assert waiting.num_cached_tokens == 8  # the full prompt block; outputs are recomputed as prompt


def test_sequences_share_a_prefix_while_both_run_and_after_both_ended():
    engine, _ = fake_engine(SchedulerConfig("continuous", 3, {"admit_k": 1}))
    pool = engine.scheduler.blocks.pool
    shared = list(range(100, 124))  # three blocks
    first = engine.add_request(shared + [1, 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()  # first's prompt computed; its full blocks are named before its next step
    engine.step()
    second = engine.add_request(shared + [3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    assert second.num_cached_tokens == 24 and second.block_ids[:3] == first.block_ids[:3]
    assert all(pool.refs(b) == 3 for b in first.block_ids[:3])  # two sequences and the cache
    drain(engine)
    third = engine.add_request(shared + [4, 5], SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    assert third.num_cached_tokens == 24  # a new session after both ended
    drain(engine)
    assert pool.num_free + engine.scheduler.blocks.num_cached == pool.num_blocks


def test_without_reuse_nothing_is_named_or_kept():
    engine, _ = fake_engine(SchedulerConfig("continuous", 2, {"admit_k": 1}), reuse=False)
    engine.add_request(list(range(100, 124)), SamplingParams(max_tokens=2, temperature=0))
    drain(engine)
    assert engine.scheduler.blocks.num_cached == 0 and engine.scheduler.blocks.pool.num_free == 256


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


def test_a_second_session_shares_the_first_s_system_prompt_and_answers_the_same(loaded):
    """Two sessions with one long system prompt, the second sent while the first decodes: it
    shares the first's blocks, and both answers are those computed without sharing."""
    tok = loaded.tokenizer
    system = tok.encode("You are a careful coding agent. Read the code before you change it. " * 5)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = {}
    for reuse in (True, False):
        engine = build_engine(loaded, EngineConfig(max_model_len=512, prefix_cache=reuse), SchedulerConfig("batched", 2, {}))
        first = engine.add_request(system + tok.encode("Fix the bug.", add_special_tokens=False), params)
        engine.step()  # the first prompt, whole
        second = engine.add_request(system + tok.encode("Add tests.", add_special_tokens=False), params)
        drain(engine)
        runs[reuse] = (first.output_token_ids, second.output_token_ids, second.num_cached_tokens)
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][2] == len(system) // 32 * 32 >= 64 and runs[False][2] == 0


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
    # the first prompt's full blocks of 32 (the default block size)
    assert first.usage.prompt_tokens - 32 < cached < second.usage.prompt_tokens and cached % 32 == 0
    assert _metric(server, "quanta:prefix_cache_queries_total") - queries == second.usage.prompt_tokens
    assert _metric(server, "quanta:prefix_cache_hits_total") - hits == cached


def test_a_step_of_cancelled_requests_stops_inside_the_forward_and_keeps_what_was_computed(loaded):
    """Real model: a prefill step whose request is cancelled while it runs stops after the decoder
    block where the check fires; the step counts nothing as computed and writes no trace record; the
    abort then names only the blocks of the steps that finished, and the same prompt sent again
    resumes from them and generates what an uninterrupted run generates."""
    sched = SchedulerConfig("batched", 2, {"prefill_quantum": 32, "mixed_prefill_quantum": 32, "prefill_cap": 32})
    engine = build_engine(loaded, EngineConfig(max_model_len=256), sched)
    prompt = loaded.tokenizer.encode(" ".join(BLOCKS) * 2)[:96]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seq = engine.add_request(prompt, params)
    engine.step()  # the first 32 prompt tokens
    assert seq.num_computed_tokens == 32
    checks = []

    def cancelled(seq_id: int) -> bool:
        checks.append(seq_id)
        return len(checks) >= 3  # cancelled while the third decoder block runs

    assert engine.step(cancelled) == []
    assert checks == [seq.seq_id] * 3  # stopped there, not at the end of the 30 blocks
    assert seq.num_computed_tokens == 32 and len(engine.trace.records) == 1
    engine.abort(seq.seq_id)
    again = engine.add_request(prompt, params)
    while again.finish_reason is None:
        engine.step(lambda _: False)  # a check that never fires changes nothing
    assert again.num_cached_tokens == 32  # the interrupted chunk's blocks were not named
    fresh = build_engine(loaded, EngineConfig(max_model_len=256, prefix_cache=False), sched)
    reference = fresh.add_request(prompt, params)
    while reference.finish_reason is None:
        fresh.step()
    assert again.output_token_ids == reference.output_token_ids


def test_a_step_runs_to_its_end_while_one_of_its_requests_is_not_cancelled(loaded):
    engine = build_engine(loaded, EngineConfig(max_model_len=256), SchedulerConfig("budget", 2, {"max_num_batched_tokens": 128}))
    tok = loaded.tokenizer
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = engine.add_request(tok.encode(BLOCKS[0]), params)
    second = engine.add_request(tok.encode(BLOCKS[1]), params)
    engine.step(lambda seq_id: seq_id == first.seq_id)  # both prompts share the step
    assert engine.trace.records[0].seq_ids == [first.seq_id, second.seq_id]
    assert first.num_computed_tokens == first.num_prompt_tokens and second.num_computed_tokens == second.num_prompt_tokens


def test_a_max_model_len_above_the_trained_context_is_served_with_a_warning(loaded, caplog):
    trained = loaded.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="quanta"):
        engine = build_engine(loaded, EngineConfig(max_model_len=trained + 16, kv_cache_tokens=trained + 16),
                              SchedulerConfig("batched", 1))
    assert engine.max_model_len == trained + 16
    assert f"above the model's trained context ({trained} tokens)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="quanta"):
        build_engine(loaded, EngineConfig(max_model_len=256), SchedulerConfig("batched", 1))
    assert "trained context" not in caplog.text
