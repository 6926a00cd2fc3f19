"""``quanta simulate --workload sessions``: a recorded sessions file replayed on the simulator with the
bench replay's steps (:func:`quanta.bench.sessions.replay_plan`): the same requests, parent before child,
think gaps, exact output lengths, and prompts that share what the recording shared (prefix-cache hits).

No model, no server: every time here is virtual (the cost model's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quanta.bench.sessions import replay_plan
from quanta.bench.workloads import Workload
from quanta.cli import main
from quanta.config import SchedulerConfig
from quanta.sim.profile import Profile
from quanta.sim.run import simulate

SEED = Path(__file__).resolve().parents[1] / "profiles" / "ds4_m3_ultra_seed.json"
HEADER = {"format": "quanta-sessions/1", "upstream": "http://up", "record_text": False}


def req(i, t, done, session, turn, parent, extends, shared, shared_tokens, segs, out, status=200) -> dict:
    return {"id": i, "t": t, "done": done, "session": session, "turn": turn, "parent": parent, "extends": extends,
            "shared": shared, "shared_tokens": shared_tokens, "segments": [{"role": r, "tokens": n} for r, n in segs],
            "prompt_tokens": shared_tokens + sum(n for _, n in segs), "completion_tokens": out, "status": status, "complete": True}


# Agent A: three turns, each resending the whole conversation (system, user, then assistant + user per turn),
# 2 s and 1.5 s of think time. A failed request (not replayed). Agent B: a new session sharing A's first
# prompt (system + user, 160 tokens), recorded after A's last turn.
ROWS = [HEADER,
        req(0, 0.0, 1.0, 0, 0, None, False, 0, 0, [("system", 100), ("user", 60)], 20),
        req(1, 3.0, 4.0, 0, 1, 0, True, 3, 180, [("user", 40)], 10),
        req(2, 4.1, 4.2, 2, 0, None, False, 0, 0, [("user", 9)], None, status=500),
        req(3, 5.5, 6.0, 0, 2, 1, True, 5, 230, [("user", 30)], 8),
        req(4, 20.0, 21.0, 1, 0, 3, False, 2, 160, [("user", 50)], 5)]


def _file(tmp_path: Path, rows: list, name: str = "agent.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def test_the_replay_steps_say_what_waits_for_what(tmp_path):
    steps = replay_plan(str(_file(tmp_path, ROWS)))
    assert [s.request.id for s in steps] == [0, 1, 3, 4]  # the failed request is not replayed
    assert [(s.parent and s.parent.id, s.after, s.think) for s in steps] == [
        (None, None, None), (0, "done", 2.0), (1, "done", 1.5), (3, "sent", None)]
    assert steps[1].times(7.0) == (9.0, 9.0)  # a next turn: its think time after its parent's end here
    assert steps[3].times(25.0) == (20.0, 25.0) and steps[3].times(3.0) == (20.0, 20.0)  # recorded t, not before the parent
    assert steps[3].prefix(["s", "u", "a", "u2"]) == ["s", "u"] and steps[3].prefix(["s"]) is None
    assert steps[0].prefix(None) == [] and steps[3].tag == "session1/turn0"


def test_a_simulated_sessions_file_sends_the_recorded_requests_and_hits_the_shared_prefixes(tmp_path, capsys):
    path = _file(tmp_path, ROWS)
    prefix = tmp_path / "sim_sessions"
    assert main(["simulate", "--profile", str(SEED), "--workload", "sessions", "--sessions-file", str(path),
                 "--scheduler", "continuous", "--max-num-seqs", "2", "--admit-k", "2", "--out", str(prefix), "--no-plots"]) == 0
    doc = json.loads(prefix.with_suffix(".json").read_text())
    assert doc["workload_text"].startswith(f"sessions: 4 recorded requests of 2 agent sessions from {path}")
    s = {x["tag"]: x for x in doc["conditions"][0]["runs"][0]["samples"]}
    a0, a1, a2, b0 = s["session0/turn0"], s["session0/turn1"], s["session0/turn2"], s["session1/turn0"]
    assert all(x["error"] is None for x in s.values()) and len(s) == 4
    assert [x["completion_tokens"] for x in (a0, a1, a2, b0)] == [20, 10, 8, 5]  # exact recorded outputs
    assert [x["prompt_tokens"] for x in (a0, a1, a2, b0)] == [160, 220, 260, 210]  # the recorded prompt sizes
    # each next turn starts with its parent's prompt and reply: its parent's prompt's full blocks of 32 are
    # cached (the reply is recomputed as prompt: decode K/V is never reused); B shares A's system prompt and
    # first message (160 tokens, five blocks)
    assert [x["cached_tokens"] for x in (a0, a1, a2, b0)] == [0, 160, 192, 160]
    # a next turn is scheduled its think time after its parent's end in this simulation, and sent no earlier
    assert a1["scheduled"] == pytest.approx(a0["done"] + 2.0) and a2["scheduled"] == pytest.approx(a1["done"] + 1.5)
    assert a0["done"] < a1["sent"] and a1["done"] < a2["sent"]
    assert b0["scheduled"] == 20.0 and b0["sent"] >= 20.0
    figures = doc["conditions"][0]["figures"][0]
    assert figures["prefix_hit_share"] == pytest.approx((160 + 192 + 160) / (160 + 220 + 260 + 210))


def test_sessions_without_the_prefix_cache_hit_nothing_and_a_missing_parent_gets_a_stand_in(tmp_path):
    rows = [HEADER, req(0, 0.0, 1.0, 0, 0, None, False, 0, 0, [("user", 50)], 4, status=502),
            req(1, 2.0, 3.0, 0, 1, 0, True, 2, 54, [("user", 10)], 3)]
    w = Workload(kind="sessions", sessions_file=str(_file(tmp_path, rows, "orphan.jsonl")))
    w.check()
    cfg = SchedulerConfig("continuous", 2, {"admit_k": 2})
    run = simulate(Profile.load(SEED), cfg, w, prefix_cache=True)
    (only,) = run["samples"]  # the parent failed upstream: the turn is sent at its recorded time, its prefix a stand-in
    assert (only["tag"], only["scheduled"], only["prompt_tokens"], only["cached_tokens"]) == ("session0/turn1", 2.0, 64, 0)
    full = simulate(Profile.load(SEED), cfg, Workload(kind="sessions", sessions_file=str(_file(tmp_path, ROWS))))
    assert [x["cached_tokens"] for x in full["samples"]] == [0, 0, 0, 0]
    assert run == simulate(Profile.load(SEED), cfg, w, prefix_cache=True)  # deterministic


def test_requests_never_scheduled_before_max_duration_count_as_failed(tmp_path):
    w = Workload(kind="sessions", sessions_file=str(_file(tmp_path, ROWS)))
    run = simulate(Profile.load(SEED), SchedulerConfig("continuous", 2, {"admit_k": 2}), w, max_duration=1.0)
    assert len(run["samples"]) == 4 and run["metrics"]["client"]["num_ok"] == 0
    assert {x["error"] for x in run["samples"]} == {"deadline"}


@pytest.mark.parametrize("rows, message", [
    ([], "empty sessions file"),
    ([{"id": 0}], "not a sessions file"),
    ([HEADER, "{not json"], ":2: not JSON"),
    ([HEADER, {"id": 0, "t": 0}], ":2: missing field 'session'"),
    ([HEADER, ROWS[1], {**ROWS[2], "t": -1.0}], ":3: 't', 'shared' and 'shared_tokens' must be >= 0"),
    ([HEADER, {**ROWS[1], "t": 5.0, "done": 6.0}, ROWS[2]], ":3: timestamps go backwards"),
    ([HEADER, {**ROWS[1], "status": 500}], "no request to replay"),
])
def test_a_bad_sessions_file_is_exit_2_and_nothing_is_written(tmp_path, capsys, rows, message):
    path = _file(tmp_path, rows, "bad.jsonl")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--profile", str(SEED), "--workload", "sessions", "--sessions-file", str(path), "--out", str(out)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("argv, message", [
    (["--workload", "sessions"], "needs --sessions-file"),
    (["--sessions-file", "x.jsonl"], "--sessions-file needs --workload sessions"),
    (["--workload", "sessions", "--sessions-file", "/nonexistent/x.jsonl"], "cannot read sessions file"),
    (["--workload", "sessions", "--sessions-file", "x.jsonl", "--output-dist", "uniform:0.5"], "--output-dist applies to"),
])
def test_sessions_flags_of_simulate_must_go_together(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--profile", str(SEED), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_compare_replays_a_sessions_result_with_the_files_own_lengths(tmp_path):
    from quanta.bench import output
    from quanta.sim.compare import compare
    from quanta.sim.run import condition

    w = Workload(kind="sessions", sessions_file=str(_file(tmp_path, ROWS)))
    cfg = SchedulerConfig("batched", 4)
    measured = simulate(Profile.load(SEED), cfg, w, prefix_cache=True)
    doc = output.document("sweep", "test", w, 1, [condition("c", [measured], ["--max-num-seqs", "4"])], None)
    (r,) = compare(Profile.load(SEED), [("run.json", doc)])
    assert all(abs(e) < 1e-9 for e in r["rel_error"].values() if e == e), r["rel_error"]  # same profile: no error
    (slow,) = compare(_twice(Profile.load(SEED)), [("run.json", doc)])
    assert slow["rel_error"]["itl_p50"] > 0.5


def _twice(p: Profile) -> Profile:
    from dataclasses import replace

    return replace(p, prefill_points=[(x, 2 * y) for x, y in p.prefill_points], decode_points=[(x, 2 * y) for x, y in p.decode_points],
                   overhead_s=2 * p.overhead_s, prefill_ctx=2 * p.prefill_ctx, decode_ctx=2 * p.decode_ctx)


def test_the_replay_workload_is_the_same_steps_on_both_sides_and_reuses_each_turns_context():
    from quanta.bench.workloads import session_steps

    w = Workload(kind="replay", sessions=2, turns=3, prompt_words=40, tool_words=10, max_tokens=6, stagger=5.0)
    steps = session_steps(w)
    assert [(s.tag, s.parent and s.parent.id, s.after, s.think, s.request.shared) for s in steps[:3]] == [
        ("session0/turn0", None, None, None, 0), ("session0/turn1", 0, "done", 0.0, 2), ("session0/turn2", 1, "done", 0.0, 4)]
    assert steps[3].times(None) == (5.0, 5.0) and len(steps) == w.total_requests()
    run = simulate(Profile.load(SEED), SchedulerConfig("continuous", 2, {"admit_k": 2}), w, prefix_cache=True, tokens_per_word=1.5)
    s = {x["tag"]: x for x in run["samples"]}
    a = [s[f"session0/turn{k}"] for k in range(3)]
    # words x 1.5 tokens; each turn resends the previous prompt, its 6 output tokens and 15 tokens of tool output
    assert [x["prompt_tokens"] for x in a] == [60, 81, 102] and [x["completion_tokens"] for x in a] == [6, 6, 6]
    assert [x["cached_tokens"] for x in a] == [0, 32, 64]  # the previous prompt's full blocks; its reply is recomputed
    assert a[1]["scheduled"] == a[0]["done"] and a[2]["scheduled"] == a[1]["done"]  # no think time
