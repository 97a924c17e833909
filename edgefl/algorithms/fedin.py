"""FedIN (Chan, Jiang, Deng & Ngai, "Federated Intermediate Layers Learning"), client half.

Every zoo classifier is ``extractor -> intermediate -> head``. A FedIN client

1. loads the weights the server sent (layer-wise averages for its own architecture) and keeps
   them as the proximal anchor ``w_received``;
2. trains on its data with the local loss (paper Eq. 4)
   ``CE + (mu/2) * ||w - w_received||^2`` (``mu_half`` = mu/2 = 0.05);
3. when the server also sent one batch ``S`` of feature pairs, computes at every step the IN loss
   (Eq. 8) ``MSE(intermediate(s_in), s_out)`` on ``S`` and replaces the intermediate layers'
   gradient by the alleviated update ``Z`` (Eq. 13 exactly, or Eq. 14 as the paper trains);
4. uploads its weights and one batch of its own pairs ``(s_in, s_out)``: the extractor's output
   and the head's input for ``pair_batch`` of its training samples, computed with the weights it
   uploads (in eval mode, so the pairs and the weights describe the same model).

How the two gradients combine on the intermediate layers:

* ``"simplified"`` (default, the paper's training choice): the update is Eq. 14,
  ``Z = G_IN + (lambda/2) G_local`` with lambda = 1, used directly ("the client models are
  optimized by Eq. 14 directly");
* ``"projection"``: Eq. 13's exact solution ``Z`` (``G_IN`` when ``b = <G_local, G_IN> >= 0``,
  else ``G_IN - (b/a) G_local``: the IN gradient with its component against the local gradient
  removed) is added to the local gradient, ``G_local + Z``, the usual gradient-surgery reading.
  Taken literally as the whole update, Eq. 13 leaves the local gradient out of the intermediate
  layers whenever the two agree; on Fashion-MNIST (Dirichlet 0.5, docs/benchmarks.md) that
  reading collapsed to 35 % accuracy, so edgefl does not use it;
* ``"none"``: the paper's "w/o Opt" ablation: a normal local step on the whole model, then a
  separate IN step on the intermediate layers.

The inner products run over all intermediate parameters as one vector (one constraint, as the
trace form of Eq. 10 reads).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.func import grad
from torch.nn import functional as F
from torch.nn.utils.stateless import _reparametrize_module

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.algorithms.batched import BatchPlan
from edgefl.algorithms.fedavg import load_weights
from edgefl.algorithms.training import make_optimizer
from edgefl.errors import PayloadError
from edgefl.messages import Message

#: tensor-name prefix of the feature pairs inside a ``weights`` message
PAIRS_PREFIX = "pairs."


class FedINOptions(MethodOptions):
    in_training: bool = Field(True, description="train the intermediate layers on the server's feature pairs (Eq. 8); false = 'w/o IN'")
    mu_half: float = Field(0.05, ge=0, description="mu/2 of the proximal term (Eq. 4); 0 = 'w/o Prox' (and FedAvg when in_training is off)")
    alleviation: Literal["simplified", "projection", "none"] = Field(
        "simplified", description="Eq. 14 (the paper's training choice), G_local + Eq. 13's projected G_IN, or none ('w/o Opt': sequential steps)"
    )
    lam: float = Field(1.0, ge=0, description="lambda of Eq. 14")
    pair_batch: int = Field(16, ge=1, le=1024, description="feature pairs a client uploads and the server sends back (|S|)")
    aggregation: Literal["layerwise", "strict"] = Field(
        "layerwise", description="average each layer over every client that has it, or only within one architecture"
    )
    store_rounds: int = Field(1, ge=1, description="the server samples S from pairs at most this many rounds old")


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def project_conflict(g_local: torch.Tensor, g_in: torch.Tensor) -> torch.Tensor:
    """Eq. 13 exactly: ``G_IN`` if ``b = <G_local, G_IN> >= 0``, else ``G_IN - (b / a) G_local``
    with ``a = <G_local, G_local>`` (the closest vector to ``G_IN`` not against ``G_local``)."""
    b = torch.dot(g_local, g_in)
    a = torch.dot(g_local, g_local)
    if b >= 0 or a == 0:
        return g_in.clone()
    return g_in - (b / a) * g_local


def alleviate(g_local: torch.Tensor, g_in: torch.Tensor, mode: str, lam: float = 1.0) -> torch.Tensor:
    """The intermediate layers' update from the local and IN gradients (flattened vectors):
    ``"simplified"`` = Eq. 14, ``G_IN + (lam / 2) G_local``; ``"projection"`` =
    ``G_local + project_conflict(G_local, G_IN)`` (Eq. 13's Z added to the local gradient)."""
    if mode == "simplified":
        return g_in + (lam / 2.0) * g_local
    if mode == "projection":
        return g_local + project_conflict(g_local, g_in)
    raise ValueError(f"alleviation {mode!r} has no single update; 'none' takes two sequential steps")


def proximal_term(model: nn.Module, anchor: dict[str, torch.Tensor], mu_half: float) -> torch.Tensor:
    """``(mu/2) * ||w - w_anchor||^2`` over the trainable parameters; its gradient is ``mu (w - w_anchor)``."""
    total = torch.zeros((), device=next(model.parameters()).device)
    for name, p in model.named_parameters():
        total = total + (p - anchor[name]).pow(2).sum()
    return mu_half * total


class _KeepBatchNormStats:
    """The IN forward runs in train mode (batch statistics, like the local step) but must not move
    the running statistics: they describe this device's data, not the pairs from elsewhere."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = {k: v.clone() for k, v in self.module.state_dict().items() if "running_" in k or "num_batches" in k}

    def __exit__(self, *exc) -> None:
        if self.saved:
            self.module.load_state_dict(self.saved, strict=False)


MAX_PAIRS = 100_000  # feature pairs a download may carry


def split_pairs(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Weights and the (s_in, s_out) batch of a FedIN message."""
    weights = {k: v for k, v in tensors.items() if not k.startswith(PAIRS_PREFIX)}
    return weights, tensors.get(PAIRS_PREFIX + "s_in"), tensors.get(PAIRS_PREFIX + "s_out")


class FedINClient(ClientHalf):
    options: FedINOptions
    dp_sgd_refusal = ("its local loss adds the proximal term (mu/2)||w - w_received||^2, which belongs to no sample, and its "
                      "gradient alleviation rewrites the intermediate layers' gradient with the IN loss of the server's "
                      "feature pairs between backward and step; per-sample clipping would drop the one and clip the other as "
                      "if it were a sample's (FedAvg trains the same weights with DP-SGD)")

    def __init__(self, setup, options) -> None:
        super().__init__(setup, options)
        for part in ("extractor", "intermediate", "head"):
            if not hasattr(self.model, part):
                raise PayloadError(f"FedIN needs a split classifier (extractor -> intermediate -> head); {setup.arch} is not one")

    def downlink_problem(self, downlink: Message) -> str | None:
        if downlink.kind != "weights":
            return f"a {downlink.kind!r} download; fedin sends weights"
        weights, s_in, s_out = split_pairs(downlink.tensors)
        problem = self.weights_problem(weights)
        if problem or (s_in is None and s_out is None):
            return problem
        if s_in is None or s_out is None:
            return "feature pairs come as both pairs.s_in and pairs.s_out"
        if not (s_in.is_floating_point() and s_out.is_floating_point()) or len(s_in) != len(s_out) or not 0 < len(s_in) <= MAX_PAIRS:
            return f"feature pairs: {len(s_in)} inputs and {len(s_out)} outputs (floating, as many of each, 1-{MAX_PAIRS})"
        try:  # the pairs must fit this model's intermediate layers, input and output
            with torch.no_grad():
                was = self.model.training
                self.model.eval()
                out = self.model.intermediate(s_in[:1].float().to(self.device))
                self.model.train(was)
        except (RuntimeError, ValueError, TypeError) as exc:
            return f"pairs.s_in {list(s_in.shape)} does not fit this model's intermediate layers ({str(exc).splitlines()[0][:120]})"
        if tuple(out.shape[1:]) != tuple(s_out.shape[1:]):
            return f"pairs.s_out {list(s_out.shape)} does not match the intermediate layers' output {list(out.shape[1:])}"
        return None

    def receive(self, downlink: Message | None) -> None:
        if downlink is not None and downlink.kind == "weights":
            weights, _, _ = split_pairs(downlink.tensors)
            load_weights(self.model, weights)

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        opts = self.options
        self.receive(downlink)
        s_in = s_out = None
        if downlink is not None and opts.in_training:
            _, s_in, s_out = split_pairs(downlink.tensors)
            s_in, s_out = (None, None) if s_in is None or s_out is None else (self.on_device(s_in), self.on_device(s_out))
        model = self.model
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        inter = [p for p in model.intermediate.parameters() if p.requires_grad]
        gen = self.round_generator(round_no)

        def local_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(xb), yb)
            if opts.mu_half > 0:
                loss = loss + proximal_term(model, anchor, opts.mu_half)
            return loss

        def in_gradients() -> list[torch.Tensor]:
            # restore the statistics only after backward: batch norm's backward checks them
            with _KeepBatchNormStats(model.intermediate):
                loss_in = F.mse_loss(model.intermediate(s_in), s_out)
                return list(torch.autograd.grad(loss_in, inter))

        after_backward = after_step = None
        if s_in is not None and opts.alleviation != "none":
            def after_backward() -> None:  # Eq. 13 / 14: the intermediate layers step along Z
                g_local = [p.grad if p.grad is not None else torch.zeros_like(p) for p in inter]
                z = alleviate(flat(g_local), flat(in_gradients()), opts.alleviation, opts.lam)
                offset = 0
                for p in inter:
                    n = p.numel()
                    p.grad = z[offset : offset + n].view_as(p).clone()
                    offset += n
        elif s_in is not None:
            in_opt = make_optimizer(inter, self.round_train(round_no))

            def after_step() -> None:  # "w/o Opt": a separate IN step after the local one
                in_opt.zero_grad(set_to_none=True)
                for p, g in zip(inter, in_gradients()):
                    p.grad = g
                in_opt.step()

        self.train_locally(round_no, local_loss, generator=gen, after_backward=after_backward, after_step=after_step)
        return self._upload(round_no, gen)

    def _upload(self, round_no: int, gen: torch.Generator) -> Message:
        tensors = dict(self.model.state_dict())
        if self.options.in_training:  # without IN training (FedAvg/FedProx) nobody uses pairs: do not send them
            pair_in, pair_out = self.feature_pairs(gen)
            tensors[PAIRS_PREFIX + "s_in"], tensors[PAIRS_PREFIX + "s_out"] = pair_in, pair_out
        return self.reply("weights", round_no, tensors)

    def batch_plan(self, downlink: Message | None, round_no: int) -> BatchPlan | None:
        opts = self.options
        s_in = s_out = None
        if downlink is not None and opts.in_training:
            _, s_in, s_out = split_pairs(downlink.tensors)
        if s_in is not None and opts.alleviation == "none":
            return None  # "w/o Opt" takes a second optimizer's step after each local one
        if s_in is not None and any(type(m) is nn.Dropout and m.p > 0 for m in self.model.intermediate.modules()):
            return None  # the IN forward would draw dropout masks between the local ones
        self.receive(downlink)
        gen = self.round_generator(round_no)
        consts = {f"anchor.{n}": p.detach().clone() for n, p in self.model.named_parameters()} if opts.mu_half > 0 else {}
        if s_in is not None:
            consts.update(s_in=self.on_device(s_in), s_out=self.on_device(s_out))
        inter = [f"intermediate.{n}" for n, p in self.model.intermediate.named_parameters() if p.requires_grad]

        def loss(model, params, xb, yb, c, e):
            value = F.cross_entropy(model(xb), yb)
            if opts.mu_half > 0:
                value = value + opts.mu_half * sum(((params[n] - c[f"anchor.{n}"]) ** 2).sum() for n in params)
            return value, {}

        def adjust(model, params, buffers, grads, c):  # Eq. 13 / 14 on the intermediate layers, per client
            def in_loss(q):
                kept = {k: v.clone() for k, v in buffers.items()}  # the IN forward must not move this device's statistics
                with _reparametrize_module(model, {**params, **q, **kept}):
                    return F.mse_loss(model.intermediate(c["s_in"]), c["s_out"])

            g_in = grad(in_loss)({n: params[n] for n in inter})
            if opts.alleviation == "simplified":
                z = {n: g_in[n] + (opts.lam / 2.0) * grads[n] for n in inter}
            else:  # projection: G_local + Eq. 13's Z, with the inner products over all intermediate parameters
                b = sum((grads[n] * g_in[n]).sum() for n in inter)
                a = sum((grads[n] * grads[n]).sum() for n in inter)
                keep = (b >= 0) | (a == 0)
                z = {n: grads[n] + torch.where(keep, g_in[n], g_in[n] - (b / torch.where(a == 0, 1.0, a)) * grads[n]) for n in inter}
            return {**grads, **z}

        key = ("fedin", s_in is not None, None if s_in is None else (tuple(s_in.shape), tuple(s_out.shape)), opts.model_dump_json())
        return BatchPlan(key, gen, self.dropout_seed(round_no), loss, lambda: self._upload(round_no, gen), consts,
                         adjust=adjust if s_in is not None else None)

    @torch.no_grad()
    def feature_pairs(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of (extractor output, head input) for random training samples."""
        n = len(self.setup.y)
        idx = torch.randperm(n, generator=gen)[: self.options.pair_batch]
        was_training = self.model.training
        self.model.eval()
        s_in = self.model.extractor(self.setup.x[idx])
        s_out = self.model.intermediate(s_in)
        self.model.train(was_training)
        return s_in.contiguous(), s_out.contiguous()
