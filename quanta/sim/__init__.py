"""``quanta simulate``: quanta's own schedulers and Engine on a virtual clock.

- :mod:`.profile` — the cost profile JSON format and the cost model.
- :mod:`.executor` — :class:`CostModelExecutor` and :class:`VirtualClock`.
- :mod:`.run` — workloads on the simulated engine, samples and trace for ``quanta.analysis``.
"""

from quanta.sim.executor import CostModelExecutor, VirtualClock
from quanta.sim.profile import Profile, ProfileError

__all__ = ["CostModelExecutor", "Profile", "ProfileError", "VirtualClock"]
