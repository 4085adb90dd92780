"""The agent's pieces that need no vLLM: the request body a RUN or RESUME becomes, the
server's load read from its metrics, the KV record size of a model, the vLLM demo's token
counts, the checks of ``AgentConfig`` and ``lumen agent``, how a server is started (beside
gRPC channels, dying with the agent), and, attached to a plain HTTP server standing in for
vLLM's (``/health``, ``/metrics``, ``/v1/completions``), the exit report and a fenced agent's
linger (its holder kept up, registered again with the next gateway)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from lumen_core.auth import CapabilityIssuer
from lumen_core.cli import main
from lumen_core.connector import ConnectorCore, StepTokens, StreamGrant
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import HolderGrant, Resume, Run, Sampling
from lumen_core.gateway.errors import GatewayError
from lumen_core.gateway.server import GatewayServer
from lumen_core.integrations.vllm.control import ControlServer
from lumen_core.policy.events import RecoveryAction
from lumen_core.testing import make_paged_cache, wait_until
from lumen_core.worker.agent import (
    Agent,
    AgentConfig,
    record_bytes_of,
    server_load,
    start_dying_with_parent,
)
from lumen_core.worker.exit_watch import ExitWatch
from lumen_core.worker.exits import EXIT_FENCED, EXIT_OK, EXIT_SERVER_EXITED
from lumen_core.worker.upstream import completion_body

CAP_A, CAP_B = bytes(range(128)), bytes(128)
HOLDERS = (HolderGrant(1, "10.0.0.1:7001", (CAP_A,)), HolderGrant(2, "10.0.0.2:7002", (CAP_B, CAP_A)))


def _resume(action: RecoveryAction, source: HolderGrant | None, **kw: object) -> Resume:
    fields = {"max_new_tokens": 10, "sampling": Sampling(0.8, 2**63 + 5)} | kw
    return Resume(42, 3, action, HOLDERS, source, (1, 2, 3), (9, 8), **fields)  # type: ignore[arg-type]


def test_a_run_streams_to_its_holders_with_the_gateways_key_and_capabilities() -> None:
    body, start = completion_body(Run(42, 1, HOLDERS, (1, 2, 3), 16), "m")
    assert start == 0
    assert (body["model"], body["prompt"], body["max_tokens"], body["temperature"]) == (
        "m",
        [1, 2, 3],
        16,
        0.0,
    )
    assert body["stream"] and body["return_token_ids"] and body["ignore_eos"] and "seed" not in body
    assert body["kv_transfer_params"] == {
        "lumen": {
            "request_id": "42",
            "key": 42,
            "epoch": 1,
            "holders": [
                {"address": "10.0.0.1", "port": 7001, "holder_id": 1},
                {"address": "10.0.0.2", "port": 7002, "holder_id": 2},
            ],
            "capabilities": [CAP_A.hex(), CAP_B.hex()],  # shard 0's: a server streams one shard
        }
    }


def test_a_resume_sends_the_tokens_so_far_shrinks_max_tokens_and_restores_at_its_epoch() -> None:
    source = HolderGrant(2, "10.0.0.2:7002", (CAP_B,))
    body, start = completion_body(_resume(RecoveryAction.REMOTE_RESTORE, source), "m")
    assert (start, body["prompt"], body["max_tokens"]) == (2, [1, 2, 3, 9, 8], 8)
    assert body["seed"] == 5  # the seed as vLLM's signed 64 bits take it
    restore = body["kv_transfer_params"]["lumen"]["restore"]
    assert restore == {
        "address": "10.0.0.2",
        "port": 7002,
        "holder_id": 2,
        "epoch": 3,
        "capability": CAP_B.hex(),
    }
    local, _ = completion_body(_resume(RecoveryAction.RESTORE, source), "m")
    assert local["kv_transfer_params"]["lumen"]["restore"] == restore
    prefill, _ = completion_body(_resume(RecoveryAction.REPREFILL, None), "m")
    assert "restore" not in prefill["kv_transfer_params"]["lumen"]


def test_a_resume_with_nothing_left_is_refused() -> None:
    with pytest.raises(ValueError, match="`max_new_tokens` must exceed the 2 tokens sent, got 2"):
        completion_body(_resume(RecoveryAction.REPREFILL, None, max_new_tokens=2), "m")


def test_a_server_reads_as_exiting_once_killed_before_it_is_reaped(tmp_path: Path) -> None:
    """The supervisor's early look: a live process is not exiting (whatever its name holds),
    a killed one not yet reaped is (a zombie here; PF_EXITING while its memory is torn down),
    and so is one that is gone; a closed watch refuses to say."""
    odd = tmp_path / "a (b) c"
    odd.symlink_to(sys.executable)  # a command name with spaces and parentheses
    proc = subprocess.Popen([str(odd), "-c", "import time; time.sleep(60)"])
    with ExitWatch(proc.pid) as watch, ExitWatch(os.getpid()) as own:
        try:
            assert not watch.exiting() and not own.exiting()
            proc.kill()
            # Exiting (PF_EXITING during its teardown, then a zombie), not reaped: no wait() yet.
            assert wait_until(watch.exiting)
            assert wait_until(lambda: proc.poll() is not None)
        finally:
            proc.kill()
            proc.wait()
        assert watch.exiting()  # reaped: gone
    with pytest.raises(ValueError, match="closed"):
        watch.exiting()  # a closed watch does not read as "still running"
    assert ExitWatch(proc.pid).exiting()  # gone before it was watched


def test_the_load_is_read_from_vllms_metrics() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
"""
    assert server_load(text) == (5, 4)
    assert server_load("") == (0, 0)


