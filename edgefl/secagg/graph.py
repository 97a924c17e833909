"""The SecAgg+ neighbour graph: whom each device masks with and shares its secrets among.

Bell et al. replace the complete graph of Bonawitz et al. by a Harary graph over a random cyclic
order: each device is joined to the k/2 devices before it and the k/2 after it, so every device has
exactly k neighbours and the graph is undirected. Mask and share traffic per device then grows with
k instead of with the fleet.

The order is public and reproducible: every device is placed by SHA-256(label || seed || round ||
its id), so the server and each device compute the same graph from the run's seed, the round and
the list of ids, with no message and no language-specific random generator (any SHA-256 gives
the same order). A new round gives a new graph.

The graph is only as unpredictable as the seed: whoever picks the seed after knowing which devices
collude could surround a target with them. A deployment that distrusts the server should take the
seed from a value it cannot choose in advance (e.g. the hash of the round's collected public keys).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ORDER_LABEL = b"edgefl secagg v1 graph order"
_U64 = (1 << 64) - 1


def neighbours(ids: Sequence[str], k: int, *, seed: int | bytes, round_no: int) -> dict[str, list[str]]:
    """{id: its neighbours' ids, sorted} (keys sorted too) for the Harary graph of degree ``k`` over the order of
    :func:`cyclic_order`. ``k >= len(ids) - 1`` gives the complete graph (Bonawitz et al.); otherwise
    k must be even and at least 2, and every device gets exactly k neighbours."""
    order = cyclic_order(ids, seed=seed, round_no=round_no)
    n = len(order)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if k >= n - 1:
        return {node: [other for other in sorted(order) if other != node] for node in sorted(order)}
    if k < 2 or k % 2:
        raise ValueError(f"k={k} for {n} devices: the Harary graph joins k/2 devices on each side, so k must be even and "
                         f"at least 2 (or at least {n - 1} for the complete graph)")
    half = k // 2
    # k < n - 1 so the k positions i +- 1..k/2 (mod n) are distinct and never i itself: degree exactly k
    graph = {node: sorted(order[(i + d) % n] for d in range(-half, half + 1) if d) for i, node in enumerate(order)}
    return {node: graph[node] for node in sorted(graph)}


def cyclic_order(ids: Sequence[str], *, seed: int | bytes, round_no: int) -> list[str]:
    """``ids`` sorted by SHA-256(label || len(seed) (4 bytes) || seed || round (8 bytes) || id):
    a permutation every party computes alike. An int seed is its 8 big-endian bytes."""
    if isinstance(ids, str):
        raise ValueError("ids must be a sequence of device ids, not one string")
    ids = list(ids)
    for device in ids:
        if not isinstance(device, str) or not device:
            raise ValueError(f"a device id must be a non-empty str, got {device!r}")
    if len(set(ids)) != len(ids):
        duplicates = sorted({d for d in ids if ids.count(d) > 1})
        raise ValueError(f"device ids must be distinct, repeated: {duplicates}")
    prefix = _ORDER_LABEL + _seed_bytes(seed) + struct.pack(">Q", _u64("round_no", round_no))
    # the id breaks the (astronomically unlikely) tie of two equal hashes, so the order is total
    return sorted(ids, key=lambda device: (hashlib.sha256(prefix + device.encode()).digest(), device))


def default_neighbours(n: int) -> int:
    """k for a fleet of n devices: ceil(log2 n) rounded up to even, at least 2, and n - 1 (the
    complete graph) when that is no more. The O(log n) growth is Bell et al.'s; the constant 1 is a
    cost choice, not their concrete security bound (which needs a larger k for a given fraction of
    colluding devices and failure probability): docs/secure-aggregation.md."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    k = max(2, (n - 1).bit_length())  # (n - 1).bit_length() == ceil(log2 n) for n >= 1, exactly
    k += k % 2
    return min(k, n - 1)


def default_threshold(k: int) -> int:
    """t = floor(2k/3) + 1 of a device's k shares reconstruct its secrets.

    Why more than half, and two thirds: each honest neighbour reveals, for a device, either the
    share of its self-mask seed (the device survived) or the share of its mask key (it dropped),
    never both. A server that lies about who dropped, helped by c colluding neighbours, gets at
    most k + c shares across the two secrets, so it can never hold t of each while 2t > k + c.
    t = floor(2k/3) + 1 keeps that true for c up to about k/3 (Bonawitz et al.'s 2n/3 rule against
    an active server), and still reconstructs when up to k - t (about k/3) neighbours drop out.
    Against a server that follows the protocol, t = floor(k/2) + 1 tolerates more dropouts."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return 2 * k // 3 + 1


def _seed_bytes(seed: int | bytes) -> bytes:
    if isinstance(seed, (bytes, bytearray)):
        raw = bytes(seed)
    elif isinstance(seed, int) and not isinstance(seed, bool):
        raw = struct.pack(">Q", _u64("seed", seed))
    else:
        raise ValueError(f"the graph seed must be an int in [0, 2**64) or bytes, got {type(seed).__name__}")
    return struct.pack(">I", len(raw)) + raw


def _u64(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _U64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value
