"""Sizes and durations as people write them, one parser each for the config, the CLI and the
benchmarks.

Sizes: '8GiB', '512MiB', '1.5GB', '4096', and Kubernetes' quantities '8Gi', '512Mi',
'100Ki', '1Ti'. KiB/MiB/GiB/TiB/PiB and Ki/Mi/Gi/Ti/Pi are binary (powers of 1024);
K/KB, M/MB, G/GB, T/TB, P/PB decimal (powers of 1000). Units are case-insensitive.

Durations: Go's and Kubernetes' spelling, '1h', '90m', '30s', '500ms', '1h30m', '2m30s'
(units ns, us, ms, s, m, h, lower case, one or more parts), or a bare number of seconds
('2', '0.5').
"""
from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "p": 10**15, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")

_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
#: Seconds per unit of a duration part; "ms" is tried before "m" and "s".
_SECONDS = {"ns": Fraction(1, 10**9), "us": Fraction(1, 10**6), "µs": Fraction(1, 10**6), "μs": Fraction(1, 10**6),
            "ms": Fraction(1, 1000), "s": Fraction(1), "m": Fraction(60), "h": Fraction(3600)}
_PART = re.compile(rf"\s*({_NUMBER})\s*(ns|us|µs|μs|ms|s|m|h)")
_BARE = re.compile(rf"\s*({_NUMBER})\s*")


def parse_size(text: str | int) -> int:
    """Bytes; raises ValueError naming the text and how to write a size."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a size; write e.g. 8GiB, 512MiB, 256KiB, 8Gi, 1.5GB "
                             "or a byte count")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError("a size must not be negative")
    return value


def parse_duration(text: str | float) -> float:
    """Seconds, from '1h30m', '90m', '2m30s', '500ms', '30s', a bare number of seconds, or an
    int or float of seconds; raises ValueError naming the text and how to write a duration."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"cannot read {text!r} as a duration; write a finite number of seconds")
    else:
        s = str(text)
        bare = _BARE.fullmatch(s)
        if bare:
            value = float(bare.group(1))
        else:
            total, end = Fraction(0), 0  # exact, so that 300ms is 0.3 and 1h30m is 5400.0
            for m in _PART.finditer(s):
                if m.start() != end:
                    break
                total += Fraction(m.group(1)) * _SECONDS[m.group(2)]
                end = m.end()
            if end == 0 or s[end:].strip():
                raise ValueError(f"cannot read {text!r} as a duration; write e.g. 30s, 500ms, 5m, 1h30m "
                                 "or a number of seconds")
            value = float(total)
    if value < 0:
        raise ValueError("a duration must not be negative")
    return value
