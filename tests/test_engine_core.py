"""The engine core: imports without torch or transformers, copies each step's
statistics from the executor's :class:`StepResult` into the trace, and takes
its text handling per request from the injected ``make_text``."""

from __future__ import annotations

import subprocess
import sys

from quanta.engine.engine import Engine
from quanta.engine.executor import Executor, StepResult
from quanta.engine.policies.chunked import ChunkedScheduler
from quanta.engine.policies.continuous import ContinuousScheduler
from quanta.engine.sampling import SamplingParams
from quanta.engine.stop_strings import StopMatcher, TextState

#: token ``i`` decodes to ``PIECES[i]``
PIECES = ["", "a", "b", "<stop>", "c"]


class Pieces:
    """A stand-in detokenizer: token ``i`` is ``PIECES[i]``."""

    def add(self, token_id: int) -> str:
        return PIECES[token_id]

    def flush(self) -> str:
        return ""


class ScriptedExecutor(Executor):
    """Emits ``tokens`` in turn for each chunk that samples; reports the step's
    token count as its expert statistics."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = iter(tokens)

    def execute(self, plan, interrupt=None):
        out = [next(self.tokens) if c.seq.num_computed_tokens + c.num_new_tokens == c.seq.num_tokens else None
               for c in plan.chunks]
        return StepResult(out, {"num_tokens": sum(c.num_new_tokens for c in plan.chunks)})


def test_the_engine_core_imports_without_torch_or_transformers():
    code = "import quanta.sim.run, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_step_statistics_go_from_the_step_result_into_its_trace_record():
    engine = Engine(ChunkedScheduler(1, 1, 4, 64), ScriptedExecutor([1, 2, 4]), max_model_len=100)
    engine.add_request([9] * 6, SamplingParams(max_tokens=3, temperature=0))
    while engine.has_work():
        engine.step()
    records = engine.trace.records
    assert [r.experts for r in records] == [{"num_tokens": r.num_new_tokens[0]} for r in records]
    assert [r.num_new_tokens[0] for r in records] == [4, 2, 1, 1]


def test_text_comes_from_the_text_state_made_for_each_request():
    made: list[SamplingParams] = []

    def make_text(params: SamplingParams) -> TextState:
        made.append(params)
        return TextState(Pieces(), StopMatcher(params.stop) if params.stop else None)

    engine = Engine(ContinuousScheduler(2, 2), ScriptedExecutor([1, 1, 2, 2, 3, 4]), 100, make_text)
    stopped = SamplingParams(max_tokens=5, temperature=0, stop=["<stop>"])
    plain = SamplingParams(max_tokens=2, temperature=0)
    a, b = engine.add_request([5, 5], stopped), engine.add_request([6], plain)
    assert made == [stopped, plain]
    text, finish = {a.seq_id: "", b.seq_id: ""}, {}
    while engine.has_work():
        for out in engine.step():
            text[out.seq_id] += out.text
            if out.finished:
                finish[out.seq_id] = (out.finish_reason, out.stop_string)
    assert text == {a.seq_id: "ab", b.seq_id: "ab"}
    assert finish == {a.seq_id: ("stop", "<stop>"), b.seq_id: ("length", None)}


def test_without_make_text_the_engine_yields_tokens_only():
    engine = Engine(ContinuousScheduler(1, 1), ScriptedExecutor([1, 2]), 100)
    engine.add_request([5], SamplingParams(max_tokens=2, temperature=0, stop=["b"]))
    outs = [o for _ in range(3) for o in engine.step()]
    assert [(o.token_ids, o.text) for o in outs] == [([1], ""), ([2], "")]
    assert outs[-1].finish_reason == "length"
