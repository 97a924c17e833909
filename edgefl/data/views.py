"""Per-client feature spaces ("views") for the completely heterogeneous setting.

A view is a fixed, per-client transform of the raw inputs, applied to that client's training
data and to whatever it is evaluated on. Views are built from (run seed, client id), so a
client's feature space is reproducible, and each client holds only its own view:

* ``features``  tabular: a random subset of the columns (``fraction`` or ``count`` of them);
* ``permute``   images: a fixed random permutation of the pixels;
* ``resize``    images: bilinear resize to ``size`` x ``size``;
* ``crop``      images: centre crop to ``size`` x ``size``;
* ``rgb``       images: three channels, each a random per-client gain of the grey image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch.nn import functional as F

from edgefl.errors import ConfigError
from edgefl.seeding import derive_seed

ViewKind = Literal["features", "permute", "resize", "crop", "rgb"]


class ViewSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: ViewKind
    fraction: float | None = Field(None, gt=0, le=1, description="features: share of the columns kept")
    count: int | None = Field(None, ge=1, description="features: number of columns kept")
    size: int | None = Field(None, ge=4, description="resize / crop: output side")

    @model_validator(mode="after")
    def _params(self) -> ViewSettings:
        if self.kind in ("resize", "crop") and self.size is None:
            raise ValueError(f"view {self.kind!r} needs size")
        if self.kind == "features" and (self.fraction is None) == (self.count is None):
            raise ValueError("view 'features' needs fraction or count" + (", not both" if self.fraction is not None else ""))
        takes = {"features": {"fraction", "count"}, "resize": {"size"}, "crop": {"size"}}.get(self.kind, set())
        stray = sorted(k for k in ("fraction", "count", "size") if getattr(self, k) is not None and k not in takes)
        if stray:
            raise ValueError(f"view {self.kind!r} takes {' or '.join(sorted(takes)) or 'no settings'}, not {', '.join(stray)}")
        return self


@dataclass
class View:
    """A fitted per-client transform: ``apply`` maps raw inputs to the client's feature space."""

    settings: ViewSettings
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    columns: torch.Tensor | None = None
    permutation: torch.Tensor | None = None
    gains: torch.Tensor | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.settings.kind
        if kind == "features":
            return x[:, self.columns]
        if kind == "permute":
            n = x.shape[0]
            return x.reshape(n, -1)[:, self.permutation].reshape(n, *self.output_shape)
        if kind == "resize":
            return F.interpolate(x, size=self.output_shape[1:], mode="bilinear", align_corners=False)
        if kind == "crop":
            h, w = x.shape[-2:]
            s = self.output_shape[-1]
            top, left = (h - s) // 2, (w - s) // 2
            return x[..., top : top + s, left : left + s]
        return x.repeat(1, 3, 1, 1) * self.gains.view(1, 3, 1, 1)  # rgb


def make_view(settings: ViewSettings, input_shape: tuple[int, ...], seed: int, client_id: str) -> View:
    rng = np.random.default_rng(derive_seed(seed, "view", client_id))
    kind = settings.kind
    if kind == "features":
        if len(input_shape) != 1:
            raise ConfigError(f"view 'features' is for tabular data; this input is {input_shape}")
        n = input_shape[0]
        k = settings.count if settings.count is not None else max(1, round(settings.fraction * n))
        if k > n:
            raise ConfigError(f"view 'features' asks for {k} of {n} columns")
        cols = torch.from_numpy(np.sort(rng.choice(n, k, replace=False)))
        return View(settings, input_shape, (k,), columns=cols)
    if len(input_shape) != 3:
        raise ConfigError(f"view {kind!r} is for images; this input is {input_shape}")
    c, h, w = input_shape
    if kind == "permute":
        return View(settings, input_shape, input_shape, permutation=torch.from_numpy(rng.permutation(c * h * w)))
    if kind in ("resize", "crop"):
        s = int(settings.size)
        if kind == "crop" and s > min(h, w):
            raise ConfigError(f"view 'crop' size {s} is larger than the {h}x{w} input")
        return View(settings, input_shape, (c, s, s))
    if c != 1:
        raise ConfigError("view 'rgb' expects one input channel")
    gains = torch.from_numpy(rng.uniform(0.5, 1.0, 3).astype(np.float32))
    return View(settings, input_shape, (3, h, w), gains=gains)


