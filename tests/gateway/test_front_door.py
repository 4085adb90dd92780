"""The front door's checks and responses on real sockets: API keys, OpenAI error shapes, bounds,
capacity, and whole requests served by a worker played in this process through the same
Coordinator calls a worker process makes (Run in, token reports out)."""

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

import lumen_core
from lumen_core.cli import main
from lumen_core.gateway.directives import Cancel, Run
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.front_door import FrontDoor
from lumen_core.gateway.http.keys import key_matches, read_api_key_file
from lumen_core.gateway.http.text import Tokenizer, write_byte_tokenizer
from lumen_core.gateway.http.tls import TLSFiles
from lumen_core.gateway.server import GatewayServer

pytestmark = pytest.mark.timeout(120)

KEY = "front-door-test-key-0123456789"
MODEL = "tiny"
GIB = 1 << 30


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def open_door(start_gateway: Callable[..., GatewayServer]) -> Iterator[Callable[..., FrontDoor]]:
    doors: list[FrontDoor] = []

    def open_(
        *, tokenizer: Tokenizer | None = None, workers: int = 0, tls: TLSFiles | None = None, **config: object
    ) -> FrontDoor:
        gateway = start_gateway()
        for worker_id in range(workers):  # registered, no process: the test plays the worker
            gateway.coordinator.register(gateway.now_s(), worker_id, budget_bytes=GIB, holder_address="h")
        door = FrontDoor(
            gateway, FrontDoorConfig(MODEL, 256, **config), frozenset([KEY]), tokenizer=tokenizer, tls=tls
        )
        doors.append(door.start())
        return door

    yield open_
    for door in doors:
        door.stop()


