"""VGG-9 as in the FedMHO authors' code: conv64-pool, conv128-pool, conv256, conv256-pool,
adaptive average pool to 7x7, FC 4096-4096-C with dropout 0.5 (about 69 M parameters at full
width for 1x28x28 input). ``width`` scales the conv channels and the FC width."""

from __future__ import annotations

from torch import nn

from edgefl.models.registry import ModelSpec, register
from edgefl.models.split import SplitClassifier, with_feature_width


def build_vgg9(
    num_classes: int, input_shape: tuple[int, ...], width: float = 1.0, feature_dim: int | None = None
) -> SplitClassifier:
    c = [max(4, round(n * width)) for n in (64, 128, 256, 256)]
    fc = max(16, round(4096 * width))
    cin = input_shape[0]

    def conv(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1), nn.ReLU(inplace=True)]

    extractor = nn.Sequential(*conv(cin, c[0]), nn.MaxPool2d(2))
    body = nn.Sequential(
        *conv(c[0], c[1]), nn.MaxPool2d(2),
        *conv(c[1], c[2]), *conv(c[2], c[3]), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten(1),
        nn.Dropout(0.5), nn.Linear(c[3] * 49, fc), nn.ReLU(inplace=True),
        nn.Dropout(0.5), nn.Linear(fc, fc), nn.ReLU(inplace=True),
    )
    intermediate, feat = with_feature_width(body, fc, feature_dim)
    return SplitClassifier(extractor, intermediate, nn.Linear(feat, num_classes), feat)


register(ModelSpec("vgg9", "classifier", build_vgg9, "vgg", "VGG-9 (FedMHO): 4 conv + FC 4096-4096, dropout 0.5"))
