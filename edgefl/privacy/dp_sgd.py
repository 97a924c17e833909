"""Sample-level differential privacy: DP-SGD on the device (Abadi et al., CCS 2016) through Opacus.

Every step clips each sample's gradient to ``max_grad_norm``, sums them, adds Gaussian noise of
standard deviation ``noise_multiplier x max_grad_norm`` and divides by the expected batch size
(Opacus' ``GradSampleModule`` and ``DPOptimizer``); batches are drawn by Poisson sampling, each
sample independently with probability q = batch_size / samples (Opacus' sampler, the one its
``DPDataLoader`` uses). One step is one release of a subsampled Gaussian mechanism, so a device's
epsilon after T steps is :class:`~edgefl.privacy.accounting.Gaussian` (z, q, T): each upload
carries it (meta ``dp_sgd_epsilon``). The training loop is
:func:`edgefl.algorithms.training.train_local`; this module holds the device's parameters, the
accounting and what is refused before a run starts (docs/privacy.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from edgefl.privacy.accounting import Gaussian, noise_for
from edgefl.seeding import derive_seed

if TYPE_CHECKING:
    from edgefl.config import DPSGDSettings, RunConfig, TrainSettings

#: the upload meta key holding the device's epsilon so far (null when it trains without noise)
META_EPSILON = "dp_sgd_epsilon"


def sample_rate(samples: int, batch_size: int) -> float:
    """q: the probability each sample joins a batch (batch_size / samples, at most 1)."""
    return min(1.0, batch_size / max(samples, 1))


def steps_per_epoch(samples: int, cfg: TrainSettings) -> int:
    """Steps of one local epoch: with Poisson sampling 1 / q as Opacus' sampler counts it (each
    sample is then drawn once per epoch in expectation); without, the fixed-size batches plain
    training takes (a trailing batch of one sample is skipped as there)."""
    b = cfg.batch_size
    if cfg.dp_sgd is None or cfg.dp_sgd.poisson:
        return max(1, samples // b)
    return math.ceil(samples / b) - (1 if samples >= 2 and samples % b == 1 else 0)


def steps_per_round(samples: int, cfg: TrainSettings) -> int:
    steps = cfg.epochs * steps_per_epoch(samples, cfg)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def max_draws(samples: int, cfg: TrainSettings) -> int:
    """The most sample draws one round of local training can make (what bounds the ``counts`` a
    knowledge method uploads): ``samples x epochs`` for plain training and fixed batches; with
    Poisson sampling a sample may be drawn at every step, so ``samples x steps``, although a round
    draws about ``samples x epochs`` on average (and above it about half the time)."""
    if cfg.dp_sgd is None or not cfg.dp_sgd.poisson:
        return samples * cfg.epochs
    return samples * steps_per_round(samples, cfg)


@dataclass(frozen=True)
class DeviceDP:
    """One device's DP-SGD: its settings, sample rate and noise multiplier (given, or derived from
    the target epsilon over the planned rounds x its steps per round)."""

    settings: DPSGDSettings
    samples: int
    sample_rate: float
    noise_multiplier: float
    planned_steps: int

    @classmethod
    def for_device(cls, cfg: TrainSettings, samples: int, total_rounds: int) -> DeviceDP:
        dp = cfg.dp_sgd
        assert dp is not None
        q = sample_rate(samples, cfg.batch_size)
        planned = max(1, total_rounds) * steps_per_round(samples, cfg)
        z = dp.noise_multiplier if dp.noise_multiplier is not None else noise_for(dp.target_epsilon, dp.delta, q, planned)
        return cls(dp, samples, q, float(z), planned)

    def epsilon(self, steps: int) -> float:
        """epsilon at the settings' delta after ``steps`` steps (inf without noise, 0 before any)."""
        return Gaussian(self.noise_multiplier, self.sample_rate, steps).epsilon(self.settings.delta)

    def meta_epsilon(self, steps: int) -> float | None:
        """What an upload's ``dp_sgd_epsilon`` holds: a finite epsilon, or None (null) when training
        adds no noise (epsilon is infinite: uploads carry finite numbers only)."""
        eps = self.epsilon(steps)
        return eps if math.isfinite(eps) else None


def noise_generator(seed: int, client_id: str, round_no: int, device: torch.device) -> torch.Generator:
    """The generator of a round's DP-SGD noise: seeded from (seed, "dp-sgd", device, round), on the
    device the model trains on, so a simulation and a fleet add the same noise."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, "dp-sgd", client_id, round_no))
    return g


def _opacus_missing() -> str | None:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return "Opacus is not installed"
    return None


def run_refusal(cfg: RunConfig) -> tuple[str, str] | None:
    """Why a run that asks for DP-SGD cannot have it, and what to do, or None. Checked before the
    run starts: Opacus present, the method's local loss made of per-sample terms, every explicitly
    named model free of layers without per-sample gradients (BatchNorm), no target epsilon in an
    asynchronous run (a device's number of trainings is not planned there). ``model = "auto"``
    groups are checked when the model is chosen (the client half refuses it)."""
    from edgefl.methods import get_method

    missing = _opacus_missing()
    if missing:
        return missing, "pip install 'edgefl[privacy]' (or: pip install opacus)"
    spec = get_method(cfg.method.name)
    why = getattr(spec.client_class(), "dp_sgd_refusal", "")
    if why:
        return f"method {spec.name}: {why}", "choose a method whose local loss is a mean of per-sample terms (fedavg, fedhe, felo, chfl, ...)"
    for i, group in enumerate(cfg.fleet.groups):
        dp = cfg.train_for(group).dp_sgd
        if dp is None:
            continue
        if cfg.train_for(group).optimizer_state == "kept":
            return (f"fleet.groups.{i}: DP-SGD makes its own optimizer each round (Opacus' DPOptimizer), so it cannot keep one "
                    "across rounds", 'set train.optimizer_state = "per_round" or drop train.dp_sgd')
        if dp.target_epsilon is not None and cfg.mode == "async":
            return (f"fleet.groups.{i}: target_epsilon needs the planned number of trainings of each device, which an "
                    'asynchronous run (mode = "async") does not fix',
                    "give noise_multiplier instead; every upload's dp_sgd_epsilon says what the device has spent")
        if group.model == "auto":
            continue
        problem = model_problem(group.model, group.options)
        if problem:
            return f"fleet.groups.{i} ({group.model}): {problem}", model_hint(group.model)
    return None


def model_problem(name: str, options: dict) -> str | None:
    """Why zoo model ``name`` built with ``options`` cannot train with DP-SGD, or None (None also
    when it cannot be built here: the client half checks the model it trains)."""
    from edgefl.models import build_model, dp_sgd_ready, get_spec

    with torch.random.fork_rng(devices=[]):  # building draws initial weights: leave the caller's RNG alone
        try:
            model = build_model(name, input_shape=get_spec(name).default_input_shape, **options)
        except Exception:  # the run's own build reports a bad option or shape
            return None
    ready, reason = dp_sgd_ready(model)
    return None if ready else reason


def model_hint(name: str) -> str:
    from edgefl.models import get_spec

    if get_spec(name).takes_norm:
        return 'add norm = "group" to the group\'s options (every device of the group and the server build the same GroupNorm model)'
    return "edgefl models lists which models train with DP-SGD as they are"
