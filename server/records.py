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
    dp_sgd_epsilon: dict[str, float | None] = field(default_factory=dict)  # device -> its DP-SGD epsilon so far (None: no noise)

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
        if "dp_sgd_epsilon" in message.meta:  # range-checked with the upload (upload_checks.meta_problem)
            spent = message.meta["dp_sgd_epsilon"]
            self.dp_sgd_epsilon[device] = None if spent is None else round(float(spent), 6)
        if accepted:
            self.accepted[device] += 1
            self.last_accepted_unix = time.time()

    def fields(self) -> dict[str, Any]:
        """The record fields every policy writes the same way."""
        return {
            "late": self.late,
            "rejected": self.rejected.summary(),
            **traffic_fields(self.bytes_up, self.bytes_down, self.bytes_control, self.train_loss),
            **({"dp_sgd_epsilon": dict(sorted(self.dp_sgd_epsilon.items()))} if self.dp_sgd_epsilon else {}),
        }


class DPSGDLedger:
    """Each device's DP-SGD epsilon over the whole run (the newest it reported: an epsilon only
    grows), turned into the record's ``dp_sgd`` facts, which every reader of a run's privacy
    (console, summary, dashboard) takes like a privacy filter's: ``epsilon_max`` at ``delta``."""

    def __init__(self, delta: float) -> None:
        self.delta = delta
        self.spent: dict[str, float | None] = {}

    def restore(self, history: list[dict[str, Any]]) -> None:
        for record in history:
            self.note(record)

    def note(self, record: dict[str, Any]) -> None:
        """Take a record's reports; give it the run's facts so far (``record["dp_sgd"]``)."""
        reported = record.get("dp_sgd_epsilon")
        if isinstance(reported, dict):
            self.spent.update(reported)
        if not self.spent:
            return
        finite = [e for e in self.spent.values() if e is not None]
        record["dp_sgd"] = {
            "epsilon_max": max(finite) if finite else None, "delta": self.delta,
            "epsilon_per_device": dict(sorted(self.spent.items())),
            **({"without_noise": sorted(d for d, e in self.spent.items() if e is None)} if None in self.spent.values() else {}),
        }


def timing_fields(train_s: float, eval_s: float, wall_s: float) -> dict[str, float]:
    """Wall-clock seconds of a record (they differ run to run: comparisons leave them out)."""
    return {"round_time_s": round(wall_s, 4), "train_time_s": round(train_s, 4), "eval_time_s": round(eval_s, 4)}
