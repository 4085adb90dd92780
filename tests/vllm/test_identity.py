"""A vLLM server's worker identity in a real engine: with ``identity_key_file`` and the
credential its agent hands over (control ``credential``), the connector's connections prove
worker 7, so a holder takes appends under a capability bound to worker 7 and refuses one bound
to worker 8; a credential for another key is refused."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import controlled_llm, durable_tokens, greedy, params

from lumen_core.auth import CapabilityIssuer, Rights, WorkerIdentity
from lumen_core.integrations.vllm.control import ControlError, ask
from lumen_core.stream import request_key
from lumen_core.transport import Client

PROMPT_TOKENS = 100
WORKER_ID = 7


@pytest.mark.timeout(600)
def test_bound_capabilities_serve_only_the_identity_the_agent_registered(
    tmp_path: Path,
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    server = holder()
    identity = WorkerIdentity.create_key_file(tmp_path / "identity.key")
    llm, sock = controlled_llm(
        tmp_path, secret_file, issuer_key_file, server.port, identity_key_file=str(tmp_path / "identity.key")
    )
    engine = llm.llm_engine

    stranger = WorkerIdentity()  # a credential for another key is not this server's
    with pytest.raises(ControlError, match="names worker 7 and another key"):
        ask(
            sock,
            "credential",
            credential=issuer.issue_credential(WORKER_ID, 1, stranger.public_key).hex(),
            issuer_public_key=issuer.public_key.hex(),
            worker_id=WORKER_ID,
        )
    reply = ask(
        sock,
        "credential",
        credential=issuer.issue_credential(WORKER_ID, 1, identity.public_key).hex(),
        issuer_public_key=issuer.public_key.hex(),
        worker_id=WORKER_ID,
    )
    assert reply == {"worker_id": WORKER_ID}

    rng = np.random.default_rng(11)
    rights = Rights.WRITE | Rights.READ
    for request_id, bearer in (("own", WORKER_ID), ("other", WORKER_ID + 1)):
        capability = issuer.issue(request_key(request_id), 0, 0, holder_id=0, rights=rights, bearer=bearer)
        engine.add_request(
            request_id,
            {"prompt_token_ids": rng.integers(1, 500, PROMPT_TOKENS).tolist()},
            greedy(2048 - PROMPT_TOKENS, extra_args=params(request_id, capabilities=[capability.hex()])),
        )
    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:

        def durable() -> dict[str, int]:
            return {r: durable_tokens(client, issuer, r) for r in ("own", "other")}

        deadline_s = time.monotonic() + 120.0  # 50 decoded tokens durable: seconds when quiet
        while durable()["own"] < PROMPT_TOKENS + 50 and time.monotonic() < deadline_s:
            for _ in range(10):
                assert engine.has_unfinished_requests(), "the requests ended before the check"
                engine.step()
        held = durable()
        identified = server.ask("stats")["server"]["identified"]
    finally:
        client.close()
        engine.abort_request(["own", "other"])
    assert held["own"] >= PROMPT_TOKENS + 50  # bound to worker 7: taken on its connection
    assert held["other"] == 0  # bound to worker 8: refused on worker 7's connection
    assert identified >= 1  # the connector's connection proved worker 7's credential
