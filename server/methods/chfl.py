"""CHFL, server half: the global head is the mean of the local heads after every epoch.

Paper Eq. 4 writes a sum of the K heads; summing would scale the logits by K, so we read it as
the mean (weighted by sample count by default, ``weighted = false`` for the plain mean), the
usual parameter-decoupling aggregation. The server knows nothing of the devices' backbones or
feature spaces: it sees heads of shape C x E only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


from edgefl.messages import Message
from edgefl.seeding import GLOBAL_RNG_LOCK, derive_seed
from edgefl.server.methods.base import Receipt, ServerHalf
from edgefl.server.methods.fedavg import weighted_average


class CHFLServer(ServerHalf):
    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        with GLOBAL_RNG_LOCK:
            torch.manual_seed(derive_seed(self.seed, "server-init", "chfl-head"))
            head = nn.Linear(options.embedding_dim, self.num_classes)
        self.global_head = {k: v.detach().clone() for k, v in head.state_dict().items()}
        self.pending: dict[str, Message] = {}

    def downlink(self, round_no: int, client_id: str) -> Message | None:
        return Message("head", round_no, "server", self.global_head, {"embedding_dim": self.options.embedding_dim})

    def shared_weights(self, client_id: str) -> dict[str, torch.Tensor]:
        return self.global_head

    def accept(self, message: Message) -> Receipt:
        if message.kind != "head":
            return Receipt("rejected", f"expected head, got {message.kind}")
        return self.hold_update(message, self.global_head, "head")

    def close_round(self, round_no: int) -> dict[str, Any]:
        if self.pending:
            msgs = [self.pending[s] for s in sorted(self.pending)]
            weights = [m.num_samples if self.options.weighted else 1 for m in msgs]
            self.global_head = weighted_average([{k: v.float() for k, v in m.tensors.items()} for m in msgs], weights)
        n = len(self.pending)
        self.pending = {}
        return {"heads_averaged": n}
