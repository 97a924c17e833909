"""Export-time form of torchvision's residual blocks, so their adds quantise to int8.

torchvision's BasicBlock and Bottleneck end with ``out += identity; out = self.relu(out)``,
reusing the block's one ReLU module. litert-torch's PT2E quantizer annotates ``torch.add`` followed
by its own ``nn.ReLU`` as one int8 ADD with a fused ReLU, but leaves an in-place add feeding a
shared ReLU unannotated, so the converter computed those residual ADDs in float between
DEQUANTIZE and QUANTIZE (4 of 6 in ResNet14): not integer-only. The blocks here compute exactly
the same function with the same parameters (checked by the exporter's parity test), written the
way the quantizer recognises. The model being exported is deep-copied first: the caller's model
is never changed.
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


def quantisable(module: nn.Module) -> nn.Module:
    """``module`` itself when it has no torchvision residual block, else a copy whose blocks
    add with ``torch.add`` into a ReLU of their own."""
    if not any(type(m) in _FORMS for m in module.modules()):
        return module
    twin = copy.deepcopy(module)
    for m in twin.modules():
        form = _FORMS.get(type(m))
        if form is not None:
            m.__class__ = form
            m.residual_relu = nn.ReLU()
    return twin.eval()
