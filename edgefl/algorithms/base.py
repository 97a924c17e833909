"""The client half of a method: trains on the device's data and turns downlinks into uplinks.

A client half runs unchanged in a simulation and on a device (:mod:`edgefl.device` drives it);
docs/adding-a-method.md walks through writing one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from edgefl.algorithms.batched import BatchPlan
from edgefl.algorithms.training import DPNoise, TrainStats, evaluate_accuracy, make_optimizer, train_local
from edgefl.config import TrainSettings
from edgefl.data.views import View
from edgefl.errors import ConfigError
from edgefl.messages import Message
from edgefl.seeding import derive_seed, generator
from edgefl.tensorchecks import layout_problem, state_layout


#: the carried-state entries of a kept optimizer's state: ``optimizer.<param index>.<key>``
OPTIMIZER_STATE = "optimizer."
#: the carried-state entry holding a device's DP-SGD steps so far (:meth:`ClientHalf.carry_state`)
DP_SGD_STEPS = "dp_sgd.steps"


class MethodOptions(BaseModel):
    """Base of every method's options (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")
    #: the options the method's client half reads (None: not declared, so all of them may shape
    #: what its clients train); kept clients (edgefl.sim.kept_clients) are compared on these alone
    client_reads: ClassVar[frozenset[str] | None] = None


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


