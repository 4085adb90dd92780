"""Draft verification: exact batched chain speculative sampling (docs/verify_draft.md), the
Python face of ``csrc/verify_draft.*``. Shapes, dtypes, devices and host-resident values are
checked in Python; then one native call, which checks every value it reads and reports per
request. On CUDA the call never waits for the device: the kernel's verdicts stay in device
memory until ``VerifyResult.check`` (or any read of the results) synchronises.

``reference.verify_draft_reference`` is the loop-form specification every path agrees with
to the bit.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch

from lumen_core import _native
from lumen_core._tensors import check_num_threads, check_tensor, to_device

#: ``|sum(row) - 1|`` allowed for target and draft probability rows.
VERIFY_SUM_TOLERANCE = 1e-3
#: Largest vocabulary ``verify_draft`` accepts (``kMaxVocabSize`` in lumen/verify_draft.h).
VERIFY_MAX_VOCAB_SIZE = 1 << 21

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ID_DTYPES = (torch.int32, torch.int64)


class ScalarType(enum.IntEnum):
    """``lumen::ScalarType``: the compute dtype of target and draft probabilities."""

    FLOAT32 = 0
    FLOAT64 = 1


class TargetKind(enum.IntEnum):
    """``lumen::TargetKind``: what the target rows hold."""

    PROBS = 0
    LOGITS = 1


class DraftKind(enum.IntEnum):
    """``lumen::DraftKind``: how the draft distribution q is given."""

    ONE_HOT = 0
    DENSE = 1
    SPARSE = 2


class VerifyStatus(enum.IntEnum):
    """``lumen::VerifyStatus``: the per-request status code (``status[b] = code << 32 |
    position``). The native side reports these when a call gets past the Python checks."""

    OK = 0
    BAD_TARGET_ROW = 1
    BAD_LOGITS_ROW = 2
    BAD_DRAFT_ROW = 3
    DRAFT_ID_RANGE = 4
    TOPK_ID_RANGE = 5
    BAD_TEMPERATURE = 6
    BAD_DRAFT_COUNT = 7
    BAD_UNIFORM = 8
    BAD_POSITION = 9
    DUPLICATE_TOPK_ID = 10


DraftProbs = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class VerifyResult:
    """What ``verify_draft`` emitted, on the target's device.

    ``output_token_ids``: ``[B, k_max + 1]`` int64, request b's emitted tokens in
    ``[:num_emitted[b]]`` (its accepted drafts, then the correction or bonus token), -1 after.
    ``num_accepted``: ``[B]`` int64 accepted drafts. ``num_emitted``: ``[B]`` int64,
    ``num_accepted + 1``. ``status``: ``[B]`` int64 ``VerifyStatus << 32 | position`` per
    request (0 = ok), or None where every request is known to be valid. A request the native
    side refused has ``num_emitted`` 0 and only -1 in its output row.
    """

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor
    num_emitted: torch.Tensor
    status: torch.Tensor | None = None

    def check(self) -> VerifyResult:
        """``self`` when every request was verified; else raises what ``verify_draft`` raises
        for the first refused request (ValueError or IndexError). Copies ``status`` to the host:
        on CUDA this waits for the stream that ran the op."""
        if self.status is not None:
            _raise_on_status(self.status.cpu())
        return self


@dataclass(frozen=True)
class _VerifyLayout:
    """Where each request's rows and drafts live. ``num_draft_tokens``: ``[B]`` int64 on the
    host or on the target's device (then the kernel checks its values), None when every request
    has ``out_cols - 1`` drafts. ``target_row_start``/``draft_start``: ``[B]`` int64 host tensors
    of the packed layout, None for the padded one (the native side computes them)."""

    num_requests: int
    out_cols: int
    num_draft_tokens: torch.Tensor | None = None
    target_row_start: torch.Tensor | None = None
    draft_start: torch.Tensor | None = None


def _verify_layout(
    target: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: object
) -> _VerifyLayout:
    if target.dim() == 3:
        num_requests, rows_per_request, _ = target.shape
        max_k = rows_per_request - 1
        if rows_per_request < 1:
            raise ValueError(
                f"`target` must have k + 1 >= 1 rows per request, got shape {tuple(target.shape)}"
            )
        if tuple(draft_token_ids.shape) != (num_requests, max_k):
            raise ValueError(
                f"`draft_token_ids` must have shape {(num_requests, max_k)} for a padded target, "
                f"got {tuple(draft_token_ids.shape)}"
            )
        if num_draft_tokens is None:
            return _VerifyLayout(num_requests, max_k + 1)
        if _on_cuda_like(num_draft_tokens, target):
            return _VerifyLayout(num_requests, max_k + 1, _device_counts(num_draft_tokens, num_requests))
        ks = _as_counts(num_draft_tokens, num_requests)
        if ks.numel() and int(ks.max()) > max_k:
            raise ValueError(f"`num_draft_tokens` must be <= {max_k} (padded k), got {int(ks.max())}")
        return _VerifyLayout(num_requests, max_k + 1, ks)
    if target.dim() == 2:
        if num_draft_tokens is None:
            raise ValueError("`num_draft_tokens` must be given for a packed 2-D target, got None")
        if draft_token_ids.dim() != 1:
            raise ValueError(
                "`draft_token_ids` must be 1-D [sum(k)] for a packed target, "
                f"got shape {tuple(draft_token_ids.shape)}"
            )
        ks = _as_counts(num_draft_tokens, None)
        # Each k + 1 rows must fit in the target, checked before summing: a sum of huge counts
        # wraps int64 and would pass the row check.
        if ks.numel() and int(ks.max()) >= target.shape[0]:
            raise ValueError(
                f"`num_draft_tokens` must be < {target.shape[0]} (the packed target's rows), "
                f"got {int(ks.max())}"
            )
        num_rows = int(ks.sum()) + ks.numel()
        if target.shape[0] != num_rows:
            raise ValueError(f"`target` must have sum(k + 1) = {num_rows} rows, got {target.shape[0]}")
        if draft_token_ids.shape[0] != num_rows - ks.numel():
            raise ValueError(
                f"`draft_token_ids` must have sum(k) = {num_rows - ks.numel()} entries, "
                f"got {draft_token_ids.shape[0]}"
            )
        row_start = torch.cumsum(ks + 1, 0) - (ks + 1)
        draft_start = torch.cumsum(ks, 0) - ks
        out_cols = int(ks.max()) + 1 if ks.numel() else 1
        return _VerifyLayout(ks.numel(), out_cols, ks, row_start, draft_start)
    raise ValueError(f"`target` must be 3-D [B, k+1, V] or 2-D packed [sum(k+1), V], got {target.dim()}-D")


def _on_cuda_like(x: object, target: torch.Tensor) -> TypeGuard[torch.Tensor]:
    """Whether ``x`` is a tensor on ``target``'s CUDA device: its values are left to the kernel."""
    return target.device.type == "cuda" and isinstance(x, torch.Tensor) and x.device == target.device


