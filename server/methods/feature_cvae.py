"""Velo's server-side conditional VAE over mid-level features (paper 000, section 3.2, Eq. 2).

Four dense layers, as the paper states: the encoder maps ``[feature, one-hot label]`` to a hidden
layer and the hidden layer to ``(mu, logvar)``; the decoder maps ``[z, one-hot label]`` to a
hidden layer and the hidden layer to a feature. Loss: reconstruction MSE summed over the feature
plus the KL divergence to N(0, I), both averaged over the batch (Eq. 2 per sample). The authors'
code differs: the MSE is the mean over every element while the KL is summed over batch and
latent, so its KL term weighs batch x feature width times more (5 x 10^4 at their defaults;
VAE_model.py, ``server_extractor_training``; docs/methods.md). Mid-level features come after a
ReLU, so they are non-negative: the decoder ends in a ReLU too (the authors' decoder is two
linear layers with no activation).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F


class FeatureCVAE(nn.Module):
    def __init__(self, feature_dim: int, num_classes: int, latent_dim: int = 64, hidden_dim: int = 256) -> None:
        super().__init__()
        self.num_classes, self.latent_dim = num_classes, latent_dim
        self.enc_hidden = nn.Linear(feature_dim + num_classes, hidden_dim)
        self.enc_out = nn.Linear(hidden_dim, 2 * latent_dim)
        self.dec_hidden = nn.Linear(latent_dim + num_classes, hidden_dim)
        self.dec_out = nn.Linear(hidden_dim, feature_dim)

    def encode(self, s: torch.Tensor, y1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.enc_hidden(torch.cat([s, y1], 1)))
        mu, logvar = self.enc_out(h).chunk(2, dim=1)
        return mu, logvar.clamp(-20, 20)

    def decode(self, z: torch.Tensor, y1: torch.Tensor) -> torch.Tensor:
        return F.relu(self.dec_out(F.relu(self.dec_hidden(torch.cat([z, y1], 1)))))

    def loss(self, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y1 = F.one_hot(y, self.num_classes).to(s.dtype)
        mu, logvar = self.encode(s, y1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon = ((self.decode(z, y1) - s) ** 2).sum(1)
        kld = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
        return (recon + kld).mean()

    @torch.no_grad()
    def generate(self, classes: torch.Tensor, per_class: int, generator: torch.Generator) -> torch.Tensor:
        """[len(classes), per_class, F] features decoded from z ~ N(0, I) for each class."""
        device = self.dec_out.weight.device
        y = classes.repeat_interleave(per_class).to(device)
        z = torch.randn(len(y), self.latent_dim, generator=generator).to(device)
        out = self.decode(z, F.one_hot(y, self.num_classes).float())
        return out.view(len(classes), per_class, -1).cpu()


def train_feature_cvae(model: FeatureCVAE, s: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, generator: torch.Generator,
                       batch_size: int = 64, device: str | None = None) -> dict[str, float]:
    """Train on (features, labels); returns the final mean loss and the wall time (the paper's
    concern: server time per round)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    s, y = s.to(device), y.to(device)
    t0 = time.perf_counter()
    last = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator).to(device)
        total = 0.0
        for i in range(0, len(y), batch_size):
            idx = order[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = model.loss(s[idx], y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        last = total / max(len(y), 1)
    if device == "cuda":
        torch.cuda.synchronize()
    model.eval()
    return {"loss": last, "seconds": time.perf_counter() - t0, "device": device, "samples": int(len(y))}
