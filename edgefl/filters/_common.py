"""What the built-in filters share: reserved tensor names and reading their meta entry.

A filter that renames tensors on the wire puts the new names under ``.<filter name>``: a name
beginning with ``.`` is never a torch state-dict key (module, parameter and buffer names are
non-empty, so a dotted path never starts with a dot) nor one of the names the methods use
(``class.*``, ``pairs.*``, ``logits``...). The device refuses to filter a message that already uses
the prefix, so the renaming stays one-to-one; the server refuses any name under the prefix that
is not one the filter makes.
"""

from __future__ import annotations

from typing import Any

import torch

from edgefl.errors import PayloadError
from edgefl.messages import Message
from edgefl.safetext import printable


def quoted(name: str) -> str:
    """A tensor name from the network, safe to put in a reason."""
    return repr(printable(name, 80))


def check_unreserved(message: Message, prefix: str, filter_name: str) -> None:
    """Device side: refuse (a bug, not the network) a message already using ``prefix``."""
    for name in message.tensors:
        if name.startswith(prefix):
            raise ValueError(f"the {filter_name} filter reserves tensor names starting with {prefix!r}, "
                             f"and this upload already has {quoted(name)}: put {filter_name} earlier in [[filters]] "
                             f"or rename the tensor")


def pop_meta(message: Message, key: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``message.meta`` without ``key`` (a new dict), and ``key``'s value, which must be a table."""
    meta = dict(message.meta)
    value = meta.pop(key, None)
    if value is not None and not isinstance(value, dict):
        raise PayloadError(f"meta {key!r} must be a table, got {type(value).__name__}")
    return meta, value


def rebuilt(message: Message, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Message:
    """A new message with ``tensors`` and ``meta``: the one passed in stays as its maker left it."""
    return Message(message.kind, message.round, message.sender, tensors, meta, message.message_id)
