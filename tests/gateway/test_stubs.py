"""The committed gRPC stubs are what `make proto` generates from lumen.proto today."""

import subprocess
import sys
from pathlib import Path

import pytest

import lumen_core.gateway

pytestmark = pytest.mark.timeout(60)

GATEWAY = Path(lumen_core.gateway.__file__).parent
STUBS = ("lumen_pb2.py", "lumen_pb2.pyi", "lumen_pb2_grpc.py")


def generate(proto_text: str, root: Path) -> dict[str, str]:
    """Run grpcio-tools as `make proto` does on ``proto_text``; return the stubs' text."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) generates the stubs")
    package = root / "lumen_core" / "gateway"
    package.mkdir(parents=True)
    (package / "lumen.proto").write_text(proto_text)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            str(package / "lumen.proto"),
        ],
        check=True,
        timeout=60,
    )
    return {name: (package / name).read_text() for name in STUBS}


def test_committed_stubs_are_current(tmp_path):
    generated = generate((GATEWAY / "lumen.proto").read_text(), tmp_path)
    for name in STUBS:
        assert generated[name] == (GATEWAY / name).read_text(), f"{name} is stale: run `make proto`"


def test_a_changed_proto_makes_the_committed_stubs_stale(tmp_path):
    proto = (GATEWAY / "lumen.proto").read_text()
    changed = proto.replace("message StatusRequest {}", "message StatusRequest {\n  bool verbose = 1;\n}")
    assert changed != proto
    generated = generate(changed, tmp_path)
    assert generated["lumen_pb2.py"] != (GATEWAY / "lumen_pb2.py").read_text()
