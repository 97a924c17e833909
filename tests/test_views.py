"""Per-device feature spaces."""

from __future__ import annotations

import pytest
import torch

from edgefl.data.views import ViewSettings, make_view
from edgefl.errors import ConfigError


def test_feature_subset_is_per_client_and_reproducible():
    s = ViewSettings(kind="features", fraction=0.5)
    a, b = make_view(s, (30,), 0, "c0"), make_view(s, (30,), 0, "c1")
    assert a.output_shape == (15,) and not torch.equal(a.columns, b.columns)
    assert torch.equal(a.columns, make_view(s, (30,), 0, "c0").columns)
    x = torch.arange(60.0).view(2, 30)
    assert torch.equal(a.apply(x), x[:, a.columns])


def test_image_views_shapes_and_content():
    x = torch.rand(3, 1, 28, 28)
    perm = make_view(ViewSettings(kind="permute"), (1, 28, 28), 0, "c0")
    out = perm.apply(x)
    assert out.shape == x.shape and torch.equal(out.flatten(1).sort(1).values, x.flatten(1).sort(1).values)
    assert make_view(ViewSettings(kind="resize", size=14), (1, 28, 28), 0, "c").apply(x).shape == (3, 1, 14, 14)
    crop = make_view(ViewSettings(kind="crop", size=20), (1, 28, 28), 0, "c").apply(x)
    assert torch.equal(crop, x[..., 4:24, 4:24])
    rgb = make_view(ViewSettings(kind="rgb"), (1, 28, 28), 0, "c").apply(x)
    assert rgb.shape == (3, 3, 28, 28)


def test_bad_views():
    with pytest.raises(ValueError, match="needs size"):
        ViewSettings(kind="crop")
    with pytest.raises(ConfigError, match="for tabular data"):
        make_view(ViewSettings(kind="features", count=3), (1, 28, 28), 0, "c")
    with pytest.raises(ConfigError, match="larger than"):
        make_view(ViewSettings(kind="crop", size=40), (1, 28, 28), 0, "c")
    with pytest.raises(ConfigError, match="asks for 40 of 30"):
        make_view(ViewSettings(kind="features", count=40), (30,), 0, "c")
