"""FedMHO (paper 003) and FedCVAE-Ens, server halves: one round of uploads, then generation,
filtering and fusion on the server.

FedMHO (Algorithm 1): classifier clients upload weights, generator clients upload CVAE decoders
and label counts. The server draws N synthetic samples (class c's share from decoder k
proportional to n_kc squared), keeps per class the ``keep_ratio`` nearest the class centre
(Algorithm 2), initialises the global model as the plain average of the classifier clients
(Eq. 4; by ensemble distillation when they run different architectures, paper section 5.6) and
trains it on the synthetic set with CE (FedMHO), CE + KL to the clients' mean logits (MD) or
CE + KL to the initial global model (SD), mixed by lambda (Eq. 8).

FedCVAE-Ens (Heinbaugh et al., ICLR 2023, the paper's reference [20]): every client uploads a
decoder; the server samples from all decoders in proportion to their data and trains a
classifier from scratch.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgefl.algorithms.fedmho import DECODER_PREFIX, FedCVAEOptions, FedMHOOptions, global_training
from edgefl.errors import ConfigError
from edgefl.messages import Message
from edgefl.models import get_spec
from edgefl.models.cvae import CVAE
from edgefl.seeding import GLOBAL_RNG_LOCK, derive_seed, generator
from edgefl.server.methods.base import Receipt, ServerHalf
from edgefl.server.methods.fedavg import weighted_average
from edgefl.server.methods.fusion import mean_logits, pick_device, train_on_synthetic
from edgefl.server.methods.generation import (
    fedmho_plan,
    generate,
    kmeans_filter,
    proportional_plan,
    sample_grid,
    save_sample_grid,
)


class _OneShotGenerativeServer(ServerHalf):
    """What FedMHO and FedCVAE-Ens share: the two kinds of upload, the decoders, the preview."""

    config_attributes = ServerHalf.config_attributes | {"kind_of"}

    def __init__(self, clients, options, **kw) -> None:
        super().__init__(clients, options, **kw)
        self.kind_of = {cid: get_spec(c.model).kind for cid, c in self.clients.items()}
        self.initial: dict[str, dict[str, torch.Tensor]] = {}
        self.decoder_reference: dict[str, dict[str, torch.Tensor]] = {}
        for arch in sorted({c.arch for c in self.clients.values()}):
            model = self.build_initial(arch)
            if isinstance(model, CVAE):
                self.decoder_reference[arch] = {k: v for k, v in model.state_dict().items() if k.startswith(DECODER_PREFIX)}
            else:
                self.initial[arch] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.pending: dict[str, Message] = {}
        self.global_arch: str | None = None
        self.global_state: dict[str, torch.Tensor] | None = None
        self.preview: torch.Tensor | None = None
        self.reference: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    # --- uploads ------------------------------------------------------------------------
    def accept(self, message: Message) -> Receipt:
        arch = self.clients[message.sender].arch
        if self.kind_of[message.sender] == "generator":
            if message.kind != "decoder":
                return Receipt("rejected", f"{arch} is a generator client: expected its decoder, got {message.kind}")
            problem = self._counts_problem(message)
            if problem:
                return Receipt("rejected", problem)
            return self.hold_update(message, self.decoder_reference[arch], "decoder")
        if message.kind != "weights":
            return Receipt("rejected", f"{arch} is a classifier client: expected weights, got {message.kind}")
        return self.hold_update(message, self.initial[arch], "weights")

    def _counts_problem(self, message: Message) -> str | None:
        counts = message.meta.get("class_counts")
        if not isinstance(counts, list) or len(counts) != self.num_classes:
            return f"class_counts must be a list of {self.num_classes} counts"
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            return "class_counts must be non-negative integers"
        if sum(counts) != message.num_samples:
            return f"class_counts sum to {sum(counts)}, but num_samples is {message.num_samples}"
        return None

    def _decoders(self, senders: list[str]) -> tuple[list[nn.Module], list[list[int]], int]:
        decoders, counts, latents = [], [], set()
        for sender in senders:
            model = self.build_initial(self.clients[sender].arch)
            assert isinstance(model, CVAE)
            decoder_state = {k[len(DECODER_PREFIX):]: v for k, v in self.pending[sender].tensors.items()}
            model.decoder.load_state_dict(decoder_state)
            decoders.append(model.decoder)
            counts.append(list(self.pending[sender].meta["class_counts"]))
            latents.add(model.latent)
        if len(latents) > 1:
            raise ValueError(f"decoders with different latent sizes {sorted(latents)} cannot share one z")
        return decoders, counts, latents.pop() if latents else 0

    def _synthesise(self, plan_fn, round_no: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        senders = sorted(s for s in self.pending if self.kind_of[s] == "generator")
        decoders, counts, latent = self._decoders(senders)
        plan = plan_fn(counts, self.options.synthetic_samples)
        gen = generator(self.seed, "synthetic", round_no)
        x, y = generate(decoders, plan, latent, self.num_classes, gen, device)
        return x, y, {"decoders": senders, "generated": len(y), "plan": {s: row for s, row in zip(senders, plan)}}

    def _keep_preview(self, x: torch.Tensor, y: torch.Tensor) -> None:
        per_class = self.options.preview_per_class
        if per_class:
            self.preview = sample_grid(x, y, self.num_classes, per_class, generator(self.seed, "preview"))

    # --- results ------------------------------------------------------------------------
    def downlink(self, round_no: int, client_id: str) -> Message | None:
        arch = self.clients[client_id].arch
        if self.global_state is not None:
            # after fusion: the global model, for the devices that can run it (and for evaluation)
            return Message("weights", round_no, "server", self.global_state, {"arch": arch}) if arch == self.global_arch else None
        if arch in self.initial:
            # the shared start: every classifier client of an architecture gets the same weights
            return Message("weights", round_no, "server", self.initial[arch], {"arch": arch, "shared_start": True})
        return None

    def global_models(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self.global_arch: self.global_state} if self.global_state is not None and self.global_arch else {}

    def reference_models(self) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
        return self.reference

    def write_artifacts(self, directory: Path) -> list[Path]:
        if self.preview is None:
            return []
        from edgefl.data.datasets import IDX_SOURCES

        names = list(IDX_SOURCES[self.dataset].class_names) if self.dataset in IDX_SOURCES else None
        return [save_sample_grid(self.preview, self.options.preview_per_class, directory / "synthetic-samples.png", names)]


class FedMHOServer(_OneShotGenerativeServer):
    options: FedMHOOptions

    def __init__(self, clients, options: FedMHOOptions, **kw) -> None:
        super().__init__(clients, options, **kw)
        classifiers = Counter(c.arch for cid, c in self.clients.items() if self.kind_of[cid] == "classifier")
        if options.global_model is not None:
            if options.global_model not in classifiers:
                raise ConfigError(f"method.global_model {options.global_model!r} is not a classifier architecture of this fleet",
                                  hint=f"use one of {sorted(classifiers) or 'none (give some devices a classifier)'}")
            self.global_arch = options.global_model
        elif classifiers:
            self.global_arch = sorted(classifiers.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
        else:
            raise ConfigError("FedMHO needs at least one classifier client: its global model starts from their weights",
                              hint='give a fleet group a classifier (model = "vgg9"), or run fedcvae for generator-only fleets')

    def close_round(self, round_no: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        opts = self.options
        epochs, lr = global_training(opts, self.dataset)
        device = pick_device(opts.device if "device" in opts.model_fields_set else self.device)
        classifier_senders = sorted(s for s in self.pending if self.kind_of[s] == "classifier")
        generator_senders = [s for s in self.pending if self.kind_of[s] == "generator"]
        if not classifier_senders:
            self.pending = {}
            # a failure, not a result: the run ends with no global model, and says so (exit 3)
            return {"fused": False, "failure": "no classifier client reported: FedMHO has nothing to initialise the global model from "
                                               f"({len(generator_senders)} decoders arrived; see each device's receipt)"}
        assert self.global_arch is not None
        record: dict[str, Any] = {"fused": True, "fusion": opts.fusion, "lam": opts.lam, "device": str(device), "global_arch": self.global_arch,
                                  "global_epochs": epochs, "global_lr": lr}

        # knowledge of the classifier clients: w0 (Eq. 4, a plain average) and the teachers
        same_arch = [s for s in classifier_senders if self.clients[s].arch == self.global_arch]
        teachers = []
        for s in classifier_senders:
            m = self.build_initial(self.clients[s].arch)
            m.load_state_dict(self.pending[s].tensors)
            teachers.append(m)
        global_model = self.build_initial(self.global_arch)
        if same_arch:
            global_model.load_state_dict(weighted_average([self.pending[s].tensors for s in same_arch], [1.0] * len(same_arch)))
            # what fusion starts from, judged in the records beside the fused model (Table IV's FedAvg row)
            self.reference = {"fedavg-of-classifiers": (self.global_arch, {k: v.detach().cpu().clone()
                                                                            for k, v in global_model.state_dict().items()})}
        record["init"] = f"average of {len(same_arch)} {self.global_arch}"

        if not generator_senders:
            record.update(synthetic=0, kept=0, note="no decoder reported: the global model is the classifier average (one-shot FedAvg)")
            self.global_state = {k: v.detach().cpu().clone() for k, v in global_model.state_dict().items()}
            self.pending = {}
            record["time_s"] = round_s(time.perf_counter() - t0)
            return record

        x, y, gen_record = self._synthesise(fedmho_plan, round_no, device)
        record.update(gen_record)
        if opts.keep_ratio < 1:
            x, y, per_class = kmeans_filter(x, y, opts.keep_ratio)
            record["filter"] = {str(c): list(v) for c, v in per_class.items()}
        record["kept"] = len(y)
        self._keep_preview(x, y)

        order = generator(self.seed, "fusion-order", round_no)
        if len(same_arch) < len(classifier_senders):
            # different classifier architectures cannot be averaged: distil their ensemble (section 5.6)
            ens = mean_logits(teachers, x, device)
            distil = train_on_synthetic(global_model, x, y, ens, 0.0, epochs=epochs, lr=lr,
                                        batch_size=opts.global_batch, generator=order, device=device)
            record["init"] += f", then ensemble distillation of {len(teachers)} classifiers ({distil.steps} steps)"
        teacher_logits = None
        if opts.fusion == "md":
            teacher_logits = mean_logits(teachers, x, device)
        elif opts.fusion == "sd":
            teacher_logits = mean_logits([_frozen_copy(global_model)], x, device)
        lam = opts.lam if teacher_logits is not None else 1.0
        stats = train_on_synthetic(global_model, x, y, teacher_logits, lam, epochs=epochs, lr=lr,
                                   batch_size=opts.global_batch, generator=order, device=device, reading=opts.fusion_loss)
        if teacher_logits is not None:
            record["fusion_loss"] = opts.fusion_loss
        record.update(steps=stats.steps, loss_first_epoch=stats.first_loss, loss_last_epoch=stats.last_loss)
        self.global_state = {k: v.detach().cpu().clone() for k, v in global_model.state_dict().items()}
        self.pending = {}
        record["time_s"] = round_s(time.perf_counter() - t0)
        return record


class FedCVAEServer(_OneShotGenerativeServer):
    options: FedCVAEOptions

    def __init__(self, clients, options: FedCVAEOptions, **kw) -> None:
        super().__init__(clients, options, **kw)
        get_spec(options.global_model)  # unknown names fail here, with the zoo's message
        self.global_arch = options.global_model + (
            f"({','.join(f'{k}={v}' for k, v in sorted(options.global_model_options.items()))})" if options.global_model_options else "")
        not_generators = sorted(cid for cid, kind in self.kind_of.items() if kind != "generator")
        if not_generators:
            raise ConfigError(f"FedCVAE-Ens needs every client to train a CVAE; {not_generators[:3]} train classifiers",
                              hint='set model = "cvae-small" (or "cvae-large") in every fleet group')

    def global_spec(self, arch: str) -> tuple[str, dict[str, Any], tuple[int, ...]]:
        if arch == self.global_arch:
            return self.options.global_model, dict(self.options.global_model_options), self.input_shape
        return super().global_spec(arch)

    def close_round(self, round_no: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        opts = self.options
        epochs, lr = global_training(opts, self.dataset)
        device = pick_device(opts.device if "device" in opts.model_fields_set else self.device)
        if not self.pending:
            return {"fused": False, "failure": "no decoder reported: FedCVAE-Ens has nothing to generate from (see each device's receipt)"}
        x, y, record = self._synthesise(proportional_plan, round_no, device)
        self._keep_preview(x, y)
        with GLOBAL_RNG_LOCK:  # dropout in the global VGG-9's training draws from the global RNG too
            torch.manual_seed(derive_seed(self.seed, "server-init", self.global_arch))
            model = self.build_global(self.global_arch)
            stats = train_on_synthetic(model, x, y, None, 1.0, epochs=epochs, lr=lr, batch_size=opts.global_batch,
                                       generator=generator(self.seed, "fusion-order", round_no), device=device)
        self.global_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        self.pending = {}
        record.update(fused=True, device=str(device), global_arch=self.global_arch, kept=len(y), steps=stats.steps,
                      loss_first_epoch=stats.first_loss, loss_last_epoch=stats.last_loss, time_s=round_s(time.perf_counter() - t0))
        return record


def _frozen_copy(model: nn.Module) -> nn.Module:
    import copy

    twin = copy.deepcopy(model)
    twin.eval()
    return twin


def round_s(t: float) -> float:
    return float(f"{t:.3f}")
