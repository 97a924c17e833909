"""FedAvg, client half: load the group's weights, train with cross-entropy, upload all weights.

In a heterogeneous fleet the server averages only clients of the same architecture
(FedAvg-groups); with one architecture for all it is plain FedAvg.
"""

from __future__ import annotations

from torch.nn import functional as F

import torch

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.algorithms.batched import BatchPlan
from edgefl.errors import PayloadError
from edgefl.messages import Message


class FedAvgOptions(MethodOptions):
    pass


def load_weights(model, tensors) -> None:
    """Load a full state dict, with an error naming what does not match."""
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise PayloadError(f"weights do not fit this model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise PayloadError(f"weights do not fit this model: {name} is {tuple(t.shape)}, expected {tuple(own[name].shape)}")
    model.load_state_dict(tensors, strict=True)


class FedAvgClient(ClientHalf):
    def downlink_problem(self, downlink: Message) -> str | None:
        if downlink.kind != "weights":
            return f"a {downlink.kind!r} download; fedavg sends weights"
        return self.weights_problem(downlink.tensors)

    def receive(self, downlink: Message | None) -> None:
        if downlink is not None and downlink.kind == "weights":
            load_weights(self.model, downlink.tensors)

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        self.receive(downlink)
        self.train_locally(round_no, lambda xb, yb: F.cross_entropy(self.model(xb), yb))
        return self.reply("weights", round_no, self.model.state_dict())

    def batch_plan(self, downlink: Message | None, round_no: int) -> BatchPlan:
        self.receive(downlink)
        return BatchPlan(("fedavg",), self.round_generator(round_no), self.dropout_seed(round_no), cross_entropy_loss,
                         lambda: self.reply("weights", round_no, self.model.state_dict()))


def cross_entropy_loss(model, params, xb: torch.Tensor, yb: torch.Tensor, consts, extras) -> tuple[torch.Tensor, dict]:
    """The batched form of plain local training's loss."""
    return F.cross_entropy(model(xb), yb), {}
