"""lumen_core._validate: every branch of the shared argument checks and their one wording."""

import math

import numpy as np
import pytest

from lumen_core._validate import check_bool, check_bytes, check_instance, check_int, check_number


def test_check_int_returns_plain_ints() -> None:
    assert check_int("n", 3) == 3
    value = check_int("n", np.int64(7), 0, 10)
    assert value == 7 and type(value) is int
    assert check_int("n", -(2**70)) == -(2**70)  # unbounded by default


@pytest.mark.parametrize(
    ("value", "low", "high", "error", "match"),
    [
        (True, None, None, TypeError, "`n` must be an int, got bool"),
        (1.0, None, None, TypeError, "`n` must be an int, got float"),
        ("1", 0, None, TypeError, "`n` must be an int, got str"),
        (-1, 0, None, ValueError, "`n` must be >= 0, got -1"),
        (11, None, 10, ValueError, "`n` must be <= 10, got 11"),
        (np.uint8(200), 0, 100, ValueError, r"`n` must be in \[0, 100\], got 200"),
    ],
)
def test_check_int_refuses(value: object, low: int | None, high: int | None, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        check_int("n", value, low, high)


def test_check_number_returns_floats() -> None:
    assert check_number("x", 2) == 2.0 and type(check_number("x", 2)) is float
    assert check_number("x", np.float32(0.5), 0, 1) == 0.5
    assert check_number("x", math.inf, positive=True) == math.inf


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "match"),
    [
        (False, {}, TypeError, "`x` must be a number, got bool"),
        ("1", {}, TypeError, "`x` must be a number, got str"),
        (0, {"positive": True}, ValueError, "`x` must be > 0, got 0"),
        (math.nan, {"positive": True}, ValueError, "`x` must be > 0, got nan"),
        (math.nan, {}, ValueError, "`x` must be a number other than NaN, got nan"),
        (math.nan, {"low": 0}, ValueError, "`x` must be >= 0, got nan"),
        (-0.5, {"low": 0}, ValueError, "`x` must be >= 0, got -0.5"),
        (1.5, {"low": 0, "high": 1}, ValueError, r"`x` must be in \[0, 1\], got 1.5"),
        (3, {"high": 2}, ValueError, "`x` must be <= 2, got 3"),
    ],
)
def test_check_number_refuses(value: object, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        check_number("x", value, **kwargs)


def test_check_bool() -> None:
    assert check_bool("flag", False) is False
    with pytest.raises(TypeError, match="`flag` must be a bool, got int"):
        check_bool("flag", 1)


def test_check_bytes() -> None:
    assert check_bytes("key", bytearray(b"ab")) == b"ab"
    assert check_bytes("key", b"abcd", 4) == b"abcd"
    with pytest.raises(TypeError, match="`key` must be bytes, got str"):
        check_bytes("key", "ab")
    with pytest.raises(ValueError, match="`key` must be 4 bytes, got 2"):
        check_bytes("key", b"ab", 4)


def test_check_instance() -> None:
    value = [1]
    assert check_instance("items", value, list) is value
    with pytest.raises(TypeError, match="`items` must be a list, got tuple"):
        check_instance("items", (1,), list)
    with pytest.raises(TypeError, match="`config` must be an AssistConfig, got dict"):
        check_instance("config", {}, int, "an AssistConfig")
