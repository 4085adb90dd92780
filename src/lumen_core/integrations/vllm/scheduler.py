"""The scheduler side of LumenConnector: per-request control, non-blocking restore lookups,
and the per-step plan of what to restore and save (``LumenMetadata``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lumen_core.connector import RestoreLookup, RestoreSource
from lumen_core.integrations.vllm.metadata import LoadSpec, LumenMetadata, OpenSpec, SaveSpec
from lumen_core.integrations.vllm.params import ConnectorConfig, RequestControl

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)


class SchedulerSide:
    """State the scheduler process keeps (see LumenConnector). ``record_bytes`` is the token
    record size of this engine's cache (the lookup reads one record's header)."""

    def __init__(self, config: ConnectorConfig, block_size: int, record_bytes: int) -> None:
        self.config = config
        self.block_size = block_size
        self.record_bytes = record_bytes
        self.kv_cache_manager: KVCacheManager | None = None
        self._controls: dict[str, RequestControl] = {}
        self._requests: dict[str, Request] = {}
        self._sources: dict[str, RestoreSource] = {}  # requests to resume
        self._pending_loads: dict[str, int] = {}  # req_id -> tokens to restore this step
        self._opened: set[str] = set()
        # Lookups run on the lookup's own thread, never on the scheduler's.
        self._lookup = RestoreLookup(
            config.secret,
            record_bytes=record_bytes,
            tls=config.tls,
            connect_timeout_s=config.connect_timeout_s,
        )

    def on_new_request(self, request: Request) -> None:
        """Parse the request's control. A malformed ``kv_transfer_params`` is logged and the
        request served without checkpointing: raising here would stop the engine."""
        try:
            control = RequestControl.parse(request.request_id, request.kv_transfer_params, self.config)
        except (TypeError, ValueError) as error:
            logger.error("lumen: request %s is not checkpointed: %s", request.request_id, error)
            control = RequestControl(request.request_id, 0, 0, (), b"", None)
        self._controls[request.request_id] = control
        self._requests[request.request_id] = request
        if control.restore is not None:
            plan = control.restore
            self._sources[request.request_id] = RestoreSource(plan.epoch, plan.address, plan.capability)

    # ---- restore --------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        source = self._sources.get(request.request_id)
        if source is None or num_computed_tokens > 0:
            # Restores fill a request's blocks from position 0; a local prefix hit is kept.
            return 0, False
        control = self._controls[request.request_id]
        durable = self._lookup.plan(request.request_id, control.key, source)
        if durable is None:  # not known yet: vLLM asks again next step
            return None, False
        # At least one token is computed: vLLM needs a forward to sample from.
        return min(durable, request.num_tokens - 1), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = num_external_tokens

    # ---- the step's plan -------------------------------------------------------------------
    def _slots(self, req_id: str, start: int, end: int) -> list[int]:
        assert self.kv_cache_manager is not None
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LumenMetadata:
        """Called before vLLM advances ``num_computed_tokens``: a request computes positions
        ``num_computed_tokens .. + num_scheduled_tokens`` this step."""
        meta = LumenMetadata()
        for req_id, num_tokens in self._pending_loads.items():
            request = self._requests[req_id]
            control = self._controls[req_id]
            slots = self._slots(req_id, 0, num_tokens)
            meta.loads.append(
                LoadSpec(
                    req_id,
                    control.request_id,
                    control.key,
                    slots,
                    list(request.all_token_ids[:num_tokens]),
                    sorted({s // self.block_size for s in slots}),
                    self._sources[req_id],
                )
            )
        self._pending_loads.clear()
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            control = self._controls[req_id]
            if not control.holders:
                continue
            start = request.num_computed_tokens
            # Scheduled draft tokens are not in all_token_ids and may be rejected: not saved.
            end = min(start + num_scheduled, request.num_tokens)
            if req_id not in self._opened:
                meta.opens.append(
                    OpenSpec(
                        req_id,
                        control.request_id,
                        control.key,
                        control.holders,
                        control.capabilities,
                        control.epoch,
                        request.num_prompt_tokens + request.max_tokens,
                    )
                )
                self._opened.add(req_id)
                start = 0
            if end > start:
                meta.saves.append(
                    SaveSpec(req_id, start, self._slots(req_id, start, end),
                             list(request.all_token_ids[start:end]))
                )  # fmt: skip
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self._opened:
                meta.preempted_req_ids.append(req_id)
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks of a streamed request stay allocated until the worker reports its gathers
        done (``get_finished``); the worker then releases its checkpoint."""
        req_id = request.request_id
        self._controls.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._sources.pop(req_id, None)
        self._lookup.forget(req_id)
        self._pending_loads.pop(req_id, None)
        if req_id in self._opened:
            self._opened.discard(req_id)
            return True, None
        return False, None

    def shutdown(self) -> None:
        self._lookup.close()
