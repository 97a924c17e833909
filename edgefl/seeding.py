"""Derived seeds: every random draw in a run comes from (run seed, purpose, ids), so a client's
training does not depend on which other clients ran before it in the same process."""

from __future__ import annotations

import hashlib
import threading

import torch

#: held while torch's global RNG is seeded and drawn from (a model's initial weights, a round's
#: dropout masks): devices that are threads of one process (an in-memory fleet) would otherwise
#: draw from it in turn and change each other's numbers
GLOBAL_RNG_LOCK = threading.RLock()


def derive_seed(seed: int, *parts: object) -> int:
    text = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, *parts: object) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *parts))
    return g
