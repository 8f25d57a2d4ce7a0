"""Sizes as people write them: '8GiB', '512MiB', '1.5GB', '4096'. One parser for the config,
the CLI and the benchmarks. KiB/MiB/GiB/TiB are binary; K/KB, M/MB, G/GB, T/TB decimal."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes; raises ValueError naming the text and how to write a size."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a size; write e.g. 8GiB, 512MiB, 256KiB or a byte count")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError("a size must not be negative")
    return value
