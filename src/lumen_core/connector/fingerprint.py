"""An engine-neutral model fingerprint: the same safetensors give the same string in every
engine (the reference engine, vLLM, ...), so a checkpoint restores across engines."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

__all__ = ["model_fingerprint"]

_FINGERPRINT_VERSION = 1
_CHUNK_BYTES = 8 << 20


@functools.lru_cache(maxsize=16)
def _weights_sha256(model_dir: Path, files: tuple[tuple[str, int, int], ...]) -> tuple[tuple[str, str], ...]:
    """sha256 of each weight file; cached per (name, size, mtime) so it is read once."""
    digests = []
    for name, _, _ in files:
        h = hashlib.sha256()
        with open(model_dir / name, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK_BYTES), b""):
                h.update(chunk)
        digests.append((name, h.hexdigest()))
    return tuple(digests)


def model_fingerprint(
    model_dir: str | Path,
    *,
    dtype: str,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    tensor_parallel_rank: int = 0,
    revision: str | None = None,
) -> str:
    """Hex digest naming the KV a model produces: its ``config.json``, ``dtype`` (e.g.
    "torch.bfloat16"), ``quantization``, tensor parallel size and rank, and either the sha256
    of every ``*.safetensors`` file in ``model_dir`` or, when given, ``revision`` (a name the
    user vouches for, which saves reading the weights).

    Raises:
        ValueError: ``model_dir`` has no config.json, no safetensors file (and no
            ``revision``), or the tensor parallel rank is outside ``[0, size)``.
    """
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"`model_dir` must hold a config.json, got {str(path)!r}")
    if not 0 <= tensor_parallel_rank < tensor_parallel_size:
        raise ValueError(
            f"`tensor_parallel_rank` must be in [0, {tensor_parallel_size}), got {tensor_parallel_rank}"
        )
    if revision is None:
        files = tuple(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.glob("*.safetensors"))
        )
        if not files:
            raise ValueError(
                f"`model_dir` must hold *.safetensors weights or a `revision` be given, got {str(path)!r}"
            )
        weights: object = _weights_sha256(path.resolve(), files)
    else:
        weights = revision
    spec = {
        "version": _FINGERPRINT_VERSION,
        "config": json.loads(config_path.read_text()),
        "dtype": dtype,
        "quantization": quantization,
        "tensor_parallel": [tensor_parallel_size, tensor_parallel_rank],
        "weights": weights,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:32]
