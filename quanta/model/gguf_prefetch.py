"""A dense GGUF's forms converted on a thread of their own while the process imports torch and the server.

``quanta serve`` spends ~1.5-2 s importing torch, FastAPI and its own modules before the model load
starts, and the load itself is mostly converting the file's blocks into forms (C, off the GIL, on
the C pool's threads). :func:`start` converts every form the load will ask for
(:func:`quanta.model.gguf_plan.dense_forms`) into numpy arrays as soon as the command line is
read; :func:`quanta.model.gguf_blocks.load_block_model` then takes each one (:meth:`Prefetch.take`,
waiting for it if it is not done yet) instead of converting it, and converts itself only what was
not planned. Nothing here imports torch.

The memory is the load's own: each form is made once, by one of the two, and the mapped bytes of
one tensor at a time. Until the loader claims the prefetch (:func:`claim`, once the imports are done)
a form's fresh pages are faulted in by the conversion's own writes, not made resident in one call
(``MAP_POPULATE``): populating holds the process's memory map lock for each mapping, and every
``mmap`` of the libraries torch loads beside it waits for that (a 1B Q8_0's 1.3 GB populated beside
``import torch`` made the import 0.4-0.5 s slower, 2-core AMD EPYC VM; faulting in, no slower).
The C pool takes one caller at a time, so the loader converts nothing of its own while the thread
runs (:meth:`Prefetch.take` of an unplanned form waits for the thread to end). A failure on the
thread (a truncated file) only leaves its forms to the loader, which reports it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

from quanta.model import gguf_plan
from quanta.model.gguf_header import read_header
from quanta.model.native import repack

log = logging.getLogger(__name__)

_lock = threading.Lock()
_current: Prefetch | None = None


class Prefetch:
    """The forms of ``path``'s plan (:func:`~quanta.model.gguf_plan.dense_forms`, read on the thread),
    converted in order on a daemon thread."""

    def __init__(self, path: Path) -> None:
        self.path, self.error = path, None
        #: forms handed to the loader
        self.taken = 0
        #: set by :func:`claim`: the imports are done, fresh pages are populated in one call
        self.claimed = threading.Event()
        self._plan: dict[tuple[str, ...], gguf_plan.Planned] | None = None
        self._done: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
        self._cond = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._convert, name="quanta-gguf-prefetch", daemon=True)
        self._thread.start()

    def _convert(self) -> None:
        try:
            header = read_header(self.path)
            plan = gguf_plan.dense_forms(header)
            tensors = {t.name: t for t in header.tensors}
            with self._cond:
                self._plan = {p.names: p for p in plan}
                self._cond.notify_all()
            for p in plan:
                with self._cond:
                    if not self._running:
                        return
                arrays = _convert_one(self.path, tensors, p, populate=self.claimed.is_set())
                with self._cond:
                    self._done[p.names] = arrays
                    self._cond.notify_all()
        except Exception as exc:  # a bad file, no C library: the loader meets it again and reports it, once
            self.error = exc
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def take(self, names: list[str], kind: str, rows: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray] | None:
        """The converted ``(data, scales)`` of the form stacked from ``names`` in ``kind`` with row maps
        ``rows``, once converted; None where it was not planned so (after the thread has ended)."""
        key = tuple(names)
        with self._cond:
            while self._plan is None and self._running:
                self._cond.wait()
            same = _same(self._plan.get(key) if self._plan else None, kind, rows)
            while (not same or key not in self._done) and self._running:
                self._cond.wait()
            done = self._done.pop(key, None) if same else None
            self.taken += done is not None
            return done

    @property
    def planned(self) -> int:
        """Forms in the plan (0 before the thread has read it)."""
        return len(self._plan or ())

    def close(self) -> None:
        """Stop after the form being converted, wait for the thread, drop what was not taken."""
        with self._cond:
            self._running = False
        self._thread.join()
        if self._done:
            log.debug("%s: %d converted forms were not asked for", self.path.name, len(self._done))
        self._done.clear()


def _same(p: gguf_plan.Planned | None, kind: str, rows: list[np.ndarray | None]) -> bool:
    """Whether ``p`` is the form asked for: its kind and every part's row map."""
    return p is not None and p.kind == kind and len(p.rows) == len(rows) and all(
        (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
        for a, b in zip(p.rows, rows, strict=True))


def _convert_one(path: Path, tensors: dict, p: gguf_plan.Planned, populate: bool) -> tuple[np.ndarray, np.ndarray]:
    """The form ``p`` from the file's bytes, its parts converted one at a time into their rows
    (``populate``: its pages made resident before, :func:`~quanta.model.native.repack.empty_arrays`)."""
    k = gguf_plan.shape(tensors[p.names[0]])[1]
    sizes = [gguf_plan.shape(tensors[n])[0] for n in p.names]
    data, scales = repack.empty_arrays(p.kind, sum(sizes), k, populate)
    start = 0
    for name, n, rows in zip(p.names, sizes, p.rows, strict=True):
        part = slice(start, start + n) if p.kind == "fp16" else slice(start // 8, (start + n) // 8)
        repack.to_form(gguf_plan.mapped(path, tensors[name]), tensors[name].tensor_type.name, n, k, p.kind, rows,
                       out=(data[part], scales if p.kind == "fp16" else scales[part]))
        start += n
    return data, scales


def start(path: str | os.PathLike[str]) -> Prefetch:
    """Start converting GGUF file ``path``'s dense forms ahead of its load (a file that is not a dense one
    read from its blocks, or whose header does not parse, converts nothing: the load reports what is
    wrong). A prefetch started before and not claimed is closed first."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
        _current = Prefetch(Path(os.path.realpath(path)))
        return _current


def claim(path: str | os.PathLike[str]) -> Prefetch | None:
    """The prefetch started for ``path`` (:func:`start`), now the caller's to :meth:`~Prefetch.close`; None if none."""
    global _current
    with _lock:
        if _current is None or _current.path != Path(os.path.realpath(path)):
            return None
        taken, _current = _current, None
        taken.claimed.set()
        return taken
