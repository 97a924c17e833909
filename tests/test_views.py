"""Per-device feature spaces."""

from __future__ import annotations

import json

import pytest
import torch

from edgefl.data.views import ViewSettings, make_view, view_from_record, view_record
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
    with pytest.raises(ValueError, match="view 'permute' takes no settings, not fraction"):
        ViewSettings(kind="permute", fraction=0.5)
    with pytest.raises(ValueError, match="needs fraction or count, not both"):
        ViewSettings(kind="features", fraction=0.5, count=5)
    with pytest.raises(ValueError, match="view 'crop' takes size, not count"):
        ViewSettings(kind="crop", size=20, count=3)
    with pytest.raises(ConfigError, match="for tabular data"):
        make_view(ViewSettings(kind="features", count=3), (1, 28, 28), 0, "c")
    with pytest.raises(ConfigError, match="larger than"):
        make_view(ViewSettings(kind="crop", size=40), (1, 28, 28), 0, "c")
    with pytest.raises(ConfigError, match="asks for 40 of 30"):
        make_view(ViewSettings(kind="features", count=40), (30,), 0, "c")


def _all_views():
    yield make_view(ViewSettings(kind="features", fraction=0.5), (30,), 0, "c0")
    for s in (ViewSettings(kind="permute"), ViewSettings(kind="resize", size=14), ViewSettings(kind="crop", size=20), ViewSettings(kind="rgb")):
        yield make_view(s, (1, 28, 28), 0, "c0")


def test_a_fitted_view_is_rebuilt_exactly_from_its_record():
    for view in _all_views():
        record = json.loads(json.dumps(view_record(view)))  # as it travels in a model file's metadata
        again = view_from_record(record)
        x = torch.rand(2, *view.input_shape)
        assert torch.equal(again.apply(x), view.apply(x)), view.settings.kind


@pytest.mark.parametrize("change, message", [
    ({"columns": [0] * 15}, "repeat"),
    ({"columns": list(range(14)) + [30]}, "indices below 30"),
    ({"columns": list(range(14)) + [True]}, "indices below 30"),
    ({"columns": list(range(14))}, "list 15 indices"),
    ({"output_shape": [16]}, "list 16 indices"),
    ({"input_shape": [10**9]}, "one to three sizes"),
    ({"input_shape": "30"}, "one to three sizes"),
    ({"kind": "scramble"}, "kind"),
    ({"fraction": -1}, "fraction"),
])
def test_a_damaged_view_record_is_refused_with_the_reason(change, message):
    record = {**view_record(make_view(ViewSettings(kind="features", fraction=0.5), (30,), 0, "c0")), **change}
    with pytest.raises(ValueError, match=message):
        view_from_record(record)


def test_damaged_image_view_records_are_refused():
    perm = view_record(make_view(ViewSettings(kind="permute"), (1, 28, 28), 0, "c0"))
    with pytest.raises(ValueError, match="repeats a pixel"):
        view_from_record({**perm, "permutation": [0] * 784})
    with pytest.raises(ValueError, match="keeps the image's shape"):
        view_from_record({**perm, "output_shape": [1, 14, 14]})
    rgb = view_record(make_view(ViewSettings(kind="rgb"), (1, 28, 28), 0, "c0"))
    for gains in ([1.0, 1.0], [1.0, -1.0, 1.0], [1.0, float("nan"), 1.0], [1e-300] * 3, "abc"):
        with pytest.raises(ValueError, match="three gains between 1e-6 and 1e6"):
            view_from_record({**rgb, "gains": gains})
    crop = view_record(make_view(ViewSettings(kind="crop", size=20), (1, 28, 28), 0, "c0"))
    with pytest.raises(ValueError, match="does not map"):
        view_from_record({**crop, "size": 40, "output_shape": [1, 40, 40]})
    with pytest.raises(ValueError, match="settings only"):
        view_from_record({"kind": "features", "fraction": 0.5})
    with pytest.raises(ValueError, match="input_shape is missing"):
        view_from_record({"kind": "features", "fraction": 0.5, "columns": [1]})
    with pytest.raises(ValueError, match="not an object"):
        view_from_record([1, 2])
