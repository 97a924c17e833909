"""Privacy accounting through a maintained accountant (Opacus' RDP accountant), never by hand.

Every mechanism edgefl runs is a (sub)sampled Gaussian mechanism: a query of L2 sensitivity S
released with N(0, (z S)^2) noise, on a random share q of the population, T times. The
accountant composes that into (epsilon, delta):

* DP-FedAvg (device-level, :mod:`edgefl.filters.dp`): one release per round, q = the share of
  devices a round selects, z the noise multiplier, T the rounds;
* local DP of knowledge uploads: one release per round a device takes part in, q = 1 (the device
  itself decides to release), z its noise multiplier, T its rounds;
* DP-SGD (sample-level): one release per step, q = batch / samples, T the steps.

Opacus is an optional dependency (``pip install 'edgefl[privacy]'``): a run that needs it and
cannot import it is refused before it starts.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from edgefl.errors import ConfigError

#: Rényi orders the accountant optimises over: Opacus' defaults plus larger ones, which the small
#: noise of a large epsilon needs (Opacus warns when the best order is its largest)
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 128, 256, 512, 1024]


def _opacus():
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:
        raise ConfigError("differential privacy needs Opacus' accountant, which is not installed",
                          hint="pip install 'edgefl[privacy]' (or: pip install opacus)") from None
    return RDPAccountant, get_noise_multiplier


@dataclass(frozen=True)
class Gaussian:
    """T releases of a Gaussian mechanism with noise multiplier z on a share q."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def epsilon(self, delta: float) -> float:
        """epsilon at ``delta`` (inf without noise; 0 before any release)."""
        return composed_epsilon([self], delta)


def composed_epsilon(releases: list[Gaussian], delta: float) -> float:
    """epsilon at ``delta`` of several runs of releases composed, each with its own noise (DP-FedAvg
    under secure aggregation when a round's sum held fewer devices than its noise was split over)."""
    releases = [r for r in releases if r.steps > 0]
    if not releases:
        return 0.0
    if any(r.noise_multiplier <= 0 for r in releases):
        return math.inf
    accountant, _ = _opacus()
    a = accountant()
    a.history = [(float(r.noise_multiplier), float(r.sample_rate), int(r.steps)) for r in releases]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "optimal order is the largest alpha": ORDERS reaches far
        return float(a.get_epsilon(delta=delta, alphas=ORDERS))


def noise_for(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest noise multiplier (to Opacus' search precision) that keeps ``steps`` releases
    at share ``sample_rate`` within ``target_epsilon`` at ``delta``."""
    if not target_epsilon > 0 or not 0 < delta < 1 or not 0 < sample_rate <= 1 or steps < 1:
        raise ConfigError(f"cannot derive a noise multiplier for epsilon {target_epsilon}, delta {delta}, "
                          f"sample rate {sample_rate}, {steps} releases", hint="epsilon > 0, 0 < delta < 1")
    _, get_noise_multiplier = _opacus()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant="rdp", epsilon_tolerance=0.01))
