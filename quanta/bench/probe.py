"""The probe workload, defined once: a generator of commands that the bench
client (:func:`run_http`, asyncio over HTTP) and the simulator
(:mod:`quanta.sim.run`, on its virtual clock) both execute.

``sessions`` requests decode continuously (``session_tokens`` outputs); once
every one streams, ``probe_delay`` seconds later one cold prompt of
``probe_words`` words after a :data:`~quanta.bench.prompts.PROBE_NONCE_CHARS`
hex nonce is sent (``max_tokens`` outputs); ``probe_delay`` seconds after it
ends, the sessions still running are cancelled (the workload's doing, so
``client_cancel``, not a failure).

Commands yielded by :func:`steps`: :class:`Send` (answered with the request's
:class:`~quanta.analysis.requests.RequestSample`), :class:`Sleep`,
:class:`Until` and :class:`Cancel` (answered with None).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass

from quanta.analysis.requests import RequestSample
from quanta.bench import prompts


@dataclass(frozen=True)
class Send:
    """Send a prompt of ``words`` words after a ``nonce_chars``-hex nonce now, for ``max_tokens`` outputs."""

    words: int
    nonce_chars: int
    max_tokens: int
    tag: str


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Until:
    """Wait until every request of ``samples`` has streamed a token or ended (``streaming``), or ended (``done``)."""

    samples: tuple[RequestSample, ...]
    what: str

    def holds(self) -> bool:
        return all(s.done is not None or (self.what == "streaming" and bool(s.chunks)) for s in self.samples)


@dataclass(frozen=True)
class Cancel:
    """Stop reading the requests of ``samples`` still running (``client_cancel``)."""

    samples: tuple[RequestSample, ...]


Command = Send | Sleep | Until | Cancel


def steps(w) -> Generator[Command, RequestSample | None, None]:
    """The probe of workload ``w`` (a :class:`~quanta.bench.workloads.Workload`) as commands."""
    sessions = []
    for _ in range(w.sessions):
        sessions.append((yield Send(w.prompt_words, prompts.NONCE_CHARS, w.session_tokens, "session")))
    yield Until(tuple(sessions), "streaming")
    yield Sleep(w.probe_delay)
    probe = yield Send(w.probe_words, prompts.PROBE_NONCE_CHARS, w.max_tokens, "probe")
    yield Until((probe,), "done")
    yield Sleep(w.probe_delay)
    yield Cancel(tuple(sessions))


async def run_http(run) -> None:
    """Execute :func:`steps` through ``run`` (a :class:`quanta.bench.workloads.Run`); cancelled (the run's
    deadline), it cancels the requests still running."""
    gen = steps(run.w)
    tasks: dict[int, asyncio.Future] = {}
    cmd = next(gen)
    try:
        while True:
            answer = None
            if isinstance(cmd, Send):
                answer = run.new_sample(run.clock.now(), cmd.tag)
                text = prompts.prompt(cmd.words, run.rng, nonce_chars=cmd.nonce_chars)
                tasks[answer.id] = asyncio.ensure_future(run.request(answer, text, cmd.max_tokens))
            elif isinstance(cmd, Sleep):
                await asyncio.sleep(cmd.seconds)
            elif isinstance(cmd, Until):
                while not cmd.holds():  # bounded by the requests' own timeouts and the run's deadline
                    await asyncio.sleep(0.01)
            else:
                await _cancel(cmd.samples, tasks)
            try:
                cmd = gen.send(answer)
            except StopIteration:
                break
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    finally:
        for t in tasks.values():
            t.cancel()


async def _cancel(samples: tuple[RequestSample, ...], tasks: dict[int, asyncio.Future]) -> None:
    for s in samples:
        tasks[s.id].cancel()
    await asyncio.gather(*(tasks[s.id] for s in samples), return_exceptions=True)
    for s in samples:  # stopping them is the workload's doing, not a failure
        if s.error == "deadline":
            s.error, s.error_detail, s.finish_reason = None, None, "client_cancel"