def _model(tmp_path: Path, **config: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_record_bytes_follow_the_models_attention_shape(tmp_path: Path) -> None:
    model = _model(tmp_path, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert record_bytes_of(model, "float32") == 2 * 2 * 2 * 32 * 4
    model = _model(tmp_path, num_hidden_layers=3, num_attention_heads=8, hidden_size=512)  # MHA, no head_dim
    assert record_bytes_of(model, "bfloat16") == 3 * 2 * 8 * 64 * 2
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        record_bytes_of(model, "int8")
    with pytest.raises(ValueError, match="must name the attention shape, missing 'num_hidden_layers'"):
        record_bytes_of(_model(tmp_path, num_attention_heads=8), "float32")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"worker_id": -1}, "`worker_id` must be an int >= 0, got -1"),
        ({"model": "/nonexistent"}, "`model` must be a model directory with a config.json"),
        ({"workdir": "/nonexistent"}, "`workdir` must be an existing directory"),
        ({"dtype": "int8"}, "`dtype` must be one of"),
        ({"port": 70000}, r"`port` must be in \[0, 65535\], got 70000"),
        ({"kv_space_gib": 0}, "`kv_space_gib` must be a number > 0, got 0"),
        ({"budget_bytes": -1}, "`budget_bytes` must be >= 0, got -1"),
        ({"reserve_bytes": 2 << 30}, r"`reserve_bytes` must be in \[0, budget_bytes\], got 2147483648"),
        ({"holder_linger_s": -1}, "`holder_linger_s` must be a finite number >= 0, got -1"),
        ({"holder_linger_s": float("inf")}, "`holder_linger_s` must be a finite number >= 0, got inf"),
        ({"server_url": "http://h:1", "server_args": ("--x",)}, "`server_args` must be empty when attaching"),
    ],
)
def test_agent_config_is_checked(tmp_path: Path, fields: dict, match: str) -> None:
    model = _model(tmp_path, num_hidden_layers=1, num_attention_heads=1, hidden_size=8)
    base = {
        "worker_id": 0,
        "gateway": "h:1",
        "secret_file": "s",
        "model": str(model),
        "workdir": str(tmp_path),
    }
    with pytest.raises(ValueError, match=match):
        AgentConfig(**(base | fields))
    assert AgentConfig(**base).socket_path == str(tmp_path / "control-0.sock")


