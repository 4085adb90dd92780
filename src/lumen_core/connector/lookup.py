"""``RestoreLookup``: the durable length of each resumed request's checkpoint, asked without
blocking the caller (an engine's scheduler): "not known yet" until a background answer
arrives, then the answer, cached per request."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from lumen_core._validate import check_int, check_number
from lumen_core.auth import WorkerIdentity
from lumen_core.connector.requests import RestoreSource
from lumen_core.connector.sources import SourceReader
from lumen_core.connector.threads import check_cpus, setup_thread
from lumen_core.stream._common import check_str
from lumen_core.stream.holder import HolderStore

__all__ = ["RestoreLookup"]


class RestoreLookup:
    """Plans restores: how many leading tokens of a request its source holds durably.

    A source in this process (``store``) is answered at once; a holder is asked on one of
    ``lanes`` background threads, one small read each. A holder's lookups all go to the same
    lane (chosen by its address), the only user of that lane's connections, so they reuse one
    connection, and a holder that stalls holds up only its own lane's lookups, not the other
    holders'. Readings are ``record_bytes`` wide (the engine's token record size). ``cpus``:
    where the lanes run (``threads.py``; None: where their first caller runs).
    Thread-safe for one caller thread (the scheduler's).
    """

    def __init__(
        self,
        secret: bytes,
        *,
        record_bytes: int,
        store: HolderStore | None = None,
        shard: int = 0,
        tls: str = "",
        connect_timeout_s: float = 2.0,
        identity: WorkerIdentity | None = None,
        encrypt: bool = False,
        lanes: int = 4,
        cpus: Iterable[int] | None = None,
    ) -> None:
        self.record_bytes = check_int("record_bytes", record_bytes, 1, 1 << 40)
        num_lanes = check_int("lanes", lanes, 1, 64)
        placed = check_cpus("cpus", cpus)

        def reader() -> SourceReader:
            return SourceReader(
                secret,
                store=store,
                shard=shard,
                tls=tls,
                connect_timeout_s=connect_timeout_s,
                identity=identity,
                encrypt=encrypt,
            )

        # Readers are not thread-safe: one for sources in this process (the caller's thread),
        # one per lane, used only on that lane's thread.
        self._local = reader()
        self._readers = [reader() for _ in range(num_lanes)]
        self._lanes = [
            ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"lumen-lookup{i}",
                initializer=setup_thread,
                initargs=(0, placed),
            )
            for i in range(num_lanes)
        ]
        self._answers: dict[str, Future[int]] = {}

    def plan(self, request_id: str, key: int, source: RestoreSource) -> int | None:
        """Durable tokens of ``request_id`` (wire key ``key``) at ``source``, or None while the
        answer is not known yet (ask again later: the first call starts the lookup). The
        answer is kept until ``forget``. A source that cannot answer reads as 0."""
        check_str("request_id", request_id)
        answer = self._answers.get(request_id)
        if answer is None:
            if not isinstance(source, RestoreSource):
                raise TypeError(f"`source` must be a RestoreSource, got {type(source).__name__}")
            if source.address is None:  # this process's store: no I/O, answered here
                answer = Future()
                answer.set_result(self._local.durable_tokens(key, source, self.record_bytes))
            else:
                lane = hash(source.address) % len(self._lanes)
                reader = self._readers[lane]
                answer = self._lanes[lane].submit(reader.durable_tokens, key, source, self.record_bytes)
            self._answers[request_id] = answer
        return answer.result() if answer.done() else None

    def wait(self, request_id: str, timeout_s: float) -> int | None:
        """The planned answer of ``request_id`` once known, waiting up to ``timeout_s`` (for
        engines that plan synchronously); None if it is still unknown then. KeyError if
        ``plan`` was never called for it."""
        answer = self._answers[request_id]
        try:
            return answer.result(timeout=check_number("timeout_s", timeout_s, positive=True))
        except FutureTimeout:
            return None

    def forget(self, request_id: str) -> None:
        """Drops ``request_id``'s answer (it finished, or was restored); a pending lookup is
        cancelled or its answer discarded."""
        answer = self._answers.pop(request_id, None)
        if answer is not None:
            answer.cancel()

    def close(self) -> None:
        """Cancels pending lookups (a running one ends within its timeout) and closes the
        connections."""
        for lane in self._lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        for lane, reader in zip(self._lanes, self._readers, strict=True):
            lane.shutdown(wait=True)
            reader.close()
        self._local.close()
