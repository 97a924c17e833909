"""Building a run from its config: the data and the devices (partition, architecture, feature
space, client halves). The server half is built from these by
:func:`edgefl.server.session.build_server` (a device never imports server code).

The one module both runners build from: the simulation and ``edgefl server`` call
:func:`build_run`, a device process calls :func:`build_device`, so a device built in a
simulation and a device process started from the same config and id hold identical data,
feature space and initial weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edgefl.algorithms import ClientHalf, ClientSetup
from edgefl.compute import resolve_device
from edgefl.config import GroupSettings, RunConfig
from edgefl.data import Dataset, class_counts, contiguous, dirichlet, iid, load_dataset, shards, subsample
from edgefl.data.views import View, make_view, view_record
from edgefl.errors import ConfigError
from edgefl.methods import get_method
from edgefl.models import build_model, example_inputs
from edgefl.profile.schema import DeviceProfile
from edgefl.seeding import GLOBAL_RNG_LOCK, derive_seed
from edgefl.transport.topics import device_ids

#: hidden sizes a ``hidden = "random"`` MLP draws from (CHFL's randomly generated client MLPs)
RANDOM_MLP_DEPTHS = (1, 2, 3)
RANDOM_MLP_WIDTHS = (16, 32, 64, 128)


@dataclass
class DeviceSlot:
    """One device of the fleet, fully resolved: id, architecture, feature space and data."""

    client_id: str
    index: int
    group: GroupSettings
    sample_indices: np.ndarray
    test_indices: np.ndarray | None = None
    model_options: dict[str, Any] = field(default_factory=dict)
    view: View | None = None
    model: str = ""  # the zoo model this device trains (resolved when the group says "auto")
    profile: DeviceProfile | None = None  # its device class, when the fleet is described by profiles

    def __post_init__(self) -> None:
        self.model = self.model or self.group.model

    @property
    def arch(self) -> str:
        if not self.model_options:
            return self.model
        return f"{self.model}({','.join(f'{k}={v}' for k, v in sorted(self.model_options.items()))})"

    def input_shape(self, ds: Dataset) -> tuple[int, ...]:
        return self.view.output_shape if self.view else ds.input_shape


#: how a pooled data set's source ends (run.json records it; an export reads it from there)
POOLED = " (train+test pooled)"


def held_out_indices(cfg: RunConfig, slots: list[DeviceSlot]) -> list[int] | None:
    """The samples the devices held out and never trained on, as indices into the data set's train
    and test splits concatenated (the pool a ``client_test_fraction`` run partitions), or None when
    the run judges on the data set's own test split. An export checks a model on these: the test
    split of a pooled run was partly trained on."""
    if not cfg.data.client_test_fraction or cfg.data.device_held:
        return None
    return sorted({int(i) for s in slots if s.test_indices is not None for i in s.test_indices})


def model_meta(cfg: RunConfig, ds: Dataset) -> dict[str, Any]:
    """What every saved model's metadata carries about the run (edgefl export reads it)."""
    return {"num_classes": ds.num_classes, "input_shape": list(ds.input_shape), "class_names": list(ds.class_names),
            "dataset": ds.name, "round": cfg.rounds, "method": cfg.method.name, "seed": cfg.seed}


def device_model_meta(cfg: RunConfig, ds: Dataset, slot: DeviceSlot, scope: str) -> dict[str, Any]:
    """The metadata of one device's own model file (a simulation's ``client-*`` and ``ship-*``
    files, a fleet device's ``model.safetensors``): the run's, and the device's architecture,
    input shape, view and held-out samples."""
    meta = {**model_meta(cfg, ds), "arch": slot.arch, "model": slot.model, "model_options": slot.model_options,
            "scope": scope, "client_id": slot.client_id, "input_shape": list(slot.input_shape(ds)),
            "view": view_record(slot.view) if slot.view else None}
    held = held_out_indices(cfg, [slot])
    if held:
        meta["held_out_indices"] = held
    return meta


