"""The server half of a method: turns uplink messages into what it sends back.

The contract, shared by simulation and fleets:

* :meth:`ServerHalf.downlink` says what a selected client receives at the start of a round;
  it has no side effects, so a runner may call it for evaluation too;
* :meth:`ServerHalf.receive` takes one uplink, at any time and in any order, and answers with a
  :class:`Receipt`; a repeated message id is a harmless duplicate;
* :meth:`ServerHalf.close_round` aggregates what the round brought.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from edgefl.algorithms.base import MethodOptions
from edgefl.messages import Message
from edgefl.models import build_model
from edgefl.stages import Stage
from edgefl.seeding import GLOBAL_RNG_LOCK, derive_seed


@dataclass(frozen=True)
class ClientInfo:
    """What the server knows of a device before any round: its architecture and data sizes."""

    client_id: str
    arch: str
    model: str
    model_options: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 0
    class_counts: tuple[int, ...] = ()
    input_shape: tuple[int, ...] = ()  # the device's own feature space (empty: the dataset's)


@dataclass(frozen=True)
class Receipt:
    status: Literal["accepted", "duplicate", "late", "rejected"]
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("accepted", "duplicate", "late")


def state_mismatch(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> str | None:
    """Why ``tensors`` cannot stand in for ``reference`` (names, shapes, dtypes, finite values),
    or None when it can."""
    if set(tensors) != set(reference):
        missing, extra = sorted(set(reference) - set(tensors)), sorted(set(tensors) - set(reference))
        return f"{what} does not match: missing {missing[:3]}, unexpected {extra[:3]}"
    for name, t in tensors.items():
        ref = reference[name]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            return f"{name}: {tuple(t.shape)} {t.dtype}, expected {tuple(ref.shape)} {ref.dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name} holds NaN or Inf"
    return None


class ServerHalf(ABC):
    """Base of server halves: implement :meth:`accept` (check and keep one upload) and
    :meth:`downlink` (what a selected device receives), usually :meth:`close_round` (aggregate)
    and, for methods that hold models, :meth:`global_models`. The method's traits (one-shot,
    asynchronous, what clients upload) are declared on its :class:`~edgefl.methods.MethodSpec`,
    not here. docs/adding-a-method.md walks through one."""

    #: attributes rebuilt from the config when a saved state is restored (never saved)
    config_attributes: ClassVar[frozenset[str]] = frozenset({"clients", "options", "seed", "num_classes", "input_shape", "dataset", "device"})

    def __init__(
        self,
        clients: list[ClientInfo],
        options: MethodOptions,
        *,
        seed: int,
        num_classes: int,
        input_shape: tuple[int, ...],
        dataset: str = "",
        device: str = "auto",
    ) -> None:
        self.clients = {c.client_id: c for c in clients}
        self.device = device  # the run's device setting: where heavy server work (fusion, CVAE training) runs
        self.dataset = dataset  # its name: methods with per-dataset defaults (FedMHO) look it up
        self.options = options
        self.seed = seed
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape)
        self.round = 0
        self._seen_ids: set[str] = set()

    def build_initial(self, arch: str) -> nn.Module:
        """The shared starting point of an architecture, the same for every client that runs it."""
        info = next(c for c in self.clients.values() if c.arch == arch)
        shape = info.input_shape or self.input_shape
        with GLOBAL_RNG_LOCK:  # device threads of an in-memory fleet seed and draw from the same global RNG
            torch.manual_seed(derive_seed(self.seed, "server-init", arch))
            return build_model(info.model, num_classes=self.num_classes, input_shape=shape, **info.model_options)

    # --- the contract -------------------------------------------------------------------
    @abstractmethod
    def downlink(self, round_no: int, client_id: str) -> Message | None:
        """What ``client_id`` receives at the start of round ``round_no`` (None: nothing but the
        selection). No side effects: a runner calls it for evaluation too."""

    def receive(self, message: Message) -> Receipt:
        if message.sender not in self.clients:
            return Receipt("rejected", f"unknown sender {message.sender!r}")
        if message.message_id in self._seen_ids:
            return Receipt("duplicate")
        receipt = self.accept(message)
        if receipt.status in ("accepted", "late"):
            self._seen_ids.add(message.message_id)
        return receipt

    @abstractmethod
    def accept(self, message: Message) -> Receipt:
        """Method-specific checks and storage of one new (non-duplicate) message."""

    def hold_update(self, message: Message, reference: dict[str, torch.Tensor], what: str) -> Receipt:
        """Check a synchronous upload against ``reference`` and keep it in ``self.pending``
        (one per device per round) until :meth:`close_round` aggregates it."""
        if message.round != self.round:
            return Receipt("late", f"round {message.round} closed; only the current round's {what} is used")
        problem = state_mismatch(message.tensors, reference, what)
        if problem:
            return Receipt("rejected", problem)
        if message.num_samples <= 0:
            return Receipt("rejected", "num_samples must be positive")
        pending: dict[str, Message] = self.__dict__.setdefault("pending", {})
        if message.sender in pending:
            return Receipt("rejected", f"one {what} upload per device per round")
        pending[message.sender] = message
        return Receipt("accepted")

    def begin_round(self, round_no: int) -> None:
        self.round = round_no

    def discard_round(self, round_no: int) -> None:
        """Forget a failed round's held uploads (a fleet round that missed its quorum)."""
        if isinstance(self.__dict__.get("pending"), dict):
            self.__dict__["pending"] = {}

    def close_round(self, round_no: int) -> dict[str, Any]:
        """Aggregate what the round brought; returns facts for the round's metrics record."""
        return {}

    def global_models(self) -> dict[str, dict[str, torch.Tensor]]:
        """Architecture -> weights of the models the server holds (none for knowledge methods)."""
        return {}

    def reference_models(self) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
        """Name -> (architecture, weights) of models the records judge beside the global ones, on
        the same test set (FedMHO's FedAvg of classifiers it fuses from: Table IV's starting point)."""
        return {}

    def shared_weights(self, client_id: str) -> dict[str, torch.Tensor]:
        """The weights ``client_id`` downloads and uploads a trained copy of (an asynchronous run
        turns its upload into a staleness-discounted step from them: server/asynchronous.py).
        :meth:`close_round` must replace these tensors, never edit them in place."""
        return self.global_models().get(self.clients[client_id].arch, {})

    def global_spec(self, arch: str) -> tuple[str, dict[str, Any], tuple[int, ...]]:
        """(zoo model, its options, input shape) of a global architecture, to rebuild it."""
        info = next(c for c in self.clients.values() if c.arch == arch)
        return info.model, dict(info.model_options), tuple(info.input_shape or self.input_shape)

    def build_global(self, arch: str) -> nn.Module:
        """An untrained model of a global architecture (load :meth:`global_models` into it)."""
        model, options, shape = self.global_spec(arch)
        return build_model(model, num_classes=self.num_classes, input_shape=shape, **options)

    def stages(self) -> list[Stage]:
        """Exchanges this method runs in every round besides training
        (:class:`edgefl.stages.Stage`; the client half answers them in ``answer_stage``)."""
        return []

    def write_artifacts(self, directory: Path) -> list[Path]:
        """Write what a person would look at besides the models (FedMHO: the synthetic sample grid)."""
        return []
