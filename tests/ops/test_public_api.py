"""The data-plane names are re-exported lazily from lumen_core, and torch stays optional."""

import subprocess
import sys

import lumen_core
from lumen_core import layouts, ops, staging, verify


def test_reexports_are_the_implementations():
    assert lumen_core.KVLayout is layouts.KVLayout
    assert lumen_core.gather_tokens is ops.gather_tokens
    assert lumen_core.scatter_tokens is ops.scatter_tokens
    assert lumen_core.checksum is ops.checksum
    assert lumen_core.verify_draft is verify.verify_draft
    assert lumen_core.VerifyResult is verify.VerifyResult
    assert lumen_core.StagingPool is staging.StagingPool
    assert set(lumen_core._LAZY) <= set(lumen_core.__all__)


def test_importing_the_package_does_not_import_torch():
    code = "import sys, lumen_core, lumen_core.policy; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