def _device_counts(num_draft_tokens: torch.Tensor, num_requests: int) -> torch.Tensor:
    """``num_draft_tokens`` on the target's CUDA device, its dtype and shape checked (its values
    are the kernel's: BAD_DRAFT_COUNT)."""
    if num_draft_tokens.dtype not in _ID_DTYPES:
        raise ValueError(f"`num_draft_tokens` must be int32 or int64, got {num_draft_tokens.dtype}")
    if tuple(num_draft_tokens.shape) != (num_requests,):
        raise ValueError(
            f"`num_draft_tokens` must have shape [{num_requests}], got {tuple(num_draft_tokens.shape)}"
        )
    return num_draft_tokens


def _as_counts(num_draft_tokens: object, num_requests: int | None) -> torch.Tensor:
    if isinstance(num_draft_tokens, torch.Tensor):
        if num_draft_tokens.dtype not in _ID_DTYPES:
            raise ValueError(f"`num_draft_tokens` must be int32 or int64, got {num_draft_tokens.dtype}")
        ks = num_draft_tokens.detach().to("cpu", torch.int64)
    elif isinstance(num_draft_tokens, Sequence) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in num_draft_tokens
    ):
        ks = torch.tensor(list(num_draft_tokens), dtype=torch.int64)
    else:
        raise TypeError(
            "`num_draft_tokens` must be a tensor or a sequence of ints, "
            f"got {type(num_draft_tokens).__name__}"
        )
    if ks.dim() != 1 or (num_requests is not None and ks.numel() != num_requests):
        want = f"[{num_requests}]" if num_requests is not None else "1-D"
        raise ValueError(f"`num_draft_tokens` must have shape {want}, got {tuple(ks.shape)}")
    if ks.numel() and int(ks.min()) < 0:
        raise ValueError(f"`num_draft_tokens` must be >= 0, got {int(ks.min())}")
    return ks


