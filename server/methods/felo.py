"""Felo and Velo (paper 000), server halves.

**Felo.** Each upload carries a client's per-class mean features and logits with their counts, and
its weights. The server keeps, per class, the ``store_size`` most recent reports, and answers
with the count-weighted per-class average of features and of logits
(Algorithm 1, line 4). Weights are averaged only among clients of the same architecture
(line 5; the FedAvg-groups rule: each architecture is its own group with a shared start). A class
nobody has reported is masked out: clients train its samples with cross-entropy alone.

**Velo.** The same store trains a conditional VAE over mid-level features (Eq. 2), every
``retrain_every`` rounds, on CUDA when present; the server then sends ``synthetic_per_class``
features per class decoded from z ~ N(0, I) instead of the average feature, and the averaged
logits as in Felo (Algorithm 2). The CVAE's training time per round is measured and reported in
the round record (``server.cvae``). With ``cvae_data = "sample_features"`` (the authors' code, not
Algorithm 2) devices also upload the features of their last trained samples, and the CVAE learns
from the ``sample_store_size`` most recent of those per class instead of the per-class means.

Both are synchronous: the knowledge and weights of a round are used when the round closes;
reports from a closed round are acknowledged as late and not used.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from edgefl.algorithms.felo import KNOWLEDGE, SAMPLE_FEATURES, SAMPLE_LABELS
from edgefl.messages import Message
from edgefl.seeding import GLOBAL_RNG_LOCK, derive_seed, generator
from edgefl.server.methods.base import Receipt, ServerHalf
from edgefl.server.methods.fedavg import weighted_average
from edgefl.compute import resolve_device
from edgefl.server.methods.feature_cvae import FeatureCVAE, train_feature_cvae


@dataclass
class _Item:
    feature: torch.Tensor
    logits: torch.Tensor
    count: int


class FeloServer(ServerHalf):
    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        self.group_weights = {arch: {k: v.detach().clone() for k, v in self.build_initial(arch).state_dict().items()}
                              for arch in sorted({c.arch for c in self.clients.values()})}
        self.store: list[deque[_Item]] = [deque(maxlen=options.store_size) for _ in range(self.num_classes)]
        self.pending: dict[str, Message] = {}
        self.knowledge: dict[str, torch.Tensor] | None = None

    # --- per-class knowledge ----------------------------------------------------------
    def class_averages(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count-weighted per-class means of the stored features and logits, and the mask of
        classes that have any (a class never reported has zeros and mask False)."""
        f_dim = self.options.feature_dim
        feats = torch.zeros(self.num_classes, f_dim)
        logits = torch.zeros(self.num_classes, self.num_classes)
        mask = torch.zeros(self.num_classes, dtype=torch.bool)
        for c, items in enumerate(self.store):
            total = sum(i.count for i in items)
            if total == 0:
                continue
            feats[c] = sum(i.feature.double() * i.count for i in items).float() / total
            logits[c] = sum(i.logits.double() * i.count for i in items).float() / total
            mask[c] = True
        return feats, logits, mask

    def class_features(self, round_no: int, feats: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """What the clients match their features against: Felo sends the averages ([C, 1, F])."""
        return feats.unsqueeze(1), {}

    # --- the contract ------------------------------------------------------------------
    def downlink(self, round_no: int, client_id: str) -> Message | None:
        arch = self.clients[client_id].arch
        tensors = dict(self.group_weights[arch])
        if self.knowledge is not None:
            tensors.update(self.knowledge)
        return Message("class_features", round_no, "server", tensors, {"arch": arch})

    def accept(self, message: Message) -> Receipt:
        if message.kind != "class_features":
            return Receipt("rejected", f"expected class_features, got {message.kind}")
        t = message.tensors
        needed = {KNOWLEDGE + k for k in ("features", "logits", "classes", "counts")}
        if not needed <= set(t):
            return Receipt("rejected", f"class_features needs {sorted(needed)}")
        classes, counts = t[KNOWLEDGE + "classes"], t[KNOWLEDGE + "counts"]
        feats, logits = t[KNOWLEDGE + "features"], t[KNOWLEDGE + "logits"]
        k = len(classes)
        if classes.dtype != torch.int64 or counts.shape != (k,) or counts.dtype != torch.int64:
            return Receipt("rejected", "classes and counts must be int64, one count per class")
        if k and (int(classes.min()) < 0 or int(classes.max()) >= self.num_classes or len(set(classes.tolist())) != k):
            return Receipt("rejected", "class indices out of range or repeated")
        if feats.shape != (k, self.options.feature_dim) or logits.shape != (k, self.num_classes):
            return Receipt("rejected", f"features must be [{k}, {self.options.feature_dim}] and logits [{k}, {self.num_classes}], "
                                       f"got {list(feats.shape)} and {list(logits.shape)}")
        if not (feats.is_floating_point() and logits.is_floating_point()) or not bool(torch.isfinite(feats).all() and torch.isfinite(logits).all()):
            return Receipt("rejected", "features and logits must be finite floats")
        if bool((counts <= 0).any()):
            return Receipt("rejected", "counts must be positive")
        # the shared synchronous checks (round, weights' names/shapes/finiteness, counts, one per round)
        # see the weights alone; what is held is the whole message, knowledge included
        weights = {n: v for n, v in t.items() if not n.startswith(KNOWLEDGE)}
        arch = self.clients[message.sender].arch
        receipt = self.hold_update(Message(message.kind, message.round, message.sender, weights, message.meta, message.message_id),
                                   self.group_weights[arch], "weights")
        if receipt.status == "accepted":
            self.pending[message.sender] = message
        return receipt

    def close_round(self, round_no: int) -> dict[str, Any]:
        senders = sorted(self.pending)  # fixed order: results do not depend on arrival order
        groups: dict[str, list[Message]] = {}
        for s in senders:
            m = self.pending[s]
            groups.setdefault(self.clients[s].arch, []).append(m)
            t = m.tensors
            for c, f, p, n in zip(t[KNOWLEDGE + "classes"].tolist(), t[KNOWLEDGE + "features"], t[KNOWLEDGE + "logits"],
                                  t[KNOWLEDGE + "counts"].tolist()):
                self.store[c].append(_Item(f.float().clone(), p.float().clone(), int(n)))
        for arch, msgs in groups.items():
            states = [{n: v for n, v in m.tensors.items() if not n.startswith(KNOWLEDGE)} for m in msgs]
            self.group_weights[arch] = weighted_average(states, [m.num_samples for m in msgs])
        self.pending = {}
        feats, logits, mask = self.class_averages()
        info: dict[str, Any] = {"groups_updated": sorted(groups), "classes_known": int(mask.sum())}
        if bool(mask.any()):
            synthetic, extra = self.class_features(round_no, feats, mask)
            info.update(extra)
            self.knowledge = {KNOWLEDGE + "features": synthetic, KNOWLEDGE + "logits": logits, KNOWLEDGE + "mask": mask}
        return info

    def global_models(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.group_weights


class VeloServer(FeloServer):
    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        with GLOBAL_RNG_LOCK:
            torch.manual_seed(derive_seed(self.seed, "velo-cvae-init"))
            self.cvae = FeatureCVAE(options.feature_dim, self.num_classes, options.latent_dim, options.hidden_dim)
        self.trained_rounds = 0
        #: cvae_data = "sample_features": per class, the most recent per-sample features devices uploaded
        self.samples: list[torch.Tensor] = [torch.zeros(0, options.feature_dim) for _ in range(self.num_classes)]

    @property
    def learns_from_samples(self) -> bool:
        return self.options.cvae_data == "sample_features"

    def accept(self, message: Message) -> Receipt:
        if self.learns_from_samples and message.kind == "class_features":
            problem = self.samples_problem(message.tensors)
            if problem:
                return Receipt("rejected", problem)
        return super().accept(message)

    def samples_problem(self, t: dict[str, torch.Tensor]) -> str | None:
        """Why an upload's per-sample features cannot be taken (None when they can)."""
        feats, labels = t.get(SAMPLE_FEATURES), t.get(SAMPLE_LABELS)
        limit, width = self.options.samples_per_upload, self.options.feature_dim
        if feats is None or labels is None:
            return (f"method.cvae_data = \"sample_features\": class_features needs {SAMPLE_FEATURES} and {SAMPLE_LABELS} "
                    "(the features of the device's last trained samples); a device of an older edgefl sends only class means")
        n = len(labels)
        if labels.dtype != torch.int64 or labels.dim() != 1 or not 1 <= n <= limit:
            return f"{SAMPLE_LABELS} must be int64, one label each for 1..{limit} samples, got {labels.dtype} {list(labels.shape)}"
        if tuple(feats.shape) != (n, width) or not feats.is_floating_point() or not bool(torch.isfinite(feats).all()):
            return f"{SAMPLE_FEATURES} must be finite floats of shape [{n}, {width}], got {feats.dtype} {list(feats.shape)}"
        if int(labels.min()) < 0 or int(labels.max()) >= self.num_classes:
            return f"{SAMPLE_LABELS} holds a class out of 0..{self.num_classes - 1}"
        return None

    def close_round(self, round_no: int) -> dict[str, Any]:
        if self.learns_from_samples:
            keep = self.options.sample_store_size
            for sender in sorted(self.pending):  # fixed order, as the class store's
                t = self.pending[sender].tensors
                feats, labels = t[SAMPLE_FEATURES].float(), t[SAMPLE_LABELS]
                for c in labels.unique().tolist():
                    self.samples[c] = torch.cat([self.samples[c], feats[labels == c]])[-keep:].clone()
        return super().close_round(round_no)

    def cvae_training_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, labels) the CVAE learns from: the stored per-class means (Algorithm 2), or the
        stored per-sample features (``cvae_data = "sample_features"``) while any were reported."""
        if self.learns_from_samples and any(len(rows) for rows in self.samples):
            return (torch.cat(self.samples),
                    torch.cat([torch.full((len(rows),), c, dtype=torch.int64) for c, rows in enumerate(self.samples)]))
        s = torch.stack([i.feature for items in self.store for i in items])
        y = torch.tensor([c for c, items in enumerate(self.store) for _ in items])
        return s, y

    def class_features(self, round_no: int, feats: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        opts = self.options
        info: dict[str, Any] = {}
        if self.trained_rounds == 0 or round_no % opts.retrain_every == 0:
            s, y = self.cvae_training_data()
            with GLOBAL_RNG_LOCK:
                torch.manual_seed(derive_seed(self.seed, "velo-cvae-train", round_no))  # the reparameterisation noise
                info["cvae"] = train_feature_cvae(self.cvae, s, y, opts.cvae_epochs, opts.cvae_lr,
                                                  generator(self.seed, "velo-order", round_no), device=str(resolve_device(self.device)))
            self.trained_rounds += 1
        known = torch.nonzero(mask).flatten()
        synthetic = torch.zeros(self.num_classes, opts.synthetic_per_class, opts.feature_dim)
        synthetic[known] = self.cvae.generate(known, opts.synthetic_per_class, generator(self.seed, "velo-generate", round_no))
        return synthetic, info
