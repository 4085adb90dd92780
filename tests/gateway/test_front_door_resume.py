"""What a move does to a stream, per engine (docs/front_door.md, "Exactness on resume"): over
vLLM servers a moved seeded stream at temperature > 0 is marked ``resumed_inexact`` from the
move on; greedy streams and reference-engine workers are never marked. Workers are played in
this process through the Coordinator calls a worker process makes."""

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from lumen_core.gateway.directives import Resume, Run
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.front_door import FrontDoor
from lumen_core.gateway.server import GatewayServer

pytestmark = pytest.mark.timeout(120)

KEY = "front-door-resume-key-0123456789"
MODEL = "tiny"
GIB = 1 << 30


@pytest.fixture
def open_door(start_gateway: Callable[..., GatewayServer]) -> Iterator[Callable[..., FrontDoor]]:
    doors: list[FrontDoor] = []

    def open_(engine: str) -> FrontDoor:
        gateway = start_gateway()
        for worker_id in range(2):  # registered, no process: the test plays both workers
            gateway.coordinator.register(gateway.now_s(), worker_id, budget_bytes=GIB, holder_address="h:1")
        door = FrontDoor(gateway, FrontDoorConfig(MODEL, 256, engine=engine), frozenset([KEY]))
        doors.append(door.start())
        return door

    yield open_
    for door in doors:
        door.stop()


def _report(door: FrontDoor, worker_id: int, worker_epoch: int, request_id: int, epoch: int,
            start: int, tokens: list[int], *, finished: bool = False) -> None:  # fmt: skip
    gateway = door.gateway
    with gateway.condition:
        gateway.coordinator.report_tokens(
            gateway.now_s(), worker_id, worker_epoch, request_id, epoch, start, tokens, finished=finished
        )
        gateway.condition.notify_all()


def _stream_across_a_move(door: FrontDoor, temperature: float) -> list[dict]:
    """A stream of 6 tokens: 3 from the worker it was admitted on, which then fails, 3 from
    the one it moves to. Returns its chunks' choices."""
    gateway, coordinator = door.gateway, door.gateway.coordinator
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 6, "temperature": temperature, "seed": 5,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    choices = []
    with (
        httpx.Client(timeout=10.0) as http,
        http.stream("POST", f"{door.url}/completions", json=body, headers=headers) as response,
    ):
        lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        with gateway.condition:
            served = next(w for w in (0, 1) if coordinator.take_directives(w))
        (request_id,) = coordinator.monitor.running_on(served)
        _report(door, served, 1, request_id, 1, 0, [7, 8, 9])
        choices.append(json.loads(next(lines))["choices"][0])
        with gateway.condition:
            coordinator.fail(gateway.now_s(), [served], cause="test: killed")
            (resume,) = [d for d in coordinator.take_directives(1 - served) if isinstance(d, (Run, Resume))]
        assert isinstance(resume, Resume) and resume.output_token_ids == (7, 8, 9)
        assert resume.sampling.temperature == temperature  # the move keeps the sampling
        _report(door, 1 - served, 1, request_id, resume.epoch, 3, [10, 11, 12], finished=True)
        for data in lines:
            if data != "[DONE]":
                choices.append(json.loads(data)["choices"][0])
    assert [t for c in choices for t in c["token_ids"]] == [7, 8, 9, 10, 11, 12]
    return choices


def test_a_moved_seeded_stream_over_vllm_is_marked_from_the_move_on(
    open_door: Callable[..., FrontDoor],
) -> None:
    choices = _stream_across_a_move(open_door("vllm"), 0.8)
    assert "resumed_inexact" not in choices[0]  # sent before the move: the failure-free run's
    assert all(c["resumed_inexact"] is True for c in choices[1:])


@pytest.mark.parametrize(("engine", "temperature"), [("vllm", 0.0), ("reference", 0.8), ("reference", 0.0)])
def test_greedy_and_position_keyed_draws_are_never_marked(
    open_door: Callable[..., FrontDoor], engine: str, temperature: float
) -> None:
    choices = _stream_across_a_move(open_door(engine), temperature)
    assert not any("resumed_inexact" in c for c in choices)


def test_the_engine_is_checked() -> None:
    with pytest.raises(ValueError, match=r"`engine` must be one of \('reference', 'vllm'\), got 'sglang'"):
        FrontDoorConfig(MODEL, 256, engine="sglang")


@pytest.mark.parametrize(
    "field",
    [
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_tokens": 4},
        {"logprobs": 1},
        {"response_format": {"type": "json_object"}},
        {"guided_regex": "[a-z]+"},
        {"n": 2},
    ],
)
def test_what_a_resume_would_change_is_refused_before_admission(
    open_door: Callable[..., FrontDoor], field: dict
) -> None:
    """Penalties and min_tokens count output tokens (a resume makes them prompt), logprobs and
    guided decoding are not kept across a move, n > 1 is not served: each is a 400, never a
    silent change (docs/front_door.md)."""
    door = open_door("vllm")
    body = {"model": MODEL, "prompt": [1, 2, 3], **field}
    response = httpx.post(
        f"{door.url}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=10.0
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == next(iter(field))
    with door.gateway.condition:
        assert door.gateway.coordinator.num_requests == 0  # nothing reached a worker
