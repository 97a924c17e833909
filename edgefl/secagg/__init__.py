"""Building blocks of secure aggregation (SecAgg+, Bell et al., CCS 2020; the complete-graph case is
Bonawitz et al., CCS 2017): the server learns the sum of the devices' updates and nothing else.

Only the primitives live here, each in its own module; the protocol that strings them together is
built on top of them:

- :mod:`edgefl.secagg.shamir`: t-of-n Shamir secret sharing of 32-byte secrets over GF(2**521 - 1)
- :mod:`edgefl.secagg.prg`: the mask generator, ChaCha20 keystream read as 64-bit words mod 2**b
- :mod:`edgefl.secagg.fixedpoint`: float tensors to integer codes whose sum cannot wrap, and back
- :mod:`edgefl.secagg.keys`: X25519 agreement, HKDF-SHA256 key derivation, ChaCha20-Poly1305 share bundles
- :mod:`edgefl.secagg.graph`: the SecAgg+ neighbour graph and the default degree and threshold

Nothing here pickles or evaluates anything it receives: every wire form is fixed-length bytes.
docs/secure-aggregation.md describes the choices for a user.
"""
