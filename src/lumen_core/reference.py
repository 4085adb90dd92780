"""The slow, obvious version of every op in ops.py: the specification the native code meets."""

from __future__ import annotations

import math

import numpy as np
import torch

from lumen_core import rng
from lumen_core.layouts import KVLayout
from lumen_core.verify import VerifyResult

_CRC32C_POLY = 0x82F63B78


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``crc``, one byte at a time."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ _CRC32C_TABLE[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def checksum(records: torch.Tensor) -> torch.Tensor:
    """``[n]`` uint32 CRC-32C of each row of ``[n, record_bytes]`` uint8 ``records``."""
    values = [crc32c(bytes(row.tolist())) for row in records.cpu()]
    return torch.tensor(values, dtype=torch.int64).to(torch.uint32)


def _row_bytes_view(view: torch.Tensor, slot: int, block_size: int) -> torch.Tensor:
    """The row of ``slot`` in a plane view ``[num_blocks, block_size, pieces, elems]`` as bytes."""
    row = view[slot // block_size, slot % block_size]  # [pieces, elems]
    return row.contiguous().view(torch.uint8).reshape(-1)


def gather_tokens(layout: KVLayout, slot_ids: torch.Tensor) -> torch.Tensor:
    """``[n, record_bytes]`` uint8 on the CPU: each slot's rows of every plane, in plane order."""
    records = torch.empty((slot_ids.numel(), layout.record_bytes), dtype=torch.uint8)
    for t, slot in enumerate(slot_ids.tolist()):
        for view, plane in zip(layout.views, layout.planes):
            row = _row_bytes_view(view, slot, layout.block_size).cpu()
            records[t, plane.record_offset : plane.record_offset + plane.row_bytes] = row
    return records


def scatter_tokens(layout: KVLayout, slot_ids: torch.Tensor, records: torch.Tensor) -> None:
    """Write row ``t`` of ``records`` into the rows of ``slot_ids[t]``, plane by plane."""
    for t, slot in enumerate(slot_ids.tolist()):
        for view, plane in zip(layout.views, layout.planes):
            row = view[slot // layout.block_size, slot % layout.block_size]
            data = records[t, plane.record_offset : plane.record_offset + plane.row_bytes]
            row.copy_(data.clone().to(row.device).view(row.dtype).reshape(row.shape))


# ---- verify_draft (docs/verify_draft.md) ---------------------------------------------------
#: Chunk of the sampling rule (``kSampleChunk`` in lumen/verify_draft.h).
SAMPLE_CHUNK = 1024
#: Residual mass at or below which the token is sampled from p instead (``kResidualMinMass``).
RESIDUAL_MIN_MASS = 1e-12


def chunk_prefix(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunks of ``w`` (float64 [V], zero-padded to whole chunks), their sums (each left to
    right) and the running prefix of the sums (left to right; the last entry is the total)."""
    num_chunks = -(-w.numel() // SAMPLE_CHUNK)
    padded = torch.zeros(num_chunks * SAMPLE_CHUNK, dtype=torch.float64)
    padded[: w.numel()] = w
    chunks = padded.view(num_chunks, SAMPLE_CHUNK)
    sums = chunks.cumsum(1)[:, -1]
    return chunks, sums, sums.cumsum(0)


def _last_positive(chunk: torch.Tensor) -> int:
    positive = torch.nonzero(chunk > 0).flatten()
    return int(positive[-1]) if positive.numel() else 0


def sample_chunked(w: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of token ids from weights ``w`` (float64 [V], total > 0) with ``u``
    in [0, 1), by the chunk rule of lumen/verify_draft.h."""
    chunks, sums, prefix = chunk_prefix(w)
    x = u * float(prefix[-1])
    for c in range(chunks.shape[0]):
        if float(prefix[c]) > x:
            before = float(prefix[c - 1]) if c else 0.0
            running = torch.cat([torch.tensor([before], dtype=torch.float64), chunks[c]]).cumsum(0)[1:]
            hits = torch.nonzero(running > x).flatten()
            return c * SAMPLE_CHUNK + (int(hits[0]) if hits.numel() else _last_positive(chunks[c]))
    for c in reversed(range(chunks.shape[0])):
        if float(sums[c]) > 0:
            return c * SAMPLE_CHUNK + _last_positive(chunks[c])
    return 0


def target_p(row: torch.Tensor, temperature: float | None) -> torch.Tensor:
    """p of one target row in float64: the row itself, or softmax((row - max) / T) with the
    normaliser summed by the chunk rule and exp from the C library (as the native code)."""
    values = row.to(torch.float64)
    if temperature is None:
        return values
    m = float(values.max())
    w = torch.tensor([math.exp((x - m) / temperature) for x in values.tolist()], dtype=torch.float64)
    return w / float(chunk_prefix(w)[2][-1])


def _request_uniforms(
    uniforms: torch.Tensor | None,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
    b: int,
    row_start: int,
    k: int,
) -> list[tuple[float, float]]:
    """(u0, u1) of rows 0..k of request b: explicit, or Philox (numpy reference)."""
    if uniforms is not None:
        return [(float(uniforms[row_start + i, 0]), float(uniforms[row_start + i, 1])) for i in range(k + 1)]
    assert seeds is not None and positions is not None  # no uniforms: the Philox stream's seeds
    seed = np.uint64(int(seeds[b]) & 0xFFFFFFFFFFFFFFFF)
    first = int(positions[b])
    return [
        (float(rng.uniforms(seed, first + i, 0)), float(rng.uniforms(seed, first + i, 1)))
        for i in range(k + 1)
    ]


def _draft_q(
    vocab_size: int, d: int, j: int, q_ids: torch.Tensor | None, q_probs: torch.Tensor | None
) -> torch.Tensor:
    """Dense float64 q of draft slot j (draft token d): one-hot, dense row or sparse top-K."""
    if q_probs is None:
        q = torch.zeros(vocab_size, dtype=torch.float64)
        q[d] = 1.0
        return q
    if q_ids is None:
        return q_probs[j].to(torch.float64)
    q = torch.zeros(vocab_size, dtype=torch.float64)
    q[q_ids[j]] = q_probs[j].to(torch.float64)
    return q


def verify_draft_reference(
    target: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    num_draft_tokens: torch.Tensor | list[int] | None = None,
    temperature: torch.Tensor | float | None = None,
    uniforms: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> VerifyResult:
    """Loop form of ``verify.verify_draft`` (same arguments and layouts, CPU tensors, no input
    validation): one request at a time, one position at a time."""
    compute = torch.float64 if target.dtype == torch.float64 else torch.float32
    target = target.to(compute)
    q_ids, q_probs = draft_probs if isinstance(draft_probs, tuple) else (None, draft_probs)
    if q_probs is not None:
        q_probs = q_probs.to(compute)
    if target.dim() == 3:
        num_requests, rows, _ = target.shape
        ks = [rows - 1] * num_requests if num_draft_tokens is None else [int(k) for k in num_draft_tokens]
        target, draft_token_ids = target.reshape(-1, target.shape[-1]), draft_token_ids.reshape(-1)
        if uniforms is not None:
            uniforms = uniforms.reshape(-1, 2)
        if q_probs is not None:
            q_probs = q_probs.reshape(-1, q_probs.shape[-1])
            q_ids = None if q_ids is None else q_ids.reshape(-1, q_ids.shape[-1])
        row_starts = [b * rows for b in range(num_requests)]
        draft_starts = [b * (rows - 1) for b in range(num_requests)]
        out_cols = rows
    else:
        assert num_draft_tokens is not None  # a packed (2-D) target always comes with its counts
        ks = [int(k) for k in num_draft_tokens]
        num_requests = len(ks)
        row_starts = [sum(ks[:b]) + b for b in range(num_requests)]
        draft_starts = [sum(ks[:b]) for b in range(num_requests)]
        out_cols = max(ks, default=0) + 1
    if isinstance(temperature, torch.Tensor):
        temps: list[float | None] = [float(t) for t in temperature]
    else:
        temps = [None if temperature is None else float(temperature)] * num_requests

    out = torch.full((num_requests, out_cols), -1, dtype=torch.int64)
    num_accepted = torch.zeros(num_requests, dtype=torch.int64)
    num_emitted = torch.zeros(num_requests, dtype=torch.int64)
    for b in range(num_requests):
        k, temp = ks[b], temps[b]
        rows_b = target[row_starts[b] : row_starts[b] + k + 1]
        drafts_b = [int(d) for d in draft_token_ids[draft_starts[b] : draft_starts[b] + k]]
        greedy = temp == 0.0  # needs no uniforms
        u = [] if greedy else _request_uniforms(uniforms, seeds, positions, b, row_starts[b], k)

        emitted: list[int] = []
        for i, d in enumerate(drafts_b):
            if greedy:
                token = int(torch.argmax(rows_b[i].to(torch.float64)))
                accepted = token == d
            else:
                p = target_p(rows_b[i], temp)
                q = _draft_q(target.shape[-1], d, draft_starts[b] + i, q_ids, q_probs)
                accepted = float(q[d]) > 0.0 and u[i][0] * float(q[d]) < float(p[d])
                if accepted:
                    token = d
                else:
                    residual = torch.clamp(p - q, min=0.0)
                    mass = float(chunk_prefix(residual)[2][-1])
                    token = sample_chunked(residual if mass > RESIDUAL_MIN_MASS else p, u[i][1])
            emitted.append(token)
            if not accepted:  # a rejection may resample d itself (q(d) = 0 or the fallback to p)
                break
        else:
            if greedy:
                emitted.append(int(torch.argmax(rows_b[k].to(torch.float64))))
            else:
                emitted.append(sample_chunked(target_p(rows_b[k], temp), u[k][1]))
        out[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
        num_emitted[b] = len(emitted)
        num_accepted[b] = len(emitted) - 1
    return VerifyResult(out, num_accepted, num_emitted)
