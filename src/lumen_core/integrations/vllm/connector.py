"""``LumenConnector``: lumen_core as a vLLM V1 KV connector (docs/vllm.md).

Loaded by ``kv_transfer_config={"kv_connector": "LumenConnector", "kv_connector_module_path":
"lumen_core.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {...}}``. vLLM builds it twice: in the scheduler (``SchedulerSide``:
lookups and the step's plan) and in each worker (``WorkerSide``: restore and streaming).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from lumen_core.connector import model_fingerprint
from lumen_core.integrations.vllm.metadata import LumenMetadata
from lumen_core.integrations.vllm.params import ConnectorConfig
from lumen_core.integrations.vllm.scheduler import SchedulerSide
from lumen_core.integrations.vllm.stats import LumenStats
from lumen_core.integrations.vllm.worker import WorkerSide
from lumen_core.layouts import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LumenConnector"]


def _attention_spec(kv_cache_config: KVCacheConfig) -> tuple[Any, int]:
    """The one attention spec of a single-group cache, and the number of layers in it."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"LumenConnector needs one KV cache group (no hybrid models yet), got {len(groups)}")
    return groups[0].kv_cache_spec, len(groups[0].layer_names)


class LumenConnector(KVConnectorBase_V1):
    """Streams every computed token's KV to the request's holders while vLLM decodes, and
    restores a resumed request's verified checkpoint instead of recomputing it.

    Raises (at construction):
        ValueError: ``kv_load_failure_policy`` is not "recompute" (a bad checkpoint must be
            recomputed, never fail the request), a malformed ``kv_connector_extra_config``,
            a hybrid or quantized KV cache.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                "`kv_load_failure_policy` must be 'recompute' for LumenConnector (a block that fails "
                f"verification is recomputed), got {transfer.kv_load_failure_policy!r}"
            )
        if vllm_config.cache_config.cache_dtype != "auto":
            raise ValueError(
                "`cache_dtype` must be 'auto' for LumenConnector, got "
                f"{vllm_config.cache_config.cache_dtype!r}"
            )
        config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            spec, num_layers = _attention_spec(kv_cache_config)
            item_bytes = torch.empty((), dtype=spec.dtype).element_size()
            record_bytes = num_layers * 2 * spec.num_kv_heads * spec.head_size * item_bytes
            self._scheduler = SchedulerSide(config, self._block_size, record_bytes)
        else:
            self._worker = WorkerSide(config, self._model_fingerprint(vllm_config, config), self._tp_rank())

    @staticmethod
    def _tp_rank() -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def _model_fingerprint(self, vllm_config: VllmConfig, config: ConnectorConfig) -> str:
        if config.model_fingerprint is not None:
            return config.model_fingerprint
        model = vllm_config.model_config
        return model_fingerprint(
            model.model,
            dtype=str(model.dtype),
            quantization=model.quantization,
            tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            tensor_parallel_rank=self._tp_rank(),
            revision=None,
        )

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describes the cache (vLLM's CPU backend; refuses others) and starts the streamer."""
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        assert self._worker is not None
        if not current_platform.is_cpu():
            raise ValueError(
                f"LumenConnector describes vLLM's CPU_ATTN cache only (docs/vllm.md), got platform "
                f"{current_platform.device_type!r}"
            )
        caches = list(kv_caches.values())
        first = caches[0]
        block_size, head_dim = first.shape[2], first.shape[3] // 2
        if block_size != self._block_size:
            raise ValueError(
                f"the kernel block size must equal the scheduler's ({self._block_size}) for LumenConnector, "
                f"got {block_size}"
            )
        model = self._vllm_config.model_config
        isa = _get_attn_isa(model.dtype, block_size, head_dim, self._vllm_config.cache_config.cache_dtype)
        self._worker.register(KVLayout.vllm_cpu(caches, isa=isa))

    def handle_preemptions(self, kv_connector_metadata: LumenMetadata) -> None:
        assert self._worker is not None
        self._worker.wait_for_preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, LumenMetadata)
        self._worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Restores are asynchronous: vLLM schedules a restored request once get_finished
        names it."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """The step is saved whole in wait_for_save."""

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, LumenMetadata)
        self._worker.save_step(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose blocks may be freed, and restores that ended (their failed
        blocks in the load errors vLLM asks for next)."""
        assert self._worker is not None
        return self._worker.finished(finished_req_ids) or None, self._worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.load_errors()

    def get_kv_connector_stats(self) -> LumenStats | None:
        """The worker's figures of the interval since the last call (None in the scheduler)."""
        if self._worker is None:
            return None
        data = self._worker.interval_stats()
        return LumenStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LumenStats:
        return LumenStats(data=dict(data or {}))

    @property
    def worker(self) -> WorkerSide | None:
        """The worker side's state (None in the scheduler): counters, restores, durable lengths."""
        return self._worker

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LumenMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker's stats of the step reach the scheduler here (for the control channel)."""
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.kv_connector_stats)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)
