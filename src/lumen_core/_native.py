"""The only importer of the compiled extension modules.

Never raises at import: a module that is missing or fails to load is ``None`` here and the
reason is kept in ``IMPORT_ERRORS``, so pure-Python parts (policy, sim) work without a build.

- ``C``: ``lumen_core._C`` (CPU kernels; always built).
- ``C_cuda``: ``lumen_core._C_cuda`` (CUDA kernels) or ``None``.
- ``C_ucx``: ``lumen_core._C_ucx`` (native UCX transport, holder, streamer) or ``None``.
- ``HAS_CUDA``: the CUDA kernels were built *and* a CUDA device is present.
- ``HAS_UCX``: the UCX module was built and loads.
- ``BUILD_INFO``: what was compiled (``modules``, ``cuda_archs``, ``cxx``, ...) plus what
  imported (``imported``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

IMPORT_ERRORS: dict[str, str] = {}


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"lumen_core.{name}")
    except ImportError as exc:
        IMPORT_ERRORS[name] = str(exc)
        return None


def _load_ucx() -> ModuleType | None:
    # UCX logs to stdout unless told otherwise, and reads where to when its libraries load: stdout
    # belongs to the program (`lumen holder` and the agent answer in JSON lines there, and a
    # UCX warning landed inside one), so a library's diagnostics go to stderr. The environment
    # wins.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    # The UCX libraries live in the libucx wheel; they must be loaded before the module.
    try:
        import libucx

        libucx.load_library()
    except Exception as exc:  # noqa: BLE001 - any failure means "no UCX", reported below
        IMPORT_ERRORS["_C_ucx"] = f"libucx.load_library() failed: {exc}"
        return None
    return _load("_C_ucx")


C = _load("_C")
C_cuda = _load("_C_cuda")
C_ucx = _load_ucx()


def _cuda_device_count() -> int:
    if C_cuda is None:
        return 0
    try:
        return int(C_cuda.device_count())
    except RuntimeError as exc:
        IMPORT_ERRORS["cuda_device"] = str(exc)
        return 0


CUDA_DEVICE_COUNT = _cuda_device_count()
HAS_CUDA = C_cuda is not None and CUDA_DEVICE_COUNT > 0
HAS_UCX = C_ucx is not None

BUILD_INFO: dict[str, Any] = dict(C.BUILD_INFO) if C is not None else {"modules": ""}
BUILD_INFO["modules"] = [m for m in str(BUILD_INFO.get("modules", "")).split(",") if m]
BUILD_INFO["imported"] = [
    name for name, mod in (("cpu", C), ("cuda", C_cuda), ("ucx", C_ucx)) if mod is not None
]
BUILD_INFO["cuda_devices"] = CUDA_DEVICE_COUNT


def require_cpu() -> ModuleType:
    """The CPU module, or a RuntimeError that says why it is missing."""
    if C is None:
        raise RuntimeError(
            "lumen_core._C is not built; install the package (make test) "
            f"({IMPORT_ERRORS.get('_C', 'unknown error')})"
        )
    return C


def require_cuda() -> ModuleType:
    """The CUDA module with a device present, or a RuntimeError that says why not."""
    if not HAS_CUDA:
        why = IMPORT_ERRORS.get("_C_cuda") or "no CUDA device is present"
        raise RuntimeError(f"CUDA kernels are unavailable: {why}")
    assert C_cuda is not None
    return C_cuda


def require_ucx() -> ModuleType:
    """The UCX module, or a RuntimeError that says why it is missing."""
    if C_ucx is None:
        raise RuntimeError(f"the UCX transport is unavailable: {IMPORT_ERRORS.get('_C_ucx', 'not built')}")
    return C_ucx
