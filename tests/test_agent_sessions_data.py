"""The committed agent sessions (``benchmarks/data/agent_sessions/``: Codex CLI, opencode and Claude Code,
each recorded by ``quanta record`` against ``quanta serve`` through ``benchmarks/coding_agents.py --record``)
parse, plan the requests and relations they recorded, and replay on the simulator with the recorded
prompt and output sizes. No agent, no network, no model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from quanta.bench.sessions import FORMAT, _Replay, chat_role, load, replay_plan
from quanta.bench.workloads import Workload
from quanta.config import SchedulerConfig
from quanta.sim.profile import Profile
from quanta.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "agent_sessions"
SEED = ROOT / "profiles" / "ds4_m3_ultra_seed.json"

#: agent -> (npm version, every recorded request as (status, session, turn, parent, extends, shared, prompt size),
#: the replayed ones' completion tokens); a prompt size is shared_tokens plus the new segments' tokens (the
#: upstream's usage for a 200, the recorder's estimate for a 400)
RECORDED = {
    "codex": ("0.171.0", [(200, 0, 0, None, False, 0, 9245)], [257]),
    "opencode": ("1.18.33", [(200, 0, 0, None, False, 0, 591), (200, 1, 0, None, False, 0, 7761)], [25, 14]),
    # the task, answered to the context's end (5,078 tokens), then 8 continuations of that answer which did
    # not fit (400): each extends the one before it, and none is replayed
    "claude-code": ("2.1.332", [(200, 0, 0, None, False, 0, 12330), (400, 0, 1, 0, True, 4, 17463),
                                *[(400, 0, t, t - 1, True, 5, 17463) for t in (2, 3, 4)],
                                (400, 0, 5, 4, True, 5, 17497),  # one more system message
                                *[(400, 0, t, t - 1, True, 6, 17497) for t in (6, 7, 8)]], [5078]),
}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_committed_sessions_file_is_listed_here():
    assert sorted(p.stem for p in DATA.glob("*.jsonl")) == sorted(RECORDED)


@pytest.mark.parametrize("agent", sorted(RECORDED))
def test_a_committed_session_loads_as_recorded_without_text(agent):
    path = DATA / f"{agent}.jsonl"
    version, rows, _ = RECORDED[agent]
    header, reqs = load(str(path))
    assert header["format"] == FORMAT and header["record_text"] is False
    assert (header["agent"], header["agent_version"], header["task"]) == (agent, version, "Reply with one word: hello.")
    lines = _lines(path)[1:]
    assert all("reply" not in d and all(set(s) == {"role", "tokens"} for s in d["segments"]) for d in lines)  # counts only
    got = [(r.status, r.session, r.turn, r.parent, r.extends, r.shared, r.shared_tokens + sum(s.tokens for s in r.segments))
           for r in reqs]
    assert got == rows
    assert all(r.prompt_tokens == size for r, (status, *_, size) in zip(reqs, rows) if status == 200)  # usage, split whole


@pytest.mark.parametrize("agent", sorted(RECORDED))
def test_the_replay_plan_of_a_committed_session_sends_its_successful_requests_in_their_relations(agent):
    _, rows, outputs = RECORDED[agent]
    steps = replay_plan(str(DATA / f"{agent}.jsonl"))
    ok = [(i, row) for i, row in enumerate(rows) if row[0] == 200]
    assert [s.request.id for s in steps] == [i for i, _ in ok]
    assert [s.request.completion_tokens for s in steps] == outputs
    # none of these recorded requests continues a replayed one: each is sent at its recorded time, fresh
    assert all((s.parent, s.after, s.think, s.prefix(None)) == (None, None, None, []) for s in steps)
    assert [s.tag for s in steps] == [f"session{row[1]}/turn{row[2]}" for _, row in ok]


@pytest.mark.parametrize("agent", sorted(RECORDED))
def test_a_committed_session_replays_on_the_simulator_with_the_recorded_sizes(agent):
    _, rows, outputs = RECORDED[agent]
    w = Workload(kind="sessions", sessions_file=str(DATA / f"{agent}.jsonl"))
    w.check()
    run = simulate(Profile.load(SEED), SchedulerConfig("continuous", 2, {"admit_k": 2}), w, prefix_cache=True)
    samples = sorted(run["samples"], key=lambda s: s["scheduled"])
    recorded = [row for row in rows if row[0] == 200]
    assert all(s["error"] is None for s in samples)
    assert [(s["tag"], s["prompt_tokens"], s["completion_tokens"]) for s in samples] == [
        (f"session{row[1]}/turn{row[2]}", row[6], out) for row, out in zip(recorded, outputs)]


def test_a_recorded_codex_request_replays_its_developer_messages_as_system_messages():
    # Codex sends its instructions as Responses developer messages; replayed as chat user messages, the first
    # would make the chat template add its default system prompt (SmolLM2: about 21 tokens the recording lacks)
    steps = replay_plan(str(DATA / "codex.jsonl"))
    assert [s.role for s in steps[0].request.segments] == ["developer", "developer", "user", "user"]
    msgs = _Replay(SimpleNamespace(w=SimpleNamespace(seed=0)), [steps[0].request]).messages(steps[0])
    assert [m["role"] for m in msgs] == ["system", "system", "user", "user"]
    assert [chat_role(r) for r in ("system", "user", "assistant", "developer", "function_call_output", "reasoning")] == [
        "system", "user", "assistant", "system", "user", "user"]
