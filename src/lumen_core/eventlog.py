"""Event log of a driver: the policy events it fed and the decisions the policy objects
returned, as JSON lines (``EventLog`` is a ``policy.driver.Recorder``), so that the sequence can
be replayed through fresh policy objects to check that they give the same decisions.

Each line is one record:
- ``{"op": "event", "event": {"type": NAME, ...fields}}``: ``LoadMonitor.apply``;
- ``{"op": "gain", "survivor_id": s, "num_draft_tokens": k, "value": g}``: a call of the gain
  function the planner was given (the driver's cost model), answered in replay from the log;
- ``{"op": OP, "args": {...}, "result": ...}`` for the calls ``place`` (args ``request_id``),
  ``route`` (``failed_worker_id``), ``move`` (``request_id``, ``reprefill`` 0 or 1), ``replace``
  (``lost_holder_id``), ``pair`` (``assistant_id``), ``finish`` (``assistant_id``) and
  ``release_survivor`` (``survivor_id``): ``result`` is a list of decisions
  ``{"type": NAME, ...fields}`` or an int / null.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from lumen_core.policy import events as ev
from lumen_core.policy.load import LoadConfig, LoadMonitor
from lumen_core.policy.presets import PolicyFactory

_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in vars(ev).values() if isinstance(cls, type) and dataclasses.is_dataclass(cls)
}
CALLS = ("place", "route", "move", "replace", "pair", "finish", "release_survivor")


def to_json(obj: Any) -> Any:
    """A policy event or decision as a JSON-ready dict (``type`` + fields; enums by value)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {"type": type(obj).__name__}
        for f in dataclasses.fields(obj):
            out[f.name] = to_json(getattr(obj, f.name))
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_json(x) for x in obj]
    return obj


def from_json(data: Any) -> Any:
    """Inverse of ``to_json`` for the types of ``policy.events``; raises ValueError on an
    unknown ``type``."""
    if isinstance(data, list):
        return [from_json(x) for x in data]
    if not isinstance(data, dict) or "type" not in data:
        return data
    cls = _TYPES.get(data["type"])
    if cls is None:
        raise ValueError(f"`type` must be one of {sorted(_TYPES)}, got {data['type']!r}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = data[f.name]
        if f.name == "action":
            value = ev.RecoveryAction(value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kwargs[f.name] = value
    return cls(**kwargs)


class EventLog:
    """Writes the records to a text stream (a file opened by the caller, or ``open``)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self.num_records = 0

    @classmethod
    def open(cls, path: str | Path) -> EventLog:
        return cls(Path(path).open("w", encoding="utf-8"))

    def close(self) -> None:
        self._stream.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._stream.write(json.dumps(record, separators=(",", ":")))
        self._stream.write("\n")
        self.num_records += 1

    def event(self, event: Any) -> None:
        self._write({"op": "event", "event": to_json(event)})

    def decision(self, op: str, args: dict[str, int], result: Any) -> None:
        if op not in CALLS:
            raise ValueError(f"`op` must be one of {CALLS}, got {op!r}")
        self._write({"op": op, "args": args, "result": to_json(result)})

    def gain(self, survivor_id: int, num_draft_tokens: int, value: float) -> None:
        self._write(
            {"op": "gain", "survivor_id": survivor_id, "num_draft_tokens": num_draft_tokens, "value": value}
        )


def read_event_log(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a log, with events and decisions rebuilt as ``policy.events`` objects."""
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if record["op"] == "event":
                record["event"] = from_json(record["event"])
            elif record["op"] in CALLS:
                record["result"] = from_json(record["result"])
            elif record["op"] != "gain":
                raise ValueError(f"record `op` must be event, gain or one of {CALLS}, got {record['op']!r}")
            yield record


def replay_event_log(
    path: str | Path,
    policy: PolicyFactory,
    load_config: LoadConfig,
) -> int:
    """Feed a log's events through fresh policy objects built by ``policy`` (given a gain
    function that answers from the log), repeat its calls and compare each result with the
    logged one. Returns the number of calls checked; raises AssertionError at the first
    decision that differs (the two drivers disagree)."""
    records = list(read_event_log(path))
    gains: deque[dict[str, Any]] = deque(r for r in records if r["op"] == "gain")

    def logged_gain(monitor: LoadMonitor, survivor_id: int, num_draft_tokens: int) -> float:
        del monitor
        record = gains.popleft()
        if (record["survivor_id"], record["num_draft_tokens"]) != (survivor_id, num_draft_tokens):
            raise AssertionError(f"gain asked for {(survivor_id, num_draft_tokens)}, log has {record}")
        return float(record["value"])

    monitor = LoadMonitor(load_config)
    policies = policy(logged_gain)
    placement, router, planner = policies.placement, policies.router, policies.planner
    checked = 0
    for record in records:
        op = record["op"]
        if op == "event":
            monitor.apply(record["event"])
            continue
        if op == "gain":
            continue
        args = record["args"]
        if op == "place":
            result: Any = [placement.place(monitor, args["request_id"])]
        elif op == "route":
            result = router.route(monitor, args["failed_worker_id"])
        elif op == "move":
            result = [router.move(monitor, args["request_id"], reprefill=bool(args["reprefill"]))]
        elif op == "replace":
            result = placement.replace(monitor, args["lost_holder_id"])
        else:
            if planner is None:
                raise AssertionError(f"log has a {op} call but the policy has no assist planner")
            if op == "pair":
                result = [planner.pair(monitor, args["assistant_id"])]
            elif op == "finish":
                result = planner.finish(args["assistant_id"])
            else:
                result = planner.release_survivor(args["survivor_id"])
        expected = record["result"]
        if isinstance(result, list):
            result = [from_json(to_json(d)) for d in result]
        if result != expected:
            raise AssertionError(f"{op}({args}) gave {result}, the log has {expected}")
        checked += 1
    return checked
