"""Local-only training: each device trains on its own data and sends nothing."""

from __future__ import annotations

from torch.nn import functional as F

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.algorithms.training import train_local
from edgefl.messages import Message


class LocalOptions(MethodOptions):
    pass


class LocalClient(ClientHalf):
    def fit(self, downlink: Message | None, round: int) -> Message | None:
        gen = self.round_generator(round)
        stats = train_local(self.model, self.setup.x, self.setup.y, self.setup.train, gen, lambda xb, yb: F.cross_entropy(self.model(xb), yb))
        self.record(stats)
        return None
