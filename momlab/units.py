"""Byte sizes: parse "2GiB"-style budgets, print bytes for people.

Sizes are stored as int bytes everywhere and turned into units only here, when
displayed (the MemTracker convention).
"""

from __future__ import annotations

import numbers
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value) -> int:
    """Return a byte count from an int or a string such as "2GiB", "512MiB", "16GB".

    >>> parse_bytes("2GiB"), parse_bytes("1.5 kB"), parse_bytes(1024)
    (2147483648, 1500, 1024)
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid byte size {value!r}")
    if isinstance(value, numbers.Integral):  # numpy ints too (DataFrame cells)
        if value < 0:
            raise ValueError(f"byte size must not be negative, got {value}")
        return int(value)
    if isinstance(value, numbers.Real):
        if value < 0 or value != value:
            raise ValueError(f"byte size must be a non-negative number, got {value}")
        return int(value)
    if isinstance(value, str):
        if value.strip().startswith("-"):
            raise ValueError(f"byte size must not be negative, got {value!r}")
        m = _PATTERN.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(
        f"cannot parse byte size {value!r}; give an int of bytes or a number with a unit "
        f"(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '2GiB'"
    )


def format_bytes(n: float | int | None) -> str:
    """Human-readable binary units: format_bytes(3 * 2**30) == '3.00 GiB'."""
    if n is None or n != n:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
