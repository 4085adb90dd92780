"""Roofline cost model per (model, GPU, tensor-parallel degree).

An iteration of a worker (chunked prefill tokens and decode tokens batched together, or a
verify step of ``B x (k+1)`` tokens) costs ``max(compute, memory) + overhead``:
compute = FLOPs / (tp * peak * mfu) with FLOPs = 2 * params per token plus attention
(``4 * layers * heads * head_dim`` per token per context token: QK^T and AV, 2 FLOPs per MAC);
memory = (weights + KV read) / (tp * HBM bandwidth * mbu). Byte movements off the GPU
(checkpoint streaming, restore, model and draft loads) are sizes over link bandwidths.

Shapes and datasheet figures are the vetted ones of shared/MODELS.md; the efficiency factors
are assumptions stated in ``CostConfig`` (change them, not the tables).
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_ELEMENT = 2  # bf16 weights and KV cache


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only model (published ``config.json``; MODELS.md table)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float

    @property
    def weights_bytes(self) -> float:
        return self.num_params * BYTES_PER_ELEMENT

    @property
    def kv_bytes_per_token(self) -> int:
        # Eq. (1) of the paper: 2 (K and V) * layers * kv_heads * head_dim * bytes/element.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BYTES_PER_ELEMENT

    @property
    def attn_flops_per_token_context(self) -> float:
        # QK^T and AV: 2 matmuls, 2 FLOPs per multiply-add, over all query heads.
        return 4.0 * self.num_layers * self.num_heads * self.head_dim


# Shapes from each model's published config.json (layers, hidden, heads, KV heads, head_dim)
# and parameter counts from the model cards; see shared/MODELS.md.
MODELS: dict[str, ModelSpec] = {
    "Llama-3-8B": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 8.0e9),
    "Llama-3-70B": ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 70.6e9),
    "Qwen3-14B": ModelSpec("Qwen3-14B", 40, 5120, 40, 8, 128, 14.8e9),
    "Qwen3-32B": ModelSpec("Qwen3-32B", 64, 5120, 64, 8, 128, 32.8e9),
    # Draft models (same tokenizers as their targets).
    "Qwen3-0.6B": ModelSpec("Qwen3-0.6B", 28, 1024, 16, 8, 128, 0.6e9),
    "Qwen3-1.7B": ModelSpec("Qwen3-1.7B", 28, 2048, 16, 8, 128, 1.7e9),
    "Llama-3.2-1B": ModelSpec("Llama-3.2-1B", 16, 2048, 32, 8, 64, 1.2e9),
}

# Draft model paired with each target (same vocabulary).
DEFAULT_DRAFT: dict[str, str] = {
    "Llama-3-8B": "Llama-3.2-1B",
    "Llama-3-70B": "Llama-3.2-1B",
    "Qwen3-14B": "Qwen3-0.6B",
    "Qwen3-32B": "Qwen3-0.6B",
}


@dataclass(frozen=True)
class GPUSpec:
    """Vendor datasheet figures (dense bf16, no sparsity); MODELS.md table."""

    name: str
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float  # achieved host<->device, one direction


GPUS: dict[str, GPUSpec] = {
    # A100-80GB SXM datasheet: 312 TFLOP/s bf16, 80 GB, 2.04 TB/s; PCIe Gen4 x16 ~25 GB/s achieved.
    "A100-80GB": GPUSpec("A100-80GB", 312e12, 80e9, 2.04e12, 25e9),
    # H100 SXM datasheet: 989 TFLOP/s bf16, 80 GB, 3.35 TB/s; PCIe Gen5 x16 ~50 GB/s (vLLM's measurement).
    "H100": GPUSpec("H100", 989e12, 80e9, 3.35e12, 50e9),
    # H200 SXM datasheet: 989 TFLOP/s bf16, 141 GB, 4.8 TB/s; PCIe Gen5 x16 (as H100).
    "H200": GPUSpec("H200", 989e12, 141e9, 4.8e12, 50e9),
}


@dataclass(frozen=True)
class CostConfig:
    """Efficiency factors and link speeds: assumptions, each with its reason.

    ``mfu``: fraction of peak FLOP/s reached by prefill matmuls under TP (a bf16 8192^3 matmul
    reaches ~0.8 of peak on H200, MODELS.md; TP all-reduces and attention kernels cost more).
    ``mbu``: fraction of HBM bandwidth reached by a decode step (weights + KV reads).
    ``iteration_overhead_s``: scheduler, sampling and kernel launches per iteration.
    ``nic_bytes_per_s``: one 25 Gb/s NIC per worker (the paper's bottleneck case; the router's
    default ``pull_bytes_per_s``). ``storage_bytes_per_s``: NVMe read of weights (the paper's
    ~7 GB/s). ``engine_start_s`` / ``draft_start_s``: process, CUDA context and graph capture
    on top of reading weights (assumed; the paper's own figures disagree, MODELS.md).
    ``gpu_memory_utilization``: vLLM's default share of HBM for weights + KV.
    """

    mfu: float = 0.5
    mbu: float = 0.7
    iteration_overhead_s: float = 0.004
    nic_bytes_per_s: float = 3.125e9
    storage_bytes_per_s: float = 7e9
    engine_start_s: float = 5.0
    draft_start_s: float = 2.0
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu", "gpu_memory_utilization"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"`{name}` must be in (0, 1], got {value}")
        for name in ("nic_bytes_per_s", "storage_bytes_per_s"):
            value = getattr(self, name)
            if value <= 0.0:
                raise ValueError(f"`{name}` must be > 0, got {value}")
        for name in ("iteration_overhead_s", "engine_start_s", "draft_start_s"):
            value = getattr(self, name)
            if value < 0.0:
                raise ValueError(f"`{name}` must be >= 0, got {value}")


class CostModel:
    """Times of one worker (``tp`` GPUs serving ``model``) and of its byte movements."""

    def __init__(
        self,
        model: str,
        gpu: str,
        tp: int,
        draft_model: str | None = None,
        config: CostConfig = CostConfig(),
    ) -> None:
        if model not in MODELS:
            raise ValueError(f"`model` must be one of {sorted(MODELS)}, got {model!r}")
        if gpu not in GPUS:
            raise ValueError(f"`gpu` must be one of {sorted(GPUS)}, got {gpu!r}")
        if not isinstance(tp, int) or isinstance(tp, bool):
            raise TypeError(f"`tp` must be int, got {type(tp).__name__}")
        if tp < 1:
            raise ValueError(f"`tp` must be >= 1, got {tp}")
        draft_model = DEFAULT_DRAFT.get(model, "Qwen3-0.6B") if draft_model is None else draft_model
        if draft_model not in MODELS:
            raise ValueError(f"`draft_model` must be one of {sorted(MODELS)}, got {draft_model!r}")
        self.model = MODELS[model]
        self.gpu = GPUS[gpu]
        self.draft = MODELS[draft_model]
        self.tp = tp
        self.config = config
        kv_capacity = tp * self.gpu.hbm_bytes * config.gpu_memory_utilization - self.model.weights_bytes
        if kv_capacity <= 0:
            raise ValueError(
                f"`tp` must give room for the KV cache: {model} weights "
                f"{self.model.weights_bytes / 1e9:.1f} GB exceed {tp} x {gpu} memory"
            )
        self.kv_bytes_per_token = self.model.kv_bytes_per_token
        self.kv_capacity_tokens = int(kv_capacity // self.kv_bytes_per_token)
        self._flops_per_s = tp * self.gpu.peak_flops * config.mfu
        self._hbm_per_s = tp * self.gpu.hbm_bytes_per_s * config.mbu
        self._linear_flops_per_token = 2.0 * self.model.num_params
        self._attn_flops = self.model.attn_flops_per_token_context

    def iteration_time_s(self, num_tokens: int, attn_context_tokens: float, kv_read_tokens: float) -> float:
        """One forward pass over ``num_tokens`` new tokens.

        ``attn_context_tokens``: sum over the new tokens of the context each attends to;
        ``kv_read_tokens``: KV tokens read from HBM (the decode requests' contexts plus the
        cached prefix of prefill chunks). No tokens: 0 (an idle worker runs no iteration).
        """
        if num_tokens <= 0:
            return 0.0
        flops = self._linear_flops_per_token * num_tokens + self._attn_flops * attn_context_tokens
        bytes_read = self.model.weights_bytes + self.kv_bytes_per_token * kv_read_tokens
        return max(flops / self._flops_per_s, bytes_read / self._hbm_per_s) + self.config.iteration_overhead_s

    def decode_step_time_s(self, batch_size: int, context_tokens: float) -> float:
        """A decode step of ``batch_size`` requests holding ``context_tokens`` KV in total."""
        return self.iteration_time_s(batch_size, context_tokens, context_tokens)

    def verify_step_time_s(self, batch_size: int, context_tokens: float, num_draft_tokens: int) -> float:
        """A verify step: each of ``batch_size`` requests scores ``num_draft_tokens + 1`` tokens."""
        width = num_draft_tokens + 1
        return self.iteration_time_s(batch_size * width, context_tokens * width, context_tokens)

    def prefill_time_s(self, prompt_tokens: int) -> float:
        """A whole prompt in one pass (no chunking): attention over ``n(n+1)/2`` pairs."""
        return self.iteration_time_s(prompt_tokens, prompt_tokens * (prompt_tokens + 1) / 2.0, 0.0)

    @property
    def stream_bytes_per_s(self) -> float:
        """Checkpoint streaming to a holder on another host: GPU -> PCIe -> NIC, the slower."""
        return min(self.tp * self.gpu.pcie_bytes_per_s, self.config.nic_bytes_per_s)

    def restore_time_s(self, tokens: int) -> float:
        """Host DRAM -> GPU of ``tokens`` KV on the holder itself (each TP rank its shard)."""
        return tokens * self.kv_bytes_per_token / (self.tp * self.gpu.pcie_bytes_per_s)

    def remote_restore_time_s(self, tokens: int) -> float:
        """Pull ``tokens`` KV from a holder's DRAM over the NIC, then into the GPU."""
        return tokens * self.kv_bytes_per_token / self.stream_bytes_per_s

    @property
    def model_load_time_s(self) -> float:
        return self.model.weights_bytes / self.config.storage_bytes_per_s + self.config.engine_start_s

    @property
    def draft_load_time_s(self) -> float:
        return self.draft.weights_bytes / self.config.storage_bytes_per_s + self.config.draft_start_s
