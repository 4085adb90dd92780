"""lumen_core.auth's gateway-plane schemes: call signatures over the whole body bound to a
gateway instance, reply seals bound to their call and place, the per-worker call keys, and
assist datagram seals with replay counters; their wire bytes pinned (a changed label or
layout would break peers of another build)."""

import hashlib
import hmac
import json

import pytest

from lumen_core import _native
from lumen_core.auth import (
    CLUSTER_PRINCIPAL,
    REPLY_MAC_BYTES,
    CallRefused,
    CallVerifier,
    CredentialTable,
    DatagramSeal,
    ReplyForged,
    check_exchange_key,
    generate_exchange_key,
    new_instance_id,
    open_reply,
    parse_worker_principal,
    seal_reply,
    sign_call,
    unwrap_call_key,
    worker_principal,
    wrap_call_key,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-cluster"
METHOD = "/lumen.gateway.v1.Gateway/Heartbeat"
INSTANCE = "a" * 32
BODY = b"\x08\x01\x10\x02"


def keys(principal):
    return SECRET if principal == CLUSTER_PRINCIPAL else None


def signed(body=BODY, *, key=SECRET, instance_id=INSTANCE, principal=CLUSTER_PRINCIPAL, now_s=1000.0):
    return sign_call(key, instance_id=instance_id, principal=principal, method=METHOD, body=body, now_s=now_s)


def refusal(verifier, value, body=BODY, method=METHOD, now_s=1000.0):
    with pytest.raises(CallRefused) as info:
        verifier.verify(method, value, body, keys, now_s=now_s)
    return info.value


def test_call_signature_accepted_once_and_only_with_its_key():
    verifier = CallVerifier(INSTANCE, max_skew_s=30.0)
    value = signed()
    assert verifier.verify(METHOD, value, BODY, keys, now_s=1010.0) == CLUSTER_PRINCIPAL
    assert refusal(verifier, value, now_s=1010.0).reason == "nonce replayed"
    assert refusal(verifier, signed(), method="/lumen.gateway.v1.Gateway/Register").reason.startswith(
        "bad MAC"
    )  # signed for another method
    assert refusal(verifier, signed(key=b"some-other-secret-entirely")).reason == (
        "bad MAC: the caller does not hold the key of cluster"
    )
    assert "more than 30.0 s from now" in refusal(verifier, signed(), now_s=1031.0).reason
    assert refusal(verifier, None).reason == "missing lumen-call-v3 metadata"
    assert refusal(verifier, "a.b.c").reason == "malformed lumen-call-v3 metadata"
    unknown = refusal(verifier, signed(principal=worker_principal(3, 1)))
    assert unknown.reason == "unknown principal 'worker-3-1' at this gateway instance"
    assert verifier.num_refused == 7


def test_call_mac_covers_the_whole_body():
    verifier = CallVerifier(INSTANCE)
    value = signed(b"\x08\x01")
    # The header alone does not carry the call: another body under it is refused.
    assert refusal(verifier, value, body=b"\x08\x02").reason.startswith("bad MAC")
    assert refusal(verifier, value, body=b"\x08\x01\x10\x05").reason.startswith("bad MAC")
    assert verifier.verify(METHOD, value, b"\x08\x01", keys, now_s=1000.0) == CLUSTER_PRINCIPAL


def test_a_call_signed_for_one_gateway_instance_is_refused_by_another():
    first, restarted = new_instance_id(), new_instance_id()
    assert first != restarted and len(first) == 32
    value = signed(instance_id=first)
    refused = refusal(CallVerifier(restarted), value)
    assert refused.stale_instance and f"this is {restarted}" in refused.reason
    # The instance is inside the MAC too: rewriting it in the header breaks the MAC.
    forged = value.replace(first, restarted, 1)
    refused = refusal(CallVerifier(restarted), forged)
    assert not refused.stale_instance and refused.reason.startswith("bad MAC")


def test_call_mac_is_the_label_header_fields_and_body():
    value = signed(principal=worker_principal(4, 2), key=b"k" * 32, now_s=1234.5)
    instance_id, principal, timestamp, nonce, mac = value.split(".")
    assert (instance_id, principal, timestamp, len(nonce)) == (INSTANCE, "worker-4-2", "1234500000", 32)
    message = f"lumen-gateway-v3|{INSTANCE}|worker-4-2|{METHOD}|{timestamp}|{nonce}|".encode() + BODY
    assert mac == hmac.new(b"k" * 32, message, hashlib.sha256).hexdigest()


def test_a_reply_seal_is_the_label_call_value_index_and_body_and_binds_all_of_them():
    value = signed(principal=worker_principal(4, 2), key=b"k" * 32)
    sealed = seal_reply(b"k" * 32, value, 3, BODY)
    message = f"lumen-reply-v3|{value}|3|".encode() + BODY
    assert sealed == hmac.new(b"k" * 32, message, hashlib.sha256).digest() + BODY
    assert len(sealed) == REPLY_MAC_BYTES + len(BODY)
    assert open_reply(b"k" * 32, value, 3, sealed) == BODY
    other_call = signed(principal=worker_principal(4, 2), key=b"k" * 32)  # another nonce
    altered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for key, call, index, data in (
        (b"x" * 32, value, 3, sealed),  # another key: not the gateway's for this call
        (b"k" * 32, other_call, 3, sealed),  # moved to another call
        (b"k" * 32, value, 4, sealed),  # moved within its stream (reordered, repeated)
        (b"k" * 32, value, 3, altered),
        (b"k" * 32, value, 3, sealed[: REPLY_MAC_BYTES - 1]),  # shorter than a MAC
    ):
        with pytest.raises(ReplyForged):
            open_reply(key, call, index, data)


def test_call_verifier_forgets_old_nonces_but_still_refuses_old_calls():
    verifier = CallVerifier(INSTANCE, max_skew_s=1.0)
    first = signed(now_s=0.0)
    assert verifier.verify(METHOD, first, BODY, keys, now_s=0.0) == CLUSTER_PRINCIPAL
    for _ in range(4100):
        assert verifier.verify(METHOD, signed(now_s=10.0), BODY, keys, now_s=10.0) == CLUSTER_PRINCIPAL
    assert verifier.num_nonces < 4200
    assert refusal(verifier, first, now_s=10.0).reason.startswith("timestamp")


def test_call_signing_validation():
    with pytest.raises(ValueError, match="`max_skew_s` must be > 0, got 0"):
        CallVerifier(INSTANCE, max_skew_s=0)
    with pytest.raises(TypeError, match="`max_skew_s` must be a number, got str"):
        CallVerifier(INSTANCE, max_skew_s="30")
    with pytest.raises(ValueError, match="`instance_id` must be a non-empty str, got ''"):
        CallVerifier("")
    with pytest.raises(ValueError, match=r"`principal` must be non-empty without '\.' or '\|', got 'a\.b'"):
        signed(principal="a.b")
    with pytest.raises(ValueError, match=r"`instance_id` must be non-empty without"):
        signed(instance_id="x|y")
    with pytest.raises(TypeError, match="`body` must be bytes, got str"):
        signed(body="text")
    with pytest.raises(ValueError, match="`secret` must be at least 16 bytes, got 3"):
        signed(key=b"abc")
    with pytest.raises(ValueError, match=r"`worker_id` must be in \[0, 2147483647\], got -1"):
        worker_principal(-1, 1)
    with pytest.raises(ValueError, match=r"`epoch` must be in \[0, 4294967295\], got 4294967296"):
        worker_principal(1, 2**32)


def test_worker_principals_parse_one_spelling_only():
    assert parse_worker_principal(worker_principal(7, 3)) == (7, 3)
    for other in ("cluster", "worker-07-3", "worker-7", "worker--7-3", "worker-7-3-1", "worker-x-1", "w-1-1"):
        assert parse_worker_principal(other) is None, other
    assert parse_worker_principal(f"worker-1-{2**32}") is None


def test_credential_table_issues_random_keys_and_keeps_the_newest_two_epochs():
    table = CredentialTable()
    first = table.issue(3, 1)
    second = table.issue(3, 2)
    assert len(first) == 32 and first != second and table.issue(4, 1) not in (first, second)
    assert table.key_of("worker-3-1") == first and table.key_of("worker-3-2") == second
    third = table.issue(3, 3)
    assert table.key_of("worker-3-1") is None  # two incarnations back: refused
    assert (table.key_of("worker-3-2"), table.key_of("worker-3-3")) == (second, third)
    assert table.key_of("worker-9-1") is None and table.key_of(CLUSTER_PRINCIPAL) is None


def test_a_worker_key_signs_only_its_own_principal():
    table = CredentialTable()
    key = table.issue(1, 1)
    table.issue(2, 1)
    verifier = CallVerifier(INSTANCE)

    def key_of(principal):
        return table.key_of(principal)

    value = signed(key=key, principal="worker-1-1")
    assert verifier.verify(METHOD, value, BODY, key_of, now_s=1000.0) == "worker-1-1"
    with pytest.raises(CallRefused, match="bad MAC: the caller does not hold the key of worker-2-1"):
        verifier.verify(METHOD, signed(key=key, principal="worker-2-1"), BODY, key_of, now_s=1000.0)


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
    assert (receiver.num_refused, receiver.num_replayed) == (6, 0)
    with pytest.raises(ValueError, match="`secret` must be at least 16 bytes, got 3"):
        DatagramSeal(b"abc")


def test_a_call_key_is_sent_wrapped_under_a_pad_of_the_secret_and_a_key_exchange(ucx_module):
    key = bytes(range(32))
    worker = generate_exchange_key()
    salt, wrapped, gateway_key = wrap_call_key(
        SECRET, key, instance_id=INSTANCE, principal="worker-1-1", worker_exchange_key=worker[1]
    )
    assert len(salt) == 16 and wrapped != key and len(gateway_key) == 32
    shared = _native.require_ucx().exchange_shared_secret(worker[0], gateway_key)
    message = f"lumen-call-key-v2|{INSTANCE}|worker-1-1|".encode() + salt + shared + worker[1] + gateway_key
    pad = hmac.new(SECRET, message, hashlib.sha256).digest()
    assert wrapped == bytes(a ^ b for a, b in zip(key, pad, strict=True))

    def unwrap(secret=SECRET, principal="worker-1-1", instance_id=INSTANCE, exchange_key=worker, salt=salt):
        return unwrap_call_key(
            secret,
            wrapped,
            salt,
            instance_id=instance_id,
            principal=principal,
            exchange_key=exchange_key,
            gateway_exchange_key=gateway_key,
        )

    assert unwrap() == key
    # Without the secret, for another principal or instance, or without the worker's private
    # exchange key (what a worker reading the network lacks), the pad is another one.
    for wrong in (
        {"secret": b"another-cluster-secret-000000"},
        {"principal": "worker-2-1"},
        {"instance_id": "b" * 32},
        {"exchange_key": (generate_exchange_key()[0], worker[1])},
    ):
        assert unwrap(**wrong) != key, wrong
    again = wrap_call_key(
        SECRET, key, instance_id=INSTANCE, principal="worker-1-1", worker_exchange_key=worker[1]
    )
    assert again[0] != salt and again[2] != gateway_key  # fresh salt, fresh gateway key pair
    with pytest.raises(ValueError, match="`key` must be 32 bytes, got 3"):
        wrap_call_key(
            SECRET, b"abc", instance_id=INSTANCE, principal="worker-1-1", worker_exchange_key=worker[1]
        )
    with pytest.raises(ValueError, match="`worker_exchange_key` must be 32 bytes, got 2"):
        wrap_call_key(SECRET, key, instance_id=INSTANCE, principal="worker-1-1", worker_exchange_key=b"ab")
    with pytest.raises(ValueError, match="must be a usable X25519 key"):
        wrap_call_key(
            SECRET, key, instance_id=INSTANCE, principal="worker-1-1", worker_exchange_key=bytes(32)
        )
    with pytest.raises(ValueError, match="`salt` must be 16 bytes, got 2"):
        unwrap(salt=b"ab")
    with pytest.raises(ValueError, match="`exchange_public_key` must be a usable X25519 public key"):
        check_exchange_key("exchange_public_key", bytes(32))
