"""``RestoreLookup``: the durable length of each resumed request's checkpoint, asked without
blocking the caller (an engine's scheduler): "not known yet" until a background answer
arrives, then the answer, cached per request."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from lumen_core._validate import check_int, check_number
from lumen_core.auth import WorkerIdentity
from lumen_core.connector.requests import RestoreSource
from lumen_core.connector.sources import SourceReader
from lumen_core.stream._common import check_str
from lumen_core.stream.holder import HolderStore

__all__ = ["RestoreLookup"]


class RestoreLookup:
    """Plans restores: how many leading tokens of a request its source holds durably.

    A source in this process (``store``) is answered at once; a holder is asked on one
    background thread (the only user of its connections), one small read each. Readings
    are ``record_bytes`` wide (the engine's token record size). Thread-safe for one caller
    thread (the scheduler's).
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
    ) -> None:
        self.record_bytes = check_int("record_bytes", record_bytes, 1, 1 << 40)
        self._reader = SourceReader(
            secret,
            store=store,
            shard=shard,
            tls=tls,
            connect_timeout_s=connect_timeout_s,
            identity=identity,
            encrypt=encrypt,
        )
        self._answers: dict[str, Future[int]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lumen-lookup")

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
                answer.set_result(self._reader.durable_tokens(key, source, self.record_bytes))
            else:
                answer = self._executor.submit(self._reader.durable_tokens, key, source, self.record_bytes)
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
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._reader.close()
