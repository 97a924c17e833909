"""What a device's upload becomes when only its sum may be seen, and back.

Secure aggregation reveals the sum of the devices' vectors, never one of them. A method can be
secured when its server only needs that sum (``MethodSpec.needs_individual_uploads`` empty):

* ``weights`` (FedAvg) and ``head`` (CHFL): every tensor times the device's sample count n, and n
  itself; the server divides the two sums (the sample-weighted mean both servers compute).
  Integer buffers (BatchNorm's ``num_batches_tracked``) are averaged and rounded, where the plain
  server takes their maximum: they count steps, and no layer uses them in evaluation.
* ``class_logits`` (FedHe): the device's mean logits for *every* class, zeros where it has no
  sample, and a 0/1 vector of the classes it has. The server gets per-class sums and how many
  devices hold each class, so it learns neither which device holds which class nor any device's
  logits; the per-class mean over devices is FedHe's Eq. 10 (uniform weighting).
* ``class_features`` (Felo): the weights as for FedAvg, and for *every* class the mean feature
  and mean logits times the device's count of that class (zeros where it has none) and the
  counts. The server half receives, per architecture group, the count-weighted per-class means
  and total counts: one report per class and group where the plain run has one per device.

The form is a flat float64 vector in a fixed order (:class:`Layout`, sent in the clear: it names
tensors and shapes, which the server knows anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edgefl.messages import Message

WEIGHT = "__n"  # the sample count that weights a mean
PRESENT = "__present"  # FedHe: which classes a device holds (0/1)
KNOWLEDGE = "class."  # Felo's per-class tensors (edgefl.algorithms.felo.KNOWLEDGE)
KINDS = ("weights", "head", "class_logits", "class_features")
_DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Layout:
    """The order, shapes and dtypes of a flattened sum form."""

    kind: str
    entries: tuple[tuple[str, tuple[int, ...], str], ...]

    @property
    def length(self) -> int:
        return sum(_numel(shape) for _, shape, _ in self.entries)

    def to_meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "entries": [[n, list(s), d] for n, s, d in self.entries]}

    @classmethod
    def from_meta(cls, meta: Any, max_length: int) -> Layout:
        """A layout a device sent: every field checked (ValueError says what is wrong)."""
        if not isinstance(meta, dict) or meta.get("kind") not in KINDS or not isinstance(meta.get("entries"), list):
            raise ValueError("a secure upload's layout is {kind, entries}")
        entries = []
        for entry in meta["entries"][:5000]:
            if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str) or len(entry[0]) > 200
                    or not isinstance(entry[1], list) or len(entry[1]) > 8
                    or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1 << 31 for d in entry[1])
                    or entry[2] not in _DTYPES):
                raise ValueError("a layout entry is [name, shape, dtype]")
            entries.append((entry[0], tuple(entry[1]), entry[2]))
        layout = cls(meta["kind"], tuple(entries))
        if len({n for n, _, _ in entries}) != len(entries) or not 0 < layout.length <= max_length:
            raise ValueError("a layout names each tensor once and sums to a bounded length")
        return layout


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def to_sum_form(message: Message) -> tuple[torch.Tensor, Layout]:
    """The flat float64 vector a device contributes to the sum, and its layout."""
    t = message.tensors
    if message.kind in ("weights", "head"):
        n = float(message.num_samples)
        if n <= 0:
            raise ValueError("an upload to secure needs its positive num_samples")
        names = sorted(t)
        parts = [t[k].detach().to(torch.float64).reshape(-1) * n for k in names] + [torch.tensor([n], dtype=torch.float64)]
        entries = tuple((k, tuple(t[k].shape), _NAMES.get(t[k].dtype, "F32")) for k in names) + ((WEIGHT, (1,), "F64"),)
        return torch.cat(parts), Layout(message.kind, entries)
    if message.kind == "class_features":
        return _felo_form(message)
    if message.kind == "class_logits":
        logits, classes = t["logits"], t["classes"]
        c = int(logits.shape[1])
        full = torch.zeros(c, c, dtype=torch.float64)
        present = torch.zeros(c, dtype=torch.float64)
        if len(classes):
            full[classes] = logits.detach().to(torch.float64)
            present[classes] = 1.0
        layout = Layout("class_logits", (("logits", (c, c), "F32"), (PRESENT, (c,), "F64")))
        return torch.cat([full.reshape(-1), present]), layout
    raise ValueError(f"{message.kind} uploads cannot be secured by summing")


def _felo_form(message: Message) -> tuple[torch.Tensor, Layout]:
    t = message.tensors
    n = float(message.num_samples)
    if n <= 0:
        raise ValueError("an upload to secure needs its positive num_samples")
    feats, logits = t[KNOWLEDGE + "features"], t[KNOWLEDGE + "logits"]
    classes, counts = t[KNOWLEDGE + "classes"], t[KNOWLEDGE + "counts"].to(torch.float64)
    c, f = int(logits.shape[1]), int(feats.shape[1])
    full_f = torch.zeros(c, f, dtype=torch.float64)
    full_l = torch.zeros(c, c, dtype=torch.float64)
    full_n = torch.zeros(c, dtype=torch.float64)
    if len(classes):
        full_f[classes] = feats.detach().to(torch.float64) * counts.unsqueeze(1)
        full_l[classes] = logits.detach().to(torch.float64) * counts.unsqueeze(1)
        full_n[classes] = counts
    names = sorted(k for k in t if not k.startswith(KNOWLEDGE))
    parts = [t[k].detach().to(torch.float64).reshape(-1) * n for k in names]
    parts += [torch.tensor([n], dtype=torch.float64), full_f.reshape(-1), full_l.reshape(-1), full_n]
    entries = tuple((k, tuple(t[k].shape), _NAMES.get(t[k].dtype, "F32")) for k in names) + (
        (WEIGHT, (1,), "F64"), (KNOWLEDGE + "features", (c, f), "F32"), (KNOWLEDGE + "logits", (c, c), "F32"),
        (KNOWLEDGE + "counts", (c,), "I64"))
    return torch.cat(parts), Layout("class_features", entries)


def from_sum(total: torch.Tensor, layout: Layout, round_no: int, sender: str, survivors: int) -> Message:
    """The message the method's server half receives in place of the survivors' uploads: what
    one device holding the whole sum would send (a mean weighted by the summed sample counts)."""
    parts: dict[str, torch.Tensor] = {}
    at = 0
    for name, shape, _ in layout.entries:
        n = _numel(shape)
        parts[name] = total[at:at + n].reshape(shape)
        at += n
    meta: dict[str, Any] = {"secure_aggregate": survivors}
    if layout.kind == "class_features":
        return _felo_message(parts, layout, round_no, sender, meta)
    if layout.kind in ("weights", "head"):
        weight = float(parts.pop(WEIGHT).item())
        if weight <= 0.5:
            raise ValueError("the secure sum holds no samples")
        tensors = {}
        for name, _shape, dtype in layout.entries:
            if name == WEIGHT:
                continue
            mean = parts[name] / weight
            target = _DTYPES[dtype]
            tensors[name] = mean.round().to(target) if not target.is_floating_point else mean.to(target)
        return Message(layout.kind, round_no, sender, tensors, {**meta, "num_samples": max(1, round(weight))})
    present = parts[PRESENT].round().to(torch.int64)
    classes = torch.nonzero(present > 0).flatten()
    logits = (parts["logits"][classes] / present[classes].unsqueeze(1).to(torch.float64)).to(torch.float32)
    counts = present[classes]
    return Message("class_logits", round_no, sender, {"logits": logits, "classes": classes, "counts": counts},
                   {**meta, "num_samples": max(1, int(counts.sum()))})


def _felo_message(parts: dict[str, torch.Tensor], layout: Layout, round_no: int, sender: str, meta: dict[str, Any]) -> Message:
    weight = float(parts[WEIGHT].item())
    if weight <= 0.5:
        raise ValueError("the secure sum holds no samples")
    counts = parts[KNOWLEDGE + "counts"].round().to(torch.int64)
    classes = torch.nonzero(counts > 0).flatten()
    divisor = counts[classes].unsqueeze(1).to(torch.float64)
    tensors: dict[str, torch.Tensor] = {
        KNOWLEDGE + "features": (parts[KNOWLEDGE + "features"][classes] / divisor).to(torch.float32),
        KNOWLEDGE + "logits": (parts[KNOWLEDGE + "logits"][classes] / divisor).to(torch.float32),
        KNOWLEDGE + "classes": classes, KNOWLEDGE + "counts": counts[classes]}
    for name, _shape, dtype in layout.entries:
        if name == WEIGHT or name.startswith(KNOWLEDGE):
            continue
        mean = parts[name] / weight
        target = _DTYPES[dtype]
        tensors[name] = mean.round().to(target) if not target.is_floating_point else mean.to(target)
    return Message("class_features", round_no, sender, tensors, {**meta, "num_samples": max(1, round(weight))})