def pooled(ds: Dataset) -> Dataset:
    """Train and test in one pool, for configs where each device holds out its own test split."""
    return Dataset(ds.name, torch.cat([ds.x_train, ds.x_test]), torch.cat([ds.y_train, ds.y_test]),
                   ds.x_test[:0], ds.y_test[:0], ds.class_names, ds.source + POOLED, ds.files,
                   ds.standardisation, ds.pixel_divisor)


def partition(cfg: RunConfig, ds: Dataset) -> list[np.ndarray]:
    labels = ds.y_train.numpy()
    n = cfg.fleet.num_clients
    rng = np.random.default_rng(derive_seed(cfg.seed, "partition"))
    d = cfg.data
    if d.device_held:  # real devices bring their own samples: the server splits nothing
        return [np.zeros(0, dtype=np.int64) for _ in range(n)]
    if d.partition == "iid":
        parts = iid(labels, n, rng)
    elif d.partition == "dirichlet":
        parts = dirichlet(labels, n, d.alpha, rng, min_samples=d.min_samples)
    elif d.partition == "contiguous":
        parts = contiguous(labels, n)
    else:
        parts = shards(labels, n, d.shards_per_client, rng)
    if d.samples_per_client is not None:
        parts = subsample(parts, d.samples_per_client, rng)
    return parts


def _resolve_options(cfg: RunConfig, group: GroupSettings, client_id: str) -> dict[str, Any]:
    options = dict(group.options)
    if group.model == "mlp" and options.get("hidden") == "random":
        rng = np.random.default_rng(derive_seed(cfg.seed, "mlp-shape", client_id))
        depth = int(rng.choice(RANDOM_MLP_DEPTHS))
        options["hidden"] = sorted((int(rng.choice(RANDOM_MLP_WIDTHS)) for _ in range(depth)), reverse=True)
    return options


def group_budgets(cfg: RunConfig, ds: Dataset, group: GroupSettings, samples: int | None = None):
    """The budgets a group's devices are judged by: the run's clock and training settings, and
    ``samples`` per round (default: an even share of the training set)."""
    from edgefl.profile.assign import Budgets

    train = cfg.train_for(group)
    per_device = (samples if samples is not None else math.ceil(len(ds.y_train) / cfg.fleet.num_clients)) * train.epochs
    samples = min(per_device, train.max_steps * train.batch_size) if train.max_steps else per_device
    optimizer = "adam" if train.optimizer == "adam" else ("momentum" if train.momentum > 0 else "sgd")
    return Budgets(headroom=cfg.clock.headroom, deadline_s=cfg.clock.deadline_s, samples=max(1, samples), epochs=1,
                   batch=train.batch_size, optimizer=optimizer)


def assign_group(cfg: RunConfig, ds: Dataset, group: GroupSettings, group_index: int, profile: DeviceProfile) -> tuple[str, dict]:
    """The model an ``auto`` group's device class gets for this run's round (budget -> architecture)."""
    from edgefl.profile.assign import assign, parse_candidates

    budgets = group_budgets(cfg, ds, group)
    # the view's output shape is the same for every device of the group (only its content differs)
    shape = make_view(group.view, ds.input_shape, cfg.seed, "probe").output_shape if group.view else ds.input_shape
    candidates = parse_candidates(",".join(cfg.clock.candidates)) if cfg.clock.candidates else None
    result = assign(profile, budgets, cfg.method.name, candidates, input_shape=tuple(shape), num_classes=ds.num_classes)
    if result.chosen is None:
        raise ConfigError(f"fleet.groups[{group_index}]: {profile.id} cannot take part: {result.reason}",
                          hint="raise clock.deadline_s or clock.headroom, give fewer samples per round, or list smaller clock.candidates")
    e = result.chosen.estimate
    return e.model, dict(e.options)


