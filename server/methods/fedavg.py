"""FedAvg, server half: sample-weighted averaging within groups of the same architecture.

Averaging across architectures is meaningless, so each architecture (model name plus its
options, e.g. ``resnet18(width=0.25)``) is its own group with its own global model. Every group
starts from weights the server builds from the run seed and hands out, so all members share
their initial point. Float tensors (weights, batch-norm running statistics) are averaged;
integer buffers (``num_batches_tracked``) take the largest value.
"""

from __future__ import annotations

from typing import Any

import torch

from edgefl.messages import Message
from edgefl.server.methods.base import Receipt, ServerHalf


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    total = float(sum(weights))
    out: dict[str, torch.Tensor] = {}
    for name in states[0]:
        tensors = [s[name] for s in states]
        if tensors[0].is_floating_point():
            acc = torch.zeros_like(tensors[0], dtype=torch.float64)
            for t, w in zip(tensors, weights):
                acc += t.to(torch.float64) * (w / total)
            out[name] = acc.to(tensors[0].dtype)
        else:
            out[name] = torch.stack(tensors).max(0).values
    return out


class FedAvgServer(ServerHalf):
    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        self.group_weights: dict[str, dict[str, torch.Tensor]] = {}
        for arch in sorted({c.arch for c in self.clients.values()}):
            model = self.build_initial(arch)
            self.group_weights[arch] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.pending: dict[str, Message] = {}

    def downlink(self, round_no: int, client_id: str) -> Message | None:
        arch = self.clients[client_id].arch
        return Message("weights", round_no, "server", self.group_weights[arch], {"arch": arch})

    def accept(self, message: Message) -> Receipt:
        if message.kind != "weights":
            return Receipt("rejected", f"expected weights, got {message.kind}")
        return self.hold_update(message, self.group_weights[self.clients[message.sender].arch], "weights")

    def close_round(self, round_no: int) -> dict[str, Any]:
        groups: dict[str, list[Message]] = {}
        for sender in sorted(self.pending):  # fixed order: the result does not depend on arrival order
            groups.setdefault(self.clients[sender].arch, []).append(self.pending[sender])
        for arch, msgs in groups.items():
            self.group_weights[arch] = weighted_average([m.tensors for m in msgs], [m.num_samples for m in msgs])
        self.pending = {}
        return {"groups_updated": sorted(groups)}

    def global_models(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.group_weights
