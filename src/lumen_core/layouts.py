"""KV layouts: an engine's paged KV cache described as planes of token rows.

Built from the engine's own tensors, never by importing the engine (docs/data_plane.md).
A plane is a view ``[num_blocks, block_size, num_pieces, piece_elems]`` whose last dimension is
contiguous: the row of slot ``block_id * block_size + offset`` is ``num_pieces`` pieces
(one for NHD rows, ``num_kv_heads`` strided pieces for HND rows). A token record is the rows of
all planes back to back; ``record_bytes`` is the sum of the planes' ``row_bytes``. Ops move
bytes, so every dtype works (fp32, fp16, bf16, fp8, int8, ...).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["KVLayout", "PlaneInfo"]

_FINGERPRINT_VERSION = 1
# The CPU_ATTN ISAs whose block interiors vllm_cpu describes (checked against vLLM's own kernel).
_VLLM_CPU_ISAS = frozenset({"vec", "vec16"})
_FP8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


_LINE_BYTES = 64  # a CPU cache line


@dataclass(frozen=True)
class PlaneInfo:
    """What one plane contributes to a token record (strides in bytes)."""

    name: str
    dtype: torch.dtype
    row_shape: tuple[int, int]  # (num_pieces, piece_elems) as given, before merging pieces
    row_bytes: int
    record_offset: int
    num_pieces: int  # after merging contiguous pieces
    piece_bytes: int
    piece_stride: int
    block_stride: int
    token_stride: int


def _require_tensor_list(value: object, name: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence) or len(value) == 0:
        raise TypeError(f"`{name}` must be a non-empty sequence of torch.Tensor, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"`{name}[{i}]` must be a torch.Tensor, got {type(item).__name__}")
    return list(value)


def _require_shape(tensor: torch.Tensor, name: str, axes: str, fixed: dict[int, int] | None = None) -> None:
    num_axes = len(axes.split(","))
    if tensor.dim() != num_axes:
        raise ValueError(f"`{name}` must be {num_axes}-D [{axes}], got shape {tuple(tensor.shape)}")
    for dim, size in (fixed or {}).items():
        if tensor.shape[dim] != size:
            raise ValueError(
                f"`{name}` must have size {size} in dimension {dim} [{axes}], got shape {tuple(tensor.shape)}"
            )


def _same_length(name: str, items: Sequence[object], other_name: str, other: Sequence[object]) -> None:
    if len(items) != len(other):
        raise ValueError(
            f"`{name}` must have one entry per layer ({len(other)} in `{other_name}`), got {len(items)}"
        )


class KVLayout:
    """A paged KV cache as planes of token rows; the argument of gather/scatter.

    The generic constructor takes the planes directly: each a tensor view
    ``[num_blocks, block_size, num_pieces, piece_elems]`` with stride 1 in its last dimension,
    all on one device (CPU or CUDA) with the same ``num_blocks`` and ``block_size``. The
    classmethods build the planes of known engines. The layout keeps the views (and so the
    cache) alive; it never copies the cache. An engine may still free or reallocate the
    cache's storage in place (``untyped_storage().resize_``, a growing ``resize_``): every
    use of the descriptors then raises ValueError instead of reading freed memory.

    Raises:
        TypeError: ``planes`` is not a sequence of tensors.
        ValueError: a plane of the wrong rank, a non-contiguous last dimension, a zero stride
            on a dimension of size > 1, planes on different devices or with different
            ``num_blocks``/``block_size``, an unsupported device.
    """

    def __init__(
        self, planes: Sequence[torch.Tensor], *, kind: str = "generic", names: Sequence[str] | None = None
    ):
        views = _require_tensor_list(planes, "planes")
        if names is not None and len(names) != len(views):
            raise ValueError(f"`names` must have one name per plane ({len(views)}), got {len(names)}")
        device = views[0].device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"`planes` must be on a CPU or CUDA device, got {device}")
        num_blocks, block_size = (views[0].shape[0], views[0].shape[1]) if views[0].dim() == 4 else (0, 0)
        infos: list[PlaneInfo] = []
        record_offset = 0
        for i, view in enumerate(views):
            name = f"planes[{i}]"
            _require_shape(view, name, "num_blocks, block_size, num_pieces, piece_elems")
            if view.device != device:
                raise ValueError(f"`{name}` must be on device {device}, got {view.device}")
            if min(view.shape) < 1:
                raise ValueError(f"`{name}` must have no empty dimension, got shape {tuple(view.shape)}")
            if (view.shape[0], view.shape[1]) != (num_blocks, block_size):
                raise ValueError(
                    f"`{name}` must have num_blocks, block_size = {num_blocks}, {block_size} like planes[0], "
                    f"got {view.shape[0]}, {view.shape[1]}"
                )
            if view.shape[3] > 1 and view.stride(3) != 1:
                raise ValueError(
                    f"`{name}` must have stride 1 in its last dimension, got strides {view.stride()}"
                )
            for dim in range(3):
                if view.shape[dim] > 1 and view.stride(dim) == 0:
                    raise ValueError(
                        f"`{name}` must not repeat memory (zero stride in dimension {dim}), got "
                        f"strides {view.stride()}"
                    )
            item = view.element_size()
            num_pieces, piece_elems = view.shape[2], view.shape[3]
            piece_bytes = piece_elems * item
            piece_stride = view.stride(2) * item
            if num_pieces > 1 and piece_stride < piece_bytes:
                raise ValueError(
                    f"`{name}` must not overlap its pieces (stride {view.stride(2)} < "
                    f"{piece_elems} elements in dimension 2), got strides {view.stride()}"
                )
            if num_pieces == 1 or piece_stride == piece_bytes:  # contiguous row: one piece
                piece_bytes, piece_stride, merged = num_pieces * piece_bytes, num_pieces * piece_bytes, 1
            else:
                merged = num_pieces
            row_bytes = num_pieces * piece_elems * item
            infos.append(
                PlaneInfo(
                    name=names[i] if names is not None else name,
                    dtype=view.dtype,
                    row_shape=(num_pieces, piece_elems),
                    row_bytes=row_bytes,
                    record_offset=record_offset,
                    num_pieces=merged,
                    piece_bytes=piece_bytes,
                    piece_stride=piece_stride,
                    block_stride=view.stride(0) * item,
                    token_stride=view.stride(1) * item,
                )
            )
            record_offset += row_bytes
        self._views = tuple(views)
        self._planes = tuple(infos)
        self._kind = kind
        self._device = device
        self._num_blocks = int(num_blocks)
        self._block_size = int(block_size)
        self._record_bytes = record_offset
        # What fingerprint() names: per plane (dtype, row shape). A constructor whose planes
        # split a row differently (vllm_cpu's K heads) names the rows it produces instead.
        self._record_format = [(str(p.dtype), p.row_shape) for p in infos]
        self._descriptors = self._pack_descriptors()
        self._addresses = tuple(int(a) for a in self._descriptors[:, 0])
        self._device_descriptors: torch.Tensor | None = None
        if self._device.type == "cuda":
            # Copied here, where waiting for the device is harmless, so that no op on this
            # layout ever synchronises; every stream that reads them sees the finished copy.
            self._device_descriptors = self._descriptors.to(self._device)
            torch.cuda.synchronize(self._device)

    # ---- engine layouts -------------------------------------------------------------------

    @classmethod
    def vllm_flash(
        cls, kv_caches: Sequence[torch.Tensor], *, scales: Sequence[torch.Tensor] | None = None
    ) -> KVLayout:
        """vLLM flash-attention layout: per layer ``[2, num_blocks, block_size, H, D]``.

        Any strides work, including vLLM's HND physical order behind the NHD logical shape.
        ``scales`` (fp8 caches): per layer ``[2, num_blocks, block_size, S]`` per-token scale
        rows. Planes per layer: K, V (then K scale, V scale).
        """
        caches = _require_tensor_list(kv_caches, "kv_caches")
        axes = "2, num_blocks, block_size, num_kv_heads, head_dim"
        planes: list[torch.Tensor] = []
        names: list[str] = []
        for i, cache in enumerate(caches):
            _require_shape(cache, f"kv_caches[{i}]", axes, {0: 2})
            planes += [cache[0], cache[1]]
            names += [f"layer{i}.k", f"layer{i}.v"]
        if scales is not None:
            planes, names = cls._interleave_scales(
                planes,
                names,
                scales,
                "2, num_blocks, block_size, scale_elems",
                lambda s: (s[0], s[1]),
                len(caches),
            )
        return cls(planes, kind="vllm_flash", names=names)

    @classmethod
    def vllm_flash_hnd(
        cls, kv_caches: Sequence[torch.Tensor], *, scales: Sequence[torch.Tensor] | None = None
    ) -> KVLayout:
        """vLLM flash layout stored head-major: per layer ``[2, num_blocks, H, block_size, D]``.

        A token's row is H pieces of D elements, ``block_size * D`` apart. Records are the same
        as those of ``vllm_flash`` with the same H, D and dtype.
        """
        caches = _require_tensor_list(kv_caches, "kv_caches")
        for i, cache in enumerate(caches):
            _require_shape(
                cache, f"kv_caches[{i}]", "2, num_blocks, num_kv_heads, block_size, head_dim", {0: 2}
            )
        layout = cls.vllm_flash([cache.permute(0, 1, 3, 2, 4) for cache in caches], scales=scales)
        layout._kind = "vllm_flash_hnd"
        return layout

    @classmethod
    def vllm_paged(cls, kv_caches: Sequence[torch.Tensor]) -> KVLayout:
        """vLLM's attention cache as its GPU backends hold it since vLLM's KV-cache layout
        rework (vLLM 0.32: ``FLASH_ATTN``, ``TRITON_ATTN``, ``FLASHINFER``): per layer a logical
        ``[num_blocks, H, block_size, 2 * D]`` view, K then V in the last dimension, in any of
        the physical orders of vLLM's ``KVCacheLayout`` (``LBNHC``, vLLM's default, a token's
        K and V heads side by side; ``LBHNC`` head-major; the block-outermost ones) as
        ``vllm.v1.kv_cache_interface.create_kv_cache_views`` makes them. K and V are the
        views the flash backend writes through (``transpose(1, 2).split(D, -1)``); records are
        those of ``vllm_flash`` for the same H, D and dtype, and so is the fingerprint.
        """
        caches = _require_tensor_list(kv_caches, "kv_caches")
        planes: list[torch.Tensor] = []
        names: list[str] = []
        for i, cache in enumerate(caches):
            _require_shape(cache, f"kv_caches[{i}]", "num_blocks, num_kv_heads, block_size, 2 * head_dim")
            if cache.shape[3] % 2:
                raise ValueError(
                    f"`kv_caches[{i}]` must hold K and V of one head size in its last dimension "
                    f"(an even size), got shape {tuple(cache.shape)}"
                )
            head_dim = cache.shape[3] // 2
            rows = cache.transpose(1, 2)
            key, value = rows[..., :head_dim], rows[..., head_dim:]
            planes += [key, value]
            names += [f"layer{i}.k", f"layer{i}.v"]
        return cls(planes, kind="vllm_paged", names=names)

    @classmethod
    def vllm_cpu(cls, kv_caches: Sequence[torch.Tensor], *, isa: str) -> KVLayout:
        """vLLM's CPU attention backend (``CPU_ATTN``): per layer ``[num_blocks, H, block_size, 2 * D]``.

        Within each (block, head), vLLM's ``cpu_attn_reshape_and_cache`` with ``isa`` "vec" or
        "vec16" stores K transposed, ``[D, block_size]``, then V as ``[block_size, D]``. K is
        described as one plane per head of one-element pieces ``block_size`` apart, V as one
        plane of H pieces; the records are those of ``vllm_flash`` for the same tokens, and so
        is the fingerprint. The native CPU gather and scatter move K a run of consecutive slots
        of one block at a time, as a blocked transpose (csrc/include/lumen/transpose.h), and
        scattered slots element by element. Other ISAs ("amx" prepacks bf16 blocks for its tiles; "neon",
        "vxe", "vsx", "rvv" are unverified) and fp8 caches (which carry scales) are refused.

        Raises:
            TypeError: ``kv_caches`` is not a sequence of tensors.
            ValueError: ``isa`` is not "vec" or "vec16"; a cache that is not 4-D, has an odd
                last dimension, is not contiguous, or is of an fp8 dtype.
        """
        caches = _require_tensor_list(kv_caches, "kv_caches")
        if isa not in _VLLM_CPU_ISAS:
            raise ValueError(
                f"`isa` must be one of {sorted(_VLLM_CPU_ISAS)} (the block layouts verified against vLLM's "
                f"cpu_attn_reshape_and_cache), got {isa!r}"
            )
        planes: list[torch.Tensor] = []
        names: list[str] = []
        record_format: list[tuple[str, tuple[int, int]]] = []
        for i, cache in enumerate(caches):
            name = f"kv_caches[{i}]"
            _require_shape(cache, name, "num_blocks, num_kv_heads, block_size, 2 * head_dim")
            if cache.shape[3] % 2:
                raise ValueError(
                    f"`{name}` must have an even last dimension (K then V), got {tuple(cache.shape)}"
                )
            if not cache.is_contiguous():
                raise ValueError(f"`{name}` must be contiguous, got strides {cache.stride()}")
            if cache.dtype in _FP8_DTYPES:
                raise ValueError(
                    f"`{name}` must not be an fp8 cache (its scales are not described), got {cache.dtype}"
                )
            num_blocks, num_kv_heads, block_size, two_head_dim = cache.shape
            head_dim = two_head_dim // 2
            halves = cache.view(num_blocks, num_kv_heads, 2, block_size * head_dim)
            k_transposed = halves[:, :, 0].view(num_blocks, num_kv_heads, head_dim, block_size)
            for head in range(num_kv_heads):
                # [num_blocks, head_dim, block_size] -> [num_blocks, block_size, head_dim, 1]
                planes.append(k_transposed[:, head].transpose(1, 2).unsqueeze(3))
                names.append(f"layer{i}.k.head{head}")
            v = halves[:, :, 1].view(num_blocks, num_kv_heads, block_size, head_dim)
            planes.append(v.transpose(1, 2))
            names.append(f"layer{i}.v")
            record_format += [(str(cache.dtype), (num_kv_heads, head_dim))] * 2
        layout = cls(planes, kind="vllm_cpu", names=names)
        layout._record_format = record_format
        return layout

    @classmethod
    def vllm_flashinfer(
        cls, kv_caches: Sequence[torch.Tensor], *, scales: Sequence[torch.Tensor] | None = None
    ) -> KVLayout:
        """vLLM FlashInfer layout: per layer ``[num_blocks, 2, block_size, H, D]``.

        ``scales``: per layer ``[num_blocks, 2, block_size, S]``.
        """
        caches = _require_tensor_list(kv_caches, "kv_caches")
        axes = "num_blocks, 2, block_size, num_kv_heads, head_dim"
        planes: list[torch.Tensor] = []
        names: list[str] = []
        for i, cache in enumerate(caches):
            _require_shape(cache, f"kv_caches[{i}]", axes, {1: 2})
            planes += [cache[:, 0], cache[:, 1]]
            names += [f"layer{i}.k", f"layer{i}.v"]
        if scales is not None:
            planes, names = cls._interleave_scales(
                planes,
                names,
                scales,
                "num_blocks, 2, block_size, scale_elems",
                lambda s: (s[:, 0], s[:, 1]),
                len(caches),
            )
        return cls(planes, kind="vllm_flashinfer", names=names)

    @classmethod
    def vllm_flashinfer_hnd(
        cls, kv_caches: Sequence[torch.Tensor], *, scales: Sequence[torch.Tensor] | None = None
    ) -> KVLayout:
        """FlashInfer layout stored head-major: per layer ``[num_blocks, 2, H, block_size, D]``."""
        caches = _require_tensor_list(kv_caches, "kv_caches")
        for i, cache in enumerate(caches):
            _require_shape(
                cache, f"kv_caches[{i}]", "num_blocks, 2, num_kv_heads, block_size, head_dim", {1: 2}
            )
        layout = cls.vllm_flashinfer([cache.permute(0, 1, 3, 2, 4) for cache in caches], scales=scales)
        layout._kind = "vllm_flashinfer_hnd"
        return layout

    @classmethod
    def sglang(
        cls,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        *,
        k_scales: Sequence[torch.Tensor] | None = None,
        v_scales: Sequence[torch.Tensor] | None = None,
    ) -> KVLayout:
        """SGLang token pool: per layer K and V ``[num_slots, H, D]`` (page size 1).

        ``k_scales``/``v_scales`` (both or neither): per layer ``[num_slots, S]``.
        Planes per layer: K, V (then K scale, V scale).
        """
        ks = _require_tensor_list(k_buffers, "k_buffers")
        vs = _require_tensor_list(v_buffers, "v_buffers")
        _same_length("v_buffers", vs, "k_buffers", ks)
        axes = "num_slots, num_kv_heads, head_dim"
        planes, names = [], []
        for i, (k, v) in enumerate(zip(ks, vs)):
            _require_shape(k, f"k_buffers[{i}]", axes)
            _require_shape(v, f"v_buffers[{i}]", axes)
            planes += [k.unsqueeze(1), v.unsqueeze(1)]
            names += [f"layer{i}.k", f"layer{i}.v"]
        if (k_scales is None) != (v_scales is None):
            raise ValueError("`k_scales` and `v_scales` must be given together, got only one")
        if k_scales is not None and v_scales is not None:
            kss = _require_tensor_list(k_scales, "k_scales")
            vss = _require_tensor_list(v_scales, "v_scales")
            _same_length("k_scales", kss, "k_buffers", ks)
            _same_length("v_scales", vss, "k_buffers", ks)
            merged, merged_names = [], []
            for i in range(len(ks)):
                _require_shape(kss[i], f"k_scales[{i}]", "num_slots, scale_elems")
                _require_shape(vss[i], f"v_scales[{i}]", "num_slots, scale_elems")
                merged += [
                    planes[2 * i],
                    planes[2 * i + 1],
                    kss[i][:, None, None, :],
                    vss[i][:, None, None, :],
                ]
                merged_names += [names[2 * i], names[2 * i + 1], f"layer{i}.k_scale", f"layer{i}.v_scale"]
            planes, names = merged, merged_names
        return cls(planes, kind="sglang", names=names)

    @classmethod
    def mla(cls, caches: Sequence[torch.Tensor], *, scales: Sequence[torch.Tensor] | None = None) -> KVLayout:
        """MLA latent cache: per layer ``[num_blocks, block_size, kv_lora_rank + rope_dim]``.

        ``scales``: per layer ``[num_blocks, block_size, S]``. One plane per layer (then its
        scale plane).
        """
        tensors = _require_tensor_list(caches, "caches")
        planes, names = [], []
        for i, cache in enumerate(tensors):
            _require_shape(cache, f"caches[{i}]", "num_blocks, block_size, kv_lora_rank + rope_dim")
            planes.append(cache.unsqueeze(2))
            names.append(f"layer{i}.kv")
        if scales is not None:
            scale_list = _require_tensor_list(scales, "scales")
            _same_length("scales", scale_list, "caches", tensors)
            merged, merged_names = [], []
            for i, scale in enumerate(scale_list):
                _require_shape(scale, f"scales[{i}]", "num_blocks, block_size, scale_elems")
                merged += [planes[i], scale.unsqueeze(2)]
                merged_names += [names[i], f"layer{i}.kv_scale"]
            planes, names = merged, merged_names
        return cls(planes, kind="mla", names=names)

    @staticmethod
    def _interleave_scales(
        planes: list[torch.Tensor],
        names: list[str],
        scales: Sequence[torch.Tensor],
        axes: str,
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        num_layers: int,
    ) -> tuple[list[torch.Tensor], list[str]]:
        """Per layer: K, V, then the layer's K and V scale planes (split out of ``scales[i]``)."""
        scale_list = _require_tensor_list(scales, "scales")
        _same_length("scales", scale_list, "kv_caches", range(num_layers))
        merged, merged_names = [], []
        for i, scale in enumerate(scale_list):
            _require_shape(scale, f"scales[{i}]", axes, {axes.split(", ").index("2"): 2})
            k_scale, v_scale = split(scale)
            merged += [planes[2 * i], planes[2 * i + 1], k_scale.unsqueeze(2), v_scale.unsqueeze(2)]
            merged_names += [names[2 * i], names[2 * i + 1], f"layer{i}.k_scale", f"layer{i}.v_scale"]
        return merged, merged_names

    # ---- properties -----------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def planes(self) -> tuple[PlaneInfo, ...]:
        return self._planes

    @property
    def views(self) -> tuple[torch.Tensor, ...]:
        """The plane views ``[num_blocks, block_size, num_pieces, piece_elems]`` (for tests)."""
        return self._views

    @property
    def num_planes(self) -> int:
        return len(self._planes)

    @property
    def record_bytes(self) -> int:
        return self._record_bytes

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def line_tokens(self) -> int:
        """How many consecutive slots share each cache line of a token's row in some plane:
        ``64 // element bytes`` where a plane keeps consecutive slots in consecutive elements
        of many pieces (vLLM CPU's K, transposed per block and head: one token's K is
        ``head_dim`` lines that its neighbours share), else 1. Gathering such a token alone
        reads every line for one element of each: a connector that saves whole lines at a time
        reads each line once (``ConnectorCore.save_step``)."""
        shared = [
            min(self._block_size, _LINE_BYTES // p.token_stride)
            for p in self._planes
            if p.num_pieces > 1 and 0 < p.token_stride < _LINE_BYTES
        ]
        return max(shared, default=1)

    @property
    def num_slots(self) -> int:
        return self._num_blocks * self._block_size

    @property
    def device(self) -> torch.device:
        return self._device

    def fingerprint(self) -> str:
        """Hex digest of the record format: per plane its dtype and row shape, in order.

        Block size and block count are not part of it: records carry no page structure, so a
        checkpoint restores into a cache of another page size. NHD and HND caches of the same
        heads, head size and dtype produce the same records and the same fingerprint.
        """
        spec = {
            "version": _FINGERPRINT_VERSION,
            "record_bytes": self._record_bytes,
            "planes": [[dtype, list(row_shape)] for dtype, row_shape in self._record_format],
        }
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]

    def descriptors(self) -> torch.Tensor:
        """``[num_planes, 9]`` int64 on the CPU: the packed ``lumen::PlaneDesc`` array.
        ValueError when the cache's memory was freed or reallocated since (see the class)."""
        self.check_allocated()
        return self._descriptors

    def device_descriptors(self) -> torch.Tensor:
        """The descriptors on the layout's CUDA device (ValueError as ``descriptors``)."""
        if self._device_descriptors is None:
            raise ValueError(f"`layout` must be on a CUDA device for device descriptors, got {self._device}")
        self.check_allocated()
        return self._device_descriptors

    def check_allocated(self) -> None:
        """ValueError unless every plane still views the memory the descriptors point into:
        a storage freed or reallocated in place moves (or nulls) its views' addresses, while
        the views themselves keep it from being freed by any other means."""
        for i, (view, address) in enumerate(zip(self._views, self._addresses)):
            if view.data_ptr() != address:
                raise ValueError(
                    f"`layout` must view memory that is still allocated, got plane {i} moved from "
                    f"{address:#x} to {view.data_ptr():#x} (the cache was freed or reallocated after "
                    "the layout was built: build a new KVLayout)"
                )

    def _pack_descriptors(self) -> torch.Tensor:
        rows = [
            [
                view.data_ptr(),
                self.num_slots,
                self._block_size,
                info.block_stride,
                info.token_stride,
                info.piece_stride,
                info.num_pieces,
                info.piece_bytes,
                info.record_offset,
            ]
            for view, info in zip(self._views, self._planes)
        ]
        return torch.tensor(rows, dtype=torch.int64)

    def __repr__(self) -> str:
        return (
            f"KVLayout(kind={self._kind!r}, num_planes={self.num_planes}, record_bytes={self._record_bytes}, "
            f"num_blocks={self._num_blocks}, block_size={self._block_size}, device={self._device})"
        )
