"""A registry of named model builders with measured metadata (parameters, FLOPs, widths)."""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from edgefl.errors import ConfigError
from edgefl.userdirs import cache_home

Kind = Literal["classifier", "generator"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build one named architecture and what it expects."""

    name: str
    kind: Kind
    builder: Callable[..., nn.Module]
    family: str
    description: str
    default_input_shape: tuple[int, ...] = (1, 28, 28)
    defaults: dict[str, Any] = field(default_factory=dict)
    #: the builder takes ``norm = "batch" | "group"`` (:func:`norm_layer`): GroupNorm makes it DP-SGD ready
    takes_norm: bool = False


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"model {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def model_names(kind: Kind | None = None) -> list[str]:
    return [n for n, s in _REGISTRY.items() if kind is None or s.kind == kind]


def get_spec(name: str) -> ModelSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "run `edgefl models` to list the zoo"
        raise ConfigError(f"unknown model {name!r}", hint=hint) from None


def build_model(
    name: str,
    num_classes: int = 10,
    input_shape: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build a zoo model by name. ``input_shape`` excludes the batch dimension."""
    spec = get_spec(name)
    shape = tuple(input_shape) if input_shape is not None else spec.default_input_shape
    params = {**spec.defaults, **kwargs}
    try:
        model = spec.builder(num_classes=num_classes, input_shape=shape, **params)
    except TypeError as exc:
        raise ConfigError(f"model {name!r}: bad option ({exc})") from None
    model.edgefl_name = name  # type: ignore[attr-defined]
    return model


def norm_layer(norm: str, channels: int) -> nn.Module:
    """The normalisation layer of a conv block: ``"batch"`` (BatchNorm2d) or ``"group"``, GroupNorm
    with gcd(32, channels) groups, exactly what Opacus' ``ModuleValidator.fix`` puts in place of a
    BatchNorm2d. A builder option (``options.norm``), so every device of a group and the server
    build the same architecture (DP-SGD needs ``"group"``: docs/privacy.md)."""
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "group":
        return nn.GroupNorm(math.gcd(32, channels), channels)
    raise ValueError(f"norm must be 'batch' or 'group', not {norm!r}")


def dp_sgd_ready(model: nn.Module) -> tuple[bool, str]:
    """Whether DP-SGD (Opacus' per-sample gradients) can train ``model`` as it is, and if not why.

    Opacus' ``ModuleValidator.validate`` decides (BatchNorm mixes the samples of a batch, so no
    per-sample gradient exists; modules Opacus cannot handle); without Opacus installed the
    zoo's only such layer, BatchNorm, is looked for directly."""
    try:
        from opacus.validators import ModuleValidator
    except ImportError:
        found = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
        if found:
            return False, _batchnorm_reason(model, found)
        return True, "no BatchNorm (Opacus is not installed: its validator did not check the other layers)"
    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return True, "every layer has per-sample gradients"
    norms = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
    if norms:
        return False, _batchnorm_reason(model, norms)
    first = str(errors[0]).split(". ")[0]
    return False, f"Opacus cannot compute its per-sample gradients ({len(errors)} problem(s); first: {first[:200]})"


def dp_sgd_status(name: str) -> str:
    """The zoo table's DP-SGD column for ``name`` at its defaults: ``yes`` (trains with DP-SGD as
    it is), ``norm=group`` (with that builder option) or ``no`` (kept in the cache file)."""
    try:
        import opacus
    except ImportError:
        opacus = None
    key = f"dp-sgd:{name}"
    cache = _DISK.load()
    if opacus is not None and isinstance(cache.get(key), str):
        return cache[key]
    spec = get_spec(name)
    with torch.random.fork_rng(devices=[]):
        ready, _ = dp_sgd_ready(build_model(name))
        if not ready and spec.takes_norm:
            ready_grouped, _ = dp_sgd_ready(build_model(name, norm="group"))
    status = "yes" if ready else "norm=group" if spec.takes_norm and ready_grouped else "no"
    if opacus is not None:  # without Opacus only BatchNorm was looked for: not the validator's verdict
        cache[key] = status
        _DISK.save()
    return status


def _batchnorm_reason(model: nn.Module, names: list[str]) -> str:
    count = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    fix = (' build it with options.norm = "group" (GroupNorm, as Opacus\' ModuleValidator.fix) in its fleet group'
           if _takes_norm(getattr(model, "edgefl_name", None)) else " choose a model without BatchNorm")
    return (f"{count} {'/'.join(names)} layer(s): batch normalisation mixes the samples of a batch, so a sample has no "
            f"gradient of its own to clip;{fix}")


def _takes_norm(name: str | None) -> bool:
    return name in _REGISTRY and _REGISTRY[name].takes_norm


def example_inputs(model: nn.Module, batch: int, input_shape: tuple[int, ...], num_classes: int) -> tuple[torch.Tensor, ...]:
    """Inputs a model's forward takes: images for classifiers, (images, one-hot labels) for CVAEs."""
    x = torch.rand(batch, *input_shape)
    if getattr(model, "conditional", False):
        y = nn.functional.one_hot(torch.arange(batch) % num_classes, num_classes).float()
        return (x, y)
    return (x,)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: Kind
    family: str
    params: int
    flops_per_sample: int
    input_shape: tuple[int, ...]
    feature_dim: int | None
    description: str


def count_flops(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Forward FLOPs measured with torch's FLOP counter (eval mode, no grad)."""
    # imported here: the counter pulls in triton on CUDA builds (~75 MiB resident), which a device
    # process that never counts FLOPs should not pay
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(*inputs)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


@lru_cache(maxsize=256)
def _info_cached(name: str, num_classes: int, input_shape: tuple[int, ...] | None, frozen_kwargs: tuple) -> ModelInfo:
    spec = get_spec(name)
    shape = tuple(input_shape) if input_shape is not None else spec.default_input_shape
    model = build_model(name, num_classes=num_classes, input_shape=shape, **dict(frozen_kwargs))
    flops = count_flops(model, example_inputs(model, 1, shape, num_classes))
    return ModelInfo(
        name=name,
        kind=spec.kind,
        family=spec.family,
        params=sum(p.numel() for p in model.parameters()),
        flops_per_sample=flops,
        input_shape=shape,
        feature_dim=getattr(model, "feature_dim", None),
        description=spec.description,
    )


def model_info(name: str, num_classes: int = 10, input_shape: tuple[int, ...] | None = None, **kwargs: Any) -> ModelInfo:
    """Metadata of a zoo model: parameters and FLOPs per sample are measured, not tabulated (and
    kept in a cache file, keyed by the models' source and torch's version: measuring the zoo
    takes tens of seconds)."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    shape = tuple(input_shape) if input_shape else None
    key = json.dumps([name, num_classes, shape, frozen], default=str)
    cache = _DISK.load()
    if key in cache:
        try:
            return ModelInfo(**{**cache[key], "input_shape": tuple(cache[key]["input_shape"])})
        except TypeError:
            pass  # written by another layout of ModelInfo: measure again
    info = _info_cached(name, num_classes, shape, frozen)
    cache[key] = asdict(info)
    _DISK.save()
    return info


@lru_cache(maxsize=1)
def _cache_path() -> Path:
    """One file per (models source, torch version): an edit to a model measures it afresh."""
    digest = hashlib.sha256(torch.__version__.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    root = cache_home() / "edgefl"
    return root / f"model-info-{digest.hexdigest()[:16]}.json"


class JsonFileCache:
    """A dict kept in one JSON file of the user's cache folder, read once per process; failing to
    write it (a read-only home) costs time, nothing else. Shared by the zoo's measurements and
    the cost model's forward statistics. Several processes share the file (test workers, a
    fleet's devices on one host): a save takes the file's lock and adds to what is on disk
    (a plain rewrite from this process's copy dropped the entries others had written since)."""

    def __init__(self, path: Callable[[], Path]) -> None:
        self.path = path
        self.data: dict[str, Any] | None = None

    def load(self) -> dict[str, Any]:
        if self.data is None:
            try:
                loaded = json.loads(self.path().read_text())
                self.data = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                self.data = {}
        return self.data

    def save(self) -> None:
        from filelock import FileLock  # (torch's own dependency)

        path = self.path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(path.with_name(path.name + ".lock"), timeout=10):  # (filelock's Timeout is an OSError)
                try:
                    held = json.loads(path.read_text())
                except (OSError, ValueError):
                    held = {}
                self.data = {**(held if isinstance(held, dict) else {}), **self.load()}
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(self.data))
                os.replace(tmp, path)
        except OSError:
            pass


_DISK = JsonFileCache(lambda: _cache_path())
