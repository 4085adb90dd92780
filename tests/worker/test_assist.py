"""The assist channel in one process: an Assistant drafting for an AssistedRequests survivor."""

import socket
import time

import pytest

from lumen_core.engine import DraftProposer, ModelConfig, build_draft_pair
from lumen_core.worker.assist import Assistant, AssistedRequests

SECRET = b"assist-test-secret-0123456789"


def _pair():
    return build_draft_pair(ModelConfig(), seed=0, draft_num_layers=1, late_layer_scale=0.0, dtype="float64")


def test_proposer_drafts_again_after_its_own_draft_came_true() -> None:
    _, draft = _pair()
    proposer = DraftProposer(draft)
    tokens = [1, 2, 3, 4]
    first = proposer.propose({"a": tokens}, 3)["a"]
    # the survivor accepted exactly the first draft token: every KV is already computed
    again = proposer.propose({"a": tokens + first[:1]}, 3)["a"]
    assert again == first[1:] + again[2:]


def test_assistant_answers_syncs_with_drafts_the_target_accepts() -> None:
    target, draft = _pair()  # late_layer_scale 0: the draft is the target, every draft is right
    assistant = Assistant(draft, "127.0.0.1", 0, lambda: 3, secret=SECRET).start()
    port = assistant.socket.getsockname()[1]
    survivor = AssistedRequests(("127.0.0.1", port), peer_worker_id=1, secret=SECRET)
    try:
        tokens = [5, 6, 7, 8, 9]
        survivor.sync({7: tokens}, {})
        deadline = time.monotonic() + 10
        drafts = {}
        while not drafts and time.monotonic() < deadline:
            drafts = survivor.drafts()
            time.sleep(0.01)
        assert drafts[7][0] == len(tokens) and len(drafts[7][1]) == 3
        proposer = DraftProposer(target)
        assert drafts[7][1] == proposer.propose({"x": tokens}, 3)["x"]
        survivor.sync({7: tokens + drafts[7][1] + [1]}, {7: (3, 3)})
        deadline = time.monotonic() + 10
        while assistant.accepted < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (assistant.proposed, assistant.accepted) == (3, 3)
    finally:
        survivor.close()
        assistant.stop()


def test_assistant_ignores_syncs_while_unpaired() -> None:
    _, draft = _pair()
    assistant = Assistant(draft, "127.0.0.1", 0, lambda: 0, secret=SECRET).start()
    survivor = AssistedRequests(
        ("127.0.0.1", assistant.socket.getsockname()[1]), peer_worker_id=1, secret=SECRET
    )
    try:
        survivor.sync({1: [1, 2, 3]}, {})
        time.sleep(0.3)
        assert survivor.drafts() == {} and assistant.steps == 0
    finally:
        survivor.close()
        assistant.stop()


def test_assist_sides_refuse_a_missing_secret() -> None:
    with pytest.raises(ValueError, match="`secret` must be given"):
        AssistedRequests(("127.0.0.1", 9), peer_worker_id=1, secret=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`secret` must be bytes, got str"):
        AssistedRequests(("127.0.0.1", 9), peer_worker_id=1, secret="not-bytes-but-long-enough")  # type: ignore[arg-type]


def test_assistant_drops_datagrams_without_the_secret() -> None:
    _, draft = _pair()
    assistant = Assistant(draft, "127.0.0.1", 0, lambda: 3, secret=SECRET).start()
    address = ("127.0.0.1", assistant.socket.getsockname()[1])
    rogue = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    forged = AssistedRequests(address, peer_worker_id=1, secret=b"not-the-cluster-secret-00000")
    try:
        rogue.sendto(b'{"r": [[1, 0, [1, 2, 3], 0, 0]], "f": []}', address)  # unsealed
        rogue.sendto(b"\xff" * 40, address)  # garbage
        forged.sync({1: [1, 2, 3]}, {})  # sealed under another secret
        deadline = time.monotonic() + 10
        while assistant.seal.num_refused < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert assistant.seal.num_refused == 3
        assert assistant.steps == 0 and forged.drafts() == {}
    finally:
        rogue.close()
        forged.close()
        assistant.stop()


def test_assistant_drops_a_replayed_sync_and_counts_it() -> None:
    _, draft = _pair()
    assistant = Assistant(draft, "127.0.0.1", 0, lambda: 3, secret=SECRET).start()
    address = ("127.0.0.1", assistant.socket.getsockname()[1])
    tap = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # what an eavesdropper captured
    tap.bind(("127.0.0.1", 0))
    tap.settimeout(10)
    survivor = AssistedRequests(tap.getsockname(), peer_worker_id=1, secret=SECRET)
    try:
        survivor.sync({1: [1, 2, 3]}, {1: (3, 2)})
        captured = tap.recv(65536)
        for _ in range(3):  # delivered once, then replayed twice
            tap.sendto(captured, address)
        deadline = time.monotonic() + 10
        while assistant.steps < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the replays have arrived by now
        # The replays counted nothing twice: one sync's drafted / accepted figures.
        assert (assistant.proposed, assistant.accepted) == (3, 2)
        assert (assistant.seal.num_replayed, assistant.seal.num_refused) == (2, 0)
    finally:
        tap.close()
        survivor.close()
        assistant.stop()
