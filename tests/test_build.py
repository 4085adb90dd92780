"""The build produced and imported every module it was asked for (BUILD_INFO)."""

import os

import pytest

from lumen_core import _native


def test_cpu_module_always_builds():
    assert "cpu" in _native.BUILD_INFO["modules"]
    assert _native.C is not None, _native.IMPORT_ERRORS


@pytest.mark.parametrize("module", ["cpu", "cuda", "ucx"])
def test_every_compiled_module_imports(module):
    if module in _native.BUILD_INFO["modules"]:
        assert module in _native.BUILD_INFO["imported"], _native.IMPORT_ERRORS


@pytest.mark.parametrize("switch,module", [("LUMEN_CUDA", "cuda"), ("LUMEN_UCX", "ucx")])
def test_switch_on_means_module_built(switch, module):
    if os.environ.get(switch) != "ON":
        pytest.skip(f"{switch} is not ON in this environment")
    assert module in _native.BUILD_INFO["modules"]
    assert module in _native.BUILD_INFO["imported"], _native.IMPORT_ERRORS


def test_has_cuda_means_device_present():
    assert _native.HAS_CUDA == (_native.C_cuda is not None and _native.CUDA_DEVICE_COUNT > 0)
