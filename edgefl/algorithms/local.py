"""Local-only training: each device trains on its own data and shares nothing (its upload is a
``status`` report: sample count, loss and, when asked, accuracy)."""

from __future__ import annotations

from torch.nn import functional as F

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.messages import Message


class LocalOptions(MethodOptions):
    pass


class LocalClient(ClientHalf):
    def fit(self, downlink: Message | None, round_no: int) -> Message:
        self.train_locally(round_no, lambda xb, yb: F.cross_entropy(self.model(xb), yb))
        return self.reply("status", round_no, {})
