"""Argument checks shared by every area, in the one message form "`arg` must be ..., got ...".

A wrong Python type raises TypeError, a wrong value ValueError (STYLE.md, errors at the
boundary). Standard library and numpy only, so that the pure ``policy`` package may use it;
numpy integers count as ints because ids and counts often come out of numpy arrays.
"""

from __future__ import annotations

import math
import numbers
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# Bounds of the u32 and u64 fields of the wire formats (request ids, shards, epochs).
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def _bounds(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (either bound may be None: unbounded).

    Raises TypeError unless ``value`` is an int or a numpy integer (bool is not), ValueError
    when it lies outside the bounds.
    """
    if value.__class__ is not int:  # the common case skips the isinstance chain: ids are checked per event
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
        value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"`{name}` must be {_bounds(low, high)}, got {value}")
    return value


def check_number(
    name: str, value: object, low: float | None = None, high: float | None = None, *, positive: bool = False
) -> float:
    """``value`` as a float in ``[low, high]``, and ``> 0`` when ``positive``; NaN is refused.

    Raises TypeError unless ``value`` is a real number (bool is not), ValueError outside the
    bounds.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__}")
    number = float(value)
    if positive and not number > 0:
        raise ValueError(f"`{name}` must be > 0, got {value}")
    if low is None and high is None:
        if math.isnan(number):
            raise ValueError(f"`{name}` must be a number other than NaN, got {value}")
    elif math.isnan(number) or (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"`{name}` must be {_bounds(low, high)}, got {value}")
    return number


def check_bool(name: str, value: object) -> bool:
    """``value`` itself; TypeError unless it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")
    return value


def check_bytes(name: str, value: object, num_bytes: int | None = None) -> bytes:
    """``value`` as bytes, exactly ``num_bytes`` long when given.

    Raises TypeError unless ``value`` is bytes or a bytearray, ValueError for another length.
    """
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"`{name}` must be bytes, got {type(value).__name__}")
    if num_bytes is not None and len(value) != num_bytes:
        raise ValueError(f"`{name}` must be {num_bytes} bytes, got {len(value)}")
    return bytes(value)


def check_instance(name: str, value: object, cls: type[T], what: str | None = None) -> T:
    """``value`` itself; TypeError unless it is a ``cls`` (named ``what`` in the message, by
    default "a <class name>")."""
    if not isinstance(value, cls):
        raise TypeError(f"`{name}` must be {what or 'a ' + cls.__name__}, got {type(value).__name__}")
    return value
