"""The mask generator: a 32-byte seed expands into a vector of uniform integers mod 2**b.

Each device adds one such vector per neighbour (seeded by the pair's agreed secret, with opposite
signs at the two ends so the pair's masks cancel in the sum) and one of its own (seeded by a fresh
random seed whose shares let the server remove it). The server recomputes masks from reconstructed
seeds, so the expansion must be identical on every platform: this module fixes it exactly.

Stream: the ChaCha20 keystream (RFC 8439 block function) with key = seed, a zero 96-bit nonce and
the 32-bit block counter starting at 0, i.e. the keystream of encrypting zeros. Value i is the
little-endian 64-bit word in keystream bytes [8i, 8i + 8), reduced mod 2**b by keeping its low b bits.

Why these choices:

- ChaCha20 rather than AES-CTR: the Raspberry Pi 4 and Zero 2 W (Cortex-A72 / A53 without the ARMv8
  crypto extensions) have no AES instructions; ChaCha20 is fast and constant-time in plain software
  on them and on microcontrollers, and just as fast as AES on a server. Any RFC 8439 ChaCha20 gives
  the same stream, so a device in another language can reproduce the masks.
- A zero nonce is safe because a seed keys exactly one stream: a pairwise seed is derived per
  round (edgefl.secagg.keys.pairwise_mask_seed) and a self-mask seed is fresh (:func:`new_seed`).
  Never expand one seed into two different masks.
- The modulus is a power of two, so keeping the low b bits of a uniform 64-bit word is exactly
  uniform (no rejection sampling), and uint64 arithmetic that wraps mod 2**64 stays correct mod 2**b.
- Eight bytes per value whatever b is: the same seed gives the same low bits at any modulus, and
  the layout has one rule.
"""

from __future__ import annotations

import secrets

import numpy as np

SEED_BYTES = 32
#: values one seed may expand to: the 32-bit block counter covers 2**32 blocks of 64 bytes
MAX_VALUES = (1 << 32) * 64 // 8
#: keystream bytes encrypted per call: bounds the zero buffer, not the result
_CHUNK = 1 << 22


def new_seed() -> bytes:
    """A fresh 32-byte seed from the operating system's CSPRNG (a device's self-mask seed)."""
    return secrets.token_bytes(SEED_BYTES)


def mask(seed: bytes, length: int, modulus_bits: int) -> np.ndarray:
    """``length`` values uniform in [0, 2**modulus_bits) from ``seed`` (uint64, 1-D)."""
    _check_seed(seed)
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= MAX_VALUES:
        raise ValueError(f"a mask's length must be an int in [0, {MAX_VALUES}], got {length!r}")
    if not isinstance(modulus_bits, int) or isinstance(modulus_bits, bool) or not 1 <= modulus_bits <= 64:
        raise ValueError(f"modulus_bits must be an int in [1, 64] (values are 64-bit words), got {modulus_bits!r}")
    out = np.empty(length, dtype="<u8")  # little-endian whatever the host: the layout is fixed
    _keystream_into(bytes(seed), out.view(np.uint8))
    if modulus_bits < 64:
        out &= np.uint64((1 << modulus_bits) - 1)
    return out.astype(np.uint64, copy=False)


def keystream(seed: bytes, nbytes: int) -> bytes:
    """The first ``nbytes`` of the stream :func:`mask` reads (for tests and other implementations)."""
    _check_seed(seed)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= MAX_VALUES * 8:
        raise ValueError(f"nbytes must be an int in [0, {MAX_VALUES * 8}], got {nbytes!r}")
    buffer = np.empty(nbytes, dtype=np.uint8)
    _keystream_into(bytes(seed), buffer)
    return buffer.tobytes()


def _check_seed(seed: object) -> None:
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
        got = f"{len(seed)} bytes" if isinstance(seed, (bytes, bytearray)) else type(seed).__name__
        raise ValueError(f"a mask seed must be {SEED_BYTES} bytes, got {got}")


def _keystream_into(key: bytes, out: np.ndarray) -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    # cryptography's 16-byte ChaCha20 nonce is the 32-bit little-endian block counter followed by
    # the 96-bit nonce (RFC 8439's layout): all zeros = counter 0, nonce 0
    encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    zeros = memoryview(bytes(min(_CHUNK, out.size)))
    # encrypting zeros in place of a growing bytes object: one pass over the output, bounded memory
    for start in range(0, out.size, _CHUNK):
        end = min(start + _CHUNK, out.size)
        encryptor.update_into(zeros[: end - start], out[start:end])
