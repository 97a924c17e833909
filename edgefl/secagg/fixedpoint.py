"""Float tensors to integer codes that can be masked and summed mod 2**m, and the sum back to floats.

Encoding one value x with clip c and q value bits (L = 2**q - 1 levels above zero):

    x -> clamp(x, -c, c) -> s = (x + c) * L / (2c)  in [0, L] -> code = floor(s) or ceil(s)

Stochastic rounding takes ceil(s) with probability s - floor(s), so E[code] = s exactly: the
rounding is unbiased and its errors average out over devices. Decoding a sum of n codes undoes the
shift once per input: sum(x) ~ total * step - n * c, with step = 2c / L.

Error bound (values inside [-c, c]; clamping adds the clipped excess on top): each code is within one
level of s, so each value's error is below one step, a sum of n below n * step, the mean below one
step. The stochastic errors are independent, zero-mean and of variance at most step**2 / 4, so the
mean's error is typically about step / (2 sqrt(n)). Round-to-nearest (``stochastic=False``) halves
the worst case (step / 2 a value) but is biased: the same small update rounds the same way on every
device and every round.

Modulus rule: n codes below 2**q sum to at most n * L, so a modulus 2**m with n * L < 2**m holds the
true sum and the wrap-around of masked arithmetic mod 2**m undoes itself exactly (:func:`modulus_bits_for`).
m is capped at 63 so uint64 (and int64) arithmetic never overflows its own range before reduction.
"""

from __future__ import annotations

import numpy as np
import torch

#: the largest modulus: 2**63 keeps every code and every partial sum representable in int64 too
MAX_MODULUS_BITS = 63
#: the most value bits: float64 computes s with an error of about L * 2**-53, negligible up to 32
#: bits, and finer codes than 32 bits carry nothing a float32 update has
MAX_VALUE_BITS = 32


def levels(value_bits: int) -> int:
    """L = 2**q - 1: the largest code (codes run 0..L, so L steps span [-clip, clip])."""
    _check_value_bits(value_bits)
    return (1 << value_bits) - 1


def step(clip: float, value_bits: int) -> float:
    """One quantisation step in the input's units: 2 * clip / (2**q - 1)."""
    return 2.0 * _check_clip(clip) / levels(value_bits)


def modulus_bits_for(n_max: int, value_bits: int) -> int:
    """The smallest m such that ``n_max`` codes of ``value_bits`` bits sum below 2**m (no wrap);
    ValueError when that needs more than 63 bits (fewer value bits or fewer inputs per sum then)."""
    if not isinstance(n_max, int) or isinstance(n_max, bool) or n_max < 1:
        raise ValueError(f"n_max must be an int >= 1, got {n_max!r}")
    largest_sum = n_max * levels(value_bits)
    bits = largest_sum.bit_length()  # smallest m with largest_sum < 2**m
    if bits > MAX_MODULUS_BITS:
        fitting = [q for q in range(1, value_bits) if n_max * ((1 << q) - 1) >> MAX_MODULUS_BITS == 0]
        advice = f"at most {fitting[-1]} value bits for {n_max} inputs" if fitting else f"fewer than {n_max} inputs"
        raise ValueError(f"a sum of {n_max} codes of {value_bits} bits needs a {bits}-bit modulus, over the "
                         f"{MAX_MODULUS_BITS}-bit limit of 64-bit integer arithmetic: use {advice}")
    return bits


