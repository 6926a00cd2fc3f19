"""How many threads the C kernels' pool gets in a decode step, 1 or 2, found by trying.

On idle cores two threads read the weights about twice as fast as one. On cores that other
work shares, it depends: with one other busy process a second thread mostly waits for a CPU
and for its partner (one thread is faster), with four the scheduler's fair share gives two
threads more CPU time than one (two are faster). No reading of the machine's load says
which, so the tuner measures it: every ``every``-th decode step runs on the other count,
and its time is compared with the median of the last few steps of the same row count on
the current one (consecutive decode steps do nearly the same work). A running mean of the
log ratio decides: the other count takes over when it is faster by ``SWITCH`` or more; while
it is clearly slower (by ``SLOWER``), tries grow rarer (up to every ``MAX_EVERY``-th step), so
on idle cores they cost under 1%. When the current count's steps get slower or faster by
``DRIFT`` (other work started or stopped), tries are frequent again at once.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

#: the other count takes over when its steps take at most this share of the current one's
SWITCH = 0.9
#: tries grow rarer while the other count's steps take this share or more
SLOWER = 1.15
FIRST_EVERY, MAX_EVERY = 8, 64
#: weight of the newest try in the running mean of log ratios
WEIGHT = 0.5
#: steps of the current count kept per row count, the reference a try is compared with
REFERENCE = 5
#: a change of the reference's median by this factor makes tries frequent again
DRIFT = 1.3


class ThreadTuner:
    """Picks each decode step's thread count (:meth:`pick`) from the times of the steps before
    (:meth:`record`). ``threads`` 1, or ``fixed``: always ``threads`` (a count set by hand)."""

    def __init__(self, threads: int, fixed: bool = False) -> None:
        self.current = threads
        self.tuning = threads == 2 and not fixed
        self.every = FIRST_EVERY
        self.score = 0.0  # running mean of log(other's time / current's time)
        self.tries = self.switches = 0
        self._since = 0
        self._reference: dict[int, deque[float]] = {}
        self._settled: dict[int, float] = {}  # the reference's median when last seen steady, per row count

    def __str__(self) -> str:
        """For the startup line: ``1-2 tried`` or the fixed count."""
        return "1-2 tried" if self.tuning else str(self.current)

    @property
    def other(self) -> int:
        return 3 - self.current

    def pick(self) -> int:
        """Threads for the next decode step: the current count, or now and then the other."""
        if not self.tuning:
            return self.current
        self._since += 1
        if self._since < self.every:
            return self.current
        self._since = 0
        return self.other

    def record(self, threads: int, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds`` on ``threads`` threads."""
        if not self.tuning:
            return
        reference = self._reference.setdefault(rows, deque(maxlen=REFERENCE))
        if threads == self.current:
            reference.append(seconds)
            self._watch_drift(rows, reference)
        elif len(reference) >= 2 and seconds > 0:
            self._judge(math.log(seconds / statistics.median(reference)))

    def _watch_drift(self, rows: int, reference: deque[float]) -> None:
        if len(reference) < REFERENCE:
            return
        median, settled = statistics.median(reference), self._settled.get(rows)
        if settled is not None and not settled / DRIFT <= median <= settled * DRIFT:
            self.every, self._since = FIRST_EVERY, max(self._since, FIRST_EVERY - 1)  # try the other count next
        if settled is None or self.every == FIRST_EVERY:
            self._settled[rows] = median

    def _judge(self, log_ratio: float) -> None:
        self.tries += 1
        self.score = (1 - WEIGHT) * self.score + WEIGHT * log_ratio
        if self.score <= math.log(SWITCH):
            self.current, self.score, self.every = self.other, 0.0, FIRST_EVERY
            self.switches += 1
            self._reference.clear()
            self._settled.clear()
        elif self.score >= math.log(SLOWER):
            self.every = min(2 * self.every, MAX_EVERY)
        else:
            self.every = FIRST_EVERY
