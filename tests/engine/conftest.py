"""Shared models for the engine tests: the default tiny config, seeded, fp32 and float64."""

from __future__ import annotations

import pytest

from lumen_core.engine import Llama, ModelConfig, random_weights

TINY = ModelConfig()


@pytest.fixture(scope="session")
def model32() -> Llama:
    return random_weights(TINY, seed=0, dtype="float32")


@pytest.fixture(scope="session")
def model64() -> Llama:
    return random_weights(TINY, seed=0, dtype="float64")
