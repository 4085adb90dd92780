"""What the capability and identity tests share: a holder that trusts the test's issuer, and
well-formed token records (what a writer appends)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer
from lumen_core.ops import checksum
from lumen_core.stream import HolderStore

RECORD_BYTES = 16
TLS = "tcp"
SECRET = b"the-cluster-secret-every-worker-holds"


@contextmanager
def trusting_holder(issuer: CapabilityIssuer, holder_id: int) -> Iterator[tp.Server]:
    """A holder on loopback (a store of its own) that verifies capabilities with ``issuer``'s key."""
    with tp.Server(
        SECRET, store=HolderStore(), holder_id=holder_id, issuer_public_key=issuer.public_key, tls=TLS
    ) as server:
        yield server


def well_formed(start: int, n: int, fill: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n well-formed records: token ids start.., crcs that match, bytes all ``fill``."""
    data = np.full((n, RECORD_BYTES), fill, dtype=np.uint8)
    crcs = checksum(torch.from_numpy(data)).numpy().astype(np.uint32)
    return np.arange(start, start + n, dtype=np.uint32), crcs, data