def test_lumen_agent_reports_bad_arguments_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["agent", "--worker-id", "0", "--gateway", "127.0.0.1:1", "--secret-file", str(tmp_path / "none"),
            "--model", str(tmp_path), "--workdir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    assert "`model` must be a model directory with a config.json" in capsys.readouterr().err


def test_servers_start_beside_live_grpc_channels() -> None:
    """The agent holds gRPC channels when it starts its server. A fork of such a process
    (what a preexec_fn makes subprocess do) runs gRPC's fork handlers, and the child crashed
    before its exec in 3 to 5 of 40 starts here; 40 starts in a row must all run."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10.0)  # its poller threads run
        outcomes = []
        for _ in range(40):
            proc = start_dying_with_parent([sys.executable, "-c", "print('up')"], stdout=subprocess.PIPE)
            out, _ = proc.communicate(timeout=60.0)
            outcomes.append((proc.returncode, out))
        assert outcomes == [(0, b"up\n")] * 40
    finally:
        channel.close()
        server.stop(grace=None)


def _state(pid: int) -> str:
    """The process's state letter (``Z`` a zombie), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return ""


def test_a_started_server_dies_with_its_agent() -> None:
    """SIGKILL of the agent (its process here, started like ``lumen agent``) takes the server
    down with it: no server runs unsupervised."""
    agent_code = (
        "import sys, time\n"
        "from lumen_core.worker.agent import start_dying_with_parent\n"
        "server = start_dying_with_parent([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    agent = subprocess.Popen([sys.executable, "-c", agent_code], stdout=subprocess.PIPE, text=True)
    server_pid = 0
    try:
        assert agent.stdout is not None
        server_pid = int(agent.stdout.readline())
        deadline = time.monotonic() + 60.0
        # Past its first program (it asked for the signal), now the server itself.
        while b"prctl" in Path(f"/proc/{server_pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        agent.kill()
        agent.wait(timeout=10.0)
        deadline = time.monotonic() + 10.0
        while _state(server_pid) not in ("", "Z"):
            assert time.monotonic() < deadline, "the server outlived its agent"
            time.sleep(0.01)
    finally:
        agent.kill()
        agent.wait(timeout=10.0)
        agent.stdout.close()
        if server_pid and _state(server_pid) not in ("", "Z"):
            os.kill(server_pid, signal.SIGKILL)


class _StandIn(ThreadingHTTPServer):
    """The stand-in server; ``hung_up`` is set once the agent closed a stream held open."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ServerEndpoints)
        self.hung_up = threading.Event()
        self.epochs: list[int] = []  # of the decoding requests (first prompt token 201) it got


class _ServerEndpoints(BaseHTTPRequestHandler):
    """What the agent polls on a vLLM server: ``/health`` (200) and ``/metrics`` (no load);
    ``/v1/completions`` answers the HTTP status a request's first prompt token names, with
    an error body in vLLM's shape (tests/vllm/test_refusal.py has vLLM's own refusal), or for
    200 opens the stream and sends nothing until the agent closes it (a request decoding).
    A first prompt token 202 breaks its stream off unanswered; 201 decodes: token
    ``10 + i % 50`` at each sequence index ``i``; at the request's first epoch it fails after
    two tokens with vLLM's mid-stream error event (what vLLM writes when generation fails
    inside the engine). 203 decodes the same tokens one event each, 20 a second, until the
    agent closes the stream (``hung_up``)."""

    server: _StandIn

    def do_GET(self) -> None:
        body = b"vllm:num_requests_running 0.0\n" if self.path == "/metrics" else b""
        self._answer(200, body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = request["prompt"][0]
        if status == 201:
            self._decode(request)
            return
        if status == 203:
            self._decode_slowly(request)
            return
        if status == 202:  # the stream breaks off: headers, then the connection closes
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.close_connection = True
            return
        if status == 200:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.flush()
            self.connection.settimeout(60.0)
            if self.rfile.read(1) == b"":  # the agent closed the connection
                self.server.hung_up.set()
            return
        error = {
            "message": f"stand-in error {status}",
            "type": "BadRequestError",
            "param": None,
            "code": status,
        }
        self._answer(status, json.dumps({"error": error}).encode())

    def _decode(self, request: dict) -> None:  # type: ignore[type-arg]
        epoch = request["kv_transfer_params"]["lumen"]["epoch"]
        self.server.epochs.append(epoch)
        start, count = len(request["prompt"]), request["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        tokens = [10 + i % 50 for i in range(start, start + count)]
        if epoch == 1:
            events = [{"choices": [{"token_ids": tokens[:2], "finish_reason": None}]}]
            events.append({"error": {"message": "Internal server error", "type": "InternalServerError",
                                     "param": None, "code": 500}})  # fmt: skip
        else:
            events = [{"choices": [{"token_ids": tokens, "finish_reason": "length"}]}]
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

    def _decode_slowly(self, request: dict) -> None:  # type: ignore[type-arg]
        self.server.epochs.append(request["kv_transfer_params"]["lumen"]["epoch"])
        start, count = len(request["prompt"]), request["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.close_connection = True
        try:
            for i in range(start, start + count):
                finish = "length" if i == start + count - 1 else None
                event = {"choices": [{"token_ids": [10 + i % 50], "finish_reason": finish}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            self.server.hung_up.set()

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass  # the agent polls every 0.5 s: not worth a line each


@contextlib.contextmanager
def _serving() -> Iterator[_StandIn]:
    httpd = _StandIn()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5.0)


@pytest.fixture
def server() -> Iterator[_StandIn]:
    with _serving() as httpd:
        yield httpd


def test_close_waits_for_the_supervisors_exit_report_so_the_gateway_gets_it(
    tmp_path: Path,
    secret: bytes,
    secret_file: Path,
    ucx_module: None,
    server: ThreadingHTTPServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The supervisor ends the agent, then reports the exit; ``close`` (what ``lumen agent``
    runs once the agent ended) must not close the gateway client while that report is out:
    a cancelled report leaves the gateway to notice the exit at lease expiry. A gateway that
    answers late (its lock held here) keeps the report out while ``close`` runs."""
    model = _model(tmp_path, num_hidden_layers=1, num_attention_heads=1, hidden_size=8)
    caplog.set_level(logging.WARNING, logger="lumen_core.worker.agent")
    # No heartbeat falls due while the gateway is held: only the exit report is out then.
    gateway = GatewayServer(GatewayConfig(lease_s=60.0, heartbeat_s=30.0), secret, port=0).start()
    agent: Agent | None = None
    closing: threading.Thread | None = None
    try:
        config = AgentConfig(
            worker_id=0,
            gateway=gateway.address,
            secret_file=str(secret_file),
            model=str(model),
            workdir=str(tmp_path),
            server_url=f"http://127.0.0.1:{server.server_address[1]}",
            tls="tcp",
        )
        agent = Agent(config).start()
        with gateway.condition:
            server.shutdown()
            server.server_close()  # the server is gone: its health checks fail from now on
            assert agent.wait(timeout_s=10.0) == EXIT_SERVER_EXITED
            closing = threading.Thread(target=agent.close)
            closing.start()
            closing.join(timeout=1.0)
            assert closing.is_alive(), "close returned while the exit report was still out"
        closing.join(timeout=10.0)
        assert not closing.is_alive()
        assert "could not report the exit" not in caplog.text
        (failure,) = gateway.coordinator.failures
        assert failure.worker_ids == (0,)
        assert failure.cause.startswith("process exited: the vLLM server at")
    finally:
        if agent is not None and closing is None:  # not closed by the test's thread
            agent.close()
        gateway.stop(grace_s=0.1)


def test_a_request_the_server_refuses_ends_at_its_client_and_one_it_fails_is_moved(
    tmp_path: Path, secret: bytes, secret_file: Path, ucx_module: None, server: _StandIn
) -> None:
    """A 4xx is the server's word on the request: reported, it ends at the client
    (INVALID_ARGUMENT). A 5xx is the server failing it while alive: reported as failed, so
    the gateway moves it; with no other worker, it is lost (UNAVAILABLE). A broken
    connection is the server's own failure: not reported, the request waits for the
    supervisor's exit report and the failover that resumes it elsewhere."""
    gateway = GatewayServer(GatewayConfig(policy="FC"), secret, port=0).start()
    client = GatewayClient(gateway.address, secret)
    agent: Agent | None = None
    try:
        agent = Agent(_agent_config(tmp_path, secret_file, gateway.address, server)).start()
        refused = (
            r"INVALID_ARGUMENT: request 1 lost: worker 0 refused it: "
            r"the server answered 400: .*stand-in error 400"
        )
        with pytest.raises(GatewayError, match=refused):
            list(client.submit([400, 1, 2], 4, timeout_s=20.0))
        failed = (
            r"UNAVAILABLE: request 2 lost: worker 0 failed it: the server answered 500: .*stand-in error 500"
        )
        with pytest.raises(GatewayError, match=failed):
            list(client.submit([500, 1, 2], 4, timeout_s=20.0))
        assert agent.stats()["upstream_refused"] == 1 and agent.stats()["upstream_failed"] == 1
        with gateway.condition:
            assert gateway.coordinator.refused(1) and not gateway.coordinator.refused(2)
        broken = client.submit([202, 1, 2], 4, timeout_s=20.0)
        request_id = next(broken).request_id
        assert wait_until(lambda: agent.stats()["upstream_errors"] == 3)  # type: ignore[union-attr]
        with gateway.condition:
            assert gateway.coordinator.tokens(request_id) == ((), False, False)  # still running
        broken.close()
    finally:
        if agent is not None:
            agent.close()
        client.close()
        gateway.stop(grace_s=0.1)


def test_a_request_its_server_fails_mid_stream_continues_on_another_worker(
    tmp_path: Path, secret: bytes, secret_file: Path, ucx_module: None, server: _StandIn
) -> None:
    """vLLM's mid-stream error event (a 500 in the stream, the server alive): the gateway moves
    the request, and the client's stream continues on the other worker with no token
    repeated or missing."""
    gateway = GatewayServer(GatewayConfig(policy="FC"), secret, port=0).start()
    client = GatewayClient(gateway.address, secret)
    agents: list[Agent] = []
    try:
        with _serving() as other:
            for config in _agent_configs(tmp_path, secret_file, gateway.address, (server, other)):
                agents.append(Agent(config).start())
            prompt = [201, 1, 2]
            started_s = time.monotonic()
            tokens = [t for piece in client.submit(prompt, 12, timeout_s=20.0) for t in piece.token_ids]
            assert tokens == [10 + i % 50 for i in range(len(prompt), len(prompt) + 12)]
            assert sorted(server.epochs + other.epochs) == [1, 2]  # failed at epoch 1, moved once
            assert sum(a.stats()["upstream_failed"] for a in agents) == 1
            # The RESUME's timing, on the host's clock: received, then its first token.
            (timing,) = [t for a in agents for t in a.stats()["resumes"]]
            assert (timing["epoch"], timing["restoring"]) == (2, False) and 0 < timing["position"] < 12
            assert started_s < timing["received_s"] < timing["first_token_s"] < time.monotonic()
    finally:
        for agent in agents:
            agent.close()
        client.close()
        gateway.stop(grace_s=0.1)


def test_a_drained_agent_keeps_its_checkpoints_and_its_request_continues_on_another_worker(
    tmp_path: Path, secret: bytes, secret_file: Path, ucx_module: None, server: _StandIn
) -> None:
    """FLUSH: the connector is told to flush, then to keep its checkpoints, before the relay is
    closed; the heartbeat says flushed, the gateway moves the request to the other worker,
    where the client's stream continues with no token repeated or missing, and STOP ends the
    agent cleanly (the gateway retires it)."""
    gateway = GatewayServer(GatewayConfig(policy="FC"), secret, port=0).start()
    client = GatewayClient(gateway.address, secret)
    commands: list[tuple[str, bool]] = []  # what the connector heard, and whether the relay was closed yet

    def handle(request: dict) -> dict:  # type: ignore[type-arg]  # the connector's control channel
        commands.append((request["command"], server.hung_up.is_set()))
        if request["command"] == "flush":
            return {"flushed": True, "durable_lag_tokens": 0}
        return {"streaming": 1, "applied": True}

    agents: list[Agent] = []
    connector: ControlServer | None = None
    try:
        with _serving() as other:
            configs = _agent_configs(tmp_path, secret_file, gateway.address, (server, other))
            connector = ControlServer(configs[0].socket_path, handle)
            agents.append(Agent(configs[0]).start())
            prompt = [203, 1, 2]
            stream = client.submit(prompt, 40, timeout_s=30.0)  # on worker 0, the only one yet
            first = next(stream)
            agents.append(Agent(configs[1]).start())
            assert client.drain(0, deadline_s=30.0).state == "flushing"
            tokens = list(first.token_ids) + [t for piece in stream for t in piece.token_ids]
            assert tokens == [10 + i % 50 for i in range(len(prompt), len(prompt) + 40)]
            assert agents[0].wait(timeout_s=10.0) == EXIT_OK and agents[0].reason.startswith("drained")
            assert commands == [("flush", False), ("abandon", False)]
            assert agents[0].stats()["drained"] == 1 and (server.epochs, other.epochs) == ([1], [2])
            drain = client.drain(0, deadline_s=30.0)
            assert (drain.state, drain.num_moved, drain.num_reprefilled) == ("stopped", 1, 0)
            agents[0].close()  # its exit report retires it: no failure
            with gateway.condition:
                assert gateway.coordinator.failures == ()
    finally:
        for agent in agents:
            agent.close()
        if connector is not None:
            connector.close()
        client.close()
        gateway.stop(grace_s=0.1)


def test_an_agent_registers_what_it_relays_with_a_restarted_gateway_and_the_stream_goes_on(
    tmp_path: Path, secret: bytes, secret_file: Path, ucx_module: None, server: _StandIn
) -> None:
    """The gateway restarts on its address within the lease: the agent registers again with
    each relay's epoch, prompt and outputs (``Agent.running``), the new gateway adopts the
    request, the relay goes on (the server is not asked again), and a client watching the
    request on the new gateway gets the rest, each token once."""
    config = GatewayConfig(policy="FC", lease_s=10.0, heartbeat_s=0.1)
    gateway = GatewayServer(config, secret, host="127.0.0.1", port=0).start()
    port = int(gateway.address.rsplit(":", 1)[1])
    agent: Agent | None = None
    successor = None
    try:
        agent = Agent(_agent_config(tmp_path, secret_file, gateway.address, server)).start()
        prompt, count = [203, 1, 2], 60
        with GatewayClient(gateway.address, secret) as client:
            stream = client.submit(prompt, count, timeout_s=30.0)
            request_id = next(stream).request_id
            got: list[int] = []
            while len(got) < 10:
                got += next(stream).token_ids
            gateway.stop(grace_s=0.1)
            with pytest.raises(GatewayError, match="gateway is stopping|UNAVAILABLE"):
                for chunk in stream:
                    got += chunk.token_ids
        successor = GatewayServer(config, secret, host="127.0.0.1", port=port).start()

        def adopted() -> bool:
            with successor.condition:
                return successor.coordinator.has_request(request_id)

        # The gateway adopts the request before the agent has read the register reply.
        assert wait_until(lambda: adopted() and agent.client.epoch == 2)  # type: ignore[union-attr]
        with GatewayClient(successor.address, secret) as client:
            rest = [
                t for chunk in client.watch(request_id, len(got), timeout_s=30.0) for t in chunk.token_ids
            ]
        assert got + rest == [10 + i % 50 for i in range(len(prompt), len(prompt) + count)]
        assert server.epochs == [1] and agent.stats()["served"] == 1  # one relay, never broken
        stats = agent.stats()
        assert stats["tokens"] == count and 1 <= stats["token_reports"] <= count
    finally:
        if agent is not None:
            agent.close()
        gateway.stop(grace_s=0.1)
        if successor is not None:
            successor.stop(grace_s=0.1)


def _agent_configs(
    tmp_path: Path, secret_file: Path, gateway: str, servers: tuple[_StandIn, ...]
) -> list[AgentConfig]:
    """One agent per stand-in server, worker ids 0.., each in its own work directory."""
    configs = []
    for worker_id, stand_in in enumerate(servers):
        workdir = tmp_path / f"w{worker_id}"
        workdir.mkdir()
        configs.append(_agent_config(workdir, secret_file, gateway, stand_in, worker_id=worker_id))
    return configs


LINGER_CONFIG = GatewayConfig(policy="FC", lease_s=1.0, heartbeat_s=0.1)


def _agent_config(
    tmp_path: Path,
    secret_file: Path,
    gateway: str,
    server: _StandIn,
    linger_s: float = 60.0,
    *,
    worker_id: int = 0,
) -> AgentConfig:
    model = _model(tmp_path, num_hidden_layers=1, num_attention_heads=1, hidden_size=8)
    return AgentConfig(
        worker_id=worker_id,
        gateway=gateway,
        secret_file=str(secret_file),
        model=str(model),
        workdir=str(tmp_path),
        server_url=f"http://127.0.0.1:{server.server_address[1]}",
        tls="tcp",
        holder_linger_s=linger_s,
    )


def test_a_fenced_agent_keeps_its_holder_and_registers_again_with_what_it_holds(
    tmp_path: Path,
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    ucx_module: None,
    server: _StandIn,
) -> None:
    """Its lease lost, the agent tells the connector to keep its checkpoints, then closes its
    relays (vLLM would abort them), keeps the checkpoint another server streamed into its
    holder, and registers again with the next gateway on the same address, reporting it."""
    gateway = GatewayServer(LINGER_CONFIG, secret, host="127.0.0.1", port=0, issuer=issuer).start()
    port = int(gateway.address.rsplit(":", 1)[1])
    commands: list[tuple[str, bool]] = []  # what the connector heard, and whether relays were closed yet

    def handle(request: dict) -> dict:  # the connector's control channel (no vLLM here)
        commands.append((request["command"], server.hung_up.is_set()))
        return {"streaming": 1}

    config = _agent_config(tmp_path, secret_file, gateway.address, server, linger_s=30.0)
    connector = ControlServer(config.socket_path, handle)
    submitter = GatewayClient(gateway.address, secret)
    peer = ConnectorCore(secret, "model", tls="tcp")  # another server's, streaming into this holder
    peer.register(make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16, seed=0))
    agent: Agent | None = None
    successor = None
    try:
        agent = Agent(config).start()
        stream = submitter.submit([200, 1, 2], 8, timeout_s=60.0)  # decoding on the server
        next(stream)
        assert wait_until(lambda: agent.stats()["served"] == 1)
        key = 7
        grant = StreamGrant(1, (("127.0.0.1", agent.holder.port),), (issuer.issue(key, 0, 1, holder_id=0),))
        assert peer.begin("r", key, grant)
        peer.save_step([StepTokens("r", 0, list(range(12)), list(range(1, 13)))])
        assert wait_until(lambda: peer.durable_tokens() == {"r": 12})

        gateway.stop(grace_s=0.1)  # the lease runs out: the agent fences itself
        assert wait_until(lambda: server.hung_up.is_set())
        assert commands == [("abandon", False)]  # told before its relay was closed
        assert agent.stats()["abandoned"] == 1
        assert [(c.request_id, c.durable_tokens) for c in agent.store.checkpoints()] == [(key, 12)]
        assert agent.wait(timeout_s=0.5) is None  # lingering, not exited

        successor = GatewayServer(LINGER_CONFIG, secret, host="127.0.0.1", port=port, issuer=issuer).start()
        assert wait_until(lambda: agent.stats()["relinked"] == 1)
        assert agent.client.epoch == 2
        with successor.condition:  # the holder reported its checkpoint with its registration
            pending = successor.coordinator._pending_holds  # noqa: SLF001 - what the next gateway heard
            assert [(h, report.durable_tokens) for h, report, _ in pending.get(key, [])] == [(0, 12)]
        time.sleep(0.5)  # several leases' worth of heartbeats as the new epoch
        assert agent.wait(timeout_s=0) is None and agent.client.lease_valid()
        stream.close()
    finally:
        if agent is not None:
            agent.close()
        peer.close()
        connector.close()
        submitter.close()
        gateway.stop(grace_s=0.1)
        if successor is not None:
            successor.stop(grace_s=0.1)


def test_past_its_linger_a_fenced_agent_exits(
    tmp_path: Path, secret: bytes, secret_file: Path, ucx_module: None, server: _StandIn
) -> None:
    gateway = GatewayServer(LINGER_CONFIG, secret, host="127.0.0.1", port=0).start()
    agent: Agent | None = None
    try:
        agent = Agent(_agent_config(tmp_path, secret_file, gateway.address, server, linger_s=0.5)).start()
        gateway.stop(grace_s=0.1)
        fenced_by = time.monotonic() + LINGER_CONFIG.lease_s
        assert agent.wait(timeout_s=20.0) == EXIT_FENCED
        assert time.monotonic() >= fenced_by + 0.4  # the lease, then the linger
        assert agent.stats()["relinked"] == 0 and "lease" in agent.reason
    finally:
        if agent is not None:
            agent.close()
        gateway.stop(grace_s=0.1)
