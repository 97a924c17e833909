"""Splitting a labelled training set across clients: IID, Dirichlet(alpha) and shards.

All partitioners take a numpy ``Generator`` (or a seed) and return one index array per client,
so the same seed always gives the same split.
"""

from __future__ import annotations

import numpy as np

from edgefl.errors import ConfigError


def _rng(seed: int | np.random.Generator) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def iid(labels: np.ndarray, num_clients: int, seed: int | np.random.Generator = 0) -> list[np.ndarray]:
    """Shuffle and deal the samples out evenly."""
    order = _rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def contiguous(labels: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """The training set cut in its file order into equal consecutive parts (the FedHe authors'
    split: device k holds samples k*n/N .. (k+1)*n/N; about IID when the file is not label-sorted)."""
    if num_clients > len(labels):
        raise ConfigError(f"{num_clients} devices cannot each hold a part of {len(labels)} samples")
    return list(np.array_split(np.arange(len(labels)), num_clients))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int | np.random.Generator = 0,
    min_samples: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided across clients by a Dirichlet(alpha) draw.

    The rebalancing loop of FedDF / NIID-Bench: redraw the whole split until every client holds
    at least ``min_samples``; while drawing, a client that already holds its fair share
    (N / num_clients) receives nothing more of the next classes.
    """
    if alpha <= 0:
        raise ConfigError(f"dirichlet alpha must be positive, got {alpha}")
    if min_samples * num_clients > len(labels):
        raise ConfigError(
            f"cannot give {num_clients} clients {min_samples} samples each from {len(labels)}",
            hint="lower data.min_samples or the number of clients",
        )
    rng = _rng(seed)
    classes = np.unique(labels)
    fair_share = len(labels) / num_clients
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = np.array([pj * (len(part) < fair_share) for pj, part in zip(p, parts)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(idx, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_samples:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ConfigError(
        f"no Dirichlet({alpha}) split gave every client {min_samples} samples in {max_tries} draws",
        hint="raise data.alpha or lower data.min_samples",
    )


def shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int = 2, seed: int | np.random.Generator = 0
) -> list[np.ndarray]:
    """McMahan et al.'s pathological split: sort by label, cut into equal shards, deal k to each."""
    rng = _rng(seed)
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise ConfigError(f"{num_shards} shards requested from {len(labels)} samples")
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, num_shards)
    deal = rng.permutation(num_shards)
    return [
        np.sort(np.concatenate([pieces[s] for s in deal[i * shards_per_client : (i + 1) * shards_per_client]]))
        for i in range(num_clients)
    ]


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """A [clients, classes] matrix of how many samples of each class each client holds."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def subsample(parts: list[np.ndarray], max_per_client: int, seed: int | np.random.Generator = 0) -> list[np.ndarray]:
    """Keep at most ``max_per_client`` randomly chosen samples per client (for quick runs)."""
    rng = _rng(seed)
    return [np.sort(rng.choice(p, max_per_client, replace=False)) if len(p) > max_per_client else p for p in parts]