def _used_draft_mask(layout: _VerifyLayout, draft_shape: torch.Size) -> torch.Tensor | None:
    """For a padded layout with shorter requests (host counts): which draft slots are read.
    None = all."""
    ks = layout.num_draft_tokens
    if len(draft_shape) != 2 or ks is None or bool((ks == draft_shape[1]).all()):
        return None
    return torch.arange(draft_shape[1]).unsqueeze(0) < ks.unsqueeze(1)


def _check_ids(ids: torch.Tensor, name: str, vocab_size: int, mask: torch.Tensor | None) -> None:
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"`{name}` must be int32 or int64, got {ids.dtype}")
    used = ids.detach().cpu()
    if mask is not None:
        used = used[mask]
    if used.numel() == 0:
        return
    low, high = int(used.min()), int(used.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise IndexError(f"`{name}` must be in [0, {vocab_size}), got {bad}")


def _verify_temperature(temperature: object, target: torch.Tensor, num_requests: int) -> torch.Tensor | None:
    """``[B]`` float64 temperatures on the target's device, or None (probabilities). Values are
    checked here unless ``temperature`` is a tensor on the target's CUDA device (the kernel's:
    BAD_TEMPERATURE)."""
    if temperature is None:
        return None
    device = target.device
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"`temperature` must be finite and >= 0, got {temperature}")
        return torch.full((num_requests,), float(temperature), dtype=torch.float64, device=device)
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"`temperature` must be a float, a tensor or None, got {type(temperature).__name__}")
    if not temperature.is_floating_point():
        raise ValueError(f"`temperature` must be a floating tensor, got {temperature.dtype}")
    if tuple(temperature.shape) != (num_requests,):
        raise ValueError(f"`temperature` must have shape ({num_requests},), got {tuple(temperature.shape)}")
    if _on_cuda_like(temperature, target):
        return temperature.detach().to(torch.float64)
    temps = temperature.detach().to("cpu", torch.float64)
    if temps.numel() and not bool((torch.isfinite(temps) & (temps >= 0)).all()):
        raise ValueError(f"`temperature` must be finite and >= 0, got {temps.tolist()}")
    return to_device(temps, device, torch.float64)


def _check_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"`{name}` must be on {device} like `target`, got {x.device}")