def check_profile_fits(cfg: RunConfig, ds: Dataset, group: GroupSettings, group_index: int, profile: DeviceProfile,
                       options: dict[str, Any]) -> None:
    """An explicit model on a group with a profile: refused when the device class cannot hold it
    (training memory within clock.headroom of its budget, or storage), judged as ``model = "auto"``
    judges its candidates. A round slower than the deadline is not refused: the virtual clock drops
    such a device as a straggler, which is what a fleet of mixed speeds studies."""
    from edgefl.profile.assign import assign

    shape = make_view(group.view, ds.input_shape, cfg.seed, "probe").output_shape if group.view else ds.input_shape
    try:
        (verdict,) = assign(profile, group_budgets(cfg, ds, group), cfg.method.name, [(group.model, options)],
                            input_shape=tuple(shape), num_classes=ds.num_classes).verdicts
    except (ValueError, TypeError, KeyError, RuntimeError):
        return  # the cost model cannot size this model for this input: check_models_fit names what is wrong with it
    if not verdict.fits and not verdict.bound.startswith("deadline"):
        raise ConfigError(f"fleet.groups[{group_index}]: {profile.id} cannot hold {verdict.label}: {verdict.bound} "
                          f"(clock.headroom = {cfg.clock.headroom:g} of its training budget)",
                          hint=f'choose a smaller model, model = "auto" (the largest {profile.id} can train), a larger device class, '
                               "or fewer samples per round")


def device_slots(cfg: RunConfig, ds: Dataset) -> list[DeviceSlot]:
    from edgefl.profile import load_profile

    parts = partition(cfg, ds)
    frac = cfg.data.client_test_fraction
    slots, i = [], 0
    ids = device_ids(cfg.fleet.num_clients)
    for g, group in enumerate(cfg.fleet.groups):
        judged: set[str] = set()  # the options already checked against this group's profile
        profile = load_profile(group.profile) if group.profile else None
        model, auto_options = (assign_group(cfg, ds, group, g, profile) if group.model == "auto" else (group.model, {}))
        for _ in range(group.count):
            cid = ids[i]
            train_idx, test_idx = parts[i], None
            if frac is not None and not cfg.data.device_held:
                order = np.random.default_rng(derive_seed(cfg.seed, "client-test", cid)).permutation(parts[i])
                n_test = max(1, int(round(frac * len(order))))
                test_idx, train_idx = np.sort(order[:n_test]), np.sort(order[n_test:])
            view = make_view(group.view, ds.input_shape, cfg.seed, cid) if group.view else None
            options = {**auto_options, **_resolve_options(cfg, group, cid)}
            if profile is not None and group.model != "auto" and repr(sorted(options.items())) not in judged:
                judged.add(repr(sorted(options.items())))  # once per distinct model (random MLP shapes differ per device)
                check_profile_fits(cfg, ds, group, g, profile, options)
            slots.append(DeviceSlot(cid, i, group, train_idx, test_idx, options, view, model, profile))
            i += 1
    return slots


