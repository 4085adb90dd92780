"""Speculative assist between a recovering worker and a survivor (docs/policies.md).

The channel is UDP datagrams of JSON on loopback (or the cluster network), at the port
number of each worker's holder listener (the holder uses TCP there, so the two do not
collide): the gateway's ASSIST_DRAFT / ASSIST_VERIFY directives name the peer's holder
address, and that is all either side needs. A lost datagram costs one round of drafts,
never correctness: the survivor verifies whatever arrives and never waits.

Survivor -> assistant (``sync``): per request, the token ids since what the assistant last
confirmed (``base``; the first sync sends the whole sequence: the assistant's cold start),
and the drafted / accepted counts of the survivor's last verify of that request.
Assistant -> survivor: per request, how many tokens it now knows (the next ``base``) and
``k`` greedy draft tokens that follow them. The assistant keeps its own draft KV per request
(``DraftProposer``: rolled back to the longest prefix that still matches).

Every datagram is sealed with the cluster secret (``lumen_core.auth.DatagramSeal``:
``HMAC-SHA256(secret, label || payload)`` then the JSON payload, which names the sending
endpoint and a counter). A datagram whose MAC does not verify, or that is not the sealed
JSON object, is dropped and counted (``seal.num_refused`` on either side); so is one whose
counter is not above the last one taken from its sender (``seal.num_replayed``: a replayed
sync would make the assistant draft again and count its drafted / accepted figures twice). verify_draft keeps
the output exact whatever the drafts, so what the seal protects is the assistant's compute
and the acceptance figures.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from lumen_core.auth import DatagramSeal
from lumen_core.engine import DraftProposer
from lumen_core.engine.config import CacheConfig
from lumen_core.engine.model import Llama
from lumen_core.stream import Address
from lumen_core.worker.engine_ids import engine_key

MAX_DATAGRAM = 65000


class Assistant:
    """The recovering worker's side: answers syncs with drafts from ``draft`` on a thread.

    ``num_draft_tokens()`` is read per sync (the planner's cold then warm draft length);
    0 = paired with nobody, syncs are ignored. Counters are cumulative since start."""

    def __init__(
        self,
        draft: Llama,
        host: str,
        port: int,
        num_draft_tokens: Callable[[], int],
        *,
        secret: bytes,
        num_blocks: int = 1024,
    ) -> None:
        self.seal = DatagramSeal(secret)
        self.proposer = DraftProposer(draft, CacheConfig(num_blocks=num_blocks))
        self.num_draft_tokens = num_draft_tokens
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((host, port))
        self.socket.settimeout(0.1)
        self.steps = 0
        self.proposed = 0
        self.accepted = 0
        self._tokens: dict[int, list[int]] = {}  # by gateway request id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lumen-assistant", daemon=True)

    def start(self) -> Assistant:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, sender = self.socket.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return
            messages = self._take([], data)
            self.socket.setblocking(False)
            try:  # syncs that queued while drafting: take their tokens, draft once for all
                while True:
                    data, sender = self.socket.recvfrom(MAX_DATAGRAM)
                    messages = self._take(messages, data)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return
            finally:
                self.socket.settimeout(0.1)
            k = self.num_draft_tokens()
            if k <= 0 or not messages:
                continue
            reply = self.answer(messages, k)
            try:
                self.socket.sendto(self.seal.seal(reply), sender)
            except OSError:
                continue  # the survivor is gone; it decodes without us

    def _take(self, messages: list[dict[str, Any]], data: bytes) -> list[dict[str, Any]]:
        message = self.seal.open(data)
        return messages if message is None else [*messages, message]

    def answer(self, messages: list[dict[str, list[list[object]]]], k: int) -> dict[str, list[list[object]]]:
        """Take the tokens of each sync in order, then draft ``k`` tokens for every request
        of the last one (one draft step for all)."""
        self.steps += 1
        for message in messages:
            for request_id, base, new_tokens, proposed, accepted in message.get("r", []):
                request_id = int(request_id)  # type: ignore[call-overload]
                self.proposed += int(proposed)  # type: ignore[call-overload]
                self.accepted += int(accepted)  # type: ignore[call-overload]
                known = self._tokens.get(request_id, [])
                if int(base) > len(known):  # type: ignore[call-overload]
                    continue  # a sync was lost: the reply's `have` asks for a resend
                self._tokens[request_id] = known[: int(base)] + [int(t) for t in new_tokens]  # type: ignore[call-overload, union-attr]
            for request_id in message.get("f", []):
                request_id = int(request_id)  # type: ignore[call-overload]
                self._tokens.pop(request_id, None)
                self.proposer.release(engine_key(request_id))
        request_ids = [int(r[0]) for r in messages[-1].get("r", []) if int(r[0]) in self._tokens]  # type: ignore[call-overload]
        drafts = (
            self.proposer.propose({engine_key(r): self._tokens[r] for r in request_ids}, k)
            if request_ids
            else {}
        )
        return {"r": [[r, len(self._tokens[r]), drafts.get(engine_key(r), [])] for r in request_ids]}

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self.socket.close()


class AssistedRequests:
    """The survivor's side: ``sync`` after a step, ``drafts`` before the next (never blocks)."""

    def __init__(self, peer: Address, peer_worker_id: int, *, secret: bytes, max_requests: int = 32) -> None:
        self.seal = DatagramSeal(secret)
        self.peer = peer
        self.peer_worker_id = peer_worker_id
        self.max_requests = max_requests
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("127.0.0.1" if peer[0] in ("127.0.0.1", "localhost") else "", 0))
        self.socket.setblocking(False)
        self._sent: dict[int, int] = {}
        self._finished: list[int] = []

    def drafts(self) -> dict[int, tuple[int, list[int]]]:
        """Drafts that arrived since the last call: request -> (position of the first, ids)."""
        out: dict[int, tuple[int, list[int]]] = {}
        while True:
            try:
                data = self.socket.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:
                return out
            message = self.seal.open(data)
            if message is None:
                continue
            for request_id, have, tokens in message.get("r", []):
                self._sent[int(request_id)] = min(self._sent.get(int(request_id), 0), int(have))
                if tokens:
                    out[int(request_id)] = (int(have), [int(t) for t in tokens])

    def finished(self, request_id: int) -> None:
        if self._sent.pop(request_id, None) is not None:
            self._finished.append(request_id)

    def sync(self, requests: dict[int, list[int]], counts: dict[int, tuple[int, int]]) -> None:
        """Send each request's tokens since what the assistant has, with the (drafted,
        accepted) counts of its last verify."""
        entries = []
        for request_id, tokens in list(requests.items())[: self.max_requests]:
            base = min(self._sent.get(request_id, 0), len(tokens))
            proposed, accepted = counts.get(request_id, (0, 0))
            entries.append([request_id, base, tokens[base:], proposed, accepted])
            self._sent[request_id] = len(tokens)
        message = self.seal.seal({"r": entries, "f": self._finished})
        self._finished = []
        if len(message) > MAX_DATAGRAM:
            return  # too long to sync in one datagram this step: no drafts for now
        try:
            self.socket.sendto(message, self.peer)
        except OSError:
            return

    def close(self) -> None:
        self.socket.close()