def verify_draft(
    target: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: DraftProbs = None,
    *,
    num_draft_tokens: torch.Tensor | Sequence[int] | None = None,
    temperature: torch.Tensor | float | None = None,
    uniforms: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> VerifyResult:
    """Exact batched chain speculative sampling: verify draft tokens against the target.

    Request b has ``k_b`` drafts and ``k_b + 1`` target rows. Draft ``d`` at position ``i`` is
    accepted when ``u0 * q(d) < p(d)`` in float64 and ``q(d) > 0``; at the first rejection a
    token is sampled with ``u1`` from ``max(p - q, 0)`` normalised (from ``p`` when that mass is
    at most 1e-12); if all ``k_b`` are accepted a bonus token is sampled with ``u1`` from row
    ``k_b``. Sampling is inverse-CDF with a fixed chunked summation order
    (lumen/verify_draft.h), so CPU, CUDA and ``reference.verify_draft_reference`` agree to the
    bit on probability inputs and the same uniforms.

    Args:
        target: float16/bfloat16/float32/float64 on the CPU or a CUDA device; padded
            ``[B, k+1, V]`` or packed ``[sum(k_b + 1), V]`` (needs ``num_draft_tokens``).
            Probabilities when ``temperature`` is None (each row >= 0, summing to 1 within
            ``VERIFY_SUM_TOLERANCE``); otherwise logits (no NaN or +inf), turned into
            ``softmax(logits / T)`` in float64. Half types are read as float32. Not modified.
        draft_token_ids: int32/int64 ``[B, k]`` (padded) or ``[sum(k_b)]`` (packed).
        draft_probs: None (drafts were greedy: q is one-hot at the draft), dense ``[B, k, V]`` /
            ``[sum(k_b), V]``, or sparse top-K ``(ids, probs)`` each ``[B, k, K]`` /
            ``[sum(k_b), K]`` (ids distinct per row; q = 0 outside them). Sparse is exact only
            if the draft sampled from that truncated, renormalised distribution.
        num_draft_tokens: ``[B]`` int k_b; required for packed, optional (each <= k) for padded.
        temperature: None (target holds probabilities), a float, or ``[B]`` float per request
            (target holds logits); 0 means greedy verification: accept while the draft equals
            the argmax (ties -> lowest id), then emit the argmax; q is ignored.
        uniforms: float64 in [0, 1), ``target.shape[:-1] + (2,)``: ``[..., 0]`` is the accept
            draw u0 of that position, ``[..., 1]`` the sampling draw u1 (residual at the
            rejection, bonus at position k_b). Exclusive with ``seeds``/``positions``.
        seeds, positions: ``[B]`` int64 (seeds read as uint64 bits; positions >= 0, the sequence
            position of verify row 0). Then ``u_j`` at row i is
            ``rng.uniforms(seeds[b], positions[b] + i, j)`` (Philox), independent of the batch.
            May be omitted together with ``uniforms`` when every temperature is 0.
        num_threads: CPU threads (default ``torch.get_num_threads()``); ignored on CUDA.

    Returns:
        VerifyResult on the target's device. CPU: every request was verified (a refused one
        raises here). CUDA: one kernel launch on the current stream and no host
        synchronisation (a packed ``target`` with ``num_draft_tokens`` on the device, and
        omitted draws with a device ``temperature``, each wait once to read it); the values of
        tensors on the device are checked by the kernel, and a request it refuses has
        ``num_emitted`` 0: ``VerifyResult.check()`` synchronises and raises the errors below.

    Raises:
        TypeError: an argument of the wrong Python type.
        ValueError: shapes, dtypes or devices that do not match; probability rows with NaN,
            negative entries or a sum outside tolerance; logits with NaN or +inf; temperatures
            < 0 or non-finite; uniforms outside [0, 1); duplicate sparse ids; V > 2**21.
        IndexError: a draft or sparse id outside [0, V).
    """
    target = check_tensor("target", target)
    draft_token_ids = check_tensor("draft_token_ids", draft_token_ids)
    vocab_size = _check_target(target)
    device = target.device
    _check_device(draft_token_ids, "draft_token_ids", device)
    layout = _verify_layout(target, draft_token_ids, num_draft_tokens)
    num_requests = layout.num_requests
    # On CUDA the kernel checks the values of device tensors (reading them here would wait).
    host_values = device.type == "cpu"
    mask = _used_draft_mask(layout, draft_token_ids.shape) if host_values else None
    if host_values:
        _check_ids(draft_token_ids, "draft_token_ids", vocab_size, mask)
    q = _check_draft_probs(draft_probs, draft_token_ids, vocab_size, mask, host_values=host_values)
    temps = _verify_temperature(temperature, target, num_requests)
    draws = _check_draws(uniforms, seeds, positions, target, layout, temps, host_values=host_values)
    if draft_token_ids.numel() == 0:
        q = _DraftQ(DraftKind.ONE_HOT)  # no q is read
    if num_requests == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return VerifyResult(
            torch.empty(0, layout.out_cols, dtype=torch.int64, device=device), empty, empty.clone()
        )
    return _run(target, draft_token_ids, layout, q, temps, draws, num_threads)


def _check_target(target: torch.Tensor) -> int:
    """The vocabulary size of a valid ``target``; ValueError for a dtype, size or device the
    native paths do not take."""
    if target.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"`target` must be float16, bfloat16, float32 or float64, got {target.dtype}")
    vocab_size = target.shape[-1] if target.dim() else 0
    if not 1 <= vocab_size <= VERIFY_MAX_VOCAB_SIZE:
        raise ValueError(
            f"`target` must have a vocabulary size in [1, {VERIFY_MAX_VOCAB_SIZE}], got {vocab_size}"
        )
    if target.device.type not in ("cpu", "cuda"):
        raise ValueError(f"`target` must be on the CPU or a CUDA device, got {target.device}")
    return vocab_size


