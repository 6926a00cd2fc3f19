"""Agent sessions: the recorded JSONL format, the prefix relation, the replay.

A sessions file (written by ``quanta record``) is one header line, then one
line per request an agent sent through the recording proxy::

    {"format": "quanta-sessions/1", "upstream": "http://...", "record_text": false, ...}
    {"id": 0, "t": 0.0, "done": 1.92, "session": 0, "turn": 0, "parent": null, "extends": false,
     "shared": 0, "shared_tokens": 0, "segments": [{"role": "system", "tokens": 31}, {"role": "user", "tokens": 412}],
     "prompt_tokens": 443, "completion_tokens": 96, "status": 200, "complete": true, ...}

Units: ``t`` / ``done`` seconds since the recording started; token counts
are the upstream's ``usage`` (its tokenizer). A request's *context* is its
prompt segments (system prompt, then each message) followed by its reply.
``parent`` is the earlier request whose context shares the longest leading
run of equal segments with this prompt, ``shared`` that number of segments
(``shared_tokens`` their tokens), ``segments`` only the segments after it.
``extends``: the prompt contains all of the parent's prompt (a next turn),
so the request belongs to the parent's session; otherwise it opens a new
session that merely shares a prefix (a common system prompt). Text is
stored only with ``quanta record --record-text``.

Replay (``quanta bench run --workload sessions --sessions-file FILE``) sends
each successful request once: a session's first request at its recorded
``t``, each next turn the recorded think time (``t`` minus the parent's
``done``) after its parent finishes in the replay. Its prompt is the
parent's replayed context cut to ``shared`` segments plus the new segments
as seeded words of their token counts (recorded text where present); the
output is exactly the recorded ``completion_tokens`` (``ignore_eos``). So
every server condition gets the same requests in the same order and
relation; only the assistant replies (the servers' own) differ in content.

The pure part of that replay (which request, after which parent's send or
end, at what time, sharing which prompt parts) is :func:`replay_plan`; the
bench client executes it over HTTP (:func:`replay`) and the simulator
(``quanta simulate --workload sessions``, :mod:`quanta.sim.run`) on its
virtual clock, so the two replay the same file the same way.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from quanta.bench import prompts

FORMAT = "quanta-sessions/1"
#: words of the per-run prefix of every session (150^6 choices: no two runs share one)
SALT_WORDS = 6
_FIELDS = {"id": int, "t": (int, float), "session": int, "turn": int, "shared": int, "shared_tokens": int,
           "segments": list, "extends": bool}


class SessionFileError(ValueError):
    """A sessions file that cannot be replayed (the message names the line and field)."""


@dataclass(frozen=True)
class Segment:
    """One prompt segment: a message (or the system prompt), ``tokens`` long."""

    role: str
    tokens: int
    text: str | None = None


@dataclass(frozen=True)
class SessionRequest:
    """One recorded request (see the module docstring for the fields)."""

    id: int
    t: float
    done: float | None
    session: int
    turn: int
    parent: int | None
    extends: bool
    shared: int
    shared_tokens: int
    segments: tuple[Segment, ...]
    prompt_tokens: int | None
    completion_tokens: int | None
    status: int | None
    complete: bool

    @property
    def replayable(self) -> bool:
        """It succeeded upstream and produced tokens (failed requests are not replayed)."""
        return self.status == 200 and self.complete and bool(self.completion_tokens)


def _check(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise SessionFileError(f"{where}: {what}")


def _segment(d, where: str) -> Segment:
    _check(isinstance(d, dict) and isinstance(d.get("role"), str), where, "a segment needs a string 'role'")
    tokens = d.get("tokens")
    _check(isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0, where, "a segment needs 'tokens' >= 0")
    _check(d.get("text") is None or isinstance(d["text"], str), where, "a segment's 'text' must be a string")
    return Segment(d["role"], tokens, d.get("text"))


def _optional_int(d: dict, key: str, where: str) -> int | None:
    v = d.get(key)
    _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0), where, f"'{key}' must be an integer >= 0 or null")
    return v


def _request(d, where: str) -> SessionRequest:
    _check(isinstance(d, dict), where, "expected a JSON object")
    for key, typ in _FIELDS.items():
        _check(key in d, where, f"missing field '{key}'")
        _check(isinstance(d[key], typ) and (typ is bool or not isinstance(d[key], bool)), where, f"'{key}' has the wrong type")
    _check(d["t"] >= 0 and d["shared"] >= 0 and d["shared_tokens"] >= 0, where, "'t', 'shared' and 'shared_tokens' must be >= 0")
    parent = _optional_int(d, "parent", where)
    done = d.get("done")
    _check(done is None or (isinstance(done, (int, float)) and done >= d["t"]), where, "'done' must be a time >= 't' or null")
    segs = tuple(_segment(s, where) for s in d["segments"])
    return SessionRequest(d["id"], float(d["t"]), None if done is None else float(done), d["session"], d["turn"], parent,
                          d["extends"], d["shared"], d["shared_tokens"], segs, _optional_int(d, "prompt_tokens", where),
                          _optional_int(d, "completion_tokens", where), _optional_int(d, "status", where), d.get("complete", True) is True)


def load(path: str) -> tuple[dict, tuple[SessionRequest, ...]]:
    """``(header, requests in id order)`` of a sessions file.

    Raises:
        SessionFileError: unreadable, no ``quanta-sessions/1`` header, a line
            that is not JSON or lacks a field, ids that are not 0..n-1, a
            timestamp earlier than the request before it, a parent that is
            not an earlier request, or nothing replayable.
    """
    try:
        st = Path(path).stat()
    except OSError as exc:
        raise SessionFileError(f"cannot read sessions file {path}: {exc}") from exc
    return _load(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> tuple[dict, tuple[SessionRequest, ...]]:
    """:func:`load`, parsed once per version of the file (workload checks, descriptions and runs all read it)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SessionFileError(f"cannot read sessions file {path}: {exc}") from exc
    parsed = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                parsed.append((n, json.loads(line)))
            except ValueError as exc:
                raise SessionFileError(f"{path}:{n}: not JSON ({exc})") from exc
    _check(bool(parsed), path, "empty sessions file")
    n0, header = parsed[0]
    _check(isinstance(header, dict) and header.get("format") == FORMAT, f"{path}:{n0}",
           f"not a sessions file (the first line must be a header with \"format\": \"{FORMAT}\", as quanta record writes)")
    reqs = sorted(((n, _request(d, f"{path}:{n}")) for n, d in parsed[1:]), key=lambda x: x[1].id)
    for i, (n, r) in enumerate(reqs):
        where = f"{path}:{n}"
        _check(r.id == i, where, f"request ids must be 0..{len(reqs) - 1}, each once (got {r.id} where {i} was expected)")
        _check(r.parent is None or r.parent < r.id, where, f"parent {r.parent} is not an earlier request")
        _check(r.parent is not None or r.shared == 0, where, "'shared' > 0 needs a parent")
        if i:
            prev = reqs[i - 1][1]
            _check(r.t >= prev.t, where, f"timestamps go backwards: request {r.id} at t={r.t:g} s arrives before "
                   f"request {prev.id} at t={prev.t:g} s (ids are in arrival order)")
    out = tuple(r for _, r in reqs)
    _check(any(r.replayable for r in out), path, "no request to replay (none finished with HTTP 200 and output tokens)")
    return header, out


