"""crc32c: known vectors, hardware vs table path, chaining, records vs the reference."""

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core import _native, reference
from lumen_core.ops import checksum

C = _native.require_cpu()


def test_standard_check_value():
    assert C.crc32c(b"123456789") == 0xE3069283
    assert C.crc32c(b"123456789", portable=True) == 0xE3069283
    assert reference.crc32c(b"123456789") == 0xE3069283


def test_known_vectors():
    # RFC 3720 (iSCSI) appendix B.4 test vectors.
    assert C.crc32c(bytes(32)) == 0x8A9136AA
    assert C.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert C.crc32c(bytes(range(32))) == 0x46DD794E
    assert C.crc32c(b"") == 0


def test_is_not_plain_crc32():
    assert C.crc32c(b"123456789") != zlib.crc32(b"123456789")


# Lengths around the 3x256 and 3x8192 block boundaries of the interleaved loop.
@pytest.mark.parametrize("num_bytes", [1, 7, 8, 767, 768, 769, 24575, 24576, 24577, 60001])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_hardware_matches_table_and_chains(num_bytes, offset):
    data = torch.randint(0, 256, (num_bytes + offset,), dtype=torch.uint8).numpy()[offset:]
    fast = C.crc32c(data)
    assert fast == C.crc32c(data, portable=True)
    cut = num_bytes // 3
    assert C.crc32c(data[cut:], C.crc32c(data[:cut])) == fast


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=2000), st.integers(0, 0xFFFFFFFF))
def test_matches_reference_bytewise(data, crc):
    assert C.crc32c(data, crc) == reference.crc32c(data, crc)


@pytest.mark.parametrize("num_records,record_bytes", [(0, 16), (1, 1), (3, 0), (17, 100), (257, 64)])
@pytest.mark.parametrize("num_threads", [1, 2, 5])
def test_records_match_reference(num_records, record_bytes, num_threads):
    records = torch.randint(0, 256, (num_records, record_bytes), dtype=torch.uint8)
    got = checksum(records, num_threads=num_threads)
    assert got.dtype == torch.uint32 and got.shape == (num_records,)
    assert torch.equal(got, reference.checksum(records))


def test_records_flip_one_bit_changes_only_that_crc():
    records = torch.randint(0, 256, (8, 4096), dtype=torch.uint8)
    before = checksum(records)
    records[5, 1234] ^= 0x10
    after = checksum(records)
    assert (before != after).tolist() == [i == 5 for i in range(8)]


def test_records_must_be_tensor():
    with pytest.raises(TypeError, match="`records` must be a torch.Tensor, got bytes"):
        checksum(b"abc")


def test_records_dtype():
    with pytest.raises(ValueError, match="`records` must have dtype torch.uint8, got torch.int32"):
        checksum(torch.zeros(2, 4, dtype=torch.int32))


def test_records_rank():
    with pytest.raises(ValueError, match=r"`records` must be 2-D \[n, record_bytes\], got shape \(8,\)"):
        checksum(torch.zeros(8, dtype=torch.uint8))


def test_records_contiguous():
    with pytest.raises(ValueError, match="`records` must be C-contiguous"):
        checksum(torch.zeros(4, 8, dtype=torch.uint8).t())


def test_num_threads_type():
    with pytest.raises(TypeError, match="`num_threads` must be an int, got float"):
        checksum(torch.zeros(2, 4, dtype=torch.uint8), num_threads=2.0)


def test_num_threads_value():
    with pytest.raises(ValueError, match="`num_threads` must be >= 1, got 0"):
        checksum(torch.zeros(2, 4, dtype=torch.uint8), num_threads=0)


def test_records_device():
    with pytest.raises(ValueError, match="`records` must be on the CPU, got device meta"):
        checksum(torch.zeros(2, 4, dtype=torch.uint8, device="meta"))