@dataclass(frozen=True)
class _DraftQ:
    """The draft distribution as the native side takes it: ``probs`` dense ``[*, V]`` or
    sparse ``[*, K]`` beside ``topk_ids``; neither for one-hot drafts."""

    kind: DraftKind
    probs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None


def _check_draft_probs(
    draft_probs: object,
    draft_token_ids: torch.Tensor,
    vocab_size: int,
    mask: torch.Tensor | None,
    *,
    host_values: bool,
) -> _DraftQ:
    """The validated draft distribution; sparse ids are range- and duplicate-checked here when
    ``host_values`` (else by the kernel: TOPK_ID_RANGE, DUPLICATE_TOPK_ID)."""
    device = draft_token_ids.device
    if draft_probs is None:
        return _DraftQ(DraftKind.ONE_HOT)
    if isinstance(draft_probs, torch.Tensor):
        want = tuple(draft_token_ids.shape) + (vocab_size,)
        if tuple(draft_probs.shape) != want:
            raise ValueError(f"`draft_probs` must have shape {want}, got {tuple(draft_probs.shape)}")
        if draft_probs.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"`draft_probs` must be a float tensor, got {draft_probs.dtype}")
        _check_device(draft_probs, "draft_probs", device)
        return _DraftQ(DraftKind.DENSE, draft_probs)
    if not isinstance(draft_probs, tuple):
        raise TypeError(
            f"`draft_probs` must be None, a tensor or a tuple (ids, probs), got {type(draft_probs).__name__}"
        )
    if len(draft_probs) != 2 or not all(isinstance(x, torch.Tensor) for x in draft_probs):
        raise TypeError("`draft_probs` must be None, a tensor or a tuple (ids, probs) of tensors")
    topk_ids, topk_probs = draft_probs
    _check_device(topk_ids, "draft_probs ids", device)
    _check_device(topk_probs, "draft_probs probs", device)
    lead = tuple(draft_token_ids.shape)
    if (
        topk_ids.dim() != len(lead) + 1
        or tuple(topk_ids.shape[:-1]) != lead
        or topk_ids.shape != topk_probs.shape
        or topk_ids.shape[-1] < 1
    ):
        raise ValueError(
            f"`draft_probs` (ids, probs) must both have shape {lead + ('K',)} with K >= 1, "
            f"got {tuple(topk_ids.shape)} and {tuple(topk_probs.shape)}"
        )
    if topk_probs.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"`draft_probs` sparse probs must be a float tensor, got {topk_probs.dtype}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"`draft_probs ids` must be int32 or int64, got {topk_ids.dtype}")
    if not host_values:
        return _DraftQ(DraftKind.SPARSE, topk_probs, topk_ids)
    _check_ids(topk_ids, "draft_probs ids", vocab_size, mask)
    used_ids = topk_ids.detach().cpu()
    sorted_ids = (used_ids if mask is None else used_ids[mask]).sort(dim=-1).values
    if bool((sorted_ids[..., 1:] == sorted_ids[..., :-1]).any()):
        raise ValueError("`draft_probs` ids must be distinct within each draft row, got a duplicate")
    return _DraftQ(DraftKind.SPARSE, topk_probs, topk_ids)


