"""Shared models for the engine tests: the default tiny config, seeded, fp32 and float64."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lumen_core.engine import Llama, ModelConfig, random_weights

TINY = ModelConfig()


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's matrices are far too small for intra-op threads: on a shared 2-core
    machine OpenMP threads only contend (measured 100x slower under load). Restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model32() -> Llama:
    return random_weights(TINY, seed=0, dtype="float32")


@pytest.fixture(scope="session")
def model64() -> Llama:
    return random_weights(TINY, seed=0, dtype="float64")