def replayed(path: str) -> list[SessionRequest]:
    """The requests a replay sends (the replayable ones)."""
    return [r for r in load(path)[1] if r.replayable]


def describe(path: str) -> str:
    """One line: what a replay of ``path`` sends."""
    reqs = replayed(path)
    sessions = len({r.session for r in reqs})
    prompt = sum(r.prompt_tokens or 0 for r in reqs)
    shared = sum(r.shared_tokens for r in reqs)
    span = max(r.t for r in reqs) - min(r.t for r in reqs)
    return (f"sessions: {len(reqs)} recorded requests of {sessions} agent sessions from {path} over {span:.1f} s "
            f"(each next turn the recorded think time after its parent finishes), {prompt} prompt tokens of which "
            f"{shared} shared with an earlier request, exact recorded output lengths")


# --- replay ---------------------------------------------------------------

@dataclass(frozen=True)
class ReplayStep:
    """One request of a replay: what it waits for, when it is sent, what its prompt shares.

    The pure part of the replay, executed by the bench client (:func:`replay`, asyncio
    over HTTP) and by the simulator (:mod:`quanta.sim.run`) alike.

    Attributes:
        request: the recorded request.
        parent: the replayed request it depends on (None: its recorded parent, if any, is not replayed).
        after: ``"done"``: it waits until ``parent`` finished in this replay (a next turn, or a shared
            prefix that reaches into the parent's reply); ``"sent"``: until ``parent`` was sent (a new
            session sharing part of the parent's prompt); None: no wait.
        think: a next turn's seconds between its parent's end and its send (the recorded ``t`` minus the
            parent's ``done``, >= 0); None: sent at its recorded ``t``.
    """

    request: SessionRequest
    parent: SessionRequest | None
    after: str | None
    think: float | None

    @property
    def tag(self) -> str:
        return f"session{self.request.session}/turn{self.request.turn}"

    def times(self, parent_at: float | None) -> tuple[float, float]:
        """``(scheduled, sent)`` seconds into the run, given when the awaited event of ``parent`` (its send
        or its end, see ``after``) happened in this replay (None without one).

        A next turn is scheduled and sent ``think`` seconds after its parent ends; any other request is
        scheduled at its recorded ``t`` and sent then, or as soon as its parent's event happened if later
        (its latency counts from ``t``, so that wait is included).
        """
        t = self.request.t
        if self.after is None or parent_at is None:
            return t, t
        if self.think is not None:
            return parent_at + self.think, parent_at + self.think
        return t, max(t, parent_at)

    def prefix(self, context: list | None) -> list | None:
        """The shared prompt parts: ``context`` (the parent's replayed parts so far: its prompt's, then its
        reply once it finished; None when it was not replayed) cut to ``request.shared`` parts; ``[]`` when
        nothing is shared; None when that context is missing or shorter, so that a stand-in of
        ``request.shared_tokens`` tokens takes its place."""
        n = self.request.shared
        if not n:
            return []
        return None if context is None or len(context) < n else list(context[:n])


