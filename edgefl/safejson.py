"""JSON from the network, bounded: nesting depth, integer size and non-finite numbers.

Python's :func:`json.loads` recurses once per nesting level (a header of 100,000 ``[`` raises
RecursionError, not JSONDecodeError), converts a 5,000-digit integer only to raise ValueError
under the interpreter's digit limit, and accepts ``NaN`` and ``Infinity``. Every JSON that
arrives from a device or a file it wrote goes through :func:`loads` instead, which raises only
:class:`~edgefl.errors.PayloadError`. The depth is measured by a scan before parsing (no library
bounds it), so the parser never recurses deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import json
from typing import Any

from edgefl.errors import PayloadError

MAX_DEPTH = 32
MAX_INT_DIGITS = 19  # |n| <= 2**63 - 1 fits in 19 digits; larger is refused before conversion
INT64_MAX = 2**63 - 1


def nesting_depth(text: str, limit: int = MAX_DEPTH) -> int:
    """Deepest ``[``/``{`` nesting outside strings; stops counting once past ``limit``."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise PayloadError(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    value = int(text)
    if abs(value) > INT64_MAX:
        raise PayloadError("integer beyond 64 bits")
    return value


def _float(text: str) -> float:
    if len(text) > 64:
        raise PayloadError(f"number of {len(text)} characters")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise PayloadError(f"number {text[:20]} overflows a double")
    return value


def _constant(name: str) -> Any:
    raise PayloadError(f"{name} is not JSON")


def loads(data: bytes | str, what: str = "JSON", max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data``; any problem raises :class:`PayloadError` naming ``what``."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
    except UnicodeDecodeError as exc:
        raise PayloadError(f"{what} is not UTF-8: {exc}") from None
    if nesting_depth(text, max_depth) > max_depth:
        raise PayloadError(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except PayloadError as exc:
        raise PayloadError(f"{what}: {exc}") from None
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise PayloadError(f"{what} is not JSON: {str(exc)[:200]}") from None
