"""lumen_core: fault-tolerant LLM serving (LUMEN, arXiv 2606.17787).

KV token records stream to checkpoint holders during decode; after a worker failure each
interrupted request is restored on its holder or re-prefilled, and the restarted worker drafts
tokens for the busiest survivor while its model reloads. See README.md and DESIGN.md.
"""

from lumen_core._native import BUILD_INFO, HAS_CUDA, HAS_UCX
from lumen_core.ops import VerifyResult, verify_draft
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

__all__ = ["BUILD_INFO", "HAS_CUDA", "HAS_UCX", "__version__"]
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
