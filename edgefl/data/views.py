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
from pydantic import BaseModel, ConfigDict, Field, model_validator
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
        if self.kind == "features" and self.fraction is None and self.count is None:
            raise ValueError("view 'features' needs fraction or count")
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
