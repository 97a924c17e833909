"""Strings from the network made safe to print.

A device id, an upload id, a tensor name or a reason quoting them comes from whoever can publish
on the broker. Printed as they are, ``[/]`` is Rich markup (``MarkupError``: the printer raises),
a newline or an escape code writes a fake line on the operator's console or log, and a lone
surrogate cannot even be encoded. :func:`printable` is for logs (control and format characters
escaped, length bounded), :func:`console_text` also escapes Rich markup for ``console.print``.
"""

from __future__ import annotations

import unicodedata

from rich.markup import escape


def printable(text: object, limit: int = 300) -> str:
    """``text`` with every control, format, surrogate, private-use or unassigned character (Unicode
    category C*) written as a ``\\xNN``/``\\uNNNN``/``\\UNNNNNNNN`` escape, cut to ``limit``
    characters of the original (``...`` marks a cut). A backslash stays as it is: the escapes are
    for reading, not for decoding back."""
    text = text if isinstance(text, str) else str(text)
    cut = len(text) > limit
    out = []
    for ch in text[:limit]:
        if unicodedata.category(ch)[0] != "C":
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out) + ("..." if cut else "")


def console_text(text: object, limit: int = 300) -> str:
    """:func:`printable`, with Rich markup escaped: safe inside a ``console.print`` f-string."""
    return escape(printable(text, limit))