def check_models_fit(cfg: RunConfig, ds: Dataset, slots: list[DeviceSlot]) -> None:
    """Each device's architecture must take its input: one tiny forward per distinct
    (architecture, input shape), so a mismatch is a config error naming the group rather than a
    shape error mid-run."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    method = get_method(cfg.method.name)
    options = method.parse_options(cfg.method.options())
    for slot in slots:
        shape = slot.input_shape(ds)
        if (slot.arch, shape) in seen:
            continue
        seen.add((slot.arch, shape))
        group_index = cfg.fleet.groups.index(slot.group)
        try:
            with GLOBAL_RNG_LOCK, torch.no_grad():  # building and probing draw from the global RNG (in-memory fleets: see seeding)
                model = build_model(slot.model, num_classes=ds.num_classes, input_shape=shape, **slot.model_options)
                model.eval()
                model(*example_inputs(model, 2, shape, ds.num_classes))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"fleet.groups[{group_index}]: model {slot.arch} cannot take {ds.name} input "
                f"{'x'.join(map(str, shape))} ({str(exc).splitlines()[0]})",
                hint="pick a model for this input size (`edgefl models` lists them) or another dataset or view",
            ) from None
        problem = method.client_class().model_problem(model, slot.arch, options)
        if problem:  # the method's own rule (Felo/Velo's feature width): the fleet server refuses as a simulation does
            raise ConfigError(f"fleet.groups[{group_index}]: {problem[0]}", hint=problem[1])
        _check_weights_fit_a_message(cfg, model, slot.arch, group_index, options, ds.num_classes)


#: what an upload carries beside its tensors (envelope, safetensors header, meta): a generous bound
MESSAGE_OVERHEAD_BYTES = 1 << 20
#: the kinds of message that carry a model's whole state (Felo's class_features carry its weights too)
WEIGHT_KINDS = frozenset({"weights", "decoder", "class_features"})


def _check_weights_fit_a_message(cfg: RunConfig, model: torch.nn.Module, arch: str, group_index: int, options: Any,
                                  num_classes: int) -> None:
    """A method that sends a model's weights needs them, and what it sends beside them (Felo's class
    knowledge, Velo's per-sample features), to fit in one message (network.max_message_bytes,
    chunked on the wire): refused before the run, with the limit that would carry them, rather than
    uploads refused mid-run (a full-width VGG-9 is 277 MB, over the 256 MiB default)."""
    spec = get_method(cfg.method.name)
    if not (WEIGHT_KINDS & (set(spec.uploads) | set(spec.downloads))):
        return
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    extra, what = spec.client_class().knowledge_bytes(options, num_classes)
    total = size + extra + MESSAGE_OVERHEAD_BYTES
    limit = cfg.network.max_message_bytes
    if total > limit:
        need = math.ceil(total / (1 << 20)) << 20
        beside = f" and {extra / 1e6:.2f} MB of {what}" if extra else ""
        raise ConfigError(
            f"fleet.groups[{group_index}]: a {cfg.method.name} message of model {arch} holds {size / 1e6:.2f} MB of weights{beside}, "
            f"plus up to {MESSAGE_OVERHEAD_BYTES >> 20} MiB of envelope and meta edgefl allows for: {total / (1 << 20):.2f} MiB, "
            f"over network.max_message_bytes = {limit} ({limit / (1 << 20):g} MiB), so such messages would be refused",
            hint=f"raise the limit: [network] max_message_bytes = {need} (and max_partial_bytes_total at least twice that "
                 "for a fleet)" + (", or send less beside the weights" if extra else "") + ", or choose a smaller model (`edgefl models`)")


def partition_record(ds: Dataset, slots: list[DeviceSlot]) -> dict:
    counts = class_counts(ds.y_train.numpy(), [s.sample_indices for s in slots], ds.num_classes)
    return {
        "class_names": list(ds.class_names),
        "clients": [
            {
                "client_id": s.client_id, "arch": s.arch, "num_samples": int(len(s.sample_indices)),
                "profile": s.profile.id if s.profile else None,
                "num_test": None if s.test_indices is None else int(len(s.test_indices)),
                "input_shape": list(s.input_shape(ds)), "view": s.group.view.model_dump(exclude_none=True) if s.group.view else None,
                "class_counts": counts[k].tolist(),
            }
            for k, s in enumerate(slots)
        ],
    }


def build_client(cfg: RunConfig, ds: Dataset, slot: DeviceSlot) -> ClientHalf:
    with GLOBAL_RNG_LOCK:  # initial weights (and CHFL's head) come from the global RNG, seeded here
        return _build_client(cfg, ds, slot)


def _build_client(cfg: RunConfig, ds: Dataset, slot: DeviceSlot) -> ClientHalf:
    method = get_method(cfg.method.name)
    torch.manual_seed(derive_seed(cfg.seed, "client-init", slot.client_id))
    model = build_model(slot.model, num_classes=ds.num_classes, input_shape=slot.input_shape(ds), **slot.model_options)

    def take(indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(indices)
        x = ds.model_input(ds.x_train[idx])
        return (slot.view.apply(x) if slot.view else x), ds.y_train[idx]

    x, y = take(slot.sample_indices)
    x_test, y_test = take(slot.test_indices) if slot.test_indices is not None else (None, None)
    device = resolve_device(cfg.device)
    if device.type != "cpu":  # the model and the device's data live where it trains
        model.to(device)
        x, y = x.to(device), y.to(device)
        x_test, y_test = (None, None) if x_test is None else (x_test.to(device), y_test.to(device))
    setup = ClientSetup(
        client_id=slot.client_id, arch=slot.arch, model=model, x=x, y=y, num_classes=ds.num_classes,
        train=cfg.train_for(slot.group), seed=cfg.seed, total_rounds=cfg.rounds, view=slot.view, x_test=x_test, y_test=y_test,
    )
    return method.client_class()(setup, method.parse_options(cfg.method.options()))


def test_subset(cfg: RunConfig, ds: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared evaluation set: the whole test split, or a fixed subset (the same for every run seed)."""
    n = cfg.data.test_samples
    if n is None or n >= len(ds.y_test):
        return ds.model_input(ds.x_test), ds.y_test
    idx = torch.from_numpy(np.sort(np.random.default_rng(0).choice(len(ds.y_test), n, replace=False)))
    return ds.model_input(ds.x_test[idx]), ds.y_test[idx]


