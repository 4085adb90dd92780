"""Fixtures of the vLLM tests (marker ``vllm``; ``make test-vllm`` runs them in .venv-vllm).

Without vLLM installed the files here are not collected, so the default suite never imports
it; under ``make test-vllm`` (LUMEN_VLLM=ON) a missing vLLM fails instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LUMEN_VLLM") == "ON":
        raise RuntimeError("LUMEN_VLLM=ON but vLLM is not importable: run `make vllm-env`")
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs vLLM code: mark it ``vllm``, so the default suite deselects it."""
    for item in items:
        if "tests/vllm/" in str(item.path):
            item.add_marker(pytest.mark.vllm)