def _post(door: FrontDoor, path: str, body: object, *, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{door.url}{path}", content=content, headers=headers, timeout=10.0)


def test_api_key_file_is_checked_like_the_secret(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# client keys\n{KEY}\n\nanother-key-0123456789abcdef\n")
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match=r"accessible by its owner only \(0600\), got 0o644"):
        read_api_key_file(path)
    os.chmod(path, 0o600)
    assert read_api_key_file(path) == {KEY, "another-key-0123456789abcdef"}
    path.write_text("0123456789abcdef-0123456789\nshort\n")
    with pytest.raises(ValueError, match="line 2 of the API key file must be one key of >= 16 ASCII"):
        read_api_key_file(path)
    path.write_text("# only a comment, padded past sixteen bytes\n")
    with pytest.raises(ValueError, match="the API key file must hold at least one key, got none"):
        read_api_key_file(path)
    keys = frozenset([KEY])
    assert key_matches(keys, f"Bearer {KEY}")
    assert (
        not key_matches(keys, None) and not key_matches(keys, KEY) and not key_matches(keys, f"Bearer {KEY}x")
    )


def test_wrong_or_missing_key_is_401_and_health_needs_none(open_door: Callable[..., FrontDoor]) -> None:
    door = open_door()
    for key in (None, "wrong-key-0123456789abcdef"):
        response = _post(door, "/completions", {"model": MODEL, "prompt": [1]}, key=key)
        assert response.status_code == 401
        assert response.json() == {
            "error": {
                "message": "a valid API key must be given as `Authorization: Bearer <key>`",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    client = openai.OpenAI(base_url=door.url, api_key="wrong-key-0123456789abcdef", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="a valid API key must be given"):
        client.models.list()
    models = openai.OpenAI(base_url=door.url, api_key=KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]
    root = door.url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{root}/metrics").text
    assert "lumen_checkpoint_coverage" in metrics  # the gateway's registry, the front door's counters
    assert 'lumen_http_requests_total{endpoint="/v1/completions",status="401"} 2.0' in metrics


PROMPT = {"model": MODEL, "prompt": [1, 2, 3]}
BAD_REQUESTS = [
    (b"{not json", "the request body must be JSON, got invalid JSON", None),
    (b"[1, 2]", "the request body must be a JSON object, got list", None),
    ({"prompt": [1]}, "`model`: Field required", "model"),
    ({"model": MODEL}, "`prompt`: Field required", "prompt"),
    ({**PROMPT, "logprobs": 2}, "`logprobs`: Extra inputs are not permitted", "logprobs"),
    ({**PROMPT, "max_tokens": "5"}, "`max_tokens`: Input should be a valid integer", "max_tokens"),
    ({**PROMPT, "max_tokens": 0}, "`max_tokens`: Input should be greater than or equal to 1", "max_tokens"),
    (
        {**PROMPT, "max_tokens": 62},
        r"`max_tokens` must be <= 61 \(max_model_len=64 minus 3 prompt",
        "max_tokens",
    ),
    ({**PROMPT, "prompt": []}, "`prompt` must not be empty, got 0 tokens", "prompt"),
    ({**PROMPT, "prompt": [1, 256]}, r"`prompt` must hold token ids in \[0, 256\), got 256", "prompt"),
    ({**PROMPT, "prompt": [-1]}, r"`prompt` must hold token ids in \[0, 256\), got -1", "prompt"),
    ({**PROMPT, "prompt": [1] * 64}, "`prompt` must be under max_model_len=64 tokens, got 64", "prompt"),
    ({**PROMPT, "prompt": "text"}, "`prompt` must be token ids: this gateway has no tokenizer", "prompt"),
    ({**PROMPT, "n": 2}, r"`n` must be 1 \(one choice per request\), got 2", "n"),
    ({**PROMPT, "temperature": 2.5}, "`temperature`: Input should be less than or equal to 2", "temperature"),
    ({**PROMPT, "seed": -1}, "`seed`: Input should be greater than or equal to 0", "seed"),
    ({**PROMPT, "top_p": 0.5}, "`top_p` must be 1: the workers sample the whole distribution", "top_p"),
    ({**PROMPT, "stop": "x"}, r"`stop` needs a tokenizer \(start the gateway with --tokenizer\)", "stop"),
    (
        {**PROMPT, "stream_options": {"include_usage": True}},
        "`stream_options` must be set only with",
        "stream_options",
    ),
    (
        b'{"model": "tiny", "prompt": [' + b"1," * 600 + b"1]}",
        "the request body must be at most 1024 bytes",
        None,
    ),
]


@pytest.mark.parametrize(("body", "message", "param"), BAD_REQUESTS)
def test_bad_requests_are_400_in_openai_shape_and_reach_no_worker(
    open_door: Callable[..., FrontDoor], body: object, message: str, param: str | None
) -> None:
    door = open_door(workers=1, max_model_len=64, max_body_bytes=1024)
    response = _post(door, "/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert re.match(message, error["message"]), error["message"]
    gateway = door.gateway
    assert gateway.coordinator.num_requests == 0 and gateway.coordinator.take_directives(0) == []


def test_unknown_model_is_404_and_chat_without_a_tokenizer_is_400(
    open_door: Callable[..., FrontDoor],
) -> None:
    door = open_door(workers=1)
    client = openai.OpenAI(base_url=door.url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="`model` must be 'tiny'") as missing:
        client.completions.create(model="gpt-4", prompt=[1])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="chat needs a tokenizer with a chat template"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="`stop` must hold at most 4 sequences, got 5"):
        client.completions.create(model=MODEL, prompt=[1], stop=list("abcde"))


def test_no_worker_is_503(open_door: Callable[..., FrontDoor]) -> None:
    response = _post(open_door(), "/completions", PROMPT)
    assert response.status_code == 503 and response.json()["error"]["message"] == "no worker is serving"


class _PlayedWorker:
    """Worker 0 of the gateway, played in this thread: it takes each RUN and reports
    ``output`` as the request's tokens, ``step`` tokens at a time (or, given an ``error``,
    refuses the request with it)."""

    def __init__(self, gateway: GatewayServer, output: bytes, step: int = 2, error: str = "") -> None:
        self.gateway = gateway
        self.output = list(output)
        self.step = step
        self.error = error
        self.cancelled: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        served: dict[int, tuple[int, int, int]] = {}  # request id -> (epoch, position, max)
        coordinator = self.gateway.coordinator
        while not self._stop.wait(0.01):
            with self.gateway.condition:
                for directive in coordinator.take_directives(0):
                    if isinstance(directive, Run):
                        served[directive.request_id] = (directive.epoch, 0, directive.max_new_tokens)
                    elif isinstance(directive, Cancel):
                        served.pop(directive.request_id, None)
                        self.cancelled.append(directive.request_id)
                for request_id, (epoch, position, limit) in list(served.items()):
                    if self.error:
                        now_s = self.gateway.now_s()
                        coordinator.report_tokens(now_s, 0, 1, request_id, epoch, 0, [], error=self.error)
                        del served[request_id]
                        continue
                    end = min(position + self.step, limit)
                    tokens = self.output[position:end]
                    coordinator.report_tokens(
                        self.gateway.now_s(), 0, 1, request_id, epoch, position, tokens, finished=end == limit
                    )
                    served[request_id] = (epoch, end, limit)
                    if end == limit:
                        del served[request_id]
                self.gateway.condition.notify_all()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def test_text_completion_ends_at_a_stop_and_the_request_is_cancelled(
    open_door: Callable[..., FrontDoor], tokenizer: Tokenizer
) -> None:
    door = open_door(tokenizer=tokenizer, workers=1)
    worker = _PlayedWorker(door.gateway, "héllo € STOP and more".encode())
    try:
        client = openai.OpenAI(base_url=door.url, api_key=KEY, max_retries=0, timeout=30.0)
        completion = client.completions.create(model=MODEL, prompt="say €", max_tokens=20, stop=[" STOP"])
        (choice,) = completion.choices
        assert (choice.text, choice.finish_reason) == ("héllo €", "stop")
        assert bytes(choice.token_ids) == "héllo € STOP".encode()
        assert completion.usage.prompt_tokens == len("say €".encode())
        assert completion.usage.completion_tokens == len(choice.token_ids)
        request_id = int(completion.id.removeprefix("cmpl-"))
        deadline = time.monotonic() + 10.0
        while worker.cancelled != [request_id]:  # ended at the stop: the worker is told
            assert time.monotonic() < deadline, worker.cancelled
            time.sleep(0.01)
    finally:
        worker.close()


def test_a_request_its_worker_refuses_is_an_error_naming_the_worker_and_its_message(
    open_door: Callable[..., FrontDoor],
) -> None:
    door = open_door(workers=1)
    worker = _PlayedWorker(door.gateway, b"", error="the server answered 400: prompt too long")
    reason = r"request (\d+) lost: worker 0 refused it: the server answered 400: prompt too long"
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        response = _post(door, "/completions", {**PROMPT, "max_tokens": 8})
        assert response.status_code == 400  # the request's own error: not retried by clients
        error = response.json()["error"]
        assert re.fullmatch(reason, error["message"]) and error["type"] == "invalid_request_error"
        body = {**PROMPT, "max_tokens": 8, "stream": True}
        with httpx.stream(
            "POST", f"{door.url}/completions", json=body, headers=headers, timeout=10.0
        ) as events:
            data = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: ")]
        (event,) = data  # no token came before it, and no [DONE] after it
        assert re.fullmatch(reason, event["error"]["message"])
    finally:
        worker.close()
    assert worker.cancelled == []  # it ended where it was refused: nothing to cancel


def test_chat_streams_a_role_then_content_then_usage(
    open_door: Callable[..., FrontDoor], tokenizer: Tokenizer
) -> None:
    door = open_door(tokenizer=tokenizer, workers=1)
    worker = _PlayedWorker(door.gateway, "a€b—c".encode(), step=1)
    try:
        client = openai.OpenAI(base_url=door.url, api_key=KEY, max_retries=0, timeout=30.0)
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=len("a€b—c".encode()),
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert pieces == ["a", "€", "b", "—", "c"]  # whole characters, each once
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len("a€b—c".encode())
        assert chunks[-1].usage.prompt_tokens == len(b"<|user|>hi\n<|assistant|>")
    finally:
        worker.close()


def test_over_capacity_is_429_and_a_closed_stream_frees_its_place(
    open_door: Callable[..., FrontDoor],
) -> None:
    door = open_door(workers=1, max_concurrent_requests=1)
    gateway = door.gateway
    body = {**PROMPT, "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=10.0) as http:
        with http.stream("POST", f"{door.url}/completions", json=body, headers=headers) as first:
            assert first.status_code == 200
            with gateway.condition:
                (run,) = gateway.coordinator.take_directives(0)
                gateway.coordinator.report_tokens(gateway.now_s(), 0, 1, run.request_id, 1, 0, [7])
                gateway.condition.notify_all()
            lines = first.iter_lines()  # kept: a discarded iterator would close the response
            assert next(line for line in lines if line.startswith("data: "))
            response = _post(door, "/completions", PROMPT)
            assert response.status_code == 429
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
        deadline = time.monotonic() + 10.0
        while not gateway.coordinator.tokens(run.request_id)[1]:  # the client left: cancelled
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gateway.coordinator.take_directives(0) == [Cancel(run.request_id, "client disconnected")]


def test_lumen_gateway_serves_the_front_door_until_sigterm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret_path, keys_path = tmp_path / "cluster.secret", tmp_path / "api.keys"
    assert main(["gateway", "--write-secret", str(secret_path)]) == 0
    keys_path.write_text(KEY + "\n")
    os.chmod(keys_path, 0o600)
    tokenizer_dir = write_byte_tokenizer(tmp_path / "tokenizer")
    base = ["gateway", "--secret-file", str(secret_path), "--port", "0", "--metrics-port", "-1"]
    assert main([*base, "--http-port", "0"]) == 2
    assert "--http-port needs --api-key-file: there are no default client keys" in capsys.readouterr().err
    assert main([*base, "--http-port", "0", "--api-key-file", str(keys_path)]) == 2
    assert "--http-port needs --vocab-size or --tokenizer" in capsys.readouterr().err
    env = dict(os.environ, PYTHONPATH=str(Path(lumen_core.__file__).parent.parent))
    command = [sys.executable, "-m", "lumen_core.cli", *base, "--http-port", "0"]
    command += ["--api-key-file", str(keys_path), "--tokenizer", str(tokenizer_dir), "--model-name", MODEL]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("gateway listening on 127.0.0.1:")
        line = process.stdout.readline()
        assert line.startswith("OpenAI front door on http://127.0.0.1:") and f"(model {MODEL})" in line
        url = line.split()[4]
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=10.0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        with pytest.raises(openai.InternalServerError, match="no worker is serving"):
            client.completions.create(model=MODEL, prompt="hello")  # tokenized, checked, then 503
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            assert stream is not None
            stream.close()


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (0600), made by the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    os.chmod(key, 0o600)
    return cert, key


def test_the_front_door_serves_https_and_refuses_a_key_others_can_read(
    open_door: Callable[..., FrontDoor], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = _self_signed(tmp_path)
    door = open_door(workers=1, tls=TLSFiles(cert, key))
    worker = _PlayedWorker(door.gateway, b"abcdef")
    try:
        assert door.url.startswith("https://127.0.0.1:")
        trusting = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)))
        client = openai.OpenAI(
            base_url=door.url, api_key=KEY, max_retries=0, timeout=30.0, http_client=trusting
        )
        completion = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=6)
        assert bytes(completion.choices[0].token_ids) == b"abcdef"
        untrusting = openai.OpenAI(base_url=door.url, api_key=KEY, max_retries=0, timeout=10.0)
        with pytest.raises(openai.APIConnectionError):  # the certificate is not in its trust store
            untrusting.models.list()
        with pytest.raises(httpx.TransportError):  # plain HTTP gets no answer on the TLS port
            httpx.get(door.url.replace("https://", "http://") + "/models", timeout=10.0)
        trusting.close()
    finally:
        worker.close()
    os.chmod(key, 0o640)
    with pytest.raises(PermissionError, match=r"accessible by its owner only \(0600\), got 0o640"):
        TLSFiles(cert, key)
    os.chmod(key, 0o600)
    with pytest.raises(FileNotFoundError, match="`cert_file` must be a file"):
        TLSFiles(tmp_path / "missing.pem", key)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ValueError, match="must be a PEM certificate chain and its private key"):
        TLSFiles(tmp_path / "junk.pem", key)
    with pytest.raises(TypeError, match="tls must be a TLSFiles, got tuple"):
        FrontDoor(door.gateway, door.config, frozenset([KEY]), tls=(cert, key))  # type: ignore[arg-type]
    secret_path, keys_path = tmp_path / "cluster.secret", tmp_path / "api.keys"
    assert main(["gateway", "--write-secret", str(secret_path)]) == 0
    keys_path.write_text(KEY + "\n")
    os.chmod(keys_path, 0o600)
    base = [
        "gateway",
        "--secret-file",
        str(secret_path),
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--http-port",
        "0",
    ]
    base += ["--api-key-file", str(keys_path), "--vocab-size", "256"]
    assert main([*base, "--tls-cert-file", str(cert)]) == 2
    assert "--tls-cert-file and --tls-key-file go together" in capsys.readouterr().err