def encode(x: torch.Tensor, *, clip: float, value_bits: int, modulus_bits: int,
           generator: torch.Generator | None = None, stochastic: bool = True) -> np.ndarray:
    """Codes in [0, 2**value_bits - 1] for the float tensor ``x`` (uint64, same shape).

    Values outside [-clip, clip] (infinities included) are clamped; NaN is refused. ``generator``
    (a CPU torch.Generator) drives stochastic rounding; None uses torch's global one. The rounding
    noise needs no secrecy: it is summed under the masks like the values themselves."""
    clip = _check_clip(clip)
    top = levels(value_bits)
    if not isinstance(modulus_bits, int) or isinstance(modulus_bits, bool) or not value_bits <= modulus_bits <= MAX_MODULUS_BITS:
        raise ValueError(f"modulus_bits must be an int in [{value_bits}, {MAX_MODULUS_BITS}] for {value_bits}-bit codes, got {modulus_bits!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"encode takes a float tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}".rstrip())
    values = x.detach().to(device="cpu", dtype=torch.float64)
    if torch.isnan(values).any():
        raise ValueError(f"the tensor holds {int(torch.isnan(values).sum())} NaN value(s): NaN has no code")
    # one multiplier rather than a division per value: exact when L / (2c) is (the hand-checked tests)
    scaled = (values.clamp(-clip, clip) + clip) * (top / (2.0 * clip))
    floor = torch.floor(scaled)
    if stochastic:
        # P(u < f) = f for u uniform in [0, 1): ceil with probability f = s - floor(s), so E[code] = s
        u = torch.rand(scaled.shape, generator=generator, dtype=torch.float64)
        codes = floor + (u < scaled - floor).to(torch.float64)
    else:
        codes = torch.floor(scaled + 0.5)
    # float rounding could push s a hair past L; the clamp keeps every code a valid level
    return codes.clamp(0, top).to(torch.int64).numpy().astype(np.uint64)


def decode_sum(total: np.ndarray, *, count: int, clip: float, value_bits: int, modulus_bits: int) -> torch.Tensor:
    """The sum of ``count`` encoded tensors from the sum of their codes mod 2**modulus_bits (float64,
    same shape). Divide by ``count`` for the mean.

    ValueError when the modulus cannot hold ``count`` codes (the sum may have wrapped) or when a
    reduced total exceeds count * L, which no honest set of codes produces: a mask that did not
    cancel or an out-of-range code. (Codes within range but wrong are not detectable here.)"""
    clip = _check_clip(clip)
    top = levels(value_bits)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    needed = modulus_bits_for(count, value_bits)
    if not isinstance(modulus_bits, int) or isinstance(modulus_bits, bool) or not needed <= modulus_bits <= MAX_MODULUS_BITS:
        raise ValueError(f"a sum of {count} codes of {value_bits} bits needs modulus_bits in [{needed}, {MAX_MODULUS_BITS}], "
                         f"got {modulus_bits!r}: the sum may have wrapped")
    total = np.asarray(total)
    if total.dtype.kind not in "ui":
        raise ValueError(f"the summed codes must be an integer array (uint64), got dtype {total.dtype}")
    # an int64 array converts two's-complement, i.e. mod 2**64, which 2**m divides
    reduced = total.astype(np.uint64, copy=True) & np.uint64((1 << modulus_bits) - 1)
    if reduced.size and int(reduced.max()) > count * top:
        raise ValueError(f"a summed code is {int(reduced.max())}, above the largest possible sum {count * top} of {count} codes: "
                         "the masks did not cancel or an input was out of range")
    decoded = reduced.astype(np.float64) * (2.0 * clip / top) - count * clip
    return torch.from_numpy(decoded)


def add_mod(a: np.ndarray, b: np.ndarray, modulus_bits: int) -> np.ndarray:
    """(a + b) mod 2**m for uint64 arrays: uint64 addition wraps mod 2**64, a multiple of 2**m."""
    return (np.asarray(a, dtype=np.uint64) + np.asarray(b, dtype=np.uint64)) & _low_bits(modulus_bits)


def sub_mod(a: np.ndarray, b: np.ndarray, modulus_bits: int) -> np.ndarray:
    """(a - b) mod 2**m for uint64 arrays: the wrap-around of uint64 subtraction is the mod."""
    return (np.asarray(a, dtype=np.uint64) - np.asarray(b, dtype=np.uint64)) & _low_bits(modulus_bits)


def _low_bits(modulus_bits: int) -> np.uint64:
    if not isinstance(modulus_bits, int) or isinstance(modulus_bits, bool) or not 1 <= modulus_bits <= 64:
        raise ValueError(f"modulus_bits must be an int in [1, 64], got {modulus_bits!r}")
    return np.uint64((1 << modulus_bits) - 1)


def _check_value_bits(value_bits: int) -> None:
    if not isinstance(value_bits, int) or isinstance(value_bits, bool) or not 1 <= value_bits <= MAX_VALUE_BITS:
        raise ValueError(f"value_bits must be an int in [1, {MAX_VALUE_BITS}], got {value_bits!r}")


def _check_clip(clip: float) -> float:
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < float(clip) < float("inf"):
        raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
    return float(clip)
