"""The connector's configuration and per-request control, parsed from plain JSON values
(``kv_connector_extra_config`` and a request's ``kv_transfer_params["lumen"]``; the format is
docs/vllm.md's). No vLLM import: the gateway and tests use it as it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lumen_core.auth import read_secret_file
from lumen_core.stream import request_key
from lumen_core.transport import CAPABILITY_BYTES, issue_capability

__all__ = ["ConnectorConfig", "RequestControl", "RestorePlan"]

Address = tuple[str, int]
_U32_MAX = 2**32 - 1


def _address(name: str, value: object) -> Address:
    """``{"address": str, "port": int}`` or ``"host:port"`` as an (address, port) tuple."""
    if isinstance(value, str) and value.rpartition(":")[2].isdigit():
        host, _, port = value.rpartition(":")
        value = {"address": host, "port": int(port)}
    if not isinstance(value, Mapping) or set(value) - {"address", "port"}:
        raise ValueError(f"`{name}` must be {{'address': str, 'port': int}} or 'host:port', got {value!r}")
    address, port = value.get("address"), value.get("port")
    if not isinstance(address, str) or not address:
        raise ValueError(f"`{name}.address` must be a non-empty str, got {address!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"`{name}.port` must be an int in [1, 65535], got {port!r}")
    return address, port


def _capability(name: str, value: object) -> bytes:
    """A capability given as hex (JSON carries no bytes)."""
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
    elif isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise ValueError(f"`{name}` must be {CAPABILITY_BYTES} bytes as hex, got {value!r}") from None
    else:
        raise TypeError(f"`{name}` must be {CAPABILITY_BYTES} bytes as hex, got {type(value).__name__}")
    if len(raw) != CAPABILITY_BYTES:
        raise ValueError(f"`{name}` must be {CAPABILITY_BYTES} bytes as hex, got {len(raw)} bytes")
    return raw


def _epoch(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32_MAX:
        raise ValueError(f"`{name}` must be an int in [0, {_U32_MAX}], got {value!r}")
    return value


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` sets: the cluster secret (``secret_file``, a 0600
    file), the default ``holders`` of requests that name none, the UCX transports (``tls``,
    "" leaves UCX's choice), ``model_fingerprint`` (default: computed from the model's files,
    see ``model_fingerprint``) and ``connect_timeout_s`` of connections to source holders."""

    secret: bytes
    holders: tuple[Address, ...] = ()
    tls: str = ""
    model_fingerprint: str | None = None
    connect_timeout_s: float = 2.0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Raises TypeError on a value of the wrong type (``holders``, ``tls``), ValueError on
        an unknown key, a missing ``secret_file`` or a bad value."""
        known = {"secret_file", "holders", "tls", "model_fingerprint", "connect_timeout_s"}
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
        return cls(
            secret=read_secret_file(str(Path(extra["secret_file"]))),
            holders=tuple(_address(f"holders[{i}]", h) for i, h in enumerate(holders)),
            tls=tls,
            model_fingerprint=fingerprint,
            connect_timeout_s=float(timeout),
        )


@dataclass(frozen=True)
class RestorePlan:
    """Where a resumed request's checkpoint is read: the holder at ``address``, at ``epoch``
    (the request's new epoch: reading fences the dead incarnation's writers) with
    ``capability``."""

    address: Address
    epoch: int
    capability: bytes


@dataclass(frozen=True)
class RequestControl:
    """One request's checkpointing: its LUMEN ``request_id`` (keyed on the wire as ``key``),
    ``epoch``, the ``holders`` it streams to (empty: not checkpointed) with ``capability``,
    and ``restore`` (None: nothing to resume from)."""

    request_id: str
    key: int
    epoch: int
    holders: tuple[Address, ...]
    capability: bytes
    restore: RestorePlan | None

    @classmethod
    def parse(
        cls, engine_request_id: str, params: Mapping[str, Any] | None, config: ConnectorConfig
    ) -> RequestControl:
        """From a request's ``kv_transfer_params`` (its "lumen" entry; absent: every default).

        Defaults: the engine's request id, epoch 0, the configured holders, capabilities
        issued with the cluster secret for (request, shard 0, epoch); ``restore`` given as
        ``{}`` reads from the first configured holder.

        Raises:
            TypeError: the "lumen" entry is not a dict, a capability neither hex nor bytes.
            ValueError: an unknown key or a malformed value (the connector then serves the
                request without checkpointing rather than somewhere it did not ask for).
        """
        lumen = (params or {}).get("lumen", {})
        if not isinstance(lumen, Mapping):
            raise TypeError(f"`kv_transfer_params['lumen']` must be a dict, got {type(lumen).__name__}")
        known = {"request_id", "epoch", "holders", "capability", "restore"}
        unknown = sorted(set(lumen) - known)
        if unknown:
            raise ValueError(
                f"`kv_transfer_params['lumen']` must have only keys {sorted(known)}, got {unknown}"
            )
        request_id = lumen.get("request_id", engine_request_id)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"`request_id` must be a non-empty str, got {request_id!r}")
        key = request_key(request_id)
        epoch = _epoch("epoch", lumen.get("epoch", 0))
        if "holders" in lumen:
            holders_value = lumen["holders"]
            if not isinstance(holders_value, list):
                raise TypeError(f"`holders` must be a list of holders, got {holders_value!r}")
            holders = tuple(_address(f"holders[{i}]", h) for i, h in enumerate(holders_value))
        else:
            holders = config.holders
        if "capability" in lumen:
            capability = _capability("capability", lumen["capability"])
        else:
            capability = issue_capability(config.secret, key, 0, epoch)
        restore = None
        if "restore" in lumen:
            restore = cls._restore_plan(lumen["restore"], key, epoch, config)
        return cls(request_id, key, epoch, holders, capability, restore)

    @staticmethod
    def _restore_plan(value: object, key: int, epoch: int, config: ConnectorConfig) -> RestorePlan:
        if not isinstance(value, Mapping) or set(value) - {"address", "port", "epoch", "capability"}:
            raise ValueError(
                f"`restore` must be a dict of address, port, epoch, capability (each optional), got {value!r}"
            )
        if "address" in value or "port" in value:
            address = _address("restore", {k: value[k] for k in ("address", "port") if k in value})
        elif config.holders:
            address = config.holders[0]
        else:
            raise ValueError("`restore` must name an address and port: no holders are configured")
        restore_epoch = _epoch("restore.epoch", value.get("epoch", epoch))
        if "capability" in value:
            capability = _capability("restore.capability", value["capability"])
        else:
            capability = issue_capability(config.secret, key, 0, restore_epoch)
        return RestorePlan(address, restore_epoch, capability)
