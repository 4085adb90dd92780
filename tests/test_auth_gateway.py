"""lumen_core.auth's gateway-plane schemes: assist datagram seals with replay counters, their
wire bytes pinned (a changed label or layout would break peers of another build)."""

import hashlib
import hmac
import json

import pytest

from lumen_core.auth import DatagramSeal, issue_capability

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-cluster"


def test_a_datagram_is_opened_once_and_old_counters_are_dropped():
    sender, receiver = DatagramSeal(SECRET), DatagramSeal(SECRET)
    first, second = sender.seal({"r": [[1, 0, [5], 0, 0]]}), sender.seal({"r": []})
    assert receiver.open(second) == {"r": []}
    assert receiver.open(first) is None  # an older counter than one already opened
    assert receiver.open(second) is None  # a replay
    assert (receiver.num_replayed, receiver.num_refused) == (2, 0)
    third = sender.seal({"f": [1]})
    assert receiver.open(third) == {"f": [1]}
    # Counters are per sender: another endpoint's first datagram is taken.
    assert receiver.open(DatagramSeal(SECRET).seal({"f": []})) == {"f": []}


def test_a_datagram_is_the_mac_of_the_label_and_payload_then_the_payload():
    seal = DatagramSeal(SECRET)
    data = seal.seal({"r": []})
    payload = json.dumps({"s": seal.sender_id, "n": 1, "m": {"r": []}}).encode()
    assert data == hmac.new(SECRET, b"lumen-assist-v2|" + payload, hashlib.sha256).digest() + payload


def test_a_datagram_with_a_bad_mac_or_shape_is_refused():
    receiver = DatagramSeal(SECRET)
    data = DatagramSeal(SECRET).seal({"r": []})
    assert DatagramSeal(b"another-cluster-secret-000000").open(data) is None
    assert receiver.open(data[:-2] + b"9}") is None
    assert receiver.open(data[:10]) is None

    def sealed(payload):
        return hmac.new(SECRET, b"lumen-assist-v2|" + payload, hashlib.sha256).digest() + payload

    for payload in (b"not json", b"[1, 2]", b'{"s": "x", "n": "1", "m": {}}', b'{"s": "x", "n": 1, "m": []}'):
        assert receiver.open(sealed(payload)) is None, payload
    # A capability is never a valid seal of its own bytes: each scheme has its own label.
    assert receiver.open(issue_capability(SECRET, 5, 0, 1) + b"{}") is None
    assert (receiver.num_refused, receiver.num_replayed) == (7, 0)
    with pytest.raises(ValueError, match="`secret` must be at least 16 bytes, got 3"):
        DatagramSeal(b"abc")
