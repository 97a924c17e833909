"""Turning a config into devices: data partition, client halves and the server half.

Shared by the in-process simulation and the fleet runners, so a device built here and a device
process started from the same config and index hold identical data and initial weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from edgefl.algorithms import ClientHalf, ClientSetup, get_method
from edgefl.config import GroupSettings, RunConfig
from edgefl.data import Dataset, class_counts, dirichlet, iid, shards, subsample
from edgefl.models import build_model
from edgefl.seeding import derive_seed


@dataclass
class DeviceSlot:
    """One device of the fleet: its id, group and the indices of its training samples."""

    client_id: str
    index: int
    group: GroupSettings
    sample_indices: np.ndarray


def partition(cfg: RunConfig, ds: Dataset) -> list[np.ndarray]:
    labels = ds.y_train.numpy()
    n = cfg.fleet.num_clients
    rng = np.random.default_rng(derive_seed(cfg.seed, "partition"))
    d = cfg.data
    if d.partition == "iid":
        parts = iid(labels, n, rng)
    elif d.partition == "dirichlet":
        parts = dirichlet(labels, n, d.alpha, rng, min_samples=d.min_samples)
    else:
        parts = shards(labels, n, d.shards_per_client, rng)
    if d.samples_per_client is not None:
        parts = subsample(parts, d.samples_per_client, rng)
    return parts


def check_models_fit(cfg: RunConfig, ds: Dataset) -> None:
    """Each group's architecture must take the dataset's input: one tiny forward per group, so a
    mismatch is a config error naming the group rather than a shape error mid-run."""
    from edgefl.errors import ConfigError
    from edgefl.models import example_inputs

    for i, group in enumerate(cfg.fleet.groups):
        try:
            model = build_model(group.model, num_classes=ds.num_classes, input_shape=ds.input_shape, **group.options)
            model.eval()
            with torch.no_grad():
                model(*example_inputs(model, 2, ds.input_shape, ds.num_classes))
        except (RuntimeError, ValueError) as exc:
            shape = "x".join(map(str, ds.input_shape))
            raise ConfigError(
                f"fleet.groups[{i}]: model {group.arch} cannot take {ds.name} input {shape} ({str(exc).splitlines()[0]})",
                hint="pick a model for this input size (`edgefl models` lists them) or another dataset",
            ) from None


def device_slots(cfg: RunConfig, ds: Dataset) -> list[DeviceSlot]:
    parts = partition(cfg, ds)
    slots, i = [], 0
    width = len(str(cfg.fleet.num_clients - 1))
    for group in cfg.fleet.groups:
        for _ in range(group.count):
            slots.append(DeviceSlot(f"client-{i:0{width}d}", i, group, parts[i]))
            i += 1
    return slots


def partition_record(ds: Dataset, slots: list[DeviceSlot]) -> dict:
    counts = class_counts(ds.y_train.numpy(), [s.sample_indices for s in slots], ds.num_classes)
    return {
        "class_names": list(ds.class_names),
        "clients": [
            {"client_id": s.client_id, "arch": s.group.arch, "num_samples": int(len(s.sample_indices)), "class_counts": counts[k].tolist()}
            for k, s in enumerate(slots)
        ],
    }


def build_client(cfg: RunConfig, ds: Dataset, slot: DeviceSlot) -> ClientHalf:
    method = get_method(cfg.method.name)
    torch.manual_seed(derive_seed(cfg.seed, "client-init", slot.client_id))
    model = build_model(slot.group.model, num_classes=ds.num_classes, input_shape=ds.input_shape, **slot.group.options)
    idx = torch.from_numpy(slot.sample_indices)
    setup = ClientSetup(
        client_id=slot.client_id,
        arch=slot.group.arch,
        model=model,
        x=ds.x_train[idx],
        y=ds.y_train[idx],
        num_classes=ds.num_classes,
        train=cfg.train_for(slot.group),
        seed=cfg.seed,
    )
    return method.client_class()(setup, method.parse_options(cfg.method.options()))


def build_server(cfg: RunConfig, ds: Dataset, slots: list[DeviceSlot]):
    from edgefl.server.methods import ClientInfo

    method = get_method(cfg.method.name)
    counts = class_counts(ds.y_train.numpy(), [s.sample_indices for s in slots], ds.num_classes)
    infos = [
        ClientInfo(s.client_id, s.group.arch, s.group.model, dict(s.group.options), int(len(s.sample_indices)), tuple(counts[k].tolist()))
        for k, s in enumerate(slots)
    ]
    return method.server_class()(
        infos, method.parse_options(cfg.method.options()), seed=cfg.seed, num_classes=ds.num_classes, input_shape=ds.input_shape
    )


def test_subset(cfg: RunConfig, ds: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluation set: the whole test split, or a fixed subset (the same for every run seed)."""
    n = cfg.data.test_samples
    if n is None or n >= len(ds.y_test):
        return ds.x_test, ds.y_test
    idx = torch.from_numpy(np.sort(np.random.default_rng(0).choice(len(ds.y_test), n, replace=False)))
    return ds.x_test[idx], ds.y_test[idx]


def sample_clients(cfg: RunConfig, client_ids: list[str], round_no: int) -> list[str]:
    """This round's participants: ceil(ratio x clients), drawn from (seed, round)."""
    k = max(1, math.ceil(cfg.fleet.sample_ratio * len(client_ids) - 1e-9))
    if k >= len(client_ids):
        return list(client_ids)
    rng = np.random.default_rng(derive_seed(cfg.seed, "sample", round_no))
    return sorted(rng.choice(client_ids, k, replace=False).tolist())
