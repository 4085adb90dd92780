"""lumen_core inside vLLM: ``LumenConnector`` (docs/vllm.md). The only package that imports vLLM;
``params`` does not, so the gateway and the default tests use it without vLLM installed."""

from typing import Any

__all__ = ["LumenConnector"]


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(module, "LumenConnector"): vLLM is imported here, not by params.
    if name == "LumenConnector":
        from lumen_core.integrations.vllm.connector import LumenConnector

        return LumenConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
