"""Felo and Velo (paper 000), client half (the two methods share it).

Every zoo classifier is ``extractor -> intermediate -> head``; Felo's mid-level feature is the
head's input (``model.features(x)``). Rounds up to ``warmup_rounds`` ("initial training") use
cross-entropy only; afterwards the loss is paper Eq. 1::

    CE(logits, y) + alpha * (MSE(feature, s_server[y]) + L_logit(logits, p_server[y]))

with ``L_logit`` = KL (the paper; ``logit_loss = "mse"`` is the authors' code). For a class the
server has no knowledge of yet (nobody reported it) the two extra terms are zero for its samples:
those train with CE alone. When the server sends several synthetic features per class (Velo),
each sample is matched with one of its class's features drawn at random every step.

During training the client accumulates, per class it holds, the sum of its mid-level features and
logits; it uploads the class means, the counts and its weights (which the server averages among
clients of the same architecture only).

**Feature width.** Averaging features across architectures needs one width, ``feature_dim``
(512 by default, what the paper's ResNets all emit). Every zoo classifier takes the builder option
``feature_dim``: when it differs from the architecture's natural width a fixed-width projection
(Linear + ReLU) is appended to the intermediate layers, as heterogeneous-model libraries do. A
device whose model emits another width is refused at start-up, with the option to set.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch.nn import functional as F

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.algorithms.batched import BatchPlan
from edgefl.algorithms.fedavg import load_weights
from edgefl.errors import ConfigError
from edgefl.messages import Message
from edgefl.tensorchecks import layout_problem

#: tensor-name prefix of the per-class knowledge inside a message that also carries weights
KNOWLEDGE = "class."
#: Velo with cvae_data = "sample_features": the per-sample features a device uploads, and their labels
SAMPLE_FEATURES, SAMPLE_LABELS = KNOWLEDGE + "sample_features", KNOWLEDGE + "sample_labels"


class FeloOptions(MethodOptions):
    alpha: float = Field(0.5, ge=0, description="weight of the feature and logit terms (authors' code: 0.5)")
    logit_loss: Literal["kl", "mse"] = Field("kl", description="KL (paper Eq. 1) or MSE on raw logits (authors' code)")
    temperature: float = Field(1.0, gt=0, description="softmax temperature of the KL term")
    feature_dim: int = Field(512, ge=1, description="the common mid-level feature width (every group's options.feature_dim)")
    warmup_rounds: int | None = Field(None, ge=0, description="CE-only rounds; default 5 % of the run (authors' code), at least 1")
    store_size: int = Field(64, ge=1, description="server: the most recent reports kept per class")


class VeloOptions(FeloOptions):
    latent_dim: int = Field(64, ge=1, description="server CVAE latent size (authors' code: the feature width, 1024)")
    hidden_dim: int = Field(256, ge=1, description="server CVAE hidden width (one hidden layer in encoder and decoder)")
    retrain_every: int = Field(1, ge=1, description="retrain the CVAE every k rounds (paper Table 4: k = 1..10 all work)")
    cvae_epochs: int = Field(50, ge=1, description="passes over the feature store per retraining")
    cvae_lr: float = Field(1e-3, gt=0)
    synthetic_per_class: int = Field(8, ge=1, description="synthetic features sent per class")
    cvae_data: Literal["class_means", "sample_features"] = Field(
        "class_means", description="what the CVAE learns from: the per-class means every device reports (Algorithm 2) or "
                                   "per-sample features, which devices then upload too (the authors' code)")
    samples_per_upload: int = Field(500, ge=1, le=100_000, description="cvae_data = \"sample_features\": the features of a device's "
                                                                        "last trained samples it uploads each round, at most (authors' code: "
                                                                        "every trained sample, 10 batches of 50)")
    sample_store_size: int = Field(4999, ge=1, le=1_000_000, description="cvae_data = \"sample_features\": the most recent per-sample "
                                                                           "features the server keeps per class (authors' code: 4,999)")

    @model_validator(mode="after")
    def _sample_options_go_with_sample_features(self) -> VeloOptions:
        stray = sorted({"samples_per_upload", "sample_store_size"} & self.model_fields_set)
        if stray and self.cvae_data != "sample_features":
            raise ValueError(f"{' and '.join(stray)} size the per-sample features of cvae_data = \"sample_features\"; with "
                             f"cvae_data = {self.cvae_data!r} nothing reads them: set cvae_data = \"sample_features\" or drop them")
        return self


def felo_loss(
    logits: torch.Tensor, feats: torch.Tensor, y: torch.Tensor, server_feats: torch.Tensor | None, server_logits: torch.Tensor | None,
    mask: torch.Tensor | None, options: FeloOptions, pick: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paper Eq. 1 for one batch. ``server_feats`` is [C, n, F]; ``pick`` chooses one of the n per sample."""
    ce = F.cross_entropy(logits, y)
    if server_feats is None or options.alpha == 0:
        return ce
    if not bool(mask[y].any()):
        return ce
    return ce + options.alpha * knowledge_terms(logits, feats, y, server_feats, server_logits, mask, options, pick)


