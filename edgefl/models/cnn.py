"""Small CNNs: the ten FedHe/FedMD networks, FedMHO's small CNN and a LeNet-style CNN.

FedHe's Table II (from FedMD): 2-layer nets ``(n1, n2, dropout)`` and 3-layer nets
``(n1, n2, n3, dropout)``; Conv-BN-ReLU-Dropout blocks with average pooling and a final dense
layer without bias (``norm = "group"``: GroupNorm instead of BatchNorm, for DP-SGD). Keras "same" padding on the 2x2 stride-1 pooling is reproduced by padding
one row and column at the bottom-right. Model 9's third layer has 198 filters in the paper and
192 in the authors' code; we follow the paper.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from edgefl.models.registry import ModelSpec, norm_layer, register
from edgefl.models.split import SplitClassifier, with_feature_width

FEDHE_CNNS: list[tuple[int, ...]] = [
    (128, 256, 20),
    (128, 384, 20),
    (128, 512, 20),
    (256, 256, 30),
    (256, 512, 40),
    (64, 128, 256, 20),
    (64, 128, 192, 20),
    (128, 192, 256, 20),
    (128, 128, 128, 30),
    (128, 128, 198, 30),
]  # last entry of each tuple: dropout in percent


def _scaled(n: int, width: float) -> int:
    return max(2, round(n * width))


def _block(cin: int, cout: int, kernel: int, stride: int, padding: int, dropout: float, norm: str = "batch") -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding), norm_layer(norm, cout), nn.ReLU(inplace=True), nn.Dropout(dropout)]


def _same_avgpool_2x2_stride1() -> nn.Module:
    return nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.AvgPool2d(2, stride=1))


def _spatial(size: int, kernel: int, stride: int, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def build_fedhe_cnn(
    index: int, num_classes: int, input_shape: tuple[int, ...], width: float = 1.0, feature_dim: int | None = None,
    norm: Literal["batch", "group"] = "batch",
) -> SplitClassifier:
    *filters, drop_pct = FEDHE_CNNS[index]
    dropout = drop_pct / 100
    chans = [_scaled(f, width) for f in filters]
    cin, h, w = input_shape
    extractor = nn.Sequential(*_block(cin, chans[0], 3, 1, 1, dropout, norm), _same_avgpool_2x2_stride1())
    body: list[nn.Module] = _block(chans[0], chans[1], 2, 2, 0, dropout, norm)
    h, w = _spatial(h, 2, 2), _spatial(w, 2, 2)
    if len(chans) == 3:
        body += [nn.AvgPool2d(2, stride=2)]
        h, w = _spatial(h, 2, 2), _spatial(w, 2, 2)
        body += _block(chans[1], chans[2], 3, 2, 0, dropout, norm)
        h, w = _spatial(h, 3, 2), _spatial(w, 3, 2)
    body.append(nn.Flatten(1))
    natural = chans[-1] * h * w
    intermediate, feat = with_feature_width(nn.Sequential(*body), natural, feature_dim)
    head = nn.Linear(feat, num_classes, bias=False)
    return SplitClassifier(extractor, intermediate, head, feat)


def build_cnn_small(
    num_classes: int, input_shape: tuple[int, ...], width: float = 1.0, feature_dim: int | None = None
) -> SplitClassifier:
    """FedMHO's FedAvg-baseline CNN: conv(10,5)-pool-relu, conv(20,5)-pool-relu, linear.

    ReLU runs before the max-pool here: the two commute exactly (both are monotone), so the
    network computes the authors' function, and TFLite's int8 max-pool, which needs its input and
    output on one scale, then sits after the ReLU where the converter can quantise it.
    """
    cin, h, w = input_shape
    c1, c2 = _scaled(10, width), _scaled(20, width)
    extractor = nn.Sequential(nn.Conv2d(cin, c1, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
    h, w = (h - 4) // 2, (w - 4) // 2
    body = nn.Sequential(nn.Conv2d(c1, c2, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(1))
    h, w = (h - 4) // 2, (w - 4) // 2
    intermediate, feat = with_feature_width(body, c2 * h * w, feature_dim)
    return SplitClassifier(extractor, intermediate, nn.Linear(feat, num_classes), feat)


def build_lenet5(
    num_classes: int, input_shape: tuple[int, ...], width: float = 1.0, feature_dim: int | None = None
) -> SplitClassifier:
    """LeNet-style CNN (6/16 channels, FC 120-84), the Flower FedAvg baseline's model."""
    cin, h, w = input_shape
    c1, c2 = _scaled(6, width), _scaled(16, width)
    extractor = nn.Sequential(nn.Conv2d(cin, c1, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
    h, w = (h - 4) // 2, (w - 4) // 2
    h, w = (h - 4) // 2, (w - 4) // 2
    body = nn.Sequential(
        nn.Conv2d(c1, c2, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(1),
        nn.Linear(c2 * h * w, 120), nn.ReLU(inplace=True), nn.Linear(120, 84), nn.ReLU(inplace=True),
    )
    intermediate, feat = with_feature_width(body, 84, feature_dim)
    return SplitClassifier(extractor, intermediate, nn.Linear(feat, num_classes), feat)


def _fedhe_builder(index: int):
    def builder(num_classes: int, input_shape: tuple[int, ...], **kw) -> SplitClassifier:
        return build_fedhe_cnn(index, num_classes, input_shape, **kw)

    return builder


for _i, _arch in enumerate(FEDHE_CNNS):
    register(
        ModelSpec(
            name=f"fedhe-cnn-{_i}",
            kind="classifier",
            builder=_fedhe_builder(_i),
            family="fedhe-cnn",
            description=f"FedHe/FedMD CNN {_i}: filters {_arch[:-1]}, dropout {_arch[-1] / 100}; options width, feature_dim, norm",
            takes_norm=True,
        )
    )
register(ModelSpec("cnn-small", "classifier", build_cnn_small, "cnn", "FedMHO's small CNN (10/20 channels)"))
register(ModelSpec("lenet5", "classifier", build_lenet5, "cnn", "LeNet-style CNN, 6/16 channels, FC 120-84"))
