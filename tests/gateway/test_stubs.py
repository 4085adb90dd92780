"""The committed gRPC stubs are what `make proto` generates from lumen.proto today."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lumen_core.gateway

GATEWAY = Path(lumen_core.gateway.__file__).parent
STUBS = ("lumen_pb2.py", "lumen_pb2.pyi", "lumen_pb2_grpc.py")


def test_committed_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) generates the stubs")
    package = tmp_path / "lumen_core" / "gateway"
    package.mkdir(parents=True)
    shutil.copy(GATEWAY / "lumen.proto", package / "lumen.proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{tmp_path}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(package / "lumen.proto"),
        ],
        check=True,
        timeout=60,
    )
    for name in STUBS:
        assert (package / name).read_text() == (GATEWAY / name).read_text(), (
            f"{name} is stale: run `make proto`"
        )
