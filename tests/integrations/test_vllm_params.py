"""The connector's configuration and per-request control (docs/vllm.md), without vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from lumen_core.integrations.vllm.params import ConnectorConfig, RequestControl, RestorePlan
from lumen_core.stream import request_key
from lumen_core.transport import issue_capability


@pytest.fixture(autouse=True)
def _ucx_module(ucx_module: None) -> None:
    """Capabilities are issued by the UCX module (tests/conftest.py)."""


@pytest.fixture
def config(secret_file: Path) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config(
        {
            "secret_file": str(secret_file),
            "holders": ["127.0.0.1:7001", {"address": "10.0.0.2", "port": 7002}],
        }
    )


def test_config_reads_secret_and_holders(config: ConnectorConfig, secret: bytes) -> None:
    assert config.secret == secret
    assert config.holders == (("127.0.0.1", 7001), ("10.0.0.2", 7002))
    assert (config.tls, config.model_fingerprint, config.connect_timeout_s) == ("", None, 2.0)


def test_defaults_without_params(config: ConnectorConfig, secret: bytes) -> None:
    control = RequestControl.parse("cmpl-7", None, config)
    key = request_key("cmpl-7")
    assert (control.request_id, control.key, control.epoch) == ("cmpl-7", key, 0)
    assert control.holders == config.holders
    assert control.capability == issue_capability(secret, key, 0, 0)
    assert control.restore is None


def test_explicit_params(config: ConnectorConfig, secret: bytes) -> None:
    capability = bytes(range(32))
    control = RequestControl.parse(
        "engine-id",
        {
            "lumen": {
                "request_id": "lumen-9",
                "epoch": 3,
                "holders": [{"address": "10.0.0.5", "port": 9000}],
                "capability": capability.hex(),
                "restore": {"address": "10.0.0.6", "port": 9001, "epoch": 3, "capability": capability.hex()},
            }
        },
        config,
    )
    assert (control.request_id, control.key, control.epoch) == ("lumen-9", request_key("lumen-9"), 3)
    assert control.holders == (("10.0.0.5", 9000),) and control.capability == capability
    assert control.restore == RestorePlan(("10.0.0.6", 9001), 3, capability)


def test_restore_defaults_to_first_holder_at_the_request_epoch(
    config: ConnectorConfig, secret: bytes
) -> None:
    control = RequestControl.parse("r", {"lumen": {"epoch": 2, "restore": {}}}, config)
    assert control.restore == RestorePlan(
        ("127.0.0.1", 7001), 2, issue_capability(secret, request_key("r"), 0, 2)
    )


def test_empty_holders_means_not_checkpointed(config: ConnectorConfig) -> None:
    assert RequestControl.parse("r", {"lumen": {"holders": []}}, config).holders == ()


@pytest.mark.parametrize(
    "lumen, error, match",
    [
        ({"epochs": 1}, ValueError, r"must have only keys"),
        ({"request_id": ""}, ValueError, r"`request_id` must be a non-empty str"),
        ({"epoch": -1}, ValueError, r"`epoch` must be an int in \[0, 4294967295\]"),
        ({"epoch": True}, ValueError, r"`epoch` must be an int"),
        ({"holders": "127.0.0.1:1"}, TypeError, r"`holders` must be a list"),
        ({"holders": [{"address": "h", "port": 0}]}, ValueError, r"`holders\[0\].port` must be an int in"),
        ({"holders": [{"host": "h"}]}, ValueError, r"`holders\[0\]` must be"),
        ({"capability": "zz"}, ValueError, r"`capability` must be 32 bytes as hex"),
        ({"capability": "00"}, ValueError, r"`capability` must be 32 bytes as hex, got 1 bytes"),
        ({"capability": 5}, TypeError, r"`capability` must be 32 bytes as hex, got int"),
        ({"restore": {"where": 1}}, ValueError, r"`restore` must be a dict of"),
    ],
)
def test_malformed_params_are_refused(config: ConnectorConfig, lumen: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RequestControl.parse("r", {"lumen": lumen}, config)


def test_lumen_entry_must_be_a_dict(config: ConnectorConfig) -> None:
    with pytest.raises(TypeError, match=r"`kv_transfer_params\['lumen'\]` must be a dict"):
        RequestControl.parse("r", {"lumen": []}, config)


def test_restore_without_address_needs_a_holder(secret_file: Path) -> None:
    bare = ConnectorConfig.from_extra_config({"secret_file": str(secret_file)})
    with pytest.raises(ValueError, match=r"`restore` must name an address and port"):
        RequestControl.parse("r", {"lumen": {"restore": {}}}, bare)


@pytest.mark.parametrize(
    "extra, error, match",
    [
        ({}, ValueError, r"must name a `secret_file`"),
        ({"holder": []}, ValueError, r"must have only keys"),
        ({"holders": "h:1"}, TypeError, r"`holders` must be a list"),
        ({"tls": 1}, TypeError, r"`tls` must be a str"),
        ({"model_fingerprint": ""}, ValueError, r"`model_fingerprint` must be a non-empty str"),
        ({"connect_timeout_s": 0}, ValueError, r"`connect_timeout_s` must be a number > 0"),
    ],
)
def test_malformed_extra_config_is_refused(secret_file: Path, extra: dict, error: type, match: str) -> None:
    if extra and "secret_file" not in extra:
        extra = {"secret_file": str(secret_file), **extra}
    with pytest.raises(error, match=match):
        ConnectorConfig.from_extra_config(extra)
