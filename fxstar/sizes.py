"""Memory sizes as a user writes them: bytes, "4GiB", or a share of the model's parameters.

A share ("30%") cannot be turned into bytes until the model is known, so it stays a `Share`
until `Share.resolve(param_bytes)` is called; everything else becomes an int of bytes at once.

Units: KiB/MiB/GiB/TiB are binary (1024**k), KB/MB/GB/TB decimal (1000**k), and the shorthand
k/M/G/T (also K, Ki, ...) is binary, as in ``ulimit`` and most allocators. Units are matched
case-insensitively; a trailing "B" alone means bytes. Fractions of a byte are truncated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

__all__ = ["Share", "Size", "format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}ib": 1024**k for k, p in enumerate("kmgt", 1)},
    **{f"{p}i": 1024**k for k, p in enumerate("kmgt", 1)},
    **{p: 1024**k for k, p in enumerate("kmgt", 1)},
    **{f"{p}b": 1000**k for k, p in enumerate("kmgt", 1)},
}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z]*)\s*$")
_SHARE_RE = re.compile(rf"^\s*{_NUMBER}\s*%\s*$")
MAX_SHARE_PERCENT = 1000.0

FORMS = (
    "bytes as an int >= 0, a size string like '4GiB', '512MiB', '1.5 GB' or '100000', "
    "or a share of the model's parameter bytes like '30%' (0% < share <= 1000%)"
)


@dataclass(frozen=True)
class Share:
    """A budget given as a percentage of the model's parameter bytes, resolved later."""

    percent: float

    def resolve(self, param_bytes: int) -> int:
        """Bytes this share stands for, for a model with `param_bytes` bytes of parameters."""
        return int(param_bytes * self.percent / 100)

    def __str__(self) -> str:
        p = self.percent
        return f"{int(p)}%" if p == int(p) else f"{p!r}%"


Size = int | Share


def parse_size(value: object, field: str) -> Size:
    """Turn `value` into bytes (int) or a `Share`; ValueError names `field` and the forms."""
    if isinstance(value, Share):
        return value
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected {FORMS}; got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}: must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        if m := _SHARE_RE.match(value):
            percent = float(m.group(1))
            if not 0 < percent <= MAX_SHARE_PERCENT:
                raise ValueError(f"{field}: a share must be in (0%, 1000%], got {value!r}")
            return Share(percent)
        if (m := _SIZE_RE.match(value)) and m.group(2).lower() in _UNITS:
            try:
                number = Decimal(m.group(1))
            except InvalidOperation:  # pragma: no cover - the regex admits only decimals
                pass
            else:
                return int(number * _UNITS[m.group(2).lower()])
    raise ValueError(f"{field}: expected {FORMS}; got {value!r}")


def format_size(value: Size | None) -> str:
    """Short human form of a size: '4GiB', '1.5MiB', '123B', '30%', or 'None'."""
    if value is None or isinstance(value, Share):
        return str(value)
    for k, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if value >= 1024**k:
            return f"{value / 1024**k:.4g}{unit}"
    return f"{value}B"
