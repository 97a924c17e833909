"""Budget -> architecture: the largest zoo model a device can train within its budgets.

For each candidate (largest first by FLOPs per sample) the three bounds are checked: training
memory against ``headroom x training budget``, parameter bytes against storage, and the round
time at the device's effective speed against the deadline. The first classifier that passes
all three is chosen; when none does and the method can use generator clients (FedMHO), the
generators are tried the same way; otherwise the device is refused with the reason. A bound
whose device number is unknown is reported as unchecked, never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgefl.errors import EdgeflError
from edgefl.methods import get_method
from edgefl.profile.cost import CostEstimate, estimate
from edgefl.profile.schema import DeviceProfile

DEFAULT_CANDIDATES: list[tuple[str, dict]] = [
    *[(f"resnet{d}", {}) for d in (50, 34, 26, 22, 18, 14, 10)],
    ("vgg9", {}),
    *[(f"resnet{d}", {"width": 0.25}) for d in (26, 18, 10)],
    ("vgg9", {"width": 0.25}),
    *[(f"fedhe-cnn-{i}", {}) for i in range(10)],
    ("lenet5", {}),
    ("cnn-small", {}),
    ("cvae-large", {}),
    ("cvae-small", {}),
]


@dataclass(frozen=True)
class Budgets:
    headroom: float = 0.8  # share of the profile's training budget a round may use
    deadline_s: float = 60.0
    storage_bytes: int | None = None  # default: the profile's free storage
    samples: int = 600
    epochs: int = 1
    batch: int = 32
    optimizer: str = "adam"


@dataclass
class Verdict:
    estimate: CostEstimate
    label: str
    fits: bool
    bound: str  # what decided: "fits", or the first bound it breaks
    unchecked: list[str] = field(default_factory=list)


@dataclass
class Assignment:
    profile: DeviceProfile
    chosen: Verdict | None
    verdicts: list[Verdict]
    reason: str


def _label(name: str, options: dict) -> str:
    return name + (f"({','.join(f'{k}={v}' for k, v in sorted(options.items()))})" if options else "")


def training_budget(profile: DeviceProfile) -> float | None:
    """The RAM a round may train in: the profile's budget, never more than RAM minus the measured
    footprint of the edgefl client runtime itself (a budget that forgot the runtime is capped)."""
    mem = profile.memory
    budget = mem.training_budget_bytes.value if mem.training_budget_bytes.known else None
    if mem.ram_bytes.known and mem.runtime_bytes.known:
        ceiling = mem.ram_bytes.value - mem.runtime_bytes.value
        budget = ceiling if budget is None else min(budget, ceiling)
    return budget


def judge(est: CostEstimate, label: str, profile: DeviceProfile, budgets: Budgets) -> Verdict:
    unchecked: list[str] = []
    mem_budget = training_budget(profile)
    if mem_budget is not None:
        limit = budgets.headroom * mem_budget
        if est.train_memory_bytes > limit:
            return Verdict(est, label, False, f"memory: needs {_mib(est.train_memory_bytes)} of {_mib(limit)}")
    else:
        unchecked.append("memory")
    storage = budgets.storage_bytes if budgets.storage_bytes is not None else profile.memory.storage_bytes.value
    if storage is not None:
        if est.storage_bytes > storage:
            return Verdict(est, label, False, f"storage: needs {_mib(est.storage_bytes)} of {_mib(storage)}")
    else:
        unchecked.append("storage")
    if est.round_s is not None:
        if est.round_s > budgets.deadline_s:
            return Verdict(est, label, False, f"deadline: {est.round_s:.0f} s a round > {budgets.deadline_s:g} s")
    else:
        unchecked.append("deadline (speed unknown)")
    return Verdict(est, label, True, "fits", unchecked)


def assign(
    profile: DeviceProfile,
    budgets: Budgets | None = None,
    method: str = "fedavg",
    candidates: list[tuple[str, dict]] | None = None,
    input_shape: tuple[int, ...] = (1, 28, 28),
    num_classes: int = 10,
) -> Assignment:
    budgets = budgets or Budgets()
    pool = candidates if candidates is not None else DEFAULT_CANDIDATES
    verdicts = []
    for name, options in pool:
        est = estimate(name, options, profile=profile, batch=budgets.batch, samples=budgets.samples, epochs=budgets.epochs,
                       optimizer=budgets.optimizer, input_shape=input_shape, num_classes=num_classes)  # type: ignore[arg-type]
        verdicts.append(judge(est, _label(name, options), profile, budgets))
    verdicts.sort(key=lambda v: (v.estimate.kind != "classifier", -v.estimate.flops_per_sample))
    classifiers = [v for v in verdicts if v.estimate.kind == "classifier"]
    generators = [v for v in verdicts if v.estimate.kind == "generator"]
    chosen = next((v for v in classifiers if v.fits), None)
    if chosen is not None:
        bigger = [v for v in classifiers if v.estimate.flops_per_sample > chosen.estimate.flops_per_sample]
        reason = f"largest classifier that fits; the next larger is bound by {bigger[-1].bound}" if bigger else "the largest candidate fits"
        return Assignment(profile, chosen, verdicts, reason)
    takes_generators = get_method(method).generator_clients
    if takes_generators:
        chosen = next((v for v in generators if v.fits), None)
        if chosen is not None:
            return Assignment(profile, chosen, verdicts, f"no classifier fits ({classifiers[-1].bound if classifiers else 'none'}); "
                                                         f"{method} takes a generator client")
    why = _none_fits(classifiers)
    if not takes_generators and any(v.fits for v in generators):
        why += f"; a generator would fit, but {method} has no generator clients (FedMHO does)"
    return Assignment(profile, None, verdicts, why)


def _none_fits(classifiers: list[Verdict]) -> str:
    """Why no classifier fits, naming the candidates nearest to fitting: the one that needs the
    least memory and the one with the fewest FLOPs (not the same model: cnn-small has fewer
    parameters and activations than lenet5, lenet5 fewer FLOPs)."""
    if not classifiers:
        return "no candidates"
    lightest = min(classifiers, key=lambda v: v.estimate.train_memory_bytes)
    cheapest = min(classifiers, key=lambda v: v.estimate.flops_per_sample)
    why = f"no classifier fits: even the one that needs the least memory, {lightest.label}, is bound by {lightest.bound}"
    if cheapest is not lightest:
        why += f"; the one with the fewest FLOPs, {cheapest.label}, by {cheapest.bound}"
    return why


def measure_advice(profile: DeviceProfile, what: str) -> str:
    """How to get a number a profile lacks (``what``: "memory", the runtime's footprint, or
    "speed"): ``edgefl device-profile`` on a device that runs Python; a microcontroller cannot."""
    if profile.device_class != "mcu":
        return f"measure {'it' if what == 'memory' else 'its speed'} with `edgefl device-profile` on the device"
    if what == "memory":
        return ("a microcontroller cannot run edgefl (no Python): take the RAM its firmware's runtime and network stack use from "
                "the build's memory map (e.g. `idf.py size`), or keep the catalog's training budget (RAM minus the SDK's share)")
    return ("a microcontroller cannot run edgefl (no Python): time a step of the model on the board with TFLite Micro and write "
            "compute.effective_gflops into a copy of the profile (docs/profile-schema.md), or keep the catalog's values")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def parse_candidates(text: str) -> list[tuple[str, dict]]:
    from edgefl.profile.measure import ModelCandidate

    if not text.strip():
        raise EdgeflError("--models is empty")
    return [(c.name, c.options) for c in (ModelCandidate.parse(t) for t in text.split(",") if t.strip())]
