"""The client half of a method: trains on the device's data and turns downlinks into uplinks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from edgefl.algorithms.training import evaluate_accuracy
from edgefl.config import TrainSettings
from edgefl.data.views import View
from edgefl.messages import Message
from edgefl.seeding import derive_seed, generator


class MethodOptions(BaseModel):
    """Base of every method's options (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class ClientSetup:
    """Everything a client half is given; the same on a simulated and a real device."""

    client_id: str
    arch: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    train: TrainSettings
    seed: int
    total_rounds: int = 1  # the planned number of rounds (CHFL's temperature schedule needs it)
    view: View | None = None  # this device's feature space: applied to anything it evaluates
    x_test: torch.Tensor | None = None  # the device's own held-out split, when it has one
    y_test: torch.Tensor | None = None


class ClientHalf:
    """Base of client halves. Subclasses implement :meth:`fit` and, when the server sends state
    that changes the model (weights), :meth:`receive`."""

    uploads_kind: ClassVar[str] = "status"

    def __init__(self, setup: ClientSetup, options: MethodOptions) -> None:
        self.setup = setup
        self.options = options
        self.model = setup.model
        self.last_train_loss: float | None = None
        self.last_train_samples = 0  # samples processed in the last fit (the virtual clock's input)

    @property
    def judged(self) -> bool:
        """Whether this device holds a classifier worth evaluating (a generator client does not)."""
        return True

    @property
    def client_id(self) -> str:
        return self.setup.client_id

    @property
    def num_samples(self) -> int:
        return len(self.setup.y)

    def class_counts(self) -> list[int]:
        return torch.bincount(self.setup.y, minlength=self.setup.num_classes).tolist()

    def round_generator(self, round: int) -> torch.Generator:
        """Seeds this round's batch order and the global RNG (dropout) from (seed, client, round)."""
        torch.manual_seed(derive_seed(self.setup.seed, "client-rng", self.client_id, round))
        return generator(self.setup.seed, "client-order", self.client_id, round)

    def record(self, stats) -> None:
        """Keep what the last local training did (loss for the metrics, samples for the clock)."""
        self.last_train_loss = stats.mean_loss
        self.last_train_samples = stats.samples

    def base_meta(self, round: int) -> dict:
        return {"num_samples": self.num_samples, "arch": self.setup.arch, "train_loss": self.last_train_loss}

    def receive(self, downlink: Message | None) -> None:
        """Apply what the server sent without training (before evaluation or before :meth:`fit`)."""

    def fit(self, downlink: Message | None, round: int) -> Message | None:
        raise NotImplementedError

    def evaluate(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None, batch_size: int = 1000) -> float:
        """Accuracy on the device's own test split when it has one, else on ``x, y`` seen
        through the device's view (raw inputs in, this device's features out)."""
        if self.setup.x_test is not None:
            return evaluate_accuracy(self.model, self.setup.x_test, self.setup.y_test, batch_size)
        if x is None or y is None:
            raise ValueError("this device has no test split of its own: pass x and y")
        if self.setup.view is not None:
            x = self.setup.view.apply(x)
        return evaluate_accuracy(self.model, x, y, batch_size)
