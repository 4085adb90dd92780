"""Where, and at what priority, the connector's own threads run (the streamer's, restores',
lookups' and their connections'). On Linux both are per thread and a thread starts with its
creator's: a thread set up here passes them on to the threads it starts, and ``creating_on``
makes the threads a constructor starts inherit them without moving the caller for longer."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from lumen_core._validate import check_int

__all__ = ["check_cpus", "creating_on", "setup_thread"]


def check_cpus(name: str, cpus: Iterable[int] | None) -> frozenset[int] | None:
    """``cpus`` as a set of this machine's CPU numbers (None: no placement). TypeError when not
    a collection of ints, ValueError when empty or naming a CPU the machine does not have."""
    if cpus is None:
        return None
    if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
        raise TypeError(f"`{name}` must be a collection of CPU numbers, got {type(cpus).__name__}")
    count = os.cpu_count() or 1
    chosen = frozenset(check_int(f"{name}[i]", cpu, 0, count - 1) for cpu in cpus)
    if not chosen:
        raise ValueError(f"`{name}` must name at least one CPU")
    return chosen


def _place(cpus: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread
    except OSError as error:
        raise ValueError(f"CPUs {sorted(cpus)} are not ones this process may run on: {error}") from error


def setup_thread(nice: int, cpus: frozenset[int] | None) -> None:
    """For the calling thread: raises its niceness to ``nice`` (never lowers it, which would
    need a privilege) and, with ``cpus``, keeps it on them."""
    thread = threading.get_native_id()
    if nice > os.getpriority(os.PRIO_PROCESS, thread):
        os.setpriority(os.PRIO_PROCESS, thread, nice)
    if cpus is not None:
        _place(cpus)


@contextmanager
def creating_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside (by the calling thread, and by those threads) run on ``cpus``;
    the caller's own CPUs are restored on leaving. None: nothing changes."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    _place(cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
