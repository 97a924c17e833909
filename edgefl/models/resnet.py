"""ResNet10/14/18/22/26/34/50 on torchvision's ResNet, with a small-image stem and a width knob.

Block counts follow the same authors' later InCo code (ChanYunHin/InCo-Aggregation,
``fed_model/cv/resnet_hetavg_new.py``: BasicBlock ResNet10-26; Bottleneck for ResNet50), the family
the Felo/Velo and FedIN papers name. FedIN's code is not public, and the Felo_Velo repository's own
ResNets are another design (three stages of one re-applied block; docs/methods.md, Felo beside
the authors' code).
torchvision hard-codes 64/128/256/512 channels; ``width`` scales them (0.25 -> 16/32/64/128),
which is what keeps these nets trainable on a 2-core CPU. Two stems:

* ``"small"`` (default): 3x3 conv, stride 1, no max-pool, for 28x28 / 32x32 inputs;
* ``"imagenet"``: torchvision's 7x7 stride-2 conv + max-pool, as the InCo code uses on
  Fashion-MNIST resized to 32x32 (16x fewer stem-resolution FLOPs, lower accuracy).

``norm = "group"`` builds every normalisation layer as GroupNorm (Opacus' BatchNorm fix) instead of
BatchNorm: what DP-SGD needs (docs/privacy.md).
"""

from __future__ import annotations

import functools

from typing import Literal

from torch import nn

from edgefl.models.registry import ModelSpec, norm_layer, register
from edgefl.models.split import SplitClassifier, with_feature_width

# torchvision is imported when a ResNet is built, not when the zoo is: importing it costs a device
# process about 170 MiB of resident memory (measured on x86; bench/arm_device.py), which a Pi Zero
# training a small CNN should not pay.
BLOCKS: dict[str, tuple[str, list[int]]] = {
    "resnet10": ("BasicBlock", [1, 1, 1, 1]),
    "resnet14": ("BasicBlock", [1, 1, 2, 2]),
    "resnet18": ("BasicBlock", [2, 2, 2, 2]),
    "resnet22": ("BasicBlock", [2, 2, 3, 3]),
    "resnet26": ("BasicBlock", [3, 3, 3, 3]),
    "resnet34": ("BasicBlock", [3, 4, 6, 3]),
    "resnet50": ("Bottleneck", [3, 4, 6, 3]),
}


@functools.cache
def _scaled_resnet_class() -> type[nn.Module]:
    from torchvision.models.resnet import ResNet

    class _ScaledResNet(ResNet):
        """torchvision's ResNet with every stage's channel count multiplied by ``width``."""

        def __init__(self, block: type[nn.Module], layers: list[int], num_classes: int, width: float, norm: str = "batch") -> None:
            self._width = width
            self._base = max(4, round(64 * width))
            super().__init__(block, layers, num_classes=num_classes, norm_layer=functools.partial(norm_layer, norm))  # type: ignore[arg-type]

        def _make_layer(self, block, planes, blocks, stride=1, dilate=False):  # type: ignore[override]
            if planes == 64:  # first stage: the stem's output width, scaled
                self.inplanes = self._base
            return super()._make_layer(block, max(4, round(planes * self._width)), blocks, stride, dilate)

    return _ScaledResNet


def _forward_out_of_place(self, x):
    """torchvision's BasicBlock / Bottleneck forward, the residual added out of place (``out +
    identity``, not ``out += identity``): the same values, and what Opacus' per-sample gradient
    hooks need, since they forbid modifying a hooked layer's output in place."""
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    if hasattr(self, "conv3"):  # Bottleneck
        out = self.bn3(self.conv3(self.relu(out)))
    identity = x if self.downsample is None else self.downsample(x)
    return self.relu(out + identity)


@functools.cache
def _group_norm_block(block: type[nn.Module]) -> type[nn.Module]:
    return type(f"GroupNorm{block.__name__}", (block,), {"forward": _forward_out_of_place, "__module__": __name__})


def build_resnet(
    depth_name: str,
    num_classes: int,
    input_shape: tuple[int, ...],
    width: float = 1.0,
    stem: Literal["small", "imagenet"] = "small",
    feature_dim: int | None = None,
    norm: Literal["batch", "group"] = "batch",
    return_reference: bool = False,
) -> SplitClassifier | tuple[SplitClassifier, nn.Module]:
    """Build a split ResNet; ``return_reference`` also returns the torchvision module sharing
    its layers, so tests can check that the split composes to torchvision's own forward."""
    from torchvision.models import resnet as tv_resnet

    block_name, layers = BLOCKS[depth_name]
    block = getattr(tv_resnet, block_name)
    if norm == "group":
        block = _group_norm_block(block)
    net = _scaled_resnet_class()(block, layers, num_classes, width, norm)
    in_channels = input_shape[0]
    base = net._base
    if stem == "small":
        net.conv1 = nn.Conv2d(in_channels, base, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif stem == "imagenet":
        net.conv1 = nn.Conv2d(in_channels, base, kernel_size=7, stride=2, padding=3, bias=False)
    else:
        raise ValueError(f"stem must be 'small' or 'imagenet', not {stem!r}")
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.bn1 = norm_layer(norm, base)
    # torchvision sizes fc for 512 channels whatever the width: take the real last-stage width
    natural = max(4, round(512 * width)) * block.expansion  # type: ignore[attr-defined]
    net.fc = nn.Linear(natural, num_classes)
    extractor = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
    intermediate, feat = with_feature_width(
        nn.Sequential(net.layer1, net.layer2, net.layer3, net.layer4, net.avgpool, nn.Flatten(1)), natural, feature_dim
    )
    head = nn.Linear(feat, num_classes)
    split = SplitClassifier(extractor, intermediate, head, feat)
    if return_reference:
        if feature_dim is None or feature_dim == natural:
            net.fc = head
        return split, net
    return split


def _make_builder(depth_name: str):
    def builder(num_classes: int, input_shape: tuple[int, ...], **kw) -> SplitClassifier:
        return build_resnet(depth_name, num_classes, input_shape, **kw)

    return builder


for _name, (_block, _layers) in BLOCKS.items():
    register(
        ModelSpec(
            name=_name,
            kind="classifier",
            builder=_make_builder(_name),
            family="resnet",
            description=f"torchvision ResNet, {_block} {_layers}; options width, stem, feature_dim, norm",
            takes_norm=True,
        )
    )