@dataclass(frozen=True)
class _Draws:
    """Where the uniforms come from: explicit ``uniforms``, or Philox ``seeds``/``positions``."""

    uniforms: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _check_draws(
    uniforms: object,
    seeds: object,
    positions: object,
    target: torch.Tensor,
    layout: _VerifyLayout,
    temps: torch.Tensor | None,
    *,
    host_values: bool,
) -> _Draws:
    """The validated source of uniforms; their values (uniforms in [0, 1), positions in range)
    are checked here when ``host_values``, else by the kernel (BAD_UNIFORM, BAD_POSITION).
    Greedy verification draws none: zero seeds and positions stand in when the caller gave
    neither and every temperature is 0."""
    device, num_requests = target.device, layout.num_requests
    if uniforms is not None and (seeds is not None or positions is not None):
        raise ValueError("`uniforms` must be None when `seeds`/`positions` are given, got both")
    if uniforms is not None:
        uniforms = check_tensor("uniforms", uniforms)
        _check_device(uniforms, "uniforms", device)
        want = tuple(target.shape[:-1]) + (2,)
        if uniforms.dtype != torch.float64 or tuple(uniforms.shape) != want:
            raise ValueError(
                f"`uniforms` must be float64 of shape {want}, got {uniforms.dtype} {tuple(uniforms.shape)}"
            )
        if host_values and uniforms.numel() and not bool(((uniforms >= 0) & (uniforms < 1)).all()):
            raise ValueError("`uniforms` must be in [0, 1), got a value outside")
        return _Draws(uniforms=uniforms)
    if seeds is None and positions is None and temps is not None and bool((temps == 0).all()):
        zeros = torch.zeros(num_requests, dtype=torch.int64, device=device)
        return _Draws(seeds=zeros, positions=zeros)
    if seeds is None or positions is None:
        raise ValueError("`seeds` and `positions` must both be given when `uniforms` is None, got a None")
    seeds = check_tensor("seeds", seeds)
    positions = check_tensor("positions", positions)
    for name, x in (("seeds", seeds), ("positions", positions)):
        _check_device(x, name, device)
        if x.dtype not in _ID_DTYPES or tuple(x.shape) != (num_requests,):
            raise ValueError(
                f"`{name}` must be int32/int64 of shape ({num_requests},), got {x.dtype} {tuple(x.shape)}"
            )
    if (
        host_values
        and positions.numel()
        and not 0 <= int(positions.min()) <= int(positions.max()) < 2**63 - layout.out_cols
    ):
        raise ValueError(
            f"`positions` must be in [0, 2**63 - {layout.out_cols}), "
            f"got [{int(positions.min())}, {int(positions.max())}]"
        )
    return _Draws(seeds=seeds, positions=positions)


