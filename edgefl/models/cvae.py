"""Conditional VAEs (FedMHO's resource-constrained clients): CVAE-small (MLP) and CVAE-large (conv).

Both take ``(x, y_onehot)`` and return ``(reconstruction, mu, logvar)``; their ``decoder``
maps ``(z, y_onehot)`` to an image in [0, 1] and is the only part a FedMHO client uploads.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from edgefl.models.registry import ModelSpec, register


class _MLPDecoder(nn.Module):
    def __init__(self, latent: int, num_classes: int, hidden: int, out_shape: tuple[int, ...]) -> None:
        super().__init__()
        n_out = 1
        for d in out_shape:
            n_out *= d
        self.out_shape = out_shape
        self.net = nn.Sequential(nn.Linear(latent + num_classes, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, n_out))

    def forward(self, z: torch.Tensor, y_onehot: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(torch.cat([z, y_onehot], 1))).view(-1, *self.out_shape)


class _CroppedConvTranspose2d(nn.ConvTranspose2d):
    """``ConvTranspose2d(kernel 4, stride 2, padding 1, output_padding=op)`` computed as the
    unpadded transposed convolution cropped to the same window: identical values and parameters.

    Why: litert-torch lowers ``output_padding`` wrongly (the extra row and column come out wrong,
    max difference 0.64 on a random layer, found by the export parity check); cropping exports
    exactly on every runtime.
    """

    def __init__(self, cin: int, cout: int, output_padding: int) -> None:
        super().__init__(cin, cout, 4, stride=2, padding=1, output_padding=output_padding)

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        full = nn.functional.conv_transpose2d(x, self.weight, self.bias, stride=self.stride)
        p, op = self.padding[0], self.output_padding[0]
        return full[:, :, p : full.shape[2] - p + op, p : full.shape[3] - p + op]


class _ConvDecoder(nn.Module):
    def __init__(self, latent: int, num_classes: int, out_shape: tuple[int, ...], chans: tuple[int, int, int]) -> None:
        super().__init__()
        c_out, size = out_shape[0], out_shape[1]
        sizes = [size, size // 2, size // 4, size // 8]
        self.start = (chans[2], sizes[3], sizes[3])
        self.fc = nn.Sequential(
            nn.Linear(latent + num_classes, 256), nn.ReLU(inplace=True),
            nn.Linear(256, chans[2] * sizes[3] * sizes[3]), nn.ReLU(inplace=True),
        )

        def up(cin: int, cout: int, a: int, b: int) -> nn.ConvTranspose2d:
            # kernel 4, stride 2, padding 1 doubles the size; output_padding fixes odd sizes (3 -> 7)
            return _CroppedConvTranspose2d(cin, cout, output_padding=b - 2 * a)

        self.deconv = nn.Sequential(
            up(chans[2], chans[1], sizes[3], sizes[2]), nn.ReLU(inplace=True),
            up(chans[1], chans[0], sizes[2], sizes[1]), nn.ReLU(inplace=True),
            up(chans[0], c_out, sizes[1], sizes[0]),
        )

    def forward(self, z: torch.Tensor, y_onehot: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat([z, y_onehot], 1)).view(-1, *self.start)
        return torch.sigmoid(self.deconv(h))


class CVAE(nn.Module):
    """Encoder q(z | x, y) and decoder p(x | z, y); loss = BCE(sum) + KL, per sample."""

    conditional = True

    def __init__(self, encoder: nn.Module, mu: nn.Module, logvar: nn.Module, decoder: nn.Module, latent: int, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.mu = mu
        self.logvar = logvar
        self.decoder = decoder
        self.latent = latent
        self.num_classes = num_classes

    def encode(self, x: torch.Tensor, y_onehot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder((x, y_onehot))
        return self.mu(h), self.logvar(h)

    def forward(self, x: torch.Tensor, y_onehot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encode(x, y_onehot)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar) if self.training else mu
        return self.decoder(z, y_onehot), mu, logvar

    @staticmethod
    def loss(recon: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        bce = F.binary_cross_entropy(recon.flatten(1), x.flatten(1), reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return (bce + kld) / x.shape[0]


class _ConcatMLPEncoder(nn.Module):
    def __init__(self, n_in: int, num_classes: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in + num_classes, hidden), nn.ReLU(inplace=True))

    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = xy
        return self.net(torch.cat([x.flatten(1), y], 1))


class _ConvEncoder(nn.Module):
    def __init__(self, in_shape: tuple[int, ...], num_classes: int, chans: tuple[int, int, int]) -> None:
        super().__init__()
        c_in, size = in_shape[0], in_shape[1]
        s = size // 8
        self.convs = nn.Sequential(
            nn.Conv2d(c_in + num_classes, chans[0], 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(chans[0], chans[1], 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(chans[1], chans[2], 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Flatten(1), nn.Linear(chans[2] * s * s, 256), nn.ReLU(inplace=True),
        )

    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = xy
        # label conditioning: one-hot broadcast to extra input planes
        planes = y[:, :, None, None].expand(-1, -1, x.shape[2], x.shape[3])
        return self.convs(torch.cat([x, planes], 1))


def build_cvae_small(num_classes: int, input_shape: tuple[int, ...], latent: int = 20, hidden: int = 256) -> CVAE:
    n_in = 1
    for d in input_shape:
        n_in *= d
    return CVAE(
        _ConcatMLPEncoder(n_in, num_classes, hidden), nn.Linear(hidden, latent), nn.Linear(hidden, latent),
        _MLPDecoder(latent, num_classes, hidden, tuple(input_shape)), latent, num_classes,
    )


def build_cvae_large(num_classes: int, input_shape: tuple[int, ...], latent: int = 20, width: float = 1.0) -> CVAE:
    chans = tuple(max(4, round(c * width)) for c in (64, 128, 256))
    return CVAE(
        _ConvEncoder(tuple(input_shape), num_classes, chans), nn.Linear(256, latent), nn.Linear(256, latent),
        _ConvDecoder(latent, num_classes, tuple(input_shape), chans), latent, num_classes,
    )


register(ModelSpec("cvae-small", "generator", build_cvae_small, "cvae", "CVAE-small (FedMHO): MLP 256, latent 20"))
register(ModelSpec("cvae-large", "generator", build_cvae_large, "cvae", "CVAE-large (FedMHO): conv 64-128-256, latent 20"))