class ClientHalf(ABC):
    """Base of client halves.

    Subclasses implement :meth:`fit` (apply the download, train, return the upload) and, when
    the server sends state that changes the model (weights), :meth:`receive`. What a method's
    clients upload is declared on its :class:`~edgefl.methods.MethodSpec` (``uploads``).
    :meth:`train_locally` and :meth:`reply` are the usual body of a ``fit``::

        def fit(self, downlink, round_no):
            self.receive(downlink)
            self.train_locally(round_no, lambda x, y: F.cross_entropy(self.model(x), y))
            return self.reply("weights", round_no, self.model.state_dict())
    """

    #: attributes (tensors, dicts of tensors, or None) the method carries from one round to the
    #: next besides the model: what a device saves to resume after a crash (:meth:`carry_state`)
    carried: ClassVar[tuple[str, ...]] = ()

    #: why this method's local training cannot run as DP-SGD (``train.dp_sgd``), or "" when it can:
    #: its loss must be the mean of per-sample terms of the model's own forward passes, and nothing
    #: may rewrite the gradients between backward and the optimizer step (docs/privacy.md)
    dp_sgd_refusal: ClassVar[str] = ""

    @classmethod
    def model_problem(cls, model: nn.Module, arch: str, options: MethodOptions) -> tuple[str, str] | None:
        """Why this method cannot train ``model`` ((what is wrong, what to set)), or None when it can:
        asked of every fleet group at start-up (:func:`edgefl.build.check_models_fit`), so a fleet
        server refuses the config before any device is built, as a simulation does."""
        return None

    @classmethod
    def knowledge_bytes(cls, options: MethodOptions, num_classes: int) -> tuple[int, str]:
        """The most a message of this method carries beside a model's weights, and what that is (for
        the start-up check that each message fits network.max_message_bytes); (0, "") for none."""
        return 0, ""

    def __init__(self, setup: ClientSetup, options: MethodOptions) -> None:
        self.setup = setup
        self.options = options
        self.model = setup.model
        self.last_train_loss: float | None = None
        self.last_train_samples = 0  # samples processed in the last fit (the virtual clock's input)
        self.dp_sgd_steps = 0  # DP-SGD steps taken over the run (what the device's epsilon counts)
        self._optimizer: torch.optim.Optimizer | None = None  # train.optimizer_state = "kept"
        self._optimizer_saved: dict[str, Any] | None = None  # its state restored from a saved device, until first used
        self._dp_sgd = None
        if setup.train.dp_sgd is not None:
            self._refuse_dp_sgd_misfits()

    def _refuse_dp_sgd_misfits(self) -> None:
        if self.dp_sgd_refusal:
            raise ConfigError(f"DP-SGD cannot train {type(self).__name__}: {self.dp_sgd_refusal}",
                              hint="choose a method whose local loss is a mean of per-sample terms, or drop train.dp_sgd")
        from edgefl.models import dp_sgd_ready
        from edgefl.privacy.dp_sgd import model_hint

        ready, why = dp_sgd_ready(self.model)
        if not ready:
            name = getattr(self.model, "edgefl_name", None)
            raise ConfigError(f"DP-SGD cannot train {self.client_id}'s model {self.setup.arch}: {why}",
                              hint=model_hint(name) if name else "choose a model edgefl models marks as DP-SGD ready")

    @property
    def dp_sgd(self):
        """This device's DP-SGD (:class:`~edgefl.privacy.dp_sgd.DeviceDP`: its sample rate and noise
        multiplier), or None when it trains plainly."""
        if self._dp_sgd is None and self.setup.train.dp_sgd is not None:
            from edgefl.privacy.dp_sgd import DeviceDP

            self._dp_sgd = DeviceDP.for_device(self.setup.train, self.num_samples, self.setup.total_rounds)
        return self._dp_sgd

    @property
    def judged(self) -> bool:
        """Whether this device holds a classifier worth evaluating (a generator client does not)."""
        return True

    @property
    def device(self) -> torch.device:
        """Where this client half computes (the run's ``device``): its data and model live there."""
        return self.setup.x.device

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A downloaded tensor (decoded on the CPU) where the model computes."""
        return tensor.to(self.device)

    @property
    def client_id(self) -> str:
        return self.setup.client_id

    @property
    def num_samples(self) -> int:
        return len(self.setup.y)

    def class_counts(self) -> list[int]:
        return torch.bincount(self.setup.y, minlength=self.setup.num_classes).tolist()

    def num_test_samples(self, y_shared: torch.Tensor | None) -> int:
        """How many samples :meth:`evaluate` judges on (its own split, else the shared set)."""
        if self.setup.y_test is not None:
            return len(self.setup.y_test)
        return 0 if y_shared is None else len(y_shared)

    def dropout_seed(self, round_no: int) -> int:
        """The global RNG's seed for this round's training (dropout masks)."""
        return derive_seed(self.setup.seed, "client-rng", self.client_id, round_no)

    def round_generator(self, round_no: int) -> torch.Generator:
        """Seeds this round's batch order and the global RNG (dropout) from (seed, client, round)."""
        torch.manual_seed(self.dropout_seed(round_no))
        return generator(self.setup.seed, "client-order", self.client_id, round_no)

    def record(self, stats: TrainStats) -> None:
        """Keep what the last local training did (loss for the metrics, samples for the clock)."""
        self.last_train_loss = stats.mean_loss
        self.last_train_samples = stats.samples

    def train_locally(self, round_no: int, loss_fn: Callable[..., torch.Tensor], generator: torch.Generator | None = None,
                      **hooks: Any) -> TrainStats:
        """One round of local training on the device's data with this round's seeded batch order
        (``generator``: one the caller already drew from :meth:`round_generator`), recorded for
        the metrics and the clock. ``hooks`` go to :func:`~edgefl.algorithms.training.train_local`
        (``extras``, ``after_backward``, ``after_step``)."""
        gen = self.round_generator(round_no) if generator is None else generator
        train = self.round_train(round_no)
        dp = self.dp_sgd
        if dp is not None:
            from edgefl.privacy.dp_sgd import noise_generator

            hooks["dp"] = DPNoise(dp.noise_multiplier, noise_generator(self.setup.seed, self.client_id, round_no, self.device))
        if self.setup.train.optimizer_state == "kept" and dp is None:
            hooks["optimizer"] = optimizer = self.kept_optimizer()
            for group in optimizer.param_groups:  # the kept moments carry on; the rate follows train.lr_milestones
                group["lr"] = train.lr
        stats = train_local(self.model, self.setup.x, self.setup.y, train, gen, loss_fn, **hooks)
        if dp is not None:
            self.dp_sgd_steps += stats.steps
        self.record(stats)
        return stats

    def round_train(self, round_no: int) -> TrainSettings:
        """The training settings of ``round_no``: the device's, with the learning rate the run's
        schedule gives that round (``train.lr_milestones``)."""
        return self.setup.train.for_round(round_no, self.setup.total_rounds)

    def base_meta(self, round_no: int) -> dict:
        meta = {"num_samples": self.num_samples, "arch": self.setup.arch, "train_loss": self.last_train_loss}
        if self.dp_sgd is not None:  # the device's own (epsilon, delta = train.dp_sgd.delta) over every step so far
            from edgefl.privacy.dp_sgd import META_EPSILON

            meta[META_EPSILON] = self.dp_sgd.meta_epsilon(self.dp_sgd_steps)
        return meta

    def reply(self, kind: str, round_no: int, tensors: dict[str, torch.Tensor], **meta: Any) -> Message:
        """The upload answering a round: detached copies of ``tensors`` (a state dict may be
        passed as is) and the metadata every upload carries (sample count, architecture, loss)
        plus ``meta``."""
        # copies on the CPU: the codec writes host memory, and the model trains on
        copies = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        return Message(kind, round_no, self.client_id, copies, {**self.base_meta(round_no), **meta})

    def kept_optimizer(self) -> torch.optim.Optimizer:
        """The one optimizer of ``train.optimizer_state = "kept"``: made on first use over the
        model's parameters (downloads load into the same tensors, so it follows them)."""
        if self._optimizer is None:
            self._optimizer = make_optimizer(self.model.parameters(), self.setup.train)
            if self._optimizer_saved is not None:  # restored from the device's state before the first training
                self._optimizer.load_state_dict(self._optimizer_saved)
                self._optimizer_saved = None
        return self._optimizer

    def carry_state(self) -> dict[str, torch.Tensor]:
        """What this device must keep to continue after a crash: its model and :attr:`carried`,
        as flat named tensors (``model.*``, ``<attribute>`` or ``<attribute>.<key>``)."""
        out = {f"model.{k}": v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        optimizer = self._optimizer.state_dict() if self._optimizer is not None else self._optimizer_saved
        if optimizer is not None:  # train.optimizer_state = "kept": its moments and step counts
            for index, state in optimizer["state"].items():
                for key, value in state.items():
                    out[f"{OPTIMIZER_STATE}{index}.{key}"] = (value.detach().cpu().clone() if isinstance(value, torch.Tensor)
                                                              else torch.tensor(float(value), dtype=torch.float64))
        if self.setup.train.dp_sgd is not None:  # the steps the device's epsilon counts survive a restart
            out[DP_SGD_STEPS] = torch.tensor([self.dp_sgd_steps], dtype=torch.int64)
        for attr in self.carried:
            value = getattr(self, attr)
            if isinstance(value, torch.Tensor):
                out[attr] = value.detach().cpu().clone()
            elif isinstance(value, dict):
                out.update({f"{attr}.{k}": v.detach().cpu().clone() for k, v in value.items()})
        return out

    def load_carry_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`carry_state` returned (attributes it did not hold stay None)."""
        self.model.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
        saved = [(k[len(OPTIMIZER_STATE):], v) for k, v in tensors.items() if k.startswith(OPTIMIZER_STATE)]
        if saved and self.setup.train.optimizer_state == "kept":
            template = make_optimizer(self.model.parameters(), self.setup.train).state_dict()
            state: dict[int, dict[str, torch.Tensor]] = {}
            for name, value in saved:
                index, _, key = name.partition(".")
                state.setdefault(int(index), {})[key] = self.on_device(value) if value.dim() else value
            self._optimizer, self._optimizer_saved = None, {"state": state, "param_groups": template["param_groups"]}
        if DP_SGD_STEPS in tensors:
            self.dp_sgd_steps = int(tensors[DP_SGD_STEPS].reshape(-1)[0])
        for attr in self.carried:
            if attr in tensors:
                setattr(self, attr, self.on_device(tensors[attr]))
            else:
                prefix = f"{attr}."
                found = {k.removeprefix(prefix): self.on_device(v) for k, v in tensors.items() if k.startswith(prefix)}
                setattr(self, attr, found or None)

    def downlink_problem(self, downlink: Message) -> str | None:
        """Why this device cannot use ``downlink`` (wrong kind, names, dtypes or shapes), or None.
        Called on every download and evaluate request before :meth:`receive` or :meth:`fit`
        touches it (values are already checked finite and bounded, and a training that fails or
        ends non-finite is undone by the device loop). The default accepts what is finite; every
        built-in method states exactly what it takes (docs/adding-a-method.md)."""
        return None

    def weights_problem(self, tensors: dict[str, torch.Tensor], what: str = "weights") -> str | None:
        """Weights sent for this device's model: exactly its state dict's names and shapes."""
        return layout_problem(tensors, state_layout(self.model.state_dict()), what)

    def receive(self, downlink: Message | None) -> None:  # noqa: B027  (optional hook: most methods send nothing to apply)
        """Apply what the server sent without training (before evaluation or before :meth:`fit`)."""

    def answer_stage(self, stage: str, request: Message) -> Message | None:
        """The reply to a stage request of this method's server half (:mod:`edgefl.stages`);
        None: not a stage of this method."""
        return None

    def batch_plan(self, downlink: Message | None, round_no: int) -> BatchPlan | None:
        """This round's training as a part of one batched computation with the other clients of
        its architecture (:mod:`edgefl.algorithms.batched`), or None: this method trains one
        client at a time. It may apply ``downlink`` (as :meth:`fit` would again)."""
        return None

    @abstractmethod
    def fit(self, downlink: Message | None, round_no: int) -> Message:
        """Apply ``downlink``, train one round, return the upload (kind ``status`` when the method
        shares nothing, so the server still learns that the device trained)."""

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