def knowledge_terms(
    logits: torch.Tensor, feats: torch.Tensor, y: torch.Tensor, server_feats: torch.Tensor, server_logits: torch.Tensor,
    mask: torch.Tensor, options: FeloOptions, pick: torch.Tensor | None = None,
) -> torch.Tensor:
    """The feature and logit terms of Eq. 1 (before alpha), zero for samples of classes the server
    does not know; no branch on data, so the batched step (vmap) runs it too."""
    has = mask[y].to(logits.dtype)
    idx = torch.zeros_like(y) if pick is None else pick
    target_f = server_feats[y, idx]
    mse = ((feats - target_f) ** 2).mean(1)
    teacher = server_logits[y]
    if options.logit_loss == "mse":
        logit_term = ((logits - teacher) ** 2).mean(1)
    else:
        t = options.temperature
        logit_term = F.kl_div(F.log_softmax(logits / t, 1), F.softmax(teacher / t, 1), reduction="none").sum(1) * t * t
    return ((mse + logit_term) * has).sum() / len(y)


class KnowledgeCollector:
    """Per-class sums of mid-level features and logits over the samples trained on."""

    def __init__(self, num_classes: int, feature_dim: int, device: torch.device | str = "cpu") -> None:
        self.feat_sums = torch.zeros(num_classes, feature_dim, dtype=torch.float64, device=device)
        self.logit_sums = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.int64, device=device)

    def add(self, feats: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        self.feat_sums.index_add_(0, y, feats.detach().to(torch.float64))
        self.logit_sums.index_add_(0, y, logits.detach().to(torch.float64))
        self.counts += torch.bincount(y, minlength=len(self.counts))

    def means(self) -> dict[str, torch.Tensor]:
        seen = torch.nonzero(self.counts > 0).flatten()
        n = self.counts[seen].to(torch.float64).unsqueeze(1)
        return {KNOWLEDGE + "classes": seen, KNOWLEDGE + "counts": self.counts[seen],
                KNOWLEDGE + "features": (self.feat_sums[seen] / n).float(), KNOWLEDGE + "logits": (self.logit_sums[seen] / n).float()}


class SampleKeeper:
    """The features and labels of the last ``limit`` samples trained on (Velo with ``cvae_data =
    "sample_features"``), as computed in the training pass, as the authors' clients send them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.batches: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self.held = 0

    def add(self, feats: torch.Tensor, y: torch.Tensor) -> None:
        self.batches.append((feats.detach().float().cpu(), y.detach().cpu()))
        self.held += len(y)
        while self.held - len(self.batches[0][1]) >= self.limit:  # batches no longer among the last `limit`
            self.held -= len(self.batches.popleft()[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        if not self.batches:
            return {}
        feats = torch.cat([f for f, _ in self.batches])[-self.limit :]
        labels = torch.cat([y for _, y in self.batches])[-self.limit :]
        return {SAMPLE_FEATURES: feats.contiguous(), SAMPLE_LABELS: labels.to(torch.int64).contiguous()}


def sample_keeper(options: FeloOptions) -> SampleKeeper | None:
    return SampleKeeper(options.samples_per_upload) if getattr(options, "cvae_data", "class_means") == "sample_features" else None


def warmup_rounds(options: FeloOptions, total_rounds: int) -> int:
    return options.warmup_rounds if options.warmup_rounds is not None else max(1, math.ceil(0.05 * total_rounds))


class FeloClient(ClientHalf):
    carried = ("server_feats", "server_logits", "server_mask")

    @classmethod
    def model_problem(cls, model, arch: str, options: FeloOptions) -> tuple[str, str] | None:
        width = getattr(model, "feature_dim", None)
        if width == options.feature_dim:
            return None
        return (f"{arch} emits {width}-wide mid-level features; Felo/Velo average them across architectures at width "
                f"{options.feature_dim}",
                f"set options.feature_dim = {options.feature_dim} in every fleet group (or method.feature_dim = {width})")

    @classmethod
    def knowledge_bytes(cls, options: FeloOptions, num_classes: int) -> tuple[int, str]:
        c, f = num_classes, options.feature_dim
        means = c * (f + c) * 4 + 2 * c * 8  # features, logits, classes, counts (up); the mask down
        down = c * getattr(options, "synthetic_per_class", 1) * f * 4 + c * c * 4 + c
        if getattr(options, "cvae_data", "class_means") == "sample_features":
            up = means + options.samples_per_upload * (f * 4 + 8)
            return max(up, down), f"class knowledge with {options.samples_per_upload} per-sample features (method.samples_per_upload)"
        return max(means, down), "class knowledge"

    def __init__(self, setup, options: FeloOptions) -> None:
        super().__init__(setup, options)
        problem = self.model_problem(self.model, setup.arch, options)
        if problem:
            raise ConfigError(problem[0], hint=problem[1])
        self.server_feats: torch.Tensor | None = None
        self.server_logits: torch.Tensor | None = None
        self.server_mask: torch.Tensor | None = None

    def downlink_problem(self, downlink: Message) -> str | None:
        if downlink.kind != "class_features":
            return f"a {downlink.kind!r} download; felo and velo send class_features"
        t = downlink.tensors
        problem = self.weights_problem({k: v for k, v in t.items() if not k.startswith(KNOWLEDGE)})
        knowledge = {k: v for k, v in t.items() if k.startswith(KNOWLEDGE)}
        if problem or not knowledge:
            return problem
        c, f = self.setup.num_classes, self.options.feature_dim  # type: ignore[attr-defined]
        feats = knowledge.get(KNOWLEDGE + "features")
        # [C, F] means per class; Felo's [C, 1, F] and Velo's [C, K, F] carry K generated features per class
        fits = feats is not None and feats.shape[0] == c and feats.shape[-1] == f and (feats.dim() == 2 or (feats.dim() == 3 and feats.shape[1] <= 10_000))
        shape = tuple(feats.shape) if fits else (c, f)
        return layout_problem(knowledge, {KNOWLEDGE + "features": (None, shape), KNOWLEDGE + "logits": (None, (c, c)),
                                          KNOWLEDGE + "mask": (torch.bool, (c,))}, "class knowledge")

    def receive(self, downlink: Message | None) -> None:
        if downlink is None:
            return
        t = downlink.tensors
        load_weights(self.model, {k: v for k, v in t.items() if not k.startswith(KNOWLEDGE)})
        if KNOWLEDGE + "features" in t:
            self.server_feats = self.on_device(t[KNOWLEDGE + "features"].float())
            self.server_logits = self.on_device(t[KNOWLEDGE + "logits"].float())
            self.server_mask = self.on_device(t[KNOWLEDGE + "mask"].bool())

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        self.receive(downlink)
        opts: FeloOptions = self.options  # type: ignore[assignment]
        distill = round_no > warmup_rounds(opts, self.setup.total_rounds) and self.server_feats is not None
        collector = KnowledgeCollector(self.setup.num_classes, opts.feature_dim, self.device)
        keeper = sample_keeper(opts)
        gen = self.round_generator(round_no)
        n_synth = self.server_feats.shape[1] if distill else 1

        def loss_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            logits, feats = self.model.forward_with_features(xb)
            collector.add(feats, logits, yb)
            if keeper is not None:
                keeper.add(feats, yb)
            if not distill:
                return F.cross_entropy(logits, yb)
            pick = torch.randint(0, n_synth, (len(yb),), generator=gen).to(self.device) if n_synth > 1 else None
            return felo_loss(logits, feats, yb, self.server_feats, self.server_logits, self.server_mask, opts, pick)

        self.train_locally(round_no, loss_fn, generator=gen)
        return self.reply("class_features", round_no, {**self.model.state_dict(), **collector.means(), **(keeper.tensors() if keeper else {})})

    def batch_plan(self, downlink: Message | None, round_no: int) -> BatchPlan:
        self.receive(downlink)
        opts: FeloOptions = self.options  # type: ignore[assignment]
        distill = round_no > warmup_rounds(opts, self.setup.total_rounds) and self.server_feats is not None
        terms = distill and opts.alpha != 0
        collector = KnowledgeCollector(self.setup.num_classes, opts.feature_dim, self.device)
        keeper = sample_keeper(opts)
        gen = self.round_generator(round_no)
        n_synth = self.server_feats.shape[1] if distill else 1
        consts = {"feats": self.server_feats, "logits": self.server_logits, "mask": self.server_mask} if terms else {}

        def loss(model, params, xb, yb, c, e):
            logits, feats = model.forward_with_features(xb)
            ce = F.cross_entropy(logits, yb)
            if not terms:
                return ce, {"feats": feats, "logits": logits}
            extra = knowledge_terms(logits, feats, yb, c["feats"], c["logits"], c["mask"], opts, e.get("pick"))
            return ce + opts.alpha * extra, {"feats": feats, "logits": logits}

        def step_extras(yb: torch.Tensor) -> dict[str, torch.Tensor]:  # Velo: one synthetic feature per sample, drawn as fit draws it
            return {"pick": torch.randint(0, n_synth, (len(yb),), generator=gen).to(self.device)} if distill and n_synth > 1 else {}

        def on_step(aux: dict[str, torch.Tensor], yb: torch.Tensor) -> None:
            collector.add(aux["feats"], aux["logits"], yb)
            if keeper is not None:
                keeper.add(aux["feats"], yb)

        return BatchPlan(("felo", distill, terms, n_synth, opts.model_dump_json()), gen, self.dropout_seed(round_no), loss,
                         lambda: self.reply("class_features", round_no,
                                            {**self.model.state_dict(), **collector.means(), **(keeper.tensors() if keeper else {})}),
                         consts, step_extras, on_step=on_step)
