"""FedMHO (Yao et al., paper 003) and the FedCVAE-Ens baseline, client half.

One client class serves both kinds of device, decided by the model it was given:

* a **classifier** client (VGG-9 by default) loads the initial weights the server hands out
  (so every classifier client of an architecture starts from the same point; averaging
  independently initialised networks is meaningless), trains with cross-entropy and uploads all
  its weights (``kind = "weights"``);
* a **generator** client (CVAE-small, or CVAE-large) trains its CVAE with BCE(sum) + KL per
  sample and uploads only the decoder and its per-class label counts (``kind = "decoder"``):
  the encoder never leaves the device.

Both methods are one-shot: a run has exactly one round.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from edgefl.algorithms.base import ClientHalf, MethodOptions
from edgefl.algorithms.fedavg import load_weights
from edgefl.messages import Message
from edgefl.models.cvae import CVAE

DECODER_PREFIX = "decoder."


#: the paper's server training per dataset (Table III, authors' code): (epochs, Adam learning rate)
GLOBAL_TRAINING = {"mnist": (10, 1e-5), "fashion-mnist": (20, 5e-4), "svhn": (20, 5e-5), "emnist": (30, 5e-5)}
DEFAULT_GLOBAL_TRAINING = GLOBAL_TRAINING["fashion-mnist"]


class _ServerFusionOptions(MethodOptions):
    client_reads: ClassVar[frozenset[str] | None] = frozenset()  # every option is the server's: the clients train alike
    synthetic_samples: int = Field(6000, ge=1, description="N: synthetic samples generated in total (N / C per class)")
    global_epochs: int | None = Field(None, ge=0, description=(
        "server training epochs (default per dataset: MNIST 10, "
        "Fashion 20, SVHN 20, EMNIST 30; others 20)"
    ))
    global_lr: float | None = Field(None, gt=0, description=(
        "server Adam learning rate (default per dataset: MNIST "
        "1e-5, Fashion 5e-4, SVHN and EMNIST 5e-5; others 5e-4)"
    ))
    global_batch: int = Field(64, ge=1)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the server generates and trains: auto = CUDA when present")
    preview_per_class: int = Field(5, ge=0, description="synthetic samples per class drawn in synthetic-samples.png (0: none)")


class FedMHOOptions(_ServerFusionOptions):
    fusion: Literal["ce", "md", "sd"] = Field(
        "ce", description="ce: FedMHO (Eq. 5); md: + KL to the classifier clients' mean logits (Eq. 6); sd: + KL to the initial global model (Eq. 7)"
    )
    lam: float = Field(0.5, ge=0, le=1, description="Eq. 8: lam x CE + (1 - lam) x KL (md and sd)")
    fusion_loss: Literal["paper", "authors-code"] = Field(
        "paper", description="how md and sd weigh KL: paper: Eq. 8, lam x CE + (1 - lam) x KL (KL averaged over the batch); "
                             "authors-code: the FedMHO authors' public code, CE + nn.KLDivLoss() at its default mean reduction "
                             "(KL / C for C classes, lam unused)")
    keep_ratio: float = Field(0.8, gt=0, le=1, description="K-means filtering: share of each class's samples kept (1: no filtering)")
    global_model: str | None = Field(None, description="architecture of the global model (default: the most common classifier architecture)")


class FedMHOMDOptions(FedMHOOptions):
    fusion: Literal["ce", "md", "sd"] = "md"


class FedMHOSDOptions(FedMHOOptions):
    fusion: Literal["ce", "md", "sd"] = "sd"


class FedCVAEOptions(_ServerFusionOptions):
    global_model: str = Field("vgg9", description="zoo classifier the server trains from scratch on the synthetic set")
    global_model_options: dict = Field(default_factory=dict)


def global_training(options: _ServerFusionOptions, dataset: str) -> tuple[int, float]:
    """Server epochs and learning rate: the options when set, else the paper's for the dataset."""
    epochs, lr = GLOBAL_TRAINING.get(dataset, DEFAULT_GLOBAL_TRAINING)
    return (options.global_epochs if options.global_epochs is not None else epochs,
            options.global_lr if options.global_lr is not None else lr)


def is_generator(model: torch.nn.Module) -> bool:
    return isinstance(model, CVAE)


class FedMHOClient(ClientHalf):
    """Classifier or CVAE client of a one-shot method (see the module docstring)."""

    @property
    def judged(self) -> bool:
        return not is_generator(self.model)

    def downlink_problem(self, downlink: Message) -> str | None:
        if downlink.kind != "weights":
            return f"a {downlink.kind!r} download; the server sends weights"
        return None if is_generator(self.model) else self.weights_problem(downlink.tensors)

    def receive(self, downlink: Message | None) -> None:
        if downlink is not None and downlink.kind == "weights" and not is_generator(self.model):
            load_weights(self.model, downlink.tensors)

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        self.receive(downlink)
        if is_generator(self.model):
            return self._fit_cvae(round_no)
        self.train_locally(round_no, lambda xb, yb: F.cross_entropy(self.model(xb), yb))
        return self.reply("weights", round_no, self.model.state_dict())

    def _fit_cvae(self, round_no: int) -> Message:
        model: CVAE = self.model  # type: ignore[assignment]
        num_classes = self.setup.num_classes

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            recon, mu, logvar = model(xb, F.one_hot(yb, num_classes).float())
            return CVAE.loss(recon, xb, mu, logvar)

        if float(self.setup.x.min()) < 0 or float(self.setup.x.max()) > 1:
            raise ValueError("a CVAE client needs inputs in [0, 1] (its reconstruction loss is a binary cross-entropy)")
        self.train_locally(round_no, loss)
        decoder = {k: v for k, v in model.state_dict().items() if k.startswith(DECODER_PREFIX)}
        return self.reply("decoder", round_no, decoder, class_counts=self.class_counts(), latent=model.latent)

    def evaluate(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None, batch_size: int = 1000) -> float:
        if is_generator(self.model):
            raise ValueError(f"{self.client_id} trains a generator ({self.setup.arch}): it has no classifier to evaluate")
        return super().evaluate(x, y, batch_size)
