"""lumen_core: fault-tolerant LLM serving (LUMEN, arXiv 2606.17787).

KV token records stream to checkpoint holders during decode; after a worker failure each
interrupted request is restored on its holder or re-prefilled, and the restarted worker drafts
tokens for the busiest survivor while its model reloads. See README.md and docs/design.md.
"""

from lumen_core._native import BUILD_INFO, HAS_CUDA, HAS_UCX
from lumen_core.policy import (
    AllToHolder,
    FixedNeighbour,
    LoadAware,
    LoadMonitor,
    LocalityAware,
    NoCheckpoint,
    Rebalance,
    SpecAssistPlanner,
    make_policy,
)

__version__ = "0.1.0"

# The data-plane names need torch; they load on first use so that torch-free parts (policy,
# sim) import without it.
_LAZY = {
    "KVLayout": "lumen_core.layouts",
    "StagingPool": "lumen_core.staging",
    "VerifyResult": "lumen_core.verify",
    "checksum": "lumen_core.ops",
    "gather_tokens": "lumen_core.ops",
    "scatter_tokens": "lumen_core.ops",
    "verify_draft": "lumen_core.verify",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lumen_core' has no attribute {name!r}")


__all__ = [
    "BUILD_INFO",
    "HAS_CUDA",
    "HAS_UCX",
    "KVLayout",
    "StagingPool",
    "__version__",
    "checksum",
    "gather_tokens",
    "scatter_tokens",
]
__all__ += [
    "AllToHolder",
    "FixedNeighbour",
    "LoadAware",
    "LoadMonitor",
    "LocalityAware",
    "NoCheckpoint",
    "Rebalance",
    "SpecAssistPlanner",
    "make_policy",
]
__all__ += ["VerifyResult", "verify_draft"]
