"""The split every zoo classifier exposes: extractor -> intermediate -> head.

* ``extractor``: the stem (FedIN's ``s_in`` is its output);
* ``intermediate``: everything up to and including flattening, so its output is the mid-level
  feature vector (Felo's feature, FedIN's ``s_out``, CHFL's embedding);
* ``head``: the final linear classifier (FedHe's logits are its output).

``forward`` is exactly ``head(intermediate(extractor(x)))``; tests check this against the
unsplit reference network for every builder.
"""

from __future__ import annotations

import torch
from torch import nn


class SplitClassifier(nn.Module):
    """A classifier made of three named parts whose composition is the whole model."""

    def __init__(self, extractor: nn.Module, intermediate: nn.Module, head: nn.Module, feature_dim: int) -> None:
        super().__init__()
        self.extractor = extractor
        self.intermediate = intermediate
        self.head = head
        self.feature_dim = int(feature_dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The mid-level feature vector (the head's input), shape [batch, feature_dim]."""
        return self.intermediate(self.extractor(x))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the mid-level features from one pass (knowledge methods need both)."""
        feats = self.features(x)
        return self.head(feats), feats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def with_feature_width(intermediate: nn.Module, natural_dim: int, feature_dim: int | None) -> tuple[nn.Module, int]:
    """Append a fixed-width projection when a common feature width is requested.

    Heterogeneous-model libraries give every architecture the same width at the classifier
    input so per-class features, prototypes and heads share a shape. ``feature_dim=None`` keeps
    the architecture's natural width.
    """
    if feature_dim is None or feature_dim == natural_dim:
        return intermediate, natural_dim
    projection = nn.Sequential(nn.Linear(natural_dim, feature_dim), nn.ReLU(inplace=True))
    return nn.Sequential(intermediate, projection), int(feature_dim)
