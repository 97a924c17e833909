"""The client half of a method: trains on the device's data and turns downlinks into uplinks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from edgefl.algorithms.training import evaluate_accuracy
from edgefl.config import TrainSettings
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


class ClientHalf:
    """Base of client halves. Subclasses implement :meth:`fit` and, when the server sends state
    that changes the model (weights), :meth:`receive`."""

    uploads_kind: ClassVar[str] = "status"

    def __init__(self, setup: ClientSetup, options: MethodOptions) -> None:
        self.setup = setup
        self.options = options
        self.model = setup.model
        self.last_train_loss: float | None = None

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

    def base_meta(self, round: int) -> dict:
        return {"num_samples": self.num_samples, "arch": self.setup.arch, "train_loss": self.last_train_loss}

    def receive(self, downlink: Message | None) -> None:
        """Apply what the server sent without training (before evaluation or before :meth:`fit`)."""

    def fit(self, downlink: Message | None, round: int) -> Message | None:
        raise NotImplementedError

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
        return evaluate_accuracy(self.model, x, y, batch_size)