@dataclass
class RunParts:
    """What both runners start from: the data as the run sees it, every device resolved, and the
    shared test set the server judges global models on (empty when every device holds its own)."""

    cfg: RunConfig
    ds: Dataset
    slots: list[DeviceSlot]
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def device_ids(self) -> list[str]:
        return [s.client_id for s in self.slots]

    def slot(self, device_id: str) -> DeviceSlot:
        index = self.__dict__.get("_by_id")
        if index is None or len(index) != len(self.slots):  # built once: a fleet of thousands looks devices up often
            index = self.__dict__["_by_id"] = {s.client_id: s for s in self.slots}
        if device_id in index:
            return index[device_id]
        ids = self.device_ids
        raise ConfigError(f"device {device_id!r} is not in this config's fleet", hint=f"device ids are {ids[0]} .. {ids[-1]}")

    def client(self, device_id: str) -> ClientHalf:
        return build_client(self.cfg, self.ds, self.slot(device_id))


def federation_name(cfg: RunConfig) -> str:
    """The federation a run's envelopes name (a topic level in a fleet): ``network.federation``,
    else the run name with anything but letters, digits, '_', '.' and '-' made '-', 64 at most."""
    if cfg.network.federation:
        return cfg.network.federation
    safe = "".join(ch if ch.isalnum() or ch in "_.-" else "-" for ch in cfg.name)[:64]
    return safe or "run"


def load_run_dataset(cfg: RunConfig, raw_pixels: bool = False) -> Dataset:
    ds = load_dataset(cfg.data.dataset, cfg.data.data_dir, cfg.data.download, cfg.data.idx_name, cfg.data.classes,
                      raw_pixels=raw_pixels)
    return pooled(ds) if cfg.data.client_test_fraction and not cfg.data.device_held else ds


def build_run(cfg: RunConfig, dataset: Dataset | None = None, check: bool = True, raw_pixels: bool = False) -> RunParts:
    """Data, devices and test set of ``cfg`` (``dataset``: an already loaded copy of the raw data;
    ``raw_pixels``: keep images as 8-bit pixels, converting only what a device takes)."""
    if dataset is None:
        ds = load_run_dataset(cfg, raw_pixels)
    else:
        ds = pooled(dataset) if cfg.data.client_test_fraction and not cfg.data.device_held else dataset
    slots = device_slots(cfg, ds)
    if check:
        check_models_fit(cfg, ds, slots)
    x_test, y_test = test_subset(cfg, ds)
    return RunParts(cfg, ds, slots, x_test, y_test)
