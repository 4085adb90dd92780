"""``PacedStreamingConnector``: the worker's ``StreamingConnector`` under ``--pace`` (issue
21), whose saves reach the streamer through ``pacing.PacedSaves``: no faster than the
modelled link carries the modelled model's KV."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lumen_core.engine.connector import SavedTokens
from lumen_core.integrations.reference import StreamingConnector
from lumen_core.pacing import PacedSaves


class PacedStreamingConnector(StreamingConnector):
    """A ``StreamingConnector`` (same arguments, after ``paced``) whose saves wait in
    ``paced`` until the modelled link has carried them. A request's queued tokens are dropped
    before its slots are freed (finish, preemption): what had not left by then is not durable,
    as on the modelled hardware."""

    def __init__(self, paced: PacedSaves, *args: Any, **kwargs: Any) -> None:
        if not isinstance(paced, PacedSaves):
            raise TypeError(f"`paced` must be a PacedSaves, got {type(paced).__name__}")
        super().__init__(*args, **kwargs)
        self.paced = paced

    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        self.paced.push(saves, lambda request_id: len(self.holders_of(request_id)))
        super().save_kv(self.paced.take())

    def wait_for_save(self, request_id: str) -> None:
        self.paced.drop(request_id)  # its slots are about to be freed or rewritten
        super().wait_for_save(request_id)

    def request_finished(self, request_id: str) -> None:
        self.paced.drop(request_id)
        super().request_finished(request_id)
