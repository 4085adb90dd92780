"""The connector's configuration and per-request control (docs/vllm.md), without vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from lumen_core.auth import CREDENTIAL_BYTES, ISSUER_KEY_BYTES, Rights, WorkerIdentity, verify_capability
from lumen_core.connector import RestoreSource
from lumen_core.gateway.directives import HolderGrant, Renew
from lumen_core.integrations.vllm.params import ConnectorConfig, CredentialGrant, Renewal, RequestControl
from lumen_core.stream import request_key
from lumen_core.worker.upstream import renew_args


@pytest.fixture(autouse=True)
def _ucx_module(ucx_module: None) -> None:
    """Capabilities are issued by the UCX module (tests/conftest.py)."""


@pytest.fixture
def config(secret_file: Path, issuer_key_file: Path) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config(
        {
            "secret_file": str(secret_file),
            "issuer_key_file": str(issuer_key_file),
            "holders": ["127.0.0.1:7001", {"address": "10.0.0.2", "port": 7002, "holder_id": 4}],
        }
    )


def _grants(
    config: ConnectorConfig, capabilities: tuple[bytes, ...]
) -> list[tuple[int, int, int, int, Rights]]:
    assert config.issuer is not None
    fields = [verify_capability(config.issuer.public_key, c) for c in capabilities]
    return [(f.request_id, f.shard, f.epoch, f.holder_id, f.rights) for f in fields]


def test_config_reads_secret_issuer_and_holders(config: ConnectorConfig, secret: bytes, issuer) -> None:
    assert config.secret == secret
    assert config.issuer is not None and config.issuer.public_key == issuer.public_key
    assert config.holders == (("127.0.0.1", 7001), ("10.0.0.2", 7002)) and config.holder_ids == (0, 4)
    assert (config.tls, config.model_fingerprint, config.connect_timeout_s) == ("", None, 2.0)


def test_defaults_without_params(config: ConnectorConfig) -> None:
    control = RequestControl.parse("cmpl-7", None, config)
    key = request_key("cmpl-7")
    assert (control.request_id, control.key, control.epoch) == ("cmpl-7", key, 0)
    assert control.holders == config.holders
    # one capability per holder, each valid on that holder only
    assert _grants(config, control.capabilities) == [
        (key, 0, 0, 0, Rights.WRITE | Rights.READ),
        (key, 0, 0, 4, Rights.WRITE | Rights.READ),
    ]
    assert control.restore is None


def test_without_an_issuer_a_request_must_bring_its_capabilities(secret_file: Path) -> None:
    bare = ConnectorConfig.from_extra_config({"secret_file": str(secret_file), "holders": ["127.0.0.1:7001"]})
    with pytest.raises(ValueError, match=r"`capabilities` must be given: no `issuer_key_file`"):
        RequestControl.parse("r", None, bare)
    with pytest.raises(ValueError, match=r"`restore.capability` must be given: no `issuer_key_file`"):
        RequestControl.parse("r", {"lumen": {"holders": [], "restore": {}}}, bare)
    capability = bytes(128)
    control = RequestControl.parse("r", {"lumen": {"capabilities": [capability.hex()]}}, bare)
    assert control.capabilities == (capability,)


def test_explicit_params(config: ConnectorConfig, secret: bytes) -> None:
    capability = bytes(range(128))
    control = RequestControl.parse(
        "engine-id",
        {
            "lumen": {
                "request_id": "lumen-9",
                "epoch": 3,
                "holders": [{"address": "10.0.0.5", "port": 9000}],
                "capabilities": [capability.hex()],
                "restore": {"address": "10.0.0.6", "port": 9001, "epoch": 3, "capability": capability.hex()},
            }
        },
        config,
    )
    assert (control.request_id, control.key, control.epoch) == ("lumen-9", request_key("lumen-9"), 3)
    assert control.holders == (("10.0.0.5", 9000),) and control.capabilities == (capability,)
    assert control.restore == RestoreSource(3, ("10.0.0.6", 9001), capability)


def test_restore_defaults_to_first_holder_at_the_request_epoch(
    config: ConnectorConfig, secret: bytes
) -> None:
    control = RequestControl.parse("r", {"lumen": {"epoch": 2, "restore": {}}}, config)
    assert control.restore is not None and control.restore.address == ("127.0.0.1", 7001)
    assert control.restore.epoch == 2
    assert _grants(config, (control.restore.capability,)) == [(request_key("r"), 0, 2, 0, Rights.READ)]
    # a restore from a configured holder is granted on that holder's id
    control = RequestControl.parse("r", {"lumen": {"restore": {"address": "10.0.0.2", "port": 7002}}}, config)
    assert _grants(config, (control.restore.capability,)) == [(request_key("r"), 0, 0, 4, Rights.READ)]


def test_a_gateway_names_the_wire_key_its_capabilities_are_bound_to(config: ConnectorConfig) -> None:
    control = RequestControl.parse("r", {"lumen": {"request_id": "42", "key": 42, "epoch": 3}}, config)
    assert (control.request_id, control.key) == ("42", 42)
    assert _grants(config, control.capabilities)[0] == (42, 0, 3, 0, Rights.WRITE | Rights.READ)
    assert RequestControl.parse("r", {"lumen": {"request_id": "42"}}, config).key == request_key("42")


def test_the_control_socket_is_configured(secret_file: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "c.sock")
    extra = {"secret_file": str(secret_file), "control_socket": path}
    assert ConnectorConfig.from_extra_config(extra).control_socket == path
    assert ConnectorConfig.from_extra_config({"secret_file": str(secret_file)}).control_socket is None


def test_encryption_is_a_bool_and_off_by_default(secret_file: Path) -> None:
    extra = {"secret_file": str(secret_file)}
    assert ConnectorConfig.from_extra_config(extra).encrypt is False
    assert ConnectorConfig.from_extra_config({**extra, "encrypt": True}).encrypt is True
    with pytest.raises(TypeError, match="`encrypt` must be a bool, got 'yes'"):
        ConnectorConfig.from_extra_config({"secret_file": str(secret_file), "encrypt": "yes"})


def test_restore_nice_is_0_unless_set(secret_file: Path) -> None:
    extra = {"secret_file": str(secret_file)}
    assert ConnectorConfig.from_extra_config(extra).restore_nice == 0
    assert ConnectorConfig.from_extra_config({**extra, "restore_nice": 19}).restore_nice == 19


def test_hold_lines_is_on_unless_turned_off(secret_file: Path) -> None:
    extra = {"secret_file": str(secret_file)}
    assert ConnectorConfig.from_extra_config(extra).hold_lines is True
    assert ConnectorConfig.from_extra_config({**extra, "hold_lines": False}).hold_lines is False


def test_staging_is_the_streamers_default_unless_set(secret_file: Path) -> None:
    extra = {"secret_file": str(secret_file)}
    config = ConnectorConfig.from_extra_config(extra)
    assert (config.staging_bytes, config.staging_buffers) == (None, None)
    config = ConnectorConfig.from_extra_config({**extra, "staging_bytes": 1 << 29, "staging_buffers": 2})
    assert (config.staging_bytes, config.staging_buffers) == (1 << 29, 2)


def test_cpus_are_none_unless_set(secret_file: Path) -> None:
    extra = {"secret_file": str(secret_file)}
    assert ConnectorConfig.from_extra_config(extra).cpus is None
    assert ConnectorConfig.from_extra_config({**extra, "cpus": [0]}).cpus == frozenset({0})


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
        ({"capabilities": ["zz", "00"]}, ValueError, r"`capabilities\[0\]` must be 128 bytes as hex"),
        (
            {"capabilities": ["00", "00"]},
            ValueError,
            r"`capabilities\[0\]` must be 128 bytes as hex, got 1 bytes",
        ),
        ({"capabilities": [5, 5]}, TypeError, r"`capabilities\[0\]` must be 128 bytes as hex, got int"),
        ({"capabilities": ["00"]}, ValueError, r"`capabilities` must be a list of one capability per holder"),
        (
            {"holders": [{"address": "h", "port": 1, "holder_id": -1}]},
            ValueError,
            r"`holders\[0\].holder_id` must be",
        ),
        ({"restore": {"where": 1}}, ValueError, r"`restore` must be a dict of"),
        ({"key": -1}, ValueError, r"`key` must be an int in \[0, 2\*\*64\)"),
        ({"key": "42"}, ValueError, r"`key` must be an int in"),
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
        ({"control_socket": ""}, ValueError, r"`control_socket` must be a non-empty str"),
        ({"restore_nice": 20}, ValueError, r"`restore_nice` must be an int in \[0, 19\], got 20"),
        ({"restore_nice": True}, ValueError, r"`restore_nice` must be an int in \[0, 19\], got True"),
        ({"hold_lines": 0}, TypeError, r"`hold_lines` must be a bool, got 0"),
        ({"staging_bytes": 1 << 19}, ValueError, r"`staging_bytes` must be an int in \[1048576, \d+\]"),
        ({"staging_buffers": 0}, ValueError, r"`staging_buffers` must be an int in \[1, 64\], got 0"),
        ({"cpus": "1"}, TypeError, r"`cpus` must be a list of CPU numbers, got '1'"),
        ({"cpus": []}, ValueError, r"`cpus` must name at least one CPU"),
        ({"cpus": [True]}, TypeError, r"`cpus\[i\]` must be an int, got bool"),
    ],
)
def test_malformed_extra_config_is_refused(secret_file: Path, extra: dict, error: type, match: str) -> None:
    if extra and "secret_file" not in extra:
        extra = {"secret_file": str(secret_file), **extra}
    with pytest.raises(error, match=match):
        ConnectorConfig.from_extra_config(extra)


def test_a_renew_from_the_gateway_reaches_the_connector_in_the_requests_holder_order() -> None:
    cap_a, cap_b = bytes(range(128)), bytes(128)
    directive = Renew(
        7, 2, (HolderGrant(1, "10.0.0.1:7001", (cap_a,)), HolderGrant(2, "10.0.0.2:7002", (cap_b,)))
    )
    renewal = Renewal.parse(renew_args(directive))  # what the agent sends, as the connector reads it
    assert (renewal.request_id, renewal.epoch) == ("7", 2)
    assert renewal.for_holders((("10.0.0.2", 7002), ("10.0.0.1", 7001))) == (cap_b, cap_a)
    assert renewal.for_holders((("10.0.0.1", 7001),)) is None  # not the request's holders
    args = renew_args(directive)
    with pytest.raises(ValueError, match=r"`capabilities` must be a list of one capability per holder \(2\)"):
        Renewal.parse({**args, "capabilities": args["capabilities"][:1]})
    with pytest.raises(ValueError, match=r"`epoch` must be an int in \[0, 4294967295\], got -1"):
        Renewal.parse({**args, "epoch": -1})
    with pytest.raises(ValueError, match=r"`request_id` must be a non-empty str, got 7"):
        Renewal.parse({**args, "request_id": 7})


def test_an_identity_key_file_is_read_checked_and_gives_each_side_its_own_identity(
    secret_file: Path, tmp_path: Path
) -> None:
    extra = {"secret_file": str(secret_file)}
    assert ConnectorConfig.from_extra_config(extra).identity() is None
    path = tmp_path / "identity.key"
    made = WorkerIdentity.create_key_file(path)
    config = ConnectorConfig.from_extra_config({**extra, "identity_key_file": str(path)})
    assert "identity_key_file" in repr(config)  # the path, never the key
    sides = [config.identity(), config.identity()]
    assert [s.public_key for s in sides if s is not None] == [made.public_key] * 2
    assert sides[0] is not sides[1]
    path.chmod(0o644)  # others may read it: refused, as a secret would be
    with pytest.raises(PermissionError):
        ConnectorConfig.from_extra_config({**extra, "identity_key_file": str(path)})
    with pytest.raises(FileExistsError):  # never overwrites a key in use
        WorkerIdentity.create_key_file(path)


def test_a_credential_grant_is_parsed_with_each_field_checked() -> None:
    good = {
        "credential": "ab" * CREDENTIAL_BYTES,
        "issuer_public_key": "cd" * ISSUER_KEY_BYTES,
        "worker_id": 3,
    }
    grant = CredentialGrant.parse(good)
    assert (grant.credential, grant.issuer_public_key, grant.worker_id) == (
        b"\xab" * CREDENTIAL_BYTES,
        b"\xcd" * ISSUER_KEY_BYTES,
        3,
    )
    for bad, error, match in [
        ({"credential": "ab" * 10}, ValueError, "`credential` must be 128 bytes as hex, got 10 bytes"),
        ({"credential": "zz"}, ValueError, "`credential` must be 128 bytes as hex"),
        ({"issuer_public_key": 7}, TypeError, "`issuer_public_key` must be 32 bytes as hex, got int"),
        ({"worker_id": -1}, ValueError, r"`worker_id` must be an int in \[0, 2\*\*31\)"),
        ({"worker_id": True}, ValueError, "`worker_id` must be an int"),
    ]:
        with pytest.raises(error, match=match):
            CredentialGrant.parse({**good, **bad})
