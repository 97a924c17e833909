"""FedIN, server half: layer-wise aggregation across depths and a store of client feature pairs.

**Aggregation.** ``layerwise`` (InclusiveFL style, the paper's default): every parameter and
buffer of every architecture is the sample-weighted average over this round's uploads that hold
a tensor of the same name *and shape*; one nobody uploaded this round keeps its value. So
ResNet10/14/18/22/26 at one width share the stem, the first block of every stage and the head,
and a block only ResNet26 has keeps ResNet26's value. ``strict`` averages only uploads of the
same architecture (paper Table 5, "extreme" heterogeneity).

**Shared start.** Layer-wise averaging assumes shared layers start equal, so the initial weights of
a layer that several architectures have come from one model: the largest architecture that has it.

**Batch norm.** Running means and variances are float buffers and are averaged exactly like
weights (they describe the averaged layers' inputs); ``num_batches_tracked`` takes the maximum.
Clients do not let the IN batch move their running statistics (see the client half).

**Feature pairs.** A client's pairs are usable by a model whose intermediate layers take
``s_in``'s shape and give ``s_out``'s: the server keys pairs by that *signature* (per-sample
shapes), computed for each architecture from its initial model. ResNets of one width and stem
share a signature whatever their depth; a CNN does not share one with a ResNet. The store keeps
each client's latest batch, no older than ``store_rounds`` rounds; at the close of every round
the server draws one batch ``S`` of ``pair_batch`` pairs per signature (seeded by run seed and
round) and sends it, with the averaged weights, to every selected client of that signature.
Before any client of a signature has reported (the paper's "initial training") ``S`` is absent
and clients train with the local loss only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from edgefl.algorithms.fedin import PAIRS_PREFIX, split_pairs
from edgefl.messages import Message
from edgefl.seeding import generator
from edgefl.server.methods.base import Receipt, ServerHalf

Signature = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass
class _Pairs:
    round: int
    s_in: torch.Tensor
    s_out: torch.Tensor


def layerwise_average(
    targets: dict[str, dict[str, torch.Tensor]],
    uploads: list[tuple[dict[str, torch.Tensor], float]],
) -> dict[str, dict[str, torch.Tensor]]:
    """Each tensor of each target state becomes the weighted mean of the uploads holding a tensor
    of the same name and shape; tensors no upload holds keep their value."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for arch, state in targets.items():
        new: dict[str, torch.Tensor] = {}
        for name, current in state.items():
            found = [(u[name], w) for u, w in uploads if name in u and u[name].shape == current.shape]
            if not found:
                new[name] = current
            elif current.is_floating_point():
                total = float(sum(w for _, w in found))
                acc = torch.zeros_like(current, dtype=torch.float64)
                for t, w in found:
                    acc += t.to(torch.float64) * (w / total)
                new[name] = acc.to(current.dtype)
            else:
                new[name] = torch.stack([t for t, _ in found]).max(0).values
        out[arch] = new
    return out