# The fitted view travels with a saved model, so that an export can feed the model what the device
# fed it (and tell a phone how to build that input) without the run's seed or config.
_MAX_RECORD_ITEMS = 1 << 20  # a permutation of a 3 x 512 x 512 image; far above any dataset edgefl loads
#: a record's fitted fields (the rest are the view's settings)
FITTED = frozenset({"input_shape", "output_shape", "columns", "permutation", "gains"})


def one_line(exc: ValidationError) -> str:
    """pydantic's errors as one line: 'field: problem; ...' (its own text spans lines and links)."""
    parts = [(".".join(str(p) for p in e["loc"]), e["msg"].removeprefix("Value error, ")) for e in exc.errors()[:4]]
    return "; ".join(f"{where}: {msg}" if where else msg for where, msg in parts)


def view_record(view: View) -> dict:
    """The fitted view as JSON-ready data (a saved model's ``view`` metadata)."""
    out: dict = {**view.settings.model_dump(exclude_none=True), "input_shape": list(view.input_shape),
                 "output_shape": list(view.output_shape)}
    if view.columns is not None:
        out["columns"] = view.columns.tolist()
    if view.permutation is not None:
        out["permutation"] = view.permutation.tolist()
    if view.gains is not None:
        out["gains"] = [float(g) for g in view.gains]
    return out


def is_whole(value: object, low: int, high: int) -> bool:
    """An int (not a bool, which JSON readers also give) from low to high: a field read from a file."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_shape(value: object) -> bool:
    """A sample shape as a file lists it: one to three sizes from 1 to 65536."""
    return isinstance(value, list) and 1 <= len(value) <= 3 and all(is_whole(v, 1, 65536) for v in value)


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not is_shape(value):
        raise ValueError(f"{what} must be a list of one to three sizes, got {str(value)[:80]}")
    return tuple(value)


def _indices(value: object, what: str, bound: int, count: int) -> torch.Tensor:
    if not isinstance(value, list) or len(value) != count or count > _MAX_RECORD_ITEMS:
        raise ValueError(f"{what} must list {count} indices")
    if not all(is_whole(v, 0, bound - 1) for v in value):
        raise ValueError(f"{what} must hold indices below {bound}")
    return torch.tensor(value, dtype=torch.long)


def view_from_record(record: object) -> View:
    """Rebuild a fitted view from :func:`view_record`'s data, checking every field (the data come
    from a file); ValueError says what is wrong."""
    if not isinstance(record, dict):
        raise ValueError("the view record is not an object")
    if not set(record) & FITTED:
        raise ValueError("the view record names its settings only, not the fitted view (a model saved before edgefl recorded it)")
    try:
        settings = ViewSettings.model_validate({k: v for k, v in record.items() if k not in FITTED})
    except ValidationError as exc:
        raise ValueError(one_line(exc)) from None
    for key in ("input_shape", "output_shape"):
        if key not in record:
            raise ValueError(f"{key} is missing")
    inp, out = _shape(record.get("input_shape"), "input_shape"), _shape(record.get("output_shape"), "output_shape")
    kind, size = settings.kind, 1
    for d in inp:
        size *= d
    view = View(settings, inp, out)
    if kind == "features":
        if len(inp) != 1 or len(out) != 1:
            raise ValueError("a features view maps a vector to a vector")
        view.columns = _indices(record.get("columns"), "columns", inp[0], out[0])
        if len(set(view.columns.tolist())) != out[0]:
            raise ValueError("columns repeat")
    elif kind == "permute":
        if out != inp or len(inp) != 3:
            raise ValueError("a permute view keeps the image's shape")
        view.permutation = _indices(record.get("permutation"), "permutation", size, size)
        if len(set(view.permutation.tolist())) != size:
            raise ValueError("the permutation repeats a pixel")
    elif kind in ("resize", "crop"):
        if len(inp) != 3 or out != (inp[0], settings.size, settings.size) or (kind == "crop" and settings.size > min(inp[1:])):
            raise ValueError(f"a {kind} view of size {settings.size} does not map {list(inp)} to {list(out)}")
    else:
        gains = record.get("gains")
        if (inp[:1] != (1,) or len(inp) != 3 or out != (3, *inp[1:]) or not isinstance(gains, list) or len(gains) != 3
                or not all(isinstance(g, (int, float)) and not isinstance(g, bool) and 1e-6 <= g <= 1e6 for g in gains)):
            raise ValueError("an rgb view maps one channel to three with three gains between 1e-6 and 1e6")
        view.gains = torch.tensor(gains, dtype=torch.float32)
    return view
