"""An in-process ``quanta`` server for fault-injection tests: the real embedded
model, engine thread, FastAPI app and uvicorn on 127.0.0.1, with an engine
that can poison a request after the API validated it.

* ``top_k == POISON_TOP_K``: the request reaches the sampler with the seed
  2**64, which ``torch.Generator`` refuses (issue 12's failure, now stopped
  at the API), so its sampling fails inside an engine step.
* ``seed == CRASH_SEED``: ``submit`` raises an unexpected exception whose text
  is :data:`SECRET` (it must reach the log, never the client).

Metrics are wired as ``quanta serve`` wires them; tokenizer calls record the
thread they ran on (:attr:`PoisoningEngine.tokenized_on`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from quanta.bench.server import free_port
from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.async_engine import AsyncEngine
from quanta.engine.sampling import SamplingParams
from quanta.launch import LoadedModel, build_engine
from quanta.server.app import ServerState, build_app
from quanta.server.metrics import EngineMetrics

POISON_TOP_K = 4242
CRASH_SEED = 4343
SECRET = "secret-detail-7f3a"
MODEL_NAME = "quanta-test"


class PoisoningEngine(AsyncEngine):
    """An :class:`AsyncEngine` that corrupts requests carrying a marker (see the module docstring)."""

    tokenized_on: list[str] = []

    async def submit(self, prompt_token_ids, params: SamplingParams, **kwargs):
        if params.seed == CRASH_SEED:
            raise KeyError(SECRET)
        if params.top_k == POISON_TOP_K:
            params.seed = 2**64
        return await super().submit(prompt_token_ids, params, **kwargs)


@dataclass
class Live:
    base: str
    model: str
    state: ServerState


@contextmanager
def serve_in_process(loaded: LoadedModel, max_model_len: int, max_request_bytes: int, max_num_seqs: int = 4) -> Iterator[Live]:
    """Run a server until the block ends (startup bounded to 60 s)."""
    engine = build_engine(loaded, EngineConfig(max_model_len=max_model_len), SchedulerConfig("batched", max_num_seqs, {}))
    async_engine = PoisoningEngine(engine)
    metrics = EngineMetrics(lambda: async_engine.num_running, lambda: async_engine.num_waiting)
    async_engine.on_output = metrics.observe_output
    engine.step_listeners.append(metrics.observe_step)
    async_engine.start()
    state = ServerState(async_engine, loaded.tokenizer, MODEL_NAME, max_model_len, {}, metrics, max_request_bytes)
    encode = loaded.tokenizer.encode

    def recording_encode(*args, **kwargs):
        PoisoningEngine.tokenized_on.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    loaded.tokenizer.encode = recording_encode
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        yield Live(f"http://127.0.0.1:{server.config.port}", MODEL_NAME, state)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        async_engine.stop()
        state.prompts.close()
        loaded.tokenizer.encode = encode