def test_front_door_arguments_a_taken_port_and_one_door_per_gateway(
    open_door: Callable[..., FrontDoor], start_gateway: Callable[..., GatewayServer], tokenizer: Tokenizer
) -> None:
    door = open_door()
    config, keys = door.config, frozenset([KEY])
    with pytest.raises(ValueError, match="registry must not hold a front door's counters yet"):
        FrontDoor(door.gateway, config, keys)
    with pytest.raises(OSError, match="Address already in use"):
        FrontDoor(start_gateway(), config, keys, port=door.port).start()
    with pytest.raises(ValueError, match="port must be an int in \\[0, 65535\\], got 70000"):
        FrontDoor(start_gateway(), config, keys, port=70000)
    with pytest.raises(TypeError, match="gateway must be a GatewayServer, got str"):
        FrontDoor("gateway", config, keys)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="api_keys must hold at least one key, got none"):
        FrontDoor(start_gateway(), config, frozenset())
    with pytest.raises(TypeError, match="config must be a FrontDoorConfig, got dict"):
        FrontDoor(start_gateway(), {}, keys)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="config.vocab_size must be >= the tokenizer's 256, got 100"):
        FrontDoor(start_gateway(), FrontDoorConfig(MODEL, 100), keys, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="`vocab_size` must be >= 1, got 0"):
        FrontDoorConfig(MODEL, 0)
    with pytest.raises(ValueError, match="`model_name` must be a non-empty str, got ' '"):
        FrontDoorConfig(" ", 256)


def test_a_stopping_gateway_ends_streams_with_an_error_and_cancels_nothing(
    open_door: Callable[..., FrontDoor],
) -> None:
    door = open_door(workers=1)
    gateway = door.gateway
    body = {**PROMPT, "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(timeout=10.0) as http,
        http.stream("POST", f"{door.url}/completions", json=body, headers=headers) as response,
    ):
        with gateway.condition:
            (run,) = gateway.coordinator.take_directives(0)
            gateway.coordinator.report_tokens(gateway.now_s(), 0, 1, run.request_id, 1, 0, [7])
            gateway.condition.notify_all()
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["token_ids"] == [7]
        stopper = threading.Thread(target=door.stop)
        stopper.start()
        last = json.loads(next(lines).removeprefix("data: "))
        stopper.join(timeout=20.0)
    assert last == {
        "error": {
            "message": "the gateway is stopping",
            "type": "server_error",
            "param": None,
            "code": "service_unavailable",
        }
    }
    assert not stopper.is_alive()
    # the client did not give up: the request runs on for a restarted gateway (or gRPC Watch)
    assert gateway.coordinator.tokens(run.request_id) == ((7,), False, False)
    assert gateway.coordinator.take_directives(0) == []