def _run(
    target: torch.Tensor,
    draft_token_ids: torch.Tensor,
    layout: _VerifyLayout,
    q: _DraftQ,
    temps: torch.Tensor | None,
    draws: _Draws,
    num_threads: int | None,
) -> VerifyResult:
    """Move the validated inputs to the target's device in the dtypes of VerifyDraftArgs and run
    the native op there. CPU: raise for the first request whose status is not OK. CUDA: launch
    and return; the status stays on the device."""
    device = target.device
    compute_dtype = torch.float64 if target.dtype == torch.float64 else torch.float32
    num_requests, out_cols = layout.num_requests, layout.out_cols

    def on_device(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if x is None or (x.dtype == dtype and x.device == device and x.is_contiguous()):
            return x  # the hot path: already in place, no torch call
        return to_device(x, device, dtype)

    # The native side holds addresses only. CPU: these stay referenced until it returns. CUDA:
    # temporaries freed on return go back to the caching allocator, which hands their blocks only
    # to work queued after the kernel on this stream.
    keep = {
        "target": on_device(target, compute_dtype),
        "num_draft_tokens": on_device(layout.num_draft_tokens, torch.int64),
        "target_row_start": on_device(layout.target_row_start, torch.int64),
        "draft_start": on_device(layout.draft_start, torch.int64),
        "draft_token_ids": on_device(draft_token_ids.reshape(-1), torch.int64),
        "draft_probs": on_device(q.probs, compute_dtype),
        "draft_topk_ids": on_device(q.topk_ids, torch.int64),
        "temperature": on_device(temps, torch.float64),
        "uniforms": on_device(draws.uniforms, torch.float64),
        "seeds": on_device(draws.seeds, torch.int64),
        "positions": on_device(draws.positions, torch.int64),
    }
    # One allocation for the four outputs (each a contiguous view); the native side writes all.
    flat = torch.empty(num_requests * (out_cols + 3), dtype=torch.int64, device=device)
    output_token_ids = flat[: num_requests * out_cols].view(num_requests, out_cols)
    num_accepted, num_emitted, status = flat[num_requests * out_cols :].view(3, num_requests).unbind()
    buffers: dict[str, int | float] = {name: (0 if x is None else x.data_ptr()) for name, x in keep.items()}
    buffers.update(
        output_token_ids=output_token_ids.data_ptr(),
        num_accepted=num_accepted.data_ptr(),
        num_emitted=num_emitted.data_ptr(),
        status=status.data_ptr(),
        out_cols=out_cols,
        dtype=ScalarType.FLOAT32 if compute_dtype == torch.float32 else ScalarType.FLOAT64,
        target_kind=TargetKind.PROBS if temps is None else TargetKind.LOGITS,
        draft_kind=q.kind,
        num_requests=num_requests,
        vocab_size=target.shape[-1],
        topk=0 if q.topk_ids is None else q.topk_ids.shape[-1],
        sum_tolerance=VERIFY_SUM_TOLERANCE,
    )
    if device.type == "cuda":
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            _native.require_cuda().verify_draft(buffers, stream.cuda_stream)
    else:
        threads = check_num_threads(num_threads, default=torch.get_num_threads())
        _native.require_cpu().verify_draft(buffers, threads)
        _raise_on_status(status)
    return VerifyResult(output_token_ids, num_accepted, num_emitted, status)


def _raise_on_status(status: torch.Tensor) -> None:
    """Raise for the first request whose status (``code << 32 | position``) is not OK."""
    bad = torch.nonzero(status).flatten()
    if bad.numel() == 0:
        return
    b = int(bad[0])
    code, pos = VerifyStatus(int(status[b]) >> 32), int(status[b]) & 0xFFFFFFFF
    where = f"request {b} position {pos}"
    if code is VerifyStatus.BAD_TARGET_ROW:
        raise ValueError(
            f"`target` rows must be probabilities (>= 0, no NaN, summing to 1 within "
            f"{VERIFY_SUM_TOLERANCE}), got a bad row at {where}"
        )
    if code is VerifyStatus.BAD_LOGITS_ROW:
        raise ValueError(
            f"`target` logits must have no NaN or +inf and a finite entry, got a bad row at {where}"
        )
    if code is VerifyStatus.BAD_DRAFT_ROW:
        raise ValueError(
            f"`draft_probs` rows must be probabilities (>= 0, no NaN, summing to 1 within "
            f"{VERIFY_SUM_TOLERANCE}), got a bad row at {where}"
        )
    if code in (VerifyStatus.DRAFT_ID_RANGE, VerifyStatus.TOPK_ID_RANGE):
        raise IndexError(
            f"`draft_token_ids` and `draft_probs` ids must be in [0, V), got one outside at {where}"
        )
    if code is VerifyStatus.BAD_DRAFT_COUNT:
        raise ValueError(f"`num_draft_tokens` must be in [0, out_cols - 1], got a bad one at {where}")
    if code is VerifyStatus.BAD_UNIFORM:
        raise ValueError(f"`uniforms` must be in [0, 1), got a value outside at {where}")
    if code is VerifyStatus.BAD_POSITION:
        raise ValueError(f"`positions` must be in [0, 2**63 - out_cols), got a bad one at {where}")
    if code is VerifyStatus.DUPLICATE_TOPK_ID:
        raise ValueError(
            f"`draft_probs` ids must be distinct within each draft row, got a duplicate at {where}"
        )
    raise ValueError(f"`temperature` must be finite and >= 0, got a bad one at {where}")
