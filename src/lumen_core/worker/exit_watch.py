"""Whether the kernel has begun to end a child process, before it can be reaped.

A SIGKILLed process is reaped only after its memory is torn down (0.16 to 3.9 s for a vLLM
server on two loaded cores, bench/RESULTS.md; longer for a GPU server's CUDA contexts), while
the kernel marks its main thread ``PF_EXITING`` as soon as it takes the signal. The agent's
supervisor looks every 10 ms, so a look must be cheap: ``/proc/<pid>/stat`` is opened once
and read again in place (1.3% of a core at 100 looks a second, against 5% for a
``Popen.wait`` with a timeout and a fresh open per look).
"""

from __future__ import annotations

import os

__all__ = ["ExitWatch", "stat_fields"]

_PF_EXITING = 0x4  # include/linux/sched.h: the task is being shut down


def stat_fields(stat: bytes) -> list[bytes]:
    """The fields of a ``/proc/<pid>/stat`` line from field 3 (the state) on; field ``n`` is
    at index ``n - 3``. The command name, field 2, is in parentheses and may hold spaces or
    parentheses itself, so the split starts after its last closing one."""
    return stat[stat.rindex(b")") + 2 :].split()


class ExitWatch:
    """Watches process ``pid`` (a child of this process, so its pid is not reused before it
    is reaped). Without a ``/proc`` it never reads as exiting: the caller's wait covers it."""

    def __init__(self, pid: int) -> None:
        self._closed = False
        try:
            self._fd: int | None = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # gone already, or no /proc
            self._fd = None
            self._gone = os.path.exists("/proc/self/stat")
        else:
            self._gone = False

    def exiting(self) -> bool:
        """Whether the kernel is ending the process (``PF_EXITING``), has ended it (a
        zombie) or it is gone (reaped). A closed watch cannot say: ValueError."""
        if self._closed:
            raise ValueError("the exit watch is closed")
        if self._fd is None:
            return self._gone
        try:
            stat = os.pread(self._fd, 1024, 0)
        except ProcessLookupError:  # reaped
            return True
        fields = stat_fields(stat)
        state, flags = fields[0], int(fields[6])  # fields 3 and 9
        return state in (b"Z", b"X") or bool(flags & _PF_EXITING)

    def close(self) -> None:
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ExitWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
