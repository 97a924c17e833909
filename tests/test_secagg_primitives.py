"""The secure-aggregation building blocks (edgefl.secagg), checked by hand where the arithmetic is
small enough to do on paper, against published test vectors where there are some, and with
property tests for the rest."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.secagg import fixedpoint, graph, keys, prg, shamir


def scripted(*values: int):
    """A randbelow that returns the given coefficients in order, so a split can be done on paper."""
    queue = list(values)
    return lambda bound: queue.pop(0)


# ---------------------------------------------------------------- Shamir


def test_split_over_a_tiny_prime_by_hand():
    # f(x) = 5 + 3x over GF(11): f(1) = 8, f(2) = 11 = 0, f(3) = 14 = 3
    assert shamir.split_int(5, 2, [1, 2, 3], prime=11, randbelow=scripted(3)) == {1: 8, 2: 0, 3: 3}
    # f(x) = 7 + 2x + 5x^2 over GF(13): 14 = 1, 31 = 5, 58 = 6, 95 = 4
    assert shamir.split_int(7, 3, [1, 2, 3, 4], prime=13, randbelow=scripted(2, 5)) == {1: 1, 2: 5, 3: 6, 4: 4}


def test_combine_over_a_tiny_prime_by_hand():
    # from x=1 and x=3 of f(x) = 5 + 3x mod 11: l1(0) = (0-3)/(1-3) = 3/2 = 3*6 = 7 and
    # l3(0) = (0-1)/(3-1) = -1/2 = 10*6 = 5, so f(0) = 8*7 + 3*5 = 71 = 5 (mod 11)
    assert shamir.combine_int({1: 8, 3: 3}, 2, prime=11) == 5
    assert shamir.combine_int({3: 6, 1: 1, 4: 4}, 3, prime=13) == 7
    assert shamir.combine_int([(2, 5), (4, 4), (1, 1), (3, 6)], 3, prime=13) == 7  # more than t, as pairs


def test_combine_with_exactly_and_more_than_t_shares():
    secret = bytes(range(32))
    xs = [3, 7, 11, 12, 40]
    shares = shamir.split(secret, 3, xs, randbelow=random.Random(1).randrange)
    assert set(shares) == set(xs) and all(len(s) == shamir.SHARE_BYTES == 66 for s in shares.values())
    for subset in ([3, 7, 11], [40, 12, 3], [7, 11, 12, 40], xs):
        assert shamir.combine({x: shares[x] for x in subset}, 3) == secret


def test_every_secret_is_consistent_with_fewer_than_t_shares():
    # the secrecy of Shamir sharing, exhaustively over GF(7): with t=3, the shares at x=1, 2 take
    # every pair of values for every secret, each equally often (7 polynomials per pair and secret)
    seen: dict[tuple[int, int], list[int]] = {}
    for secret in range(7):
        for a1 in range(7):
            for a2 in range(7):
                shares = shamir.split_int(secret, 3, [1, 2, 3], prime=7, randbelow=scripted(a1, a2))
                seen.setdefault((shares[1], shares[2]), []).append(secret)
    assert len(seen) == 49 and all(sorted(secrets) == list(range(7)) for secrets in seen.values())


def test_fewer_than_t_shares_are_refused():
    shares = shamir.split(bytes(32), 3, [1, 2, 3])
    with pytest.raises(ValueError, match="2 share.*threshold 3.*at least 3"):
        shamir.combine({1: shares[1], 2: shares[2]}, 3)


def test_a_corrupt_share_is_refused():
    secret = b"\x42" * 32
    shares = shamir.split(secret, 2, [1, 2, 3, 4])
    bad = dict(shares)
    bad[4] = bytes(a ^ b for a, b in zip(shares[4], b"\x00" * 65 + b"\x01"))
    with pytest.raises(ValueError, match="x=4 disagrees"):
        shamir.combine(bad, 2)
    # with exactly t shares the error cannot be located, but the result leaves the 32-byte range
    with pytest.raises(ValueError, match="corrupt"):
        shamir.combine({1: shares[1], 4: bad[4]}, 2)
    # shares of two different secrets do not mix either
    other = shamir.split(b"\x07" * 32, 2, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        shamir.combine({1: shares[1], 2: shares[2], 3: other[3]}, 2)


@pytest.mark.parametrize("xs, match", [
    ([1, 2, 2], "x=2 appears twice"),
    ([0, 1, 2], "x=0 cannot hold a share"),
    ([1, -2, 3], r"must lie in \[1, "),
    ([1, shamir.PRIME, 3], r"must lie in \[1, "),
    ([1, True, 3], "must be an int"),
])
def test_split_refuses_bad_points(xs, match):
    with pytest.raises(ValueError, match=match):
        shamir.split(bytes(32), 2, xs)


def test_split_and_combine_refuse_bad_inputs():
    with pytest.raises(ValueError, match="must be 32 bytes, got 31 bytes"):
        shamir.split(bytes(31), 2, [1, 2])
    with pytest.raises(ValueError, match="threshold of 3 needs at least 3 holders"):
        shamir.split(bytes(32), 3, [1, 2])
    with pytest.raises(ValueError, match="threshold must be"):
        shamir.split(bytes(32), 0, [1, 2])
    shares = shamir.split(bytes(32), 2, [1, 2])
    with pytest.raises(ValueError, match="must be 66 bytes, got 65 bytes"):
        shamir.combine({1: shares[1], 2: shares[2][1:]}, 2)
    with pytest.raises(ValueError, match="not a field element"):
        shamir.combine({1: shares[1], 2: b"\xff" * 66}, 2)  # 2**528 - 1 >= p
    with pytest.raises(ValueError, match="x=2 appears twice"):
        shamir.combine([(1, shares[1]), (2, shares[2]), (2, shares[2])], 2)
    with pytest.raises(ValueError, match="x=0 cannot"):
        shamir.combine({0: shares[1], 2: shares[2]}, 2)
    with pytest.raises(ValueError, match="pairs"):
        shamir.combine([shares[1], shares[2]], 2)  # type: ignore[list-item]


def test_shared_private_key_reconstructs_the_same_key_pair():
    pair = keys.KeyPair.generate()
    shares = shamir.split(pair.private_bytes(), 4, list(range(1, 8)))
    again = keys.KeyPair.from_private_bytes(shamir.combine({x: shares[x] for x in (2, 3, 5, 7)}, 4))
    assert again.public_bytes() == pair.public_bytes()


@settings(max_examples=40, deadline=None)
@given(secret=st.binary(min_size=32, max_size=32), data=st.data())
def test_any_t_shares_reconstruct(secret, data):
    n = data.draw(st.integers(1, 12))
    t = data.draw(st.integers(1, n))
    xs = data.draw(st.lists(st.integers(1, 10**6), min_size=n, max_size=n, unique=True))
    shares = shamir.split(secret, t, xs)
    chosen = data.draw(st.lists(st.sampled_from(xs), min_size=t, max_size=n, unique=True))
    assert shamir.combine({x: shares[x] for x in chosen}, t) == secret


# ---------------------------------------------------------------- the mask PRG

# RFC 8439 appendix A.1, test vectors 1 and 2: the ChaCha20 blocks 0 and 1 of the all-zero key and
# nonce, i.e. the first 128 bytes of the stream prg.mask reads for the all-zero seed
RFC8439_ZERO_KEY_BLOCKS_0_1 = bytes.fromhex(
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
    "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f")
# RFC 8439 section 2.3.2: key 00..1f, nonce 000000090000004a00000000, counter 1
RFC8439_BLOCK_232 = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")


def chacha20_block(key: bytes, counter: int, nonce: bytes) -> bytes:
    """The RFC 8439 block function written out in plain Python: an implementation independent of
    the library prg uses."""
    mask32 = 0xFFFFFFFF

    def rotl(v: int, c: int) -> int:
        return ((v << c) & mask32) | (v >> (32 - c))

    def quarter(s: list[int], a: int, b: int, c: int, d: int) -> None:
        s[a] = (s[a] + s[b]) & mask32
        s[d] = rotl(s[d] ^ s[a], 16)
        s[c] = (s[c] + s[d]) & mask32
        s[b] = rotl(s[b] ^ s[c], 12)
        s[a] = (s[a] + s[b]) & mask32
        s[d] = rotl(s[d] ^ s[a], 8)
        s[c] = (s[c] + s[d]) & mask32
        s[b] = rotl(s[b] ^ s[c], 7)

    state = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574, *struct.unpack("<8I", key), counter, *struct.unpack("<3I", nonce)]
    working = list(state)
    for _ in range(10):
        for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                           (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            quarter(working, a, b, c, d)
    return struct.pack("<16I", *((w + s) & mask32 for w, s in zip(working, state)))


def test_reference_block_function_matches_the_rfc():
    assert chacha20_block(bytes(range(32)), 1, bytes.fromhex("000000090000004a00000000")) == RFC8439_BLOCK_232
    assert chacha20_block(bytes(32), 0, bytes(12)) + chacha20_block(bytes(32), 1, bytes(12)) == RFC8439_ZERO_KEY_BLOCKS_0_1


def test_keystream_is_rfc8439_chacha20_with_zero_nonce_and_counter():
    assert prg.keystream(bytes(32), 128) == RFC8439_ZERO_KEY_BLOCKS_0_1
    key = bytes(range(32))
    expected = b"".join(chacha20_block(key, i, bytes(12)) for i in range(3))
    assert prg.keystream(key, 192) == expected
    assert prg.keystream(key, 100) == expected[:100]  # any prefix, not only whole blocks


def test_mask_values_by_hand():
    # value 0 of the zero seed: the little-endian word of bytes 76 b8 e0 ad a0 f1 3d 90
    full = prg.mask(bytes(32), 16, 64)
    assert full.dtype == np.uint64 and full.shape == (16,)
    assert int(full[0]) == 0x903DF1A0ADE0B876
    assert int(full[8]) == 0x7A385155BEE7079F  # the first word of block 1: 9f 07 e7 be 55 51 38 7a
    # a smaller modulus keeps the low bits of the same words
    # words 1 and 2 end in ... 5d 40 (bytes 40 5d) and ... d2 bd (bytes bd d2)
    assert prg.mask(bytes(32), 3, 16).tolist() == [0xB876, 0x5D40, 0xD2BD]


def test_mask_low_bits_and_prefix():
    seed = prg.new_seed()
    words = prg.mask(seed, 1000, 64)
    for bits in (1, 8, 20, 32, 63):
        got = prg.mask(seed, 1000, bits)
        assert (got == (words & np.uint64((1 << bits) - 1))).all() and int(got.max()) < 1 << bits
    assert (prg.mask(seed, 10, 32) == prg.mask(seed, 1000, 32)[:10]).all()
    assert prg.mask(seed, 0, 32).shape == (0,)
    assert not (prg.mask(seed, 100, 32) == prg.mask(prg.new_seed(), 100, 32)).all()


def test_mask_spans_chunks_like_one_stream(monkeypatch):
    seed = bytes(range(32))
    whole = prg.mask(seed, 5000, 64)
    monkeypatch.setattr(prg, "_CHUNK", 24)  # not a multiple of the 64-byte block: the stream must carry on
    assert (prg.mask(seed, 5000, 64) == whole).all()


def test_mask_is_roughly_uniform():
    values = prg.mask(bytes(range(32)), 200_000, 4)
    counts = np.bincount(values.astype(np.int64), minlength=16)
    # 12500 expected per bin, standard deviation about 108: 6 sigma
    assert counts.shape == (16,) and np.abs(counts - 12_500).max() < 650


def test_mask_refuses_bad_arguments():
    with pytest.raises(ValueError, match="32 bytes, got 16 bytes"):
        prg.mask(bytes(16), 10, 32)
    with pytest.raises(ValueError, match="modulus_bits"):
        prg.mask(bytes(32), 10, 65)
    with pytest.raises(ValueError, match="modulus_bits"):
        prg.mask(bytes(32), 10, 0)
    with pytest.raises(ValueError, match="length"):
        prg.mask(bytes(32), -1, 32)


# ---------------------------------------------------------------- fixed point


def test_exact_codes_by_hand():
    # clip 1.5 and 2 value bits: L = 3 levels above 0, step = 3 / 3 = 1, s = x + 1.5
    x = torch.tensor([-1.5, -0.5, 0.5, 1.5, 5.0, -7.0, float("inf")])
    for stochastic in (True, False):  # integral s: both roundings give s itself
        codes = fixedpoint.encode(x, clip=1.5, value_bits=2, modulus_bits=8, stochastic=stochastic)
        assert codes.dtype == np.uint64 and codes.tolist() == [0, 1, 2, 3, 3, 0, 3]
    # s = 1.5 rounds to 2 to the nearest, to 1 or 2 stochastically
    assert fixedpoint.encode(torch.tensor([0.0]), clip=1.5, value_bits=2, modulus_bits=8, stochastic=False).tolist() == [2]
    halves = fixedpoint.encode(torch.zeros(200), clip=1.5, value_bits=2, modulus_bits=8, generator=torch.Generator().manual_seed(0))
    assert set(halves.tolist()) == {1, 2} and halves.tolist().count(1) in range(60, 141)
    assert fixedpoint.encode(torch.zeros(2, 3), clip=1.0, value_bits=4, modulus_bits=8).shape == (2, 3)


def test_decode_sum_by_hand():
    # the codes 0, 1, 2, 3 of clip 1.5 / 2 bits mean -1.5, -0.5, 0.5, 1.5; three inputs shift by 4.5
    total = np.array([0 + 0 + 0, 3 + 3 + 3, 1 + 2 + 3], dtype=np.uint64)
    got = fixedpoint.decode_sum(total, count=3, clip=1.5, value_bits=2, modulus_bits=4)
    assert got.dtype == torch.float64 and got.tolist() == [-4.5, 4.5, 1.5]


def test_modulus_rule_by_hand():
    # 8-bit codes: L = 255; n * 255 must stay below 2**m
    assert [fixedpoint.modulus_bits_for(n, 8) for n in (1, 2, 3, 257, 258)] == [8, 9, 10, 16, 17]
    # 2**31 codes of 32 bits: 2**63 - 2**31 fits 63 bits; one more input does not
    assert fixedpoint.modulus_bits_for(2**31, 32) == 63
    with pytest.raises(ValueError, match="64-bit modulus.*at most 31 value bits"):
        fixedpoint.modulus_bits_for(2**31 + 1, 32)
    with pytest.raises(ValueError, match="value_bits"):
        fixedpoint.modulus_bits_for(10, 33)
    with pytest.raises(ValueError, match="n_max"):
        fixedpoint.modulus_bits_for(0, 8)


def test_no_wrap_at_the_bound_and_a_wrap_just_below_it():
    n, q = 5, 6
    m = fixedpoint.modulus_bits_for(n, q)  # 5 * 63 = 315 -> 9 bits
    assert m == 9
    top = np.full(4, (1 << q) - 1, dtype=np.uint64)
    total = np.zeros(4, dtype=np.uint64)
    for _ in range(n):
        total = fixedpoint.add_mod(total, top, m)
    assert total.tolist() == [315] * 4
    assert fixedpoint.decode_sum(total, count=n, clip=2.0, value_bits=q, modulus_bits=m).tolist() == [10.0] * 4
    # one bit less and the same sum wraps: decode refuses that modulus
    assert int(fixedpoint.add_mod(np.uint64(315), np.uint64(0), m - 1)) != 315
    with pytest.raises(ValueError, match="may have wrapped"):
        fixedpoint.decode_sum(total, count=n, clip=2.0, value_bits=q, modulus_bits=m - 1)


def test_masked_sum_decodes_within_n_steps():
    generator = torch.Generator().manual_seed(0)
    n, clip, q = 7, 0.5, 10
    m = fixedpoint.modulus_bits_for(n, q)
    inputs = [torch.rand(1000, generator=generator, dtype=torch.float64) - 0.5 for _ in range(n)]
    # masks: one random vector per input, plus the negation of their sum on the last, so they cancel
    masks = [prg.mask(prg.new_seed(), 1000, m) for _ in range(n - 1)]
    cancel = np.zeros(1000, dtype=np.uint64)
    for mk in masks:
        cancel = fixedpoint.sub_mod(cancel, mk, m)
    masks.append(cancel)
    total = np.zeros(1000, dtype=np.uint64)
    for x, mk in zip(inputs, masks):
        codes = fixedpoint.encode(x, clip=clip, value_bits=q, modulus_bits=m, generator=generator)
        total = fixedpoint.add_mod(total, fixedpoint.add_mod(codes, mk, m), m)
    got = fixedpoint.decode_sum(total, count=n, clip=clip, value_bits=q, modulus_bits=m)
    error = (got - sum(inputs)).abs()
    assert error.max() < n * fixedpoint.step(clip, q)
    # the stochastic errors mostly cancel: the mean error is far below the worst case
    assert error.mean() < 0.5 * n * fixedpoint.step(clip, q)


def test_stochastic_rounding_is_unbiased():
    # x = 0.3 with clip 1 and 2 bits: s = 1.3 * 1.5 = 1.95, code 2 with probability 0.95
    generator = torch.Generator().manual_seed(1)
    codes = fixedpoint.encode(torch.full((40_000,), 0.3), clip=1.0, value_bits=2, modulus_bits=4, generator=generator)
    assert set(codes.tolist()) == {1, 2}
    assert abs(codes.astype(np.float64).mean() - 1.95) < 0.005  # standard error 0.0011
    decoded = fixedpoint.decode_sum(codes, count=1, clip=1.0, value_bits=2, modulus_bits=4)
    assert abs(decoded.mean().item() - 0.3) < 0.005
    # the nearest rounding is biased: always 2, i.e. 1/3 instead of 0.3
    nearest = fixedpoint.encode(torch.full((10,), 0.3), clip=1.0, value_bits=2, modulus_bits=4, stochastic=False)
    assert nearest.tolist() == [2] * 10


def test_same_generator_seed_same_codes():
    x = torch.randn(1000)
    a = fixedpoint.encode(x, clip=2.0, value_bits=8, modulus_bits=16, generator=torch.Generator().manual_seed(5))
    b = fixedpoint.encode(x, clip=2.0, value_bits=8, modulus_bits=16, generator=torch.Generator().manual_seed(5))
    assert (a == b).all()


def test_encode_and_decode_refuse_bad_inputs():
    with pytest.raises(ValueError, match="NaN"):
        fixedpoint.encode(torch.tensor([0.0, float("nan")]), clip=1.0, value_bits=8, modulus_bits=16)
    with pytest.raises(ValueError, match="float tensor"):
        fixedpoint.encode(torch.tensor([1, 2]), clip=1.0, value_bits=8, modulus_bits=16)
    with pytest.raises(ValueError, match="clip"):
        fixedpoint.encode(torch.zeros(2), clip=0.0, value_bits=8, modulus_bits=16)
    with pytest.raises(ValueError, match="modulus_bits"):
        fixedpoint.encode(torch.zeros(2), clip=1.0, value_bits=8, modulus_bits=7)
    with pytest.raises(ValueError, match="modulus_bits"):
        fixedpoint.encode(torch.zeros(2), clip=1.0, value_bits=8, modulus_bits=64)
    with pytest.raises(ValueError, match="above the largest possible sum 6"):
        fixedpoint.decode_sum(np.array([7], dtype=np.uint64), count=2, clip=1.0, value_bits=2, modulus_bits=8)
    with pytest.raises(ValueError, match="integer array"):
        fixedpoint.decode_sum(np.array([1.0]), count=2, clip=1.0, value_bits=2, modulus_bits=8)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20), q=st.integers(1, 16), clip=st.floats(0.01, 100.0), seed=st.integers(0, 2**32 - 1))
def test_sum_error_below_n_steps(n, q, clip, seed):
    generator = torch.Generator().manual_seed(seed)
    m = fixedpoint.modulus_bits_for(n, q)
    inputs = [(torch.rand(50, generator=generator, dtype=torch.float64) * 2 - 1) * clip for _ in range(n)]
    total = np.zeros(50, dtype=np.uint64)
    for x in inputs:
        total = fixedpoint.add_mod(total, fixedpoint.encode(x, clip=clip, value_bits=q, modulus_bits=m, generator=generator), m)
    got = fixedpoint.decode_sum(total, count=n, clip=clip, value_bits=q, modulus_bits=m)
    # below n steps, with room for float64 rounding of the decode itself
    assert ((got - sum(inputs)).abs() <= n * fixedpoint.step(clip, q) * (1 + 1e-9)).all()


# ---------------------------------------------------------------- keys and share bundles


def test_agreement_is_symmetric_and_pairwise_distinct():
    a, b, c = keys.KeyPair.generate(), keys.KeyPair.generate(), keys.KeyPair.generate()
    ab = a.agree(b.public_bytes())
    assert len(ab) == 32 and ab == b.agree(a.public_bytes())
    assert ab != a.agree(c.public_bytes())
    assert len(a.public_bytes()) == len(a.private_bytes()) == 32
    assert a.private_bytes().hex() not in repr(a) and a.public_bytes().hex() in repr(a)


def test_rfc7748_agreement_vector():
    # RFC 7748 section 6.1: Alice's and Bob's private keys and their shared secret
    alice = keys.KeyPair.from_private_bytes(bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"))
    bob = keys.KeyPair.from_private_bytes(bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"))
    assert alice.public_bytes().hex() == "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
    shared = "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"
    assert alice.agree(bob.public_bytes()).hex() == bob.agree(alice.public_bytes()).hex() == shared


def test_low_order_and_malformed_public_keys_are_refused():
    pair = keys.KeyPair.generate()
    with pytest.raises(ValueError, match="low-order"):
        pair.agree(bytes(32))
    with pytest.raises(ValueError, match="32 bytes, got 31"):
        pair.agree(bytes(31))
    with pytest.raises(ValueError, match="private key must be 32 bytes"):
        keys.KeyPair.from_private_bytes(bytes(33))


def test_derivation_labels_rounds_and_contexts_separate_keys():
    shared = bytes(range(32))
    seed = keys.pairwise_mask_seed(shared, 3, b"run-a")
    key = keys.share_encryption_key(shared, 3, b"run-a")
    assert len(seed) == len(key) == 32 and seed != key
    assert seed != keys.pairwise_mask_seed(shared, 4, b"run-a")
    assert seed != keys.pairwise_mask_seed(shared, 3, b"run-b")
    assert seed == keys.pairwise_mask_seed(shared, 3, b"run-a")
    # the info layout, spelled out: len(label) || label || round || context
    info = struct.pack(">H", len(keys.MASK_SEED_LABEL)) + keys.MASK_SEED_LABEL + (3).to_bytes(8, "big") + b"run-a"
    assert seed == HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)
    with pytest.raises(ValueError, match="round_no"):
        keys.pairwise_mask_seed(shared, -1)


def test_bundle_round_trip_and_wire_form():
    key = bytes(range(32))
    nonce = bytes(range(12))
    sealed = keys.seal_bundle(key, b"share bytes", round_no=2, sender=5, recipient=9, context=b"run", nonce=nonce)
    assert len(sealed) == 12 + len(b"share bytes") + 16
    ad = b"edgefl secagg v1 share bundle" + (2).to_bytes(8, "big") + (5).to_bytes(8, "big") + (9).to_bytes(8, "big") + b"run"
    assert sealed == nonce + ChaCha20Poly1305(key).encrypt(nonce, b"share bytes", ad)
    assert keys.open_bundle(key, sealed, round_no=2, sender=5, recipient=9, context=b"run") == b"share bytes"
    # a fresh random nonce by default: two seals of one bundle differ
    assert keys.seal_bundle(key, b"x", round_no=2, sender=5, recipient=9) != keys.seal_bundle(key, b"x", round_no=2, sender=5, recipient=9)


@pytest.mark.parametrize("change", ["round", "sender", "recipient", "swapped", "context", "key", "flip", "truncate"])
def test_tampered_or_replayed_bundles_are_refused(change):
    key = keys.share_encryption_key(bytes(range(32)), 2)
    sealed = keys.seal_bundle(key, b"shares" * 20, round_no=2, sender=5, recipient=9, context=b"run")
    binding = {"round_no": 2, "sender": 5, "recipient": 9, "context": b"run"}
    if change == "round":
        binding["round_no"] = 3
    elif change == "sender":
        binding["sender"] = 6
    elif change == "recipient":
        binding["recipient"] = 8
    elif change == "swapped":
        binding.update(sender=9, recipient=5)
    elif change == "context":
        binding["context"] = b"other run"
    elif change == "key":
        key = keys.share_encryption_key(bytes(range(32)), 3)
    elif change == "flip":
        sealed = sealed[:20] + bytes([sealed[20] ^ 1]) + sealed[21:]
    else:
        sealed = sealed[:-1]
    with pytest.raises(ValueError, match="does not authenticate"):
        keys.open_bundle(key, sealed, **binding)  # type: ignore[arg-type]


def test_bundle_refuses_malformed_arguments():
    key = bytes(32)
    with pytest.raises(ValueError, match="sender and recipient are both 4"):
        keys.seal_bundle(key, b"x", round_no=1, sender=4, recipient=4)
    with pytest.raises(ValueError, match="at least 28 bytes"):
        keys.open_bundle(key, bytes(27), round_no=1, sender=1, recipient=2)
    with pytest.raises(ValueError, match="share-encryption key must be 32 bytes"):
        keys.seal_bundle(bytes(16), b"x", round_no=1, sender=1, recipient=2)
    with pytest.raises(ValueError, match="sender"):
        keys.seal_bundle(key, b"x", round_no=1, sender=-1, recipient=2)


# ---------------------------------------------------------------- the neighbour graph

IDS = [f"device-{i:03d}" for i in range(30)]


def test_graph_is_symmetric_and_k_regular():
    g = graph.neighbours(IDS, 6, seed=7, round_no=1)
    assert sorted(g) == IDS
    for node, peers in g.items():
        assert len(peers) == len(set(peers)) == 6 and node not in peers and peers == sorted(peers)
        assert all(node in g[peer] for peer in peers)


def test_graph_is_the_harary_graph_of_the_cyclic_order():
    order = graph.cyclic_order(IDS, seed=7, round_no=1)
    assert sorted(order) == IDS
    g = graph.neighbours(IDS, 4, seed=7, round_no=1)
    for i, node in enumerate(order):
        assert set(g[node]) == {order[(i + d) % 30] for d in (-2, -1, 1, 2)}


def test_graph_is_determined_by_seed_and_round_only():
    g = graph.neighbours(IDS, 6, seed=7, round_no=1)
    assert graph.neighbours(list(reversed(IDS)), 6, seed=7, round_no=1) == g  # the input order does not matter
    assert graph.neighbours(IDS, 6, seed=8, round_no=1) != g
    assert graph.neighbours(IDS, 6, seed=7, round_no=2) != g
    assert graph.neighbours(IDS, 6, seed=b"beacon", round_no=1) != g
    # the order by hand: SHA-256(label || len(seed) || seed || round || id)
    prefix = b"edgefl secagg v1 graph order" + (8).to_bytes(4, "big") + (7).to_bytes(8, "big") + (1).to_bytes(8, "big")
    assert graph.cyclic_order(IDS, seed=7, round_no=1) == sorted(IDS, key=lambda d: hashlib.sha256(prefix + d.encode()).digest())


def test_complete_graph_when_k_reaches_n_minus_1():
    for k in (29, 30, 100):
        g = graph.neighbours(IDS, k, seed=0, round_no=0)
        assert all(g[node] == [d for d in IDS if d != node] for node in IDS)
    assert graph.neighbours(["solo"], 0, seed=0, round_no=0) == {"solo": []}
    assert graph.neighbours(["a", "b"], 1, seed=0, round_no=0) == {"a": ["b"], "b": ["a"]}


def test_graph_refusals():
    with pytest.raises(ValueError, match="k must be even"):
        graph.neighbours(IDS, 5, seed=0, round_no=0)
    with pytest.raises(ValueError, match="k must be even"):
        graph.neighbours(IDS, 0, seed=0, round_no=0)
    with pytest.raises(ValueError, match="distinct.*device-001"):
        graph.neighbours(IDS + ["device-001"], 4, seed=0, round_no=0)
    with pytest.raises(ValueError, match="seed"):
        graph.neighbours(IDS, 4, seed=-1, round_no=0)
    with pytest.raises(ValueError, match="non-empty str"):
        graph.neighbours(["a", ""], 4, seed=0, round_no=0)


def test_default_neighbours_and_threshold():
    # ceil(log2 n) up to even, at least 2, at most n - 1
    assert [graph.default_neighbours(n) for n in (1, 2, 3, 4, 5, 9, 17, 100, 1000, 1024, 1025)] == [0, 1, 2, 2, 4, 4, 6, 8, 10, 10, 12]
    # floor(2k/3) + 1: more than half always, so 2t > k + c for up to about k/3 colluders
    assert [graph.default_threshold(k) for k in (1, 2, 3, 4, 6, 10, 99)] == [1, 2, 3, 3, 5, 7, 67]
    for k in range(1, 200):
        t = graph.default_threshold(k)
        assert 2 * t > k and t <= k


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(0, 70), seed=st.integers(0, 2**64 - 1), round_no=st.integers(0, 1000))
def test_graph_properties(n, k, seed, round_no):
    ids = [f"d{i}" for i in range(n)]
    if k < n - 1 and (k < 2 or k % 2):
        with pytest.raises(ValueError):
            graph.neighbours(ids, k, seed=seed, round_no=round_no)
        return
    g = graph.neighbours(ids, k, seed=seed, round_no=round_no)
    degree = min(k, n - 1)
    for node, peers in g.items():
        assert len(set(peers)) == degree and node not in peers and all(node in g[p] for p in peers)
