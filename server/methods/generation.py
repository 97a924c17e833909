"""Server-side data generation from uploaded CVAE decoders (FedMHO and FedCVAE-Ens).

* :func:`squared_count_shares` / :func:`allocate` decide how many samples of each class each
  decoder draws (FedMHO: class c's share from decoder k proportional to n_kc squared);
* :func:`generate` runs the decoders on z ~ N(0, I);
* :func:`kmeans_filter` is the paper's Algorithm 2 (one cluster per class, keep the fraction rho
  nearest the centre);
* :func:`save_sample_grid` draws a few kept samples per class as a PNG (paper Fig. 9).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn


def allocate(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder; ties go to
    the earlier entry, so the split is deterministic). All-zero weights split uniformly."""
    if not weights:
        return []
    if total < 0:
        raise ValueError("total must be non-negative")
    s = float(sum(weights))
    if s <= 0:
        weights, s = [1.0] * len(weights), float(len(weights))
    exact = [total * w / s for w in weights]
    out = [math.floor(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def squared_count_shares(counts: list[list[int]]) -> list[list[float]]:
    """FedMHO's share rule. ``counts[k][c]`` is decoder client k's count of class c; the result's
    ``[k][c]`` is the fraction of class c's synthetic samples that decoder k generates:
    n_kc^2 / sum_j n_jc^2, uniform over the decoders when none of them holds class c."""
    if not counts:
        return []
    num_classes = len(counts[0])
    shares = [[0.0] * num_classes for _ in counts]
    for c in range(num_classes):
        sq = [float(row[c]) ** 2 for row in counts]
        total = sum(sq)
        for k in range(len(counts)):
            shares[k][c] = sq[k] / total if total > 0 else 1.0 / len(counts)
    return shares


def fedmho_plan(counts: list[list[int]], total: int) -> list[list[int]]:
    """How many samples of each class each decoder draws: total / C per class, split by
    :func:`squared_count_shares`."""
    num_classes = len(counts[0]) if counts else 0
    per_class = allocate(total, [1.0] * num_classes) if num_classes else []
    shares = squared_count_shares(counts)
    plan = [[0] * num_classes for _ in counts]
    for c in range(num_classes):
        for k, n in enumerate(allocate(per_class[c], [row[c] for row in shares])):
            plan[k][c] = n
    return plan


def proportional_plan(counts: list[list[int]], total: int) -> list[list[int]]:
    """FedCVAE-Ens: samples drawn from every decoder in proportion to its data, each with its own
    label distribution (one largest-remainder split over all (client, class) cells)."""
    flat = [float(n) for row in counts for n in row]
    cells = allocate(total, flat)
    width = len(counts[0]) if counts else 0
    return [cells[k * width : (k + 1) * width] for k in range(len(counts))]


@torch.no_grad()
def generate(
    decoders: list[nn.Module],
    plan: list[list[int]],
    latent: int,
    num_classes: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    batch: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``plan[k][c]`` samples of class c from decoder k with z ~ N(0, I).
    Returns ``(x, y)`` on the CPU, grouped by decoder then class."""
    xs, ys = [], []
    for decoder, row in zip(decoders, plan):
        decoder.to(device).eval()
        for c, n in enumerate(row):
            for start in range(0, n, batch):
                m = min(batch, n - start)
                z = torch.randn(m, latent, generator=generator).to(device)
                onehot = torch.zeros(m, num_classes, device=device)
                onehot[:, c] = 1.0
                xs.append(decoder(z, onehot).float().cpu())
                ys.append(torch.full((m,), c, dtype=torch.long))
    if not xs:
        raise ValueError("the plan asks for no samples")
    return torch.cat(xs), torch.cat(ys)


def kmeans_filter(x: torch.Tensor, y: torch.Tensor, keep_ratio: float) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[int, int]]]:
    """Algorithm 2: per class, cluster the flattened samples into one cluster and keep the
    floor(keep_ratio x n) samples nearest its centre (Euclidean).

    K-means with a single cluster converges in one step to the class mean (the assignment step
    has nothing to choose), so the centre is computed directly as the mean rather than through
    an iterative K-means library call that would return the same point.
    Returns the kept samples (in their original order) and, per class, (generated, kept).
    """
    if not 0 < keep_ratio <= 1:
        raise ValueError("keep_ratio must be in (0, 1]")
    keep = torch.zeros(len(y), dtype=torch.bool)
    report: dict[int, tuple[int, int]] = {}
    flat = x.flatten(1).double()
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        centre = flat[idx].mean(0, keepdim=True)
        dist = torch.linalg.vector_norm(flat[idx] - centre, dim=1)
        n_keep = math.floor(keep_ratio * len(idx) + 1e-9)
        nearest = torch.sort(dist, stable=True).indices[:n_keep]
        keep[idx[nearest]] = True
        report[int(c)] = (len(idx), n_keep)
    return x[keep], y[keep], report


def sample_grid(x: torch.Tensor, y: torch.Tensor, num_classes: int, per_class: int, generator: torch.Generator) -> torch.Tensor:
    """``per_class`` random samples of each class, row by row (a missing class leaves a blank row)."""
    rows = []
    for c in range(num_classes):
        idx = torch.nonzero(y == c).flatten()
        pick = idx[torch.randperm(len(idx), generator=generator)[:per_class]]
        imgs = x[pick]
        if len(imgs) < per_class:
            imgs = torch.cat([imgs, torch.zeros(per_class - len(imgs), *x.shape[1:])])
        rows.append(imgs)
    return torch.cat(rows)


def save_sample_grid(grid: torch.Tensor, per_class: int, path: Path, class_names: list[str] | None = None) -> Path:
    """Synthetic samples, one labelled row per class, large enough to see (matplotlib; falls
    back to torchvision's unlabelled grid without it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    images = grid.detach().float().cpu().clamp(0, 1)
    rows = max(1, len(images) // max(per_class, 1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from torchvision.utils import save_image

        save_image(images, str(path), nrow=per_class, padding=2, pad_value=1.0)
        return path
    fig, axes = plt.subplots(rows, per_class, figsize=(1.1 * per_class + 1.4, 1.1 * rows + 0.6), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if i < len(images):
            img = images[i]
            ax.imshow(img[0] if img.shape[0] == 1 else img.permute(1, 2, 0), cmap="gray" if img.shape[0] == 1 else None, vmin=0, vmax=1)
        if i % per_class == 0:
            row = i // per_class
            ax.set_ylabel(class_names[row] if class_names and row < len(class_names) else f"class {row}", rotation=0,
                          ha="right", va="center", fontsize=8)
    fig.suptitle(f"Synthetic samples from the fused generator ({per_class} per class)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
