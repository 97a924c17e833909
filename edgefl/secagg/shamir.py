"""t-of-n Shamir secret sharing of 32-byte secrets (the X25519 mask keys and the self-mask seeds
that SecAgg+ lets the survivors reconstruct for the server).

The field is GF(p) with p = 2**521 - 1, the Mersenne prime M521 (also the field of the NIST P-521
curve). Why this prime:

- a 32-byte secret is an integer below 2**256 < p, so it is one field element: one polynomial per
  secret, no chunking and no encoding rule to get wrong (2**127 - 1 would need three polynomials
  per secret; 2**255 - 19 is smaller than 2**256 and cannot hold every 32-byte string);
- its primality is textbook (a Mersenne prime), nothing to prove or to trust in a constant;
- the field is far larger than the secrets, so a reconstruction from corrupt shares lands above
  2**256 with probability 1 - 2**-265 and is refused rather than returned as a wrong key.

A share is the polynomial's value at the holder's point x (a device index, 1 <= x < p), written as
``SHARE_BYTES`` = 66 big-endian bytes; the point itself is not part of the share (the protocol
knows who sent it). The secret is the polynomial's value at 0. Fewer than ``threshold`` shares say
nothing about the secret: every value of it is equally consistent with them.

:func:`split` / :func:`combine` are the byte-level API; :func:`split_int` / :func:`combine_int` are
the same arithmetic over any prime (the tests use tiny primes to check it by hand).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache

#: the Mersenne prime 2**521 - 1
PRIME = (1 << 521) - 1
#: bytes of a serialised share: ceil(521 / 8)
SHARE_BYTES = (PRIME.bit_length() + 7) // 8
#: bytes of a secret this module shares (X25519 private keys and PRG seeds are both 32 bytes)
SECRET_BYTES = 32

RandBelow = Callable[[int], int]


def split(secret: bytes, threshold: int, xs: Sequence[int], randbelow: RandBelow = secrets.randbelow) -> dict[int, bytes]:
    """Shares of a 32-byte ``secret`` for the holders at points ``xs`` (distinct, 1 <= x < p), any
    ``threshold`` of which reconstruct it. ``randbelow(n)`` draws the polynomial's coefficients
    uniformly from [0, n); the default is the operating system's CSPRNG (inject a seeded one only
    in tests). Returns {x: SHARE_BYTES bytes}, in the order of ``xs``."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) != SECRET_BYTES:
        raise ValueError(f"the secret must be {SECRET_BYTES} bytes, got {_describe(secret)}")
    values = split_int(int.from_bytes(secret, "big"), threshold, xs, PRIME, randbelow)
    return {x: y.to_bytes(SHARE_BYTES, "big") for x, y in values.items()}


def combine(shares: Mapping[int, bytes] | Iterable[tuple[int, bytes]], threshold: int) -> bytes:
    """The 32-byte secret from at least ``threshold`` shares ({x: share} or (x, share) pairs).

    The ``threshold`` shares with the smallest points reconstruct it; every further share is checked
    against the same polynomial, so a corrupt share, or one of another secret, is refused (ValueError)
    instead of silently changing the result. With exactly ``threshold`` shares a corrupt one is still
    caught, with probability 1 - 2**-265, because the result does not fit in 32 bytes.

    Cost: O(t^2) field operations for a new set of base points (cached), then O(t) per secret and
    O(t) per extra share; pass exactly ``threshold`` shares to skip the cross-check."""
    points: list[tuple[int, int]] = []  # a list, not a dict: a repeated x must reach the check, not vanish
    for x, share in _pairs(shares):
        if not isinstance(share, (bytes, bytearray)) or len(share) != SHARE_BYTES:
            raise ValueError(f"the share at x={x} must be {SHARE_BYTES} bytes, got {_describe(share)}")
        points.append((x, int.from_bytes(share, "big")))
    value = combine_int(points, threshold, PRIME)
    if value >> (8 * SECRET_BYTES):
        raise ValueError(f"the shares do not reconstruct a {SECRET_BYTES}-byte secret: at least one is corrupt or belongs to another secret")
    return value.to_bytes(SECRET_BYTES, "big")


def split_int(secret: int, threshold: int, xs: Sequence[int], prime: int = PRIME, randbelow: RandBelow = secrets.randbelow) -> dict[int, int]:
    """{x: f(x)} for a random polynomial f of degree ``threshold - 1`` over GF(``prime``) with
    f(0) = ``secret``. ``prime`` must be prime (not checked: it is PRIME outside tests)."""
    if not 0 <= secret < prime:
        raise ValueError(f"the secret must lie in [0, {_field(prime)}), got {secret}")
    points = _check_points(xs, prime)
    _check_threshold(threshold, len(points))
    # f(x) = secret + c1 x + ... + c_{t-1} x^{t-1}; uniform coefficients make any t-1 values uniform
    coefficients = [secret] + [randbelow(prime) for _ in range(threshold - 1)]
    if any(not 0 <= c < prime for c in coefficients):
        raise ValueError(f"randbelow({prime}) returned a value outside [0, {prime})")
    return {x: _horner(coefficients, x, prime) for x in points}


