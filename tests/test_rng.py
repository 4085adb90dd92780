import numpy as np
import pytest

from lumen_core import rng


def test_philox_known_answers():
    # Known-answer vectors of Random123 (kat_vectors, philox4x32_10).
    zero = rng.philox4x32(np.zeros(4, np.uint32), np.zeros(2, np.uint32))
    assert [hex(x) for x in zero] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]
    ones = rng.philox4x32(np.full(4, 0xFFFFFFFF, np.uint32), np.full(2, 0xFFFFFFFF, np.uint32))
    assert [hex(x) for x in ones] == ["0x408f276d", "0x41c83b0e", "0xa20bc7c6", "0x6d5451fd"]
    pi = rng.philox4x32(
        np.array([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], np.uint32),
        np.array([0xA4093822, 0x299F31D0], np.uint32),
    )
    assert [hex(x) for x in pi] == ["0xd16cfe09", "0x94fdcceb", "0x5001e420", "0x24126ea1"]


def test_uniforms_depend_only_on_seed_position_index():
    u = rng.uniforms(np.array([7, 7, 8]), np.array([3, 4, 3]))
    assert u.shape == (3,) and np.all((u >= 0) & (u < 1))
    assert u[0] == rng.uniforms(7, 3) and u[2] == rng.uniforms(8, 3)
    assert len(set(u.tolist())) == 3
    assert rng.uniforms(7, 3, index=1) != u[0]


def test_uniforms_are_uniform():
    u = rng.uniforms(12345, np.arange(200_000))
    hist, _ = np.histogram(u, bins=20, range=(0, 1))
    expected = len(u) / 20
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 43.8  # chi-square 19 dof, p = 0.001


def test_uniforms_reject_bad_input():
    with pytest.raises(ValueError, match="`positions` must be >= 0"):
        rng.uniforms(1, np.array([-1]))
    with pytest.raises(ValueError, match="`index` must be in"):
        rng.uniforms(1, 0, index=-1)