def replay_plan(path: str) -> list[ReplayStep]:
    """The steps of a replay of ``path``, one per replayed request, in id (arrival) order.

    Raises:
        SessionFileError: as :func:`load`.
    """
    return plan_steps(replayed(path))


def plan_steps(reqs: list[SessionRequest]) -> list[ReplayStep]:
    """The replay steps of ``reqs`` (ids increasing, parents earlier): a parent not among them is not replayed."""
    by_id = {r.id: r for r in reqs}
    steps = []
    for r in reqs:
        parent = by_id.get(r.parent) if r.parent is not None else None
        if parent is None:
            steps.append(ReplayStep(r, None, None, None))
        elif r.extends:  # a next turn: the agent acts on the parent's reply, after its think time
            gap = r.t - parent.done if parent.done is not None else 0.0
            steps.append(ReplayStep(r, parent, "done", max(0.0, gap)))
        else:  # a new session sharing a prefix: its recorded time, once that prefix exists
            reply = r.shared > len(parent.segments) + parent.shared
            steps.append(ReplayStep(r, parent, "done" if reply else "sent", None))
    return steps


def chat_role(role: str) -> str:
    """The chat role a recorded segment is replayed as: system, user and assistant as they are, a Responses
    ``developer`` message as ``system`` (OpenAI's system role; a first message that is no system message
    makes chat templates such as SmolLM2's add their default system prompt, tokens the recording did not
    have), any other segment (a tool call, its output, reasoning) as ``user``."""
    if role in ("system", "user", "assistant"):
        return role
    return "system" if role == "developer" else "user"


def _words(tokens: int, seed: str) -> str:
    return prompts.text(tokens, random.Random(seed)) if tokens else ""


class _Replay:
    """State of one replay over HTTP: every request's replayed context and its events."""

    def __init__(self, run, reqs: list[SessionRequest]) -> None:
        self.run = run
        # per run, so no replay hits an earlier run's (or repeat's) cache; words, not hex, so that its
        # length in tokens is the same in every run (BPE splits random hex unevenly)
        self.salt = prompts.text(SALT_WORDS, random.Random(uuid.uuid4().int))
        self.prompts: dict[int, list[dict]] = {}
        self.contexts: dict[int, list[dict]] = {}
        self.sent = {r.id: asyncio.Event() for r in reqs}
        self.done = {r.id: asyncio.Event() for r in reqs}
        self.at: dict[str, dict[int, float]] = {"sent": {}, "done": {}}

    def messages(self, step: ReplayStep) -> list[dict]:
        """The chat messages of ``step``: its shared prefix, then its new segments."""
        r = step.request
        parent = step.parent.id if step.parent is not None else None
        msgs = step.prefix(self.contexts.get(parent) or self.prompts.get(parent))
        if msgs is None:  # the parent was not replayed: same size, synthetic words
            msgs = [{"role": "user", "content": f"{self.salt} " + _words(r.shared_tokens, f"{self.run.w.seed}:{r.id}:shared")}]
        for j, seg in enumerate(r.segments):
            text = seg.text if seg.text is not None else _words(seg.tokens, f"{self.run.w.seed}:{r.id}:{j}")
            if not msgs and j == 0:
                text = f"{self.salt} {text}"
            msgs.append({"role": chat_role(seg.role), "content": text})
        return msgs or [{"role": "user", "content": self.salt}]

    def _mark(self, event: str, rid: int) -> None:
        self.at[event].setdefault(rid, self.run.clock.now())
        (self.sent if event == "sent" else self.done)[rid].set()

    async def _wait_parent(self, step: ReplayStep) -> float:
        """Wait until this request may be sent; returns its scheduled time."""
        parent_at = None
        if step.after is not None:
            await (self.done if step.after == "done" else self.sent)[step.parent.id].wait()
            parent_at = self.at[step.after][step.parent.id]
        scheduled, send = step.times(parent_at)
        await self.run.at(send)
        return scheduled

    async def one(self, step: ReplayStep) -> None:
        r = step.request
        try:
            scheduled = await self._wait_parent(step)
            msgs = self.messages(step)
            self.prompts[r.id] = msgs
            self._mark("sent", r.id)
            sample = self.run.new_sample(scheduled, step.tag)
            pieces: list[str] = []
            await self.run.request(sample, msgs, r.completion_tokens, pieces, prompt_size=r.prompt_tokens)
            reply = "".join(pieces) if sample.ok else _words(r.completion_tokens, f"{self.run.w.seed}:{r.id}:reply")
            self.contexts[r.id] = msgs + [{"role": "assistant", "content": reply}]
        finally:
            self._mark("sent", r.id)
            self._mark("done", r.id)


async def replay(run, steps: list[ReplayStep]) -> None:
    """Send ``steps`` over HTTP through ``run`` (a :class:`quanta.bench.workloads.Run`)."""
    state = _Replay(run, [s.request for s in steps])
    await asyncio.gather(*(state.one(s) for s in steps))
