""":class:`ModelExecutor` on a synthetic MoE model: each step's expert
statistics come back in its :class:`StepResult` and land in the trace record
of that step (dense models and fake executors leave ``experts`` None)."""

from __future__ import annotations

import torch

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model

from moe_helpers import tiny_moe_dir


def test_each_step_records_the_expert_statistics_of_its_own_forward_pass(tmp_path_factory):
    loaded = load_model(str(tiny_moe_dir(tmp_path_factory)), torch.float32)
    engine = build_engine(loaded, EngineConfig(max_model_len=128), SchedulerConfig("chunked", 2, {"chunk": 16}))
    engine.add_request(list(range(10, 50)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    records = list(engine.trace.records)
    assert [sum(r.num_new_tokens) for r in records] == [16, 16, 8, 1, 1]
    assert [r.experts["num_tokens"] for r in records] == [16, 16, 8, 1, 1]
    assert all(6 <= r.experts["unique_experts"] <= 64 and r.experts["num_layers"] == 2 for r in records)
