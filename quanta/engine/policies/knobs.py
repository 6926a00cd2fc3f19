"""The declaration of a scheduler knob, and the one knob two unrelated policies share.

Each policy class lists the knobs its constructor takes in ``knobs`` (its own
file declares them). Everything else is derived from those declarations: the
``quanta serve`` / ``quanta simulate`` flags (:mod:`quanta.flags`), the
defaults, which policy takes which knob (:data:`quanta.engine.policies.POLICIES`)
and the one validation (:class:`quanta.config.SchedulerConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Knob:
    """One scheduler knob; its values are positive integers.

    Attributes:
        name: the policy constructor's argument and the :class:`~quanta.config.SchedulerConfig`
            key; the flag is ``--`` + the name with dashes.
        default: the value when the knob is not given (tokens, positions or sequences).
        help: what the knob sets, for ``--help`` (the policies taking it and the
            default are added there).
        within_cap: the value may not exceed ``prefill_cap``; the default is
            lowered to a smaller cap the user chose.
        seqs_bound: the value must be ``at_most`` or ``at_least`` ``max_num_seqs``, or None.
        seqs_reason: why it must (the tail of the error message).
        auto: the flag also takes ``auto`` (resolved before the engine starts).
    """

    name: str
    default: int
    help: str
    within_cap: bool = False
    seqs_bound: Literal["at_most", "at_least"] | None = None
    seqs_reason: str = ""
    auto: bool = False

    @property
    def flag(self) -> str:
        """``--prefill-cap`` for ``prefill_cap``."""
        return "--" + self.name.replace("_", "-")


#: The executor's graph boundary: ``batched`` and ``chunked`` split chunks at its multiples.
PREFILL_CAP = Knob("prefill_cap", 4096, "graph boundary in positions; chunks never cross its multiples")
