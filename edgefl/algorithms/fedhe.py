"""FedHe (Chan & Ngai, MSN 2021), client half.

Loss (paper Eq. 13): ``CE(logits, y) + alpha * l_logit(logits, p_s[y])`` where ``p_s`` are the
server's per-class average logits. The paper leaves ``l_logit`` generic; the authors' code uses
mean-squared error on raw logits, which is the default here (``logit_loss = "kl"`` is the
distillation alternative). Samples of a class the server has no logits for get CE only.

While training, the client sums the logits it produces per class (Eq. 7) and sends
``sum / (count + 1)`` (Eq. 8) for every class it saw.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.algorithms.batched import BatchPlan
from edgefl.messages import Message
from edgefl.tensorchecks import layout_problem


class FedHeOptions(MethodOptions):
    alpha: float = Field(1.0, ge=0, description="weight of the logit loss (paper: 1)")
    logit_loss: Literal["mse", "kl"] = Field("mse", description="mse on raw logits (authors' code) or KL")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of the KL variant")
    warmup_rounds: int = Field(1, ge=0, description="rounds of CE only before the logit loss starts (mode = \"async\": downloads of the run)")
    count_offset: int = Field(1, ge=0, le=1, description="the +1 in Eq. 8's denominator, sum / (count + 1); 0 sends the plain mean")
    server_weighting: Literal["uniform", "count"] = Field(
        "uniform", description="server: per-class mean over clients unweighted (paper Eq. 10) or weighted by sample counts"
    )
    max_age_rounds: int | None = Field(
        None, ge=1, description="server: ignore a client's logits older than this many rounds (None: keep each client's latest)"
    )


def logit_loss(logits: torch.Tensor, teacher: torch.Tensor, has_teacher: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """Per-batch logit loss: mean over the batch of each sample's loss, zero where no teacher."""
    if not bool(has_teacher.any()):
        return logits.new_zeros(())
    return masked_logit_loss(logits, teacher, has_teacher, kind, temperature)


def masked_logit_loss(logits: torch.Tensor, teacher: torch.Tensor, has_teacher: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    """:func:`logit_loss` without its shortcut (the same value; no branch on data, so vmap runs it)."""
    if kind == "mse":
        per_sample = ((logits - teacher) ** 2).mean(dim=1)
    else:
        t = temperature
        per_sample = F.kl_div(F.log_softmax(logits / t, 1), F.softmax(teacher / t, 1), reduction="none").sum(1) * t * t
    return (per_sample * has_teacher).sum() / len(logits)


def fedhe_loss(
    logits: torch.Tensor, y: torch.Tensor, server_logits: torch.Tensor | None, server_mask: torch.Tensor | None, options: FedHeOptions
) -> torch.Tensor:
    ce = F.cross_entropy(logits, y)
    if server_logits is None or options.alpha == 0:
        return ce
    has = server_mask[y].to(logits.dtype)
    return ce + options.alpha * logit_loss(logits, server_logits[y], has, options.logit_loss, options.temperature)


class LogitCollector:
    """Per-class sums and counts of the logits produced during training (paper Eq. 7-8)."""

    def __init__(self, num_classes: int, device: torch.device | str = "cpu", offset: int = 1) -> None:
        self.offset = offset  # Eq. 8's +1 (FedHeOptions.count_offset)
        self.sums = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.int64, device=device)

    def add(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        self.sums.index_add_(0, y, logits.detach().to(torch.float64))
        self.counts += torch.bincount(y, minlength=len(self.counts))

    def averages(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(classes seen, their sum / (count + offset), their counts)."""
        seen = torch.nonzero(self.counts > 0).flatten()
        avg = self.sums[seen] / (self.counts[seen].to(torch.float64) + self.offset).unsqueeze(1)
        return seen, avg.to(torch.float32), self.counts[seen]


class FedHeClient(ClientHalf):
    carried = ("server_logits", "server_mask")

    def __init__(self, setup, options: FedHeOptions) -> None:
        super().__init__(setup, options)
        self.server_logits: torch.Tensor | None = None
        self.server_mask: torch.Tensor | None = None

    def downlink_problem(self, downlink: Message) -> str | None:
        if downlink.kind != "class_logits":
            return f"a {downlink.kind!r} download; fedhe sends class_logits"
        if not downlink.tensors:
            return None  # nothing averaged yet (the first round)
        c = self.setup.num_classes
        return layout_problem(downlink.tensors, {"logits": (None, (c, c)), "mask": (torch.bool, (c,))}, "class logits")

    def receive(self, downlink: Message | None) -> None:
        if downlink is not None and downlink.kind == "class_logits" and "logits" in downlink.tensors:
            self.server_logits = self.on_device(downlink.tensors["logits"].float())
            self.server_mask = self.on_device(downlink.tensors["mask"].bool())

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        self.receive(downlink)
        opts: FedHeOptions = self.options  # type: ignore[assignment]
        distill = round_no > opts.warmup_rounds and self.server_logits is not None
        teacher, mask = (self.server_logits, self.server_mask) if distill else (None, None)
        collector = LogitCollector(self.setup.num_classes, self.device, opts.count_offset)

        def loss_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            logits = self.model(xb)
            collector.add(logits, yb)
            return fedhe_loss(logits, yb, teacher, mask, opts)

        self.train_locally(round_no, loss_fn)
        return self._upload(collector, round_no)

    def _upload(self, collector: LogitCollector, round_no: int) -> Message:
        classes, avg, counts = collector.averages()
        return self.reply("class_logits", round_no, {"logits": avg, "classes": classes, "counts": counts})

    def batch_plan(self, downlink: Message | None, round_no: int) -> BatchPlan:
        self.receive(downlink)
        opts: FedHeOptions = self.options  # type: ignore[assignment]
        distill = round_no > opts.warmup_rounds and self.server_logits is not None and opts.alpha != 0
        collector = LogitCollector(self.setup.num_classes, self.device, opts.count_offset)
        consts = {"teacher": self.server_logits, "has": self.server_mask.to(self.server_logits.dtype)} if distill else {}

        def loss(model, params, xb, yb, c, extras):
            logits = model(xb)
            ce = F.cross_entropy(logits, yb)
            if not distill:
                return ce, {"logits": logits}
            return ce + opts.alpha * masked_logit_loss(logits, c["teacher"][yb], c["has"][yb], opts.logit_loss, opts.temperature), {"logits": logits}

        return BatchPlan(("fedhe", distill, opts.model_dump_json()), self.round_generator(round_no), self.dropout_seed(round_no), loss,
                         lambda: self._upload(collector, round_no), consts, on_step=lambda aux, yb: collector.add(aux["logits"], yb))
