"""A client's stream continued after a gateway restart (``POST /v1/resume``, docs/front_door.md):
the restarted gateway adopts the request from its worker's registration, and the client,
with the stream's resume token and the number of tokens it has, gets the rest, each token
once, its text whole across the cut. The worker is played in this process through the
Coordinator calls a worker process makes."""

import json
from collections.abc import Iterator

import httpx
import pytest

from lumen_core.gateway.directives import Run
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.front_door import FrontDoor
from lumen_core.gateway.http.resume import HEADER, KEY_LABEL, ResumeTokens
from lumen_core.gateway.http.text import Tokenizer, write_byte_tokenizer
from lumen_core.gateway.reports import RunningReport
from lumen_core.gateway.server import GatewayServer

pytestmark = pytest.mark.timeout(120)

KEY = "front-door-reconnect-key-0123456789"
MODEL = "tiny"
HEADERS = {"Authorization": f"Bearer {KEY}"}
GIB = 1 << 30
PROMPT = [1, 2, 3]
OUTPUT = list("añ€b".encode())  # 7 byte tokens; the cut falls inside "€"
CUT = 5  # tokens the client has when the gateway goes away


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def _events(response: httpx.Response) -> Iterator[dict]:  # type: ignore[type-arg]
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def _report(gateway: GatewayServer, worker_epoch: int, request_id: int, start: int, end: int) -> None:
    with gateway.condition:
        gateway.coordinator.report_tokens(
            gateway.now_s(),
            0,
            worker_epoch,
            request_id,
            1,
            start,
            OUTPUT[start:end],
            finished=end == len(OUTPUT),
        )
        gateway.condition.notify_all()


def test_a_stream_continues_on_a_restarted_gateway_with_its_resume_token(
    start_gateway, tokenizer: Tokenizer
) -> None:
    config = FrontDoorConfig(MODEL, 256)
    first = start_gateway()
    with first.condition:
        first.coordinator.register(first.now_s(), 0, budget_bytes=GIB, holder_address="h")
    door = FrontDoor(first, config, frozenset([KEY]), tokenizer=tokenizer).start()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": len(OUTPUT), "stream": True}
    with httpx.Client(timeout=10.0) as http:
        with http.stream("POST", f"{door.url}/completions", json=body, headers=HEADERS) as response:
            token = response.headers[HEADER]
            with first.condition:
                (run,) = [d for d in first.coordinator.take_directives(0) if isinstance(d, Run)]
            request_id = run.request_id
            _report(first, 1, request_id, 0, CUT)
            events = _events(response)
            got, text = [], ""
            while len(got) < CUT:
                choice = next(events)["choices"][0]
                got += choice["token_ids"]
                text += choice["text"]
            door.stop()  # the gateway goes away mid-stream: an error event ends the stream
            assert [e["error"]["message"] for e in events] == ["the gateway is stopping"]
        first.stop(grace_s=0.1)
        assert (got, text) == (OUTPUT[:CUT], "añ")  # the half of "€" is held back

        # The restarted gateway (same secret) learns the request from its worker, which had
        # decoded one token more meanwhile.
        second = start_gateway()
        with second.condition:
            report = RunningReport(request_id, 1, tuple(PROMPT), tuple(OUTPUT[: CUT + 1]), len(OUTPUT), 0)
            epoch = second.coordinator.register(
                second.now_s(), 0, budget_bytes=GIB, holder_address="h", running=[report]
            ).epoch
        door = FrontDoor(second, config, frozenset([KEY]), tokenizer=tokenizer).start()
        try:
            resume = {"id": f"cmpl-{request_id}", "position": CUT, "resume_token": token}
            resume["stream_options"] = {"include_usage": True}
            with http.stream("POST", f"{door.url}/resume", json=resume, headers=HEADERS) as response:
                assert response.status_code == 200 and response.headers[HEADER] == token
                _report(second, epoch, request_id, CUT + 1, len(OUTPUT))
                events = list(_events(response))
            chunks = [e["choices"][0] for e in events if e["choices"]]
            assert [t for c in chunks for t in c["token_ids"]] == OUTPUT[CUT:]  # none again, none missing
            assert text + "".join(c["text"] for c in chunks) == "añ€b"
            assert chunks[-1]["finish_reason"] == "length" and events[0]["id"] == f"cmpl-{request_id}"
            usage = events[-1]["usage"]  # the whole request's, counted once
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), len(OUTPUT))

            def refused(**change: object) -> httpx.Response:
                return http.post(f"{door.url}/resume", json={**resume, **change}, headers=HEADERS)

            other = ResumeTokens(second.derive_key(KEY_LABEL)).token(request_id + 1)
            assert refused(resume_token=other).status_code == 403  # another request's token
            assert refused(resume_token="0" * 64).status_code == 403
            unknown = refused(id=f"cmpl-{request_id + 1}", resume_token=other)
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "id"
            assert refused(position=len(OUTPUT) + 1).json()["error"]["param"] == "position"
            assert refused(id="cmpl-x").status_code == 400
            assert http.post(f"{door.url}/resume", json=resume).status_code == 401  # no API key
            with pytest.raises(ValueError, match="`label` must be non-empty bytes"):
                second.derive_key(b"")
        finally:
            door.stop()


def test_a_token_of_another_cluster_secret_is_refused() -> None:
    ours = ResumeTokens(b"\x01" * 32)
    theirs = ResumeTokens(b"\x02" * 32)
    assert ours.matches(7, ours.token(7)) and not ours.matches(7, theirs.token(7))
    assert not ours.matches(8, ours.token(7))
    with pytest.raises(ValueError, match="`key` must be 32 bytes"):
        ResumeTokens(b"short")
