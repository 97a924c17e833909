"""FedHe, server half: a per-class store of client logits, averaged on request (paper Eq. 9-10).

Asynchronous by design: a report is accepted at any time, in any order. The paper's store is the
union of every report ever received; its authors' code resets the running mean periodically. We
keep each client's *latest* report (optionally only those at most ``max_age_rounds`` old), which
bounds the store at clients x classes, drops stale logits, and makes the average independent of
arrival order: reports are averaged in sender order, so shuffled, late and repeated arrivals
give the same result. The server's logits for class c are the unweighted mean over the clients
that reported c (Eq. 10); a class nobody reported is masked out and the clients use CE alone
for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edgefl.messages import Message
from edgefl.server.methods.base import Receipt, ServerHalf


@dataclass
class _Report:
    round: int
    classes: torch.Tensor
    logits: torch.Tensor
    counts: torch.Tensor


class FedHeServer(ServerHalf):

    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        self.store: dict[str, _Report] = {}
        # the average depends only on the store and the round: computed once per change, not once
        # per selected device's download (a thousand downloads over ten thousand reports)
        self._average: tuple[torch.Tensor, torch.Tensor] | None = None

    def accept(self, message: Message) -> Receipt:
        if message.kind != "class_logits":
            return Receipt("rejected", f"expected class_logits, got {message.kind}")
        t = message.tensors
        if set(t) != {"logits", "classes", "counts"}:
            return Receipt("rejected", f"class_logits needs logits, classes, counts; got {sorted(t)}")
        logits, classes, counts = t["logits"], t["classes"], t["counts"]
        k, c = len(classes), self.num_classes
        if logits.shape != (k, c) or not logits.is_floating_point():
            return Receipt("rejected", f"logits must be float [{k}, {c}], got {tuple(logits.shape)} {logits.dtype}")
        if classes.dtype != torch.int64 or counts.shape != (k,):
            return Receipt("rejected", "classes must be int64 and counts one per class")
        if k and (int(classes.min()) < 0 or int(classes.max()) >= c or len(set(classes.tolist())) != k):
            return Receipt("rejected", "class indices out of range or repeated")
        if not bool(torch.isfinite(logits).all()):
            return Receipt("rejected", "logits hold NaN or Inf")
        previous = self.store.get(message.sender)
        if previous is not None and previous.round > message.round:
            return Receipt("late", f"older than the round-{previous.round} report already held; not used")
        if bool((counts < 0).any()):
            return Receipt("rejected", "counts must not be negative")
        self.store[message.sender] = _Report(message.round, classes.clone(), logits.float().clone(), counts.clone())
        self._average = None
        status = "late" if message.round < self.round else "accepted"
        return Receipt(status, "used: FedHe accepts knowledge at any time" if status == "late" else "")

    def _fresh_reports(self) -> list[_Report]:
        max_age = getattr(self.options, "max_age_rounds", None)
        reports = [self.store[s] for s in sorted(self.store)]
        if max_age is not None:
            reports = [r for r in reports if r.round > self.round - max_age - 1]
        return reports

    def begin_round(self, round_no: int) -> None:
        super().begin_round(round_no)
        self._average = None  # max_age_rounds counts from the round

    def global_logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-class mean of the stored client averages, and which classes have any."""
        if self._average is None:
            self._average = self._mean_of_reports()
        return self._average

    def _mean_of_reports(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.num_classes
        sums = torch.zeros(c, c, dtype=torch.float64)
        n = torch.zeros(c, dtype=torch.int64)
        by_count = getattr(self.options, "server_weighting", "uniform") == "count"
        for report in self._fresh_reports():
            w = report.counts.to(torch.float64) if by_count else torch.ones(len(report.classes), dtype=torch.float64)
            sums.index_add_(0, report.classes, report.logits.to(torch.float64) * w.unsqueeze(1))
            n.index_add_(0, report.classes, w.to(torch.int64) if by_count else torch.ones_like(report.classes))
        mask = n > 0
        sums[mask] /= n[mask].unsqueeze(1).to(torch.float64)
        return sums.float(), mask

    def downlink(self, round_no: int, client_id: str) -> Message | None:
        logits, mask = self.global_logits()
        if not bool(mask.any()):
            return Message("class_logits", round_no, "server", {}, {"empty": True})
        return Message("class_logits", round_no, "server", {"logits": logits, "mask": mask})

    def close_round(self, round_no: int) -> dict[str, Any]:
        _, mask = self.global_logits()
        return {"classes_known": int(mask.sum()), "clients_in_store": len(self.store)}
