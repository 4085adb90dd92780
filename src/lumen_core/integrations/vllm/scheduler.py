"""The scheduler side of LumenConnector: per-request control, non-blocking restore lookups,
and the per-step plan of what to restore and save (``LumenMetadata``)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lumen_core.integrations.vllm.metadata import LoadSpec, LumenMetadata, OpenSpec, SaveSpec
from lumen_core.integrations.vllm.params import ConnectorConfig, RequestControl, RestorePlan
from lumen_core.transport import Client, ClientPool, Rejected, TransportError

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
        self._lookups: dict[str, Future[int]] = {}
        self._pending_loads: dict[str, int] = {}  # req_id -> tokens to restore this step
        self._opened: set[str] = set()
        # One thread: lookups are one small read each, and never run on the scheduler's thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lumen-lookup")
        self._pool = ClientPool(config.secret, tls=config.tls, connect_timeout_s=config.connect_timeout_s)

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

    # ---- restore --------------------------------------------------------------------------
    def _durable_tokens(self, control: RequestControl, restore: RestorePlan) -> int:
        """The durable length of the checkpoint at ``restore`` (0 when unreachable or absent).
        Runs on the lookup thread, the only user of ``self._pool``."""

        def lookup(client: Client) -> int:
            result = client.read(
                control.key, 0, restore.epoch, 0, 1, self.record_bytes, restore.capability,
                timeout_s=self.config.connect_timeout_s,
            )  # fmt: skip
            return int(result.durable_tokens)

        try:
            return self._pool.call(restore.address, lookup)
        except Rejected:  # no checkpoint of this request at this epoch
            return 0
        except TransportError as error:
            logger.warning("lumen: lookup at %s failed (%s): recomputing", restore.address, error)
            return 0

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        control = self._controls[request.request_id]
        if control.restore is None or num_computed_tokens > 0:
            # Restores fill a request's blocks from position 0; a local prefix hit is kept.
            return 0, False
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            self._lookups[request.request_id] = self._executor.submit(
                self._durable_tokens, control, control.restore
            )
            return None, False
        if not lookup.done():
            return None, False
        # At least one token is computed: vLLM needs a forward to sample from.
        return min(lookup.result(), request.num_tokens - 1), False

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
            assert control.restore is not None
            slots = self._slots(req_id, 0, num_tokens)
            meta.loads.append(
                LoadSpec(
                    req_id,
                    control.request_id,
                    control.key,
                    slots,
                    list(request.all_token_ids[:num_tokens]),
                    sorted({s // self.block_size for s in slots}),
                    control.restore,
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
                    SaveSpec(req_id, control.key, start, self._slots(req_id, start, end),
                             list(request.all_token_ids[start:end]))
                )  # fmt: skip
        for req_id in scheduler_output.preempted_req_ids or ():
            control = self._controls.get(req_id)
            if control is not None and req_id in self._opened:
                meta.preempted_keys.append(control.key)
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks of a streamed request stay allocated until the worker reports its gathers
        done (``get_finished``); the worker then releases its checkpoint."""
        req_id = request.request_id
        self._controls.pop(req_id, None)
        self._requests.pop(req_id, None)
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None:
            lookup.cancel()
        self._pending_loads.pop(req_id, None)
        if req_id in self._opened:
            self._opened.discard(req_id)
            return True, None
        return False, None

    def shutdown(self) -> None:
        # Pending lookups are cancelled; a running one ends within its deadlines.
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._pool.close()
