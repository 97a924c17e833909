"""CHFL, completely heterogeneous FL (Liu et al., paper 004), client half.

Devices agree only on the class list and an embedding width E. Each keeps a private backbone
over its own feature space and a local head h_k: E -> C (the zoo's ``head``); only the head's
parameters ever leave the device. One round is one local epoch (paper Algorithm 1), after which
the server averages the heads into the global head.

Modes (paper Table 1):

* ``kd`` (the paper's method): the local head is kept; from the second epoch on the loss is
  ``CE(h_k(f_k(x)), y) + alpha * DKD(h_k(f_k(x)), hbar(f_k(x)), T)`` with the global head as a
  fixed teacher within the epoch (its logits are computed once, at the epoch's start, with the
  backbone in eval mode) and ``T = beta (1 + cos(pi * epoch / epochs)) + 1``;
* ``avg``: the local head is replaced by the global head at the start of every epoch, no KD
  (parameter decoupling as in FedPer);
* ``avgkd``: both.

SOLO, the fourth strategy, is the ``local`` method.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.algorithms.dkd import chfl_temperature, dkd_loss
from edgefl.algorithms.fedavg import load_weights
from edgefl.errors import ConfigError
from edgefl.messages import Message
from edgefl.tensorchecks import layout_problem
from edgefl.seeding import derive_seed


class CHFLOptions(MethodOptions):
    mode: Literal["kd", "avg", "avgkd"] = Field("kd", description="kd (paper), avg (heads averaged, no KD), avgkd (both)")
    alpha: float = Field(0.5, ge=0, description="weight of the DKD loss (paper: 0.5)")
    beta: float = Field(5.0, ge=0, description="temperature schedule amplitude (paper: 5)")
    embedding_dim: int = Field(64, ge=1, description="the agreed embedding width E (models' feature_dim)")
    weighted: bool = Field(True, description="server: weight heads by sample count (False: plain mean)")


class CHFLClient(ClientHalf):
    carried = ("global_head",)

    def __init__(self, setup, options: CHFLOptions) -> None:
        super().__init__(setup, options)
        head = self.model.head
        if isinstance(head, torch.nn.Linear) and head.bias is None:
            # The federation's head is Linear(E, C) with bias; zoo models whose head has none
            # (the FedHe CNNs) get one, so every device's head has the same shape.
            torch.manual_seed(derive_seed(setup.seed, "chfl-head", setup.client_id))
            self.model.head = head = torch.nn.Linear(head.in_features, head.out_features)
        if not isinstance(head, torch.nn.Linear) or head.in_features != options.embedding_dim:
            width = getattr(head, "in_features", "?")
            raise ConfigError(
                f"CHFL: {setup.client_id}'s model {setup.arch} emits {width}-wide embeddings, the federation agreed on "
                f"{options.embedding_dim}",
                hint=f"set options.feature_dim = {options.embedding_dim} in every fleet group (or method.embedding_dim)",
            )
        if setup.train.epochs != 1:
            raise ConfigError(
                f"CHFL aggregates heads after every local epoch, but {setup.client_id} trains {setup.train.epochs} epochs a round",
                hint="set train.epochs = 1 (one round is one epoch) and raise rounds instead",
            )
        self.global_head: dict[str, torch.Tensor] | None = None

    def head_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.head.state_dict().items()}

    def downlink_problem(self, downlink: Message) -> str | None:
        if downlink.kind != "head":
            return f"a {downlink.kind!r} download; chfl sends the head"
        if not downlink.tensors:
            return None  # nothing averaged yet
        weight = self.model.head.weight
        return layout_problem(downlink.tensors, {"weight": (None, tuple(weight.shape)), "bias": (None, (weight.shape[0],))}, "head")

    def receive(self, downlink: Message | None) -> None:
        if downlink is not None and downlink.kind == "head" and downlink.tensors:
            self.global_head = {k: self.on_device(v.float()) for k, v in downlink.tensors.items()}

    @torch.no_grad()
    def _teacher_logits(self) -> torch.Tensor:
        """The global head applied to this device's embeddings, fixed for the epoch."""
        was_training = self.model.training
        self.model.eval()
        feats = torch.cat([self.model.features(xb) for xb in self.setup.x.split(1000)])
        self.model.train(was_training)
        return F.linear(feats, self.global_head["weight"], self.global_head["bias"])

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        self.receive(downlink)
        opts: CHFLOptions = self.options  # type: ignore[assignment]
        if opts.mode in ("avg", "avgkd") and self.global_head is not None:
            load_weights(self.model.head, self.global_head)
        distill = opts.mode in ("kd", "avgkd") and round_no > 1 and self.global_head is not None and opts.alpha > 0
        temperature = chfl_temperature(round_no, max(self.setup.total_rounds, round_no), opts.beta)
        gen = self.round_generator(round_no)  # drawn before the teacher's logits, as it always was
        if distill:
            teacher = self._teacher_logits()

            def loss_fn(xb, yb, tb):
                logits = self.model(xb)
                return F.cross_entropy(logits, yb) + dkd_loss(logits, tb, yb, temperature, opts.alpha)

            self.train_locally(round_no, loss_fn, generator=gen, extras=(teacher,))
        else:
            self.train_locally(round_no, lambda xb, yb: F.cross_entropy(self.model(xb), yb), generator=gen)
        return self.reply("head", round_no, self.head_state(), temperature=temperature if distill else None)
