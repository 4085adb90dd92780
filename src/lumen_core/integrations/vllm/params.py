"""The connector's configuration and per-request control, parsed from plain JSON values
(``kv_connector_extra_config`` and a request's ``kv_transfer_params["lumen"]``; the format is
docs/vllm.md's). No vLLM import: the gateway and tests use it as it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lumen_core.auth import (
    CREDENTIAL_BYTES,
    ISSUER_KEY_BYTES,
    CapabilityIssuer,
    Rights,
    WorkerIdentity,
    read_issuer_key_file,
    read_secret_file,
)
from lumen_core.connector import RestoreSource
from lumen_core.connector.threads import check_cpus
from lumen_core.stream import request_key
from lumen_core.transport import CAPABILITY_BYTES

__all__ = ["ConnectorConfig", "CredentialGrant", "Renewal", "RequestControl"]

Address = tuple[str, int]
_U32_MAX = 2**32 - 1
_Default = TypeVar("_Default", int, None)


def _holder(name: str, value: object) -> tuple[Address, int]:
    """``{"address": str, "port": int, "holder_id": int}`` (``holder_id`` optional, default 0)
    or ``"host:port"`` as ((address, port), holder_id)."""
    if isinstance(value, str) and value.rpartition(":")[2].isdigit():
        host, _, port = value.rpartition(":")
        value = {"address": host, "port": int(port)}
    if not isinstance(value, Mapping) or set(value) - {"address", "port", "holder_id"}:
        raise ValueError(
            f"`{name}` must be {{'address': str, 'port': int, 'holder_id': int}} or 'host:port', "
            f"got {value!r}"
        )
    holder_id = value.get("holder_id", 0)
    if isinstance(holder_id, bool) or not isinstance(holder_id, int) or not 0 <= holder_id < 2**64:
        raise ValueError(f"`{name}.holder_id` must be an int in [0, 2**64), got {holder_id!r}")
    return _address(name, {k: v for k, v in value.items() if k != "holder_id"}), holder_id


def _address(name: str, value: Mapping[str, Any]) -> Address:
    """``{"address": str, "port": int}`` as an (address, port) tuple."""
    address, port = value.get("address"), value.get("port")
    if not isinstance(address, str) or not address:
        raise ValueError(f"`{name}.address` must be a non-empty str, got {address!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"`{name}.port` must be an int in [1, 65535], got {port!r}")
    return address, port


def _hex_bytes(name: str, value: object, size: int) -> bytes:
    """``size`` bytes given as hex (JSON carries no bytes)."""
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
    elif isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise ValueError(f"`{name}` must be {size} bytes as hex, got {value!r:.80}") from None
    else:
        raise TypeError(f"`{name}` must be {size} bytes as hex, got {type(value).__name__}")
    if len(raw) != size:
        raise ValueError(f"`{name}` must be {size} bytes as hex, got {len(raw)} bytes")
    return raw


def _bounded_int(
    extra: Mapping[str, Any], name: str, default: _Default, low: int, high: int
) -> int | _Default:
    """``extra[name]`` (``default`` when absent), an int in [``low``, ``high``]."""
    if name not in extra:
        return default
    value = extra[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"`{name}` must be an int in [{low}, {high}], got {value!r}")
    return value


def _capability(name: str, value: object) -> bytes:
    return _hex_bytes(name, value, CAPABILITY_BYTES)


def _epoch(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32_MAX:
        raise ValueError(f"`{name}` must be an int in [0, {_U32_MAX}], got {value!r}")
    return value


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` sets: the cluster secret (``secret_file``, a 0600
    file), the capability issuer of the gateway-less mode (``issuer_key_file``, a 0600 file
    from ``lumen keygen``; None: every request brings its capabilities), the default
    ``holders`` of requests that name none with the ids capabilities name them by
    (``holder_ids``), the UCX transports (``tls``, "" leaves UCX's choice),
    ``model_fingerprint`` (default: computed from the model's files, see
    ``model_fingerprint``), ``connect_timeout_s`` of connections to source holders,
    ``control_socket``, the path of the local control channel (``control.py``; None: none),
    ``encrypt``: records to and from holders in AES-256-GCM (docs/security.md), and
    ``identity_key_file``: the private key of the server's worker identity (a 0600 file its
    ``lumen agent`` wrote; the credential comes over the control channel; None: connections
    prove no identity, and only unbound capabilities serve), ``restore_nice`` (0-19), the
    niceness of the worker's restore thread (``ConnectorCore``: 19 on a CPU server keeps
    restores off the forward's time), ``hold_lines`` (``ConnectorCore``: False saves every token
    in its step), ``cpus``, the CPU numbers the connector's threads run on (``ConnectorCore``:
    on a CPU server, cores vLLM's forward does not use), and the streamer's ``staging_bytes``
    and ``staging_buffers`` (``CheckpointStreamer``: a step hands over at most one buffer;
    None: its defaults)."""

    secret: bytes = field(repr=False)
    holders: tuple[Address, ...] = ()
    tls: str = ""
    model_fingerprint: str | None = None
    connect_timeout_s: float = 2.0
    issuer: CapabilityIssuer | None = None
    holder_ids: tuple[int, ...] = ()
    control_socket: str | None = None
    encrypt: bool = False
    identity_key_file: str | None = None
    restore_nice: int = 0
    hold_lines: bool = True
    cpus: frozenset[int] | None = None
    staging_bytes: int | None = None
    staging_buffers: int | None = None

    def __post_init__(self) -> None:
        if len(self.holder_ids) != len(self.holders):
            raise ValueError(
                f"`holder_ids` must be one per holder ({len(self.holders)}), got {len(self.holder_ids)}"
            )

    def holder_id(self, address: Address) -> int:
        """The id of the configured holder at ``address`` (0 for one not configured)."""
        return dict(zip(self.holders, self.holder_ids)).get(address, 0)

    def issue(self, name: str, key: int, epoch: int, holder_id: int, rights: Rights) -> bytes:
        """A capability of (key, shard 0, epoch) on ``holder_id`` from the local issuer;
        ValueError naming ``name`` (what the request should have carried) without one."""
        if self.issuer is None:
            raise ValueError(f"`{name}` must be given: no `issuer_key_file` is configured to issue it")
        return self.issuer.issue(key, 0, epoch, holder_id=holder_id, rights=rights)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Raises TypeError on a value of the wrong type (``holders``, ``tls``), ValueError on
        an unknown key, a missing ``secret_file`` or a bad value."""
        known = {
            "secret_file",
            "issuer_key_file",
            "holders",
            "tls",
            "model_fingerprint",
            "connect_timeout_s",
            "control_socket",
            "encrypt",
            "identity_key_file",
            "restore_nice",
            "hold_lines",
            "cpus",
            "staging_bytes",
            "staging_buffers",
        }
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"`kv_connector_extra_config` must have only keys {sorted(known)}, got {unknown}"
            )
        if "secret_file" not in extra:
            raise ValueError("`kv_connector_extra_config` must name a `secret_file` (the cluster secret)")
        holders = extra.get("holders", [])
        if isinstance(holders, (str, Mapping)) or not isinstance(holders, list):
            raise TypeError(f"`holders` must be a list of holders, got {holders!r}")
        tls = extra.get("tls", "")
        if not isinstance(tls, str):
            raise TypeError(f"`tls` must be a str, got {tls!r}")
        fingerprint = extra.get("model_fingerprint")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise ValueError(f"`model_fingerprint` must be a non-empty str, got {fingerprint!r}")
        timeout = extra.get("connect_timeout_s", 2.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"`connect_timeout_s` must be a number > 0, got {timeout!r}")
        control_socket = extra.get("control_socket")
        if control_socket is not None and (not isinstance(control_socket, str) or not control_socket):
            raise ValueError(f"`control_socket` must be a non-empty str (a path), got {control_socket!r}")
        encrypt = extra.get("encrypt", False)
        if not isinstance(encrypt, bool):
            raise TypeError(f"`encrypt` must be a bool, got {encrypt!r}")
        restore_nice = _bounded_int(extra, "restore_nice", 0, 0, 19)
        hold_lines = extra.get("hold_lines", True)
        if not isinstance(hold_lines, bool):
            raise TypeError(f"`hold_lines` must be a bool, got {hold_lines!r}")
        cpus = extra.get("cpus")
        if cpus is not None and not isinstance(cpus, list):
            raise TypeError(f"`cpus` must be a list of CPU numbers, got {cpus!r}")
        staging_bytes = _bounded_int(extra, "staging_bytes", None, 1 << 20, 1 << 36)
        staging_buffers = _bounded_int(extra, "staging_buffers", None, 1, 64)
        parsed = [_holder(f"holders[{i}]", h) for i, h in enumerate(holders)]
        issuer = None
        if "issuer_key_file" in extra:
            issuer = CapabilityIssuer(read_issuer_key_file(str(Path(extra["issuer_key_file"]))))
        identity_file = extra.get("identity_key_file")
        if identity_file is not None:
            if not isinstance(identity_file, str) or not identity_file:
                raise ValueError(f"`identity_key_file` must be a non-empty path, got {identity_file!r}")
            WorkerIdentity.from_key_file(identity_file)  # a bad key fails here, not at a request
        return cls(
            secret=read_secret_file(str(Path(extra["secret_file"]))),
            holders=tuple(address for address, _ in parsed),
            tls=tls,
            model_fingerprint=fingerprint,
            connect_timeout_s=float(timeout),
            issuer=issuer,
            holder_ids=tuple(holder_id for _, holder_id in parsed),
            control_socket=control_socket,
            encrypt=encrypt,
            identity_key_file=identity_file,
            restore_nice=restore_nice,
            hold_lines=hold_lines,
            cpus=check_cpus("cpus", cpus),
            staging_bytes=staging_bytes,
            staging_buffers=staging_buffers,
        )

    def identity(self) -> WorkerIdentity | None:
        """The ``WorkerIdentity`` of ``identity_key_file``, read now (one per connector side:
        each takes the credential itself), None without one."""
        path = self.identity_key_file
        return None if path is None else WorkerIdentity.from_key_file(path)


@dataclass(frozen=True)
class RequestControl:
    """One request's checkpointing: its LUMEN ``request_id`` (keyed on the wire as ``key``),
    ``epoch``, the ``holders`` it streams to (empty: not checkpointed) with its capability on
    each (``capabilities``), and ``restore`` (None: nothing to resume from)."""

    request_id: str
    key: int
    epoch: int
    holders: tuple[Address, ...]
    capabilities: tuple[bytes, ...]
    restore: RestoreSource | None

    @classmethod
    def parse(
        cls, engine_request_id: str, params: Mapping[str, Any] | None, config: ConnectorConfig
    ) -> RequestControl:
        """From a request's ``kv_transfer_params`` (its "lumen" entry; absent: every default).

        Defaults: the engine's request id, its wire key ``request_key(request_id)`` (a
        gateway names its own u64: its capabilities are bound to it), epoch 0, the configured
        holders, capabilities issued by the configured issuer for (request, shard 0, epoch) on each holder;
        ``restore`` given as ``{}`` reads from the first configured holder.

        Raises:
            TypeError: the "lumen" entry is not a dict, a capability neither hex nor bytes.
            ValueError: an unknown key, a malformed value, or a capability neither given nor
                issuable here (the connector then serves the request without checkpointing
                rather than somewhere it did not ask for).
        """
        lumen = (params or {}).get("lumen", {})
        if not isinstance(lumen, Mapping):
            raise TypeError(f"`kv_transfer_params['lumen']` must be a dict, got {type(lumen).__name__}")
        known = {"request_id", "key", "epoch", "holders", "capabilities", "restore"}
        unknown = sorted(set(lumen) - known)
        if unknown:
            raise ValueError(
                f"`kv_transfer_params['lumen']` must have only keys {sorted(known)}, got {unknown}"
            )
        request_id = lumen.get("request_id", engine_request_id)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"`request_id` must be a non-empty str, got {request_id!r}")
        key = lumen.get("key", request_key(request_id))
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
            raise ValueError(f"`key` must be an int in [0, 2**64), got {key!r}")
        epoch = _epoch("epoch", lumen.get("epoch", 0))
        if "holders" in lumen:
            holders_value = lumen["holders"]
            if not isinstance(holders_value, list):
                raise TypeError(f"`holders` must be a list of holders, got {holders_value!r}")
            parsed = [_holder(f"holders[{i}]", h) for i, h in enumerate(holders_value)]
            holders = tuple(address for address, _ in parsed)
            holder_ids = tuple(holder_id for _, holder_id in parsed)
        else:
            holders, holder_ids = config.holders, config.holder_ids
        if "capabilities" in lumen:
            values = lumen["capabilities"]
            if not isinstance(values, list) or len(values) != len(holders):
                raise ValueError(
                    f"`capabilities` must be a list of one capability per holder, got {values!r:.80}"
                )
            capabilities = tuple(_capability(f"capabilities[{i}]", c) for i, c in enumerate(values))
        else:
            capabilities = tuple(
                config.issue("capabilities", key, epoch, holder_id, Rights.WRITE | Rights.READ)
                for holder_id in holder_ids
            )
        restore = None
        if "restore" in lumen:
            restore = cls._restore_source(lumen["restore"], key, epoch, config)
        return cls(request_id, key, epoch, holders, capabilities, restore)

    @staticmethod
    def _restore_source(value: object, key: int, epoch: int, config: ConnectorConfig) -> RestoreSource:
        fields = {"address", "port", "holder_id", "epoch", "capability"}
        if not isinstance(value, Mapping) or set(value) - fields:
            raise ValueError(
                f"`restore` must be a dict of address, port, holder_id, epoch, capability (each optional), "
                f"got {value!r}"
            )
        if "address" in value or "port" in value:
            address, holder_id = _holder(
                "restore", {k: value[k] for k in fields - {"epoch", "capability"} if k in value}
            )
            if "holder_id" not in value:
                holder_id = config.holder_id(address)
        elif config.holders:
            address, holder_id = config.holders[0], config.holder_ids[0]
        else:
            raise ValueError("`restore` must name an address and port: no holders are configured")
        restore_epoch = _epoch("restore.epoch", value.get("epoch", epoch))
        if "capability" in value:
            capability = _capability("restore.capability", value["capability"])
        else:
            capability = config.issue("restore.capability", key, restore_epoch, holder_id, Rights.READ)
        return RestoreSource(restore_epoch, address, capability)


@dataclass(frozen=True)
class Renewal:
    """A control ``renew``: fresh ``capabilities`` (same epoch, later expiry) for LUMEN request
    ``request_id`` at ``epoch``, one per holder of ``holders`` (any order of the request's)."""

    request_id: str
    epoch: int
    holders: tuple[Address, ...]
    capabilities: tuple[bytes, ...]

    @classmethod
    def parse(cls, request: Mapping[str, Any]) -> Renewal:
        """From ``{"request_id": str, "epoch": int, "holders": [holder, ...], "capabilities":
        [hex, ...]}`` (a holder as in ``kv_transfer_params``). ValueError/TypeError for a bad
        field."""
        request_id = request.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"`request_id` must be a non-empty str, got {request_id!r}")
        holders, capabilities = request.get("holders"), request.get("capabilities")
        if not isinstance(holders, list) or not holders:
            raise ValueError(f"`holders` must be a non-empty list, got {holders!r:.80}")
        if not isinstance(capabilities, list) or len(capabilities) != len(holders):
            raise ValueError(
                f"`capabilities` must be a list of one capability per holder ({len(holders)}), "
                f"got {capabilities!r:.80}"
            )
        return cls(
            request_id,
            _epoch("epoch", request.get("epoch")),
            tuple(_holder(f"holders[{i}]", h)[0] for i, h in enumerate(holders)),
            tuple(_capability(f"capabilities[{i}]", c) for i, c in enumerate(capabilities)),
        )

    def for_holders(self, holders: tuple[Address, ...]) -> tuple[bytes, ...] | None:
        """The capabilities in the order of ``holders`` (a request's), or None when they are
        not the renewal's holders."""
        fresh = dict(zip(self.holders, self.capabilities, strict=True))
        if set(fresh) != set(holders) or len(fresh) != len(self.holders):
            return None
        return tuple(fresh[h] for h in holders)


@dataclass(frozen=True)
class CredentialGrant:
    """A control ``credential``: what the server's agent got at its latest registration, the
    ``credential`` the issuer signed for this server's identity key as worker ``worker_id``,
    and the issuer's public key it verifies with. Sent on to the worker side in the metadata
    (all three are public)."""

    credential: bytes
    issuer_public_key: bytes
    worker_id: int

    @classmethod
    def parse(cls, request: Mapping[str, Any]) -> CredentialGrant:
        """From ``{"credential": hex, "issuer_public_key": hex, "worker_id": int}``;
        ValueError/TypeError for a bad field."""
        worker_id = request.get("worker_id")
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or not 0 <= worker_id < 2**31:
            raise ValueError(f"`worker_id` must be an int in [0, 2**31), got {worker_id!r}")
        return cls(
            _hex_bytes("credential", request.get("credential"), CREDENTIAL_BYTES),
            _hex_bytes("issuer_public_key", request.get("issuer_public_key"), ISSUER_KEY_BYTES),
            worker_id,
        )
