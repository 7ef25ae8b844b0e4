"""Byte counts as operators write them: ``parse_bytes("256MiB") -> 268435456``.

One parser for every byte-count input of the agent: the command line's ``--chunk-bytes`` and
``--staging-bytes`` (agent/cli/common.py's ``BytesType``, a click type), the environment's
``$CUINTERPOSE_CHUNK_BYTES`` / ``$CUINTERPOSE_STAGING_BYTES``, and the benches' ``--bytes``
and ``--size`` (:func:`arg_bytes`, an argparse type).
A count is a plain integer of bytes (``8388608``, or hex ``0x800000``), or an integer with an
IEC binary unit (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 2^10; ``K``/``M``/``G``/``T``
mean the same; case and a space before the unit do not matter). Decimal units (``MB``, ``GB``)
are refused as ambiguous rather than guessed.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["parse_bytes", "arg_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}
_DECIMAL = {"kb", "mb", "gb", "tb"}
_COUNT = re.compile(r"(\d+)\s*([A-Za-z]*)")


def parse_bytes(value) -> int:
    """The byte count ``value`` (an int, or text as the module docstring says). Raises
    ValueError naming the text and what is accepted; a negative count is never accepted."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{value} is not a byte count: it is negative")
        return value
    text = str(value).strip()
    if text.lower().startswith("0x"):
        try:
            return int(text, 16)
        except ValueError:
            pass
    m = _COUNT.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m and unit in _UNITS:
        return int(m.group(1)) * _UNITS[unit]
    hint = (
        f"{m.group(2)} is ambiguous (10^3 or 2^10?): write {m.group(2)[0].upper()}iB or bytes"
        if m and unit in _DECIMAL
        else "write a number of bytes, or one with KiB, MiB, GiB or TiB (e.g. 256MiB)"
    )
    raise ValueError(f"{str(value)!r} is not a byte count: {hint}")


def arg_bytes(text: str) -> int:
    """An argparse ``type=`` for byte counts: :func:`parse_bytes`, its refusal shown as is."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
