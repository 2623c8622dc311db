"""Parse the unit strings a person types: `10Gbit`, `1.5Gbit/s`, `20us`, `256MiB`, `4MB`, `1.3B`.

Conventions (one place, so the CLI, the Python API and calibration files agree):

* **rates**: `bit` / `b` mean bits, `B` means bytes; `10Gbit`, `10Gb/s`, `10Gbps` are 10e9 bit/s and
  `1.25GB/s`, `1GiB/s` are bytes per second. A bare number (or bare prefix, `10G`) is bits per second.
  `parse_rate` returns **bits per second**; `parse_byte_rate` returns bytes per second.
* **sizes**: bytes, with decimal (`KB`, `MB`, `GB`, also `K`, `M`, `G`) and binary (`KiB`, `MiB`, `GiB`)
  prefixes. A bare number is bytes.
* **times**: `ns`, `us` (or `µs`), `ms`, `s`; a bare number is seconds.
* **counts** (parameters, FLOP/s, tokens): `K`, `M`, `B`/`G` (1e9), `T`; `1.3B` is 1.3e9.

Everything raises ValueError with the offending text on malformed input.
"""

from __future__ import annotations

import math
import re

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_TIMES = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_RATE_RE = re.compile(_NUM + r"([kKMGTP]i?)?(bit|bits|b|B|bps)?(?:/s|ps)?\s*$")
_SIZE_RE = re.compile(_NUM + r"([kKMGTP]i?)?(B|bytes?)?\s*$")
_TIME_RE = re.compile(_NUM + r"(s|sec|ms|us|µs|ns)?\s*$")
_COUNT_RE = re.compile(_NUM + r"([kKMBGT])?\s*$")


def _prefix(p: str | None, text: str) -> float:
    p = p or ""
    if p in _BINARY:
        return _BINARY[p]
    if p in _DECIMAL:
        return _DECIMAL[p]
    raise ValueError(f"unknown unit prefix {p!r} in {text!r}")


def _finite(value: float, text, what: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {text!r}")
    return value


def _number(value, what: str) -> float | None:
    """A plain int/float passes through (checked); a string returns None so the caller parses it."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a number or a string with units, got {value!r}")
    if isinstance(value, (int, float)):
        return _finite(float(value), value, what)
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected a number or a string with units, got {value!r}")
    return None


def parse_rate(value) -> float:
    """A link rate in **bits per second**: `10Gbit`, `100Mbit`, `1.5Gbit/s`, `25Gbps`, `1.25GB/s`."""
    num = _number(value, "rate")
    if num is not None:
        return num
    m = _RATE_RE.match(value)
    if not m:
        raise ValueError(f"malformed rate {value!r}; expected e.g. '10Gbit', '100Mbit/s', '1.25GB/s'")
    x = float(m.group(1)) * _prefix(m.group(2), value)
    unit = m.group(3) or "bit"
    return _finite(x * 8.0 if unit == "B" else x, value, "rate")


def parse_byte_rate(value) -> float:
    """A rate in **bytes per second** (memory bandwidth, reduction rate). Strings follow `parse_rate`
    (`2TB/s` = 2e12 B/s, `100Gbit` = 12.5e9 B/s); a bare number is bytes per second."""
    num = _number(value, "byte rate")
    if num is not None:
        return num
    return parse_rate(value) / 8.0


def parse_size(value) -> float:
    """A size in bytes: `256MiB`, `4MB`, `1.5GiB`, `4096`."""
    num = _number(value, "size")
    if num is not None:
        return num
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"malformed size {value!r}; expected e.g. '256MiB', '4MB', '1048576'")
    return _finite(float(m.group(1)) * _prefix(m.group(2), value), value, "size")


def parse_time(value) -> float:
    """A duration in seconds: `20us`, `1ms`, `0.5s`, `2e-5`."""
    num = _number(value, "time")
    if num is not None:
        return num
    m = _TIME_RE.match(value)
    if not m:
        raise ValueError(f"malformed time {value!r}; expected e.g. '20us', '1ms', '0.5s'")
    return _finite(float(m.group(1)) * _TIMES[m.group(2) or ""], value, "time")


def parse_count(value) -> float:
    """A plain count with an optional decimal suffix: `1.3B` (1.3e9), `125M`, `8K`, `4e14`."""
    num = _number(value, "count")
    if num is not None:
        return num
    m = _COUNT_RE.match(value)
    if not m:
        raise ValueError(f"malformed number {value!r}; expected e.g. '1.3B', '125M', '4e14'")
    suffix = m.group(2) or ""
    scale = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}[suffix]
    return _finite(float(m.group(1)) * scale, value, "count")


def parse_list(text: str, parse) -> list[float]:
    """`'1Gbit,10Gbit'` -> [1e9, 1e10] with the given element parser."""
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"empty list {text!r}")
    return [parse(t.strip()) for t in items]


def format_rate(bits_per_s: float) -> str:
    for scale, name in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.4g} {name}"
    return f"{bits_per_s:g} bit/s"


def format_size(nbytes: float) -> str:
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {name}"
    return f"{nbytes:.4g} B"


def format_time(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.4g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"


def format_speedup(x: float, band=None) -> str:
    """'8.13x', or with the forecast's interval '8.13x (7.20-8.90x)'."""
    return f"{x:.2f}x" + (f" ({band[0]:.2f}-{band[1]:.2f}x)" if band else "")


def format_ms(seconds: float, band=None) -> str:
    """'223.3 ms', or with the forecast's interval '223.3 ms (201.0-245.6)'."""
    return f"{1e3 * seconds:.1f} ms" + (f" ({1e3 * band[0]:.1f}-{1e3 * band[1]:.1f})" if band else "")
