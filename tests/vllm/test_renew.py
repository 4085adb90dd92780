"""Capability renewal in a real engine: a request whose capabilities are renewed over the
connector's control channel (control ``renew``, what ``lumen agent`` sends on the gateway's
RENEW) goes on checkpointing past their first expiry; its twin, not renewed, stops there."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import controlled_llm, durable_tokens, greedy, params

from lumen_core.auth import CapabilityIssuer, Rights, read_issuer_key_file
from lumen_core.integrations.vllm.control import ControlError, ask
from lumen_core.stream import request_key
from lumen_core.transport import Client

TTL_S = 2.0  # the capabilities the requests start with
PROMPT_TOKENS = 100


@pytest.mark.timeout(600)
def test_a_renewed_request_streams_past_its_first_capabilities_expiry(
    tmp_path: Path,
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    server = holder()
    llm, sock = controlled_llm(tmp_path, secret_file, issuer_key_file, server.port)
    engine = llm.llm_engine
    short = CapabilityIssuer(read_issuer_key_file(issuer_key_file), ttl_s=TTL_S)
    rng = np.random.default_rng(7)
    issued_s = time.monotonic()
    rights = Rights.WRITE | Rights.READ
    for request_id in ("renewed", "expired"):
        capability = short.issue(request_key(request_id), 0, 0, holder_id=0, rights=rights)
        engine.add_request(
            request_id,
            {"prompt_token_ids": rng.integers(1, 500, PROMPT_TOKENS).tolist()},
            greedy(2048 - PROMPT_TOKENS, extra_args=params(request_id, capabilities=[capability.hex()])),
        )
    holders = [{"address": "127.0.0.1", "port": server.port}]
    fresh = issuer.issue(request_key("renewed"), 0, 0, holder_id=0, rights=rights)
    renewed = ask(sock, "renew", request_id="renewed", epoch=0, holders=holders, capabilities=[fresh.hex()])
    assert renewed == {"request_id": "renewed", "known": True}
    stale = ask(sock, "renew", request_id="renewed", epoch=1, holders=holders, capabilities=[fresh.hex()])
    assert stale["known"] is False  # another epoch: not this request's
    with pytest.raises(ControlError, match=r"`capabilities` must be a list of one capability per holder"):
        ask(sock, "renew", request_id="renewed", epoch=0, holders=holders, capabilities=[])

    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:

        def durable() -> dict[str, int]:
            return {r: durable_tokens(client, issuer, r) for r in ("renewed", "expired")}

        def step_until(t_s: float) -> None:
            while time.monotonic() - issued_s < t_s:
                assert engine.has_unfinished_requests(), "the requests ended before the check"
                engine.step()

        step_until(TTL_S + 1.0)  # past the expiry, and the streamer's give-up on the refusals
        first = durable()
        # 50 tokens more for the renewed one: 2 s when quiet, longer on a loaded machine.
        deadline_s = time.monotonic() + 60.0
        while durable()["renewed"] <= first["renewed"] + 50 and time.monotonic() < deadline_s:
            for _ in range(10):
                assert engine.has_unfinished_requests(), "the requests ended before the check"
                engine.step()
        last = durable()
    finally:
        client.close()
        engine.abort_request(["renewed", "expired"])
    assert first["expired"] >= PROMPT_TOKENS  # it streamed until its capability expired ...
    assert last["expired"] == first["expired"], (first, last)  # ... and not after
    assert last["renewed"] > first["renewed"] + 50, (first, last)  # the renewed one streams on
