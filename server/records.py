"""What a metrics record says about traffic and refusals, written once for every round policy.

A synchronous round and an asynchronous run's window between two records count downloads,
uploads, control traffic, losses, late uploads and refusals the same way: through a
:class:`Tally`. The policies add only what is theirs (quorum and stragglers, or staleness).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from edgefl.messages import Message
from edgefl.server.rejections import Rejections
from edgefl.transport.envelope import Envelope


def traffic_fields(bytes_up: dict[str, int], bytes_down: dict[str, int], control: int, train_loss: dict[str, float]) -> dict[str, Any]:
    """The traffic and loss fields every metrics record carries, synchronous or not."""
    return {
        "bytes_up": sum(bytes_up.values()),
        "bytes_down": sum(bytes_down.values()),
        "bytes_up_per_client": dict(sorted(bytes_up.items())),
        "bytes_down_per_client": dict(sorted(bytes_down.items())),
        "bytes_control": control,
        "train_loss": dict(sorted(train_loss.items())),
    }


@dataclass
class Tally:
    """Traffic, losses, accepted uploads, late uploads and refusals since a record began."""

    bytes_up: Counter[str] = field(default_factory=Counter)
    bytes_down: Counter[str] = field(default_factory=Counter)
    bytes_control: int = 0
    train_loss: dict[str, float] = field(default_factory=dict)
    accepted: Counter[str] = field(default_factory=Counter)  # device -> updates accepted
    late: list[str] = field(default_factory=list)
    rejected: Rejections = field(default_factory=Rejections)
    last_accepted_unix: float | None = None  # wall clock of the last upload counted
    wall0: float = field(default_factory=time.perf_counter)

    def download(self, device: str, body_bytes: int | None, sent: int) -> None:
        """A download sent: its body counts as traffic down, an empty one (a method that sends
        nothing) as control traffic."""
        if body_bytes is not None:
            self.bytes_down[device] += body_bytes
        else:
            self.bytes_control += sent

    def upload(self, device: str, env: Envelope, message: Message, size: int, accepted: bool) -> None:
        """An upload that counts: its body as traffic up (a report with no tensors, local-only's
        status, as control traffic) and its training loss."""
        if message.tensors:
            self.bytes_up[device] += len(env.body)
        else:
            self.bytes_control += size
        if message.meta.get("train_loss") is not None:
            self.train_loss[device] = round(float(message.meta["train_loss"]), 6)
        if accepted:
            self.accepted[device] += 1
            self.last_accepted_unix = time.time()

    def fields(self) -> dict[str, Any]:
        """The record fields every policy writes the same way."""
        return {
            "late": self.late,
            "rejected": self.rejected.summary(),
            **traffic_fields(self.bytes_up, self.bytes_down, self.bytes_control, self.train_loss),
        }


def timing_fields(train_s: float, eval_s: float, wall_s: float) -> dict[str, float]:
    """Wall-clock seconds of a record (they differ run to run: comparisons leave them out)."""
    return {"round_time_s": round(wall_s, 4), "train_time_s": round(train_s, 4), "eval_time_s": round(eval_s, 4)}
