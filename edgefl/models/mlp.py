"""A multi-layer perceptron for tabular data (CHFL's per-client backbones)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from edgefl.models.registry import ModelSpec, register
from edgefl.models.split import SplitClassifier, with_feature_width


def build_mlp(
    num_classes: int,
    input_shape: tuple[int, ...],
    hidden: Sequence[int] = (64, 32),
    width: float = 1.0,
    feature_dim: int | None = None,
) -> SplitClassifier:
    if not hidden:
        raise ValueError("an MLP needs at least one hidden layer")
    sizes = [max(2, round(h * width)) for h in hidden]
    in_features = 1
    for d in input_shape:
        in_features *= d
    extractor = nn.Sequential(nn.Flatten(1), nn.Linear(in_features, sizes[0]), nn.ReLU(inplace=True))
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU(inplace=True)]
    intermediate, feat = with_feature_width(nn.Sequential(*layers), sizes[-1], feature_dim)
    return SplitClassifier(extractor, intermediate, nn.Linear(feat, num_classes), feat)


register(
    ModelSpec("mlp", "classifier", build_mlp, "mlp", "MLP for tabular data; option hidden=[...]", default_input_shape=(30,))
)
