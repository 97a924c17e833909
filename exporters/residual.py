"""Export-time forms the int8 quantizer handles: residual blocks and adaptive pools before an FC.

torchvision's BasicBlock and Bottleneck end with ``out += identity; out = self.relu(out)``,
reusing the block's one ReLU module. litert-torch's PT2E quantizer annotates ``torch.add`` followed
by its own ``nn.ReLU`` as one int8 ADD with a fused ReLU, but leaves an in-place add feeding a
shared ReLU unannotated, so the converter computed those residual ADDs in float between
DEQUANTIZE and QUANTIZE (4 of 6 in ResNet14): not integer-only. The blocks here compute exactly
the same function with the same parameters (checked by the exporter's parity test), written the
way the quantizer recognises. The model being exported is deep-copied first: the caller's model
is never changed.

VGG-9's ``AdaptiveAvgPool2d((7, 7))`` meets a 3x3 map on 28x28 inputs: it *enlarges*, which the
converter lowers to gathers, MULs and ADDs left in float. For the file's fixed input size the pool
is a fixed linear map M (each output cell averages one or two input cells), and the Linear that
follows the flatten sees only M's outputs, so ``Linear(C*49) o flatten o pool`` equals
``Linear(C*9) o flatten`` with the weight W' = W M^T per channel: exact, and a smaller FC.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck


class _ExportBasicBlock(BasicBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.residual_relu(torch.add(out, identity))


class _ExportBottleneck(Bottleneck):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.residual_relu(torch.add(out, identity))


_FORMS = {BasicBlock: _ExportBasicBlock, Bottleneck: _ExportBottleneck}


def quantisable(module: nn.Module, sample: tuple[torch.Tensor, ...] | None = None) -> nn.Module:
    """``module`` itself when nothing needs rewriting, else a copy whose residual blocks add with
    ``torch.add`` into a ReLU of their own and whose adaptive pools before an FC (for ``sample``'s
    input size) are folded into that FC."""
    pools = sample is not None and any(isinstance(m, nn.AdaptiveAvgPool2d) for m in module.modules())
    if not pools and not any(type(m) in _FORMS for m in module.modules()):
        return module
    twin = copy.deepcopy(module).eval()
    for m in twin.modules():
        form = _FORMS.get(type(m))
        if form is not None:
            m.__class__ = form
            m.residual_relu = nn.ReLU()
    if pools:
        _fold_pools(twin, sample)
    return twin


def _fold_pools(model: nn.Module, sample: tuple[torch.Tensor, ...]) -> None:
    seen: dict[int, tuple[int, ...]] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(id(mod), tuple(args[0].shape[1:])))
             for m in model.modules() if isinstance(m, nn.AdaptiveAvgPool2d)]
    with torch.no_grad():
        model(*sample)
    for h in hooks:
        h.remove()
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        layers = list(seq)
        for i, pool in enumerate(layers):
            if not isinstance(pool, nn.AdaptiveAvgPool2d) or id(pool) not in seen or len(seen[id(pool)]) != 3:
                continue
            j = i + 1
            if j >= len(layers) or not isinstance(layers[j], nn.Flatten):
                continue
            k = j + 1
            while k < len(layers) and isinstance(layers[k], nn.Dropout):
                k += 1
            if k >= len(layers) or not isinstance(layers[k], nn.Linear):
                continue
            c, h, w = seen[id(pool)]
            with torch.no_grad():
                basis = torch.eye(h * w).reshape(h * w, 1, h, w)
                m = pool(basis).reshape(h * w, -1)  # in-cell -> out-cells
                fc: nn.Linear = layers[k]
                if fc.in_features != c * m.shape[1]:
                    continue
                weight = fc.weight.reshape(fc.out_features, c, m.shape[1]) @ m.T
                folded = nn.Linear(c * h * w, fc.out_features, bias=fc.bias is not None)
                folded.weight.copy_(weight.reshape(fc.out_features, c * h * w))
                if fc.bias is not None:
                    folded.bias.copy_(fc.bias)
            seq[i] = nn.Identity()
            seq[k] = folded