def combine_int(shares: Mapping[int, int] | Iterable[tuple[int, int]], threshold: int, prime: int = PRIME) -> int:
    """f(0) from at least ``threshold`` points of f over GF(``prime``); extra points must lie on the
    polynomial through the first ``threshold`` (by x), or ValueError."""
    pairs = _pairs(shares)
    points = _check_points([x for x, _ in pairs], prime)
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        raise ValueError(f"the threshold must be an int >= 1, got {threshold!r}")
    if len(points) < threshold:
        raise ValueError(f"{len(points)} share(s) cannot reconstruct a secret split with threshold {threshold}: "
                         f"at least {threshold} are needed")
    values = dict(pairs)
    for x, y in pairs:
        if not isinstance(y, int) or isinstance(y, bool) or not 0 <= y < prime:
            raise ValueError(f"the share at x={x} is not a field element (0 <= y < {_field(prime)})")
    # a fixed choice of base points (the smallest) so the same shares always take the same path and
    # repeated reconstructions from one set of holders reuse the cached Lagrange weights
    ordered = sorted(points)
    base = tuple(ordered[:threshold])
    secret = _evaluate(base, [values[x] for x in base], 0, prime)
    for x in ordered[threshold:]:
        if _evaluate(base, [values[b] for b in base], x, prime) != values[x]:
            held = list(base) if len(base) <= 8 else f"[{base[0]}, {base[1]}, ..., {base[-1]}] ({len(base)} shares)"
            raise ValueError(f"the share at x={x} disagrees with the shares at x={held}: "
                             "at least one of them is corrupt or belongs to another secret")
    return secret


def _evaluate(base: tuple[int, ...], ys: list[int], z: int, prime: int) -> int:
    """The interpolating polynomial through (base, ys) at z (z not in base)."""
    coefficients = _at_zero(base, prime) if z == 0 else _lagrange(base, z, prime)
    return sum(c * y for c, y in zip(coefficients, ys)) % prime


@lru_cache(maxsize=64)
def _at_zero(base: tuple[int, ...], prime: int) -> tuple[int, ...]:
    # cached: the server reconstructs many secrets from the same holders (everyone who answered)
    return _lagrange(base, 0, prime)


def _lagrange(base: tuple[int, ...], z: int, prime: int) -> tuple[int, ...]:
    """Lagrange coefficients l_i(z) = prod_{j != i} (z - x_j) / (x_i - x_j) for the points in base.
    The denominators cost O(t^2) once per set of points (cached); each z then costs O(t)."""
    inverse_denominators = _inverse_denominators(base, prime)
    # prod_{j != i} (z - x_j) from prefix and suffix products: no division, so z may be any point
    t = len(base)
    prefix = [1] * (t + 1)
    for i, x in enumerate(base):
        prefix[i + 1] = prefix[i] * (z - x) % prime
    suffix = [1] * (t + 1)
    for i in range(t - 1, -1, -1):
        suffix[i] = suffix[i + 1] * (z - base[i]) % prime
    return tuple(prefix[i] * suffix[i + 1] % prime * inverse_denominators[i] % prime for i in range(t))


@lru_cache(maxsize=64)
def _inverse_denominators(base: tuple[int, ...], prime: int) -> tuple[int, ...]:
    result = []
    for i, xi in enumerate(base):
        denominator = 1
        for j, xj in enumerate(base):
            if j != i:
                denominator = denominator * (xi - xj) % prime
        result.append(pow(denominator, -1, prime))
    return tuple(result)


def _horner(coefficients: list[int], x: int, prime: int) -> int:
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % prime
    return value


def _pairs(shares: Mapping[int, object] | Iterable[tuple[int, object]]) -> list[tuple[int, object]]:
    items = list(shares.items()) if isinstance(shares, Mapping) else list(shares)
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"shares must be a mapping {{x: share}} or (x, share) pairs, got an item {_describe(item)}")
    return items  # type: ignore[return-value]


def _check_points(xs: Iterable[int], prime: int) -> list[int]:
    seen: dict[int, None] = {}  # ordered, with O(1) membership
    for x in xs:
        # bool is an int subclass: True as a device index is a bug, not a point
        if not isinstance(x, int) or isinstance(x, bool):
            raise ValueError(f"a share's point must be an int, got {_describe(x)}")
        if x == 0:
            raise ValueError("x=0 cannot hold a share: f(0) is the secret itself")
        if not 0 < x < prime:
            raise ValueError(f"a share's point must lie in [1, {_field(prime)}), got {x}")
        if x in seen:
            raise ValueError(f"x={x} appears twice: each holder needs its own point")
        seen[x] = None
    return list(seen)


def _check_threshold(threshold: int, holders: int) -> None:
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        raise ValueError(f"the threshold must be an int >= 1, got {threshold!r}")
    if threshold > holders:
        raise ValueError(f"a threshold of {threshold} needs at least {threshold} holders, got {holders}: the secret could never be reconstructed")


def _field(prime: int) -> str:
    return "2**521 - 1" if prime == PRIME else str(prime)


def _describe(value: object) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return f"{type(value).__name__} {value!r}"[:80]