class FedINServer(ServerHalf):
    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        models = {arch: self.build_initial(arch) for arch in sorted({c.arch for c in self.clients.values()})}
        self.signature: dict[str, Signature] = {arch: self._signature(arch, m) for arch, m in models.items()}
        states = {arch: {k: v.detach().clone() for k, v in m.state_dict().items()} for arch, m in models.items()}
        self.arch_weights = self._shared_start(states)
        self.store: dict[str, _Pairs] = {}
        self.batch_for: dict[Signature, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: dict[str, Message] = {}

    def _signature(self, arch: str, model) -> Signature:
        info = next(c for c in self.clients.values() if c.arch == arch)
        shape = info.input_shape or self.input_shape
        model.eval()
        with torch.no_grad():
            s_in = model.extractor(torch.zeros((2, *shape)))
            s_out = model.intermediate(s_in)
        return tuple(s_in.shape[1:]), tuple(s_out.shape[1:])

    @staticmethod
    def _shared_start(states: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        by_size = sorted(states, key=lambda a: (-sum(t.numel() for t in states[a].values()), a))
        out: dict[str, dict[str, torch.Tensor]] = {}
        for arch, state in states.items():
            new = {}
            for name, t in state.items():
                donor = next(a for a in by_size if name in states[a] and states[a][name].shape == t.shape)
                new[name] = states[donor][name].clone()
            out[arch] = new
        return out

    def downlink(self, round_no: int, client_id: str) -> Message | None:
        arch = self.clients[client_id].arch
        tensors = dict(self.arch_weights[arch])
        batch = self.batch_for.get(self.signature[arch])
        if batch is not None:
            tensors[PAIRS_PREFIX + "s_in"], tensors[PAIRS_PREFIX + "s_out"] = batch
        return Message("weights", round_no, "server", tensors, {"arch": arch, "pairs": 0 if batch is None else len(batch[0])})

    def accept(self, message: Message) -> Receipt:
        if message.kind != "weights":
            return Receipt("rejected", f"expected weights, got {message.kind}")
        arch = self.clients[message.sender].arch
        weights, s_in, s_out = split_pairs(message.tensors)
        if not self.options.in_training and (s_in is None and s_out is None):
            return self.hold_update(message, self.arch_weights[arch], "weights")
        if s_in is None or s_out is None:
            return Receipt("rejected", "a FedIN upload carries pairs.s_in and pairs.s_out with its weights")
        sig_in, sig_out = self.signature[arch]
        if s_in.dim() != len(sig_in) + 1 or tuple(s_in.shape[1:]) != sig_in or tuple(s_out.shape[1:]) != sig_out:
            return Receipt("rejected", f"feature pairs of {tuple(s_in.shape)} -> {tuple(s_out.shape)} do not fit {arch} "
                                       f"({list(sig_in)} -> {list(sig_out)})")
        if len(s_in) != len(s_out) or not 1 <= len(s_in) <= self.options.pair_batch:
            return Receipt("rejected", f"expected 1..{self.options.pair_batch} pairs, got {len(s_in)} inputs and {len(s_out)} outputs")
        if not (s_in.is_floating_point() and s_out.is_floating_point()) or not bool(torch.isfinite(s_in).all() and torch.isfinite(s_out).all()):
            return Receipt("rejected", "feature pairs must be finite floats")
        without_pairs = Message(message.kind, message.round, message.sender, weights, message.meta, message.message_id)
        receipt = self.hold_update(without_pairs, self.arch_weights[arch], "weights")
        if receipt.status == "accepted":
            self.store[message.sender] = _Pairs(message.round, s_in.float().clone(), s_out.float().clone())
        return receipt

    def close_round(self, round_no: int) -> dict[str, Any]:
        senders = sorted(self.pending)  # fixed order: the result does not depend on arrival order
        if self.options.aggregation == "strict":
            for arch in sorted({self.clients[s].arch for s in senders}):
                mine = [(self.pending[s].tensors, float(self.pending[s].num_samples)) for s in senders if self.clients[s].arch == arch]
                self.arch_weights[arch] = layerwise_average({arch: self.arch_weights[arch]}, mine)[arch]
        elif senders:
            uploads = [(self.pending[s].tensors, float(self.pending[s].num_samples)) for s in senders]
            self.arch_weights = layerwise_average(self.arch_weights, uploads)
        self.pending = {}
        self._draw_batches(round_no)
        return {"aggregated": len(senders), "pair_batches": {str(list(s[0])): len(b[0]) for s, b in self.batch_for.items()}}

    def _draw_batches(self, round_no: int) -> None:
        """Algorithm 1, line 5: one random batch S per signature from the recent pairs."""
        self.batch_for = {}
        fresh = {c: p for c, p in sorted(self.store.items()) if round_no - p.round < self.options.store_rounds}
        for sig in sorted(set(self.signature.values())):
            chosen = [p for c, p in fresh.items() if self.signature[self.clients[c].arch] == sig]
            if not chosen:
                continue
            s_in = torch.cat([p.s_in for p in chosen])
            s_out = torch.cat([p.s_out for p in chosen])
            gen = generator(self.seed, "fedin-pairs", round_no, str(sig))
            idx = torch.randperm(len(s_in), generator=gen)[: self.options.pair_batch]
            self.batch_for[sig] = (s_in[idx].contiguous(), s_out[idx].contiguous())

    def global_models(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.arch_weights
