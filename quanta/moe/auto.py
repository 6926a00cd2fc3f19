"""``--mixed-prefill-quantum auto``: resolved from the model's config before any weight is loaded."""

from __future__ import annotations

import logging
from pathlib import Path

from quanta.config import SchedulerConfig
from quanta.model.loader import embedded_model_path, load_config
from quanta.moe.advisor import Advice, advise, cached_cost_report

log = logging.getLogger("quanta")

#: Placeholder the CLI validates with until the model config is read (any legal quantum works).
AUTO_PLACEHOLDER = 1


def resolve_auto_from_model(model: str | None, sched: SchedulerConfig) -> tuple[SchedulerConfig, Advice]:
    """A copy of ``sched`` whose ``mixed_prefill_quantum`` is the advisor's choice for ``model``.

    Reads only ``config.json`` / GGUF metadata (None: the embedded model) and
    this machine's cached cost report of the model, if ``quanta profile`` made one.

    Raises:
        FileNotFoundError / ValueError: the model cannot be read.
    """
    path = Path(model) if model else embedded_model_path()
    cfg = load_config(path)
    name = path.stem if path.is_file() else path.name  # the name quanta profile files its report under
    cap = sched.knobs["prefill_cap"]
    advice = advise(cfg.num_experts if cfg.is_moe else None, cfg.num_experts_per_tok or None, cap,
                    cost_report=cached_cost_report(name), model_name=name)
    resolved = sched.with_knob("mixed_prefill_quantum", advice.quantum)
    log.info("mixed_prefill_quantum=auto -> %d: %s", advice.quantum, advice.reason)
    return resolved, advice
