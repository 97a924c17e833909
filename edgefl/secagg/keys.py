"""Key agreement, key derivation and the authenticated encryption of share bundles.

- X25519 (RFC 7748) key pairs: each device publishes 32-byte public keys, any two devices agree on
  a 32-byte shared secret without talking to each other, and the server, which only relays public
  keys, learns nothing of it.
- HKDF-SHA256 (RFC 5869) turns a raw shared secret into keys, one per purpose: the ``info`` input
  starts with a distinct label per purpose and carries the round, so the pairwise mask seed and
  the share-encryption key of one pair are independent, and no round ever reuses another's mask
  even if a protocol kept its key pairs across rounds.
- ChaCha20-Poly1305 (RFC 8439) encrypts a share bundle from one device to another through the
  server. The associated data binds the round and the sender's and recipient's indices: the server
  cannot replay a bundle to another device, in another round, or back to its sender. Any change
  to the ciphertext, the nonce or the binding is refused (ValueError). ChaCha20 for the same reason
  as the mask PRG: devices without AES instructions.

Use two key pairs per device, as Bonawitz et al. do: one whose agreements only derive share-encryption
keys, and one whose agreements derive mask seeds. Only the mask key pair's private key is ever
Shamir-shared (so the server can remove a dropped device's pairwise masks); if one pair served
both purposes, reconstructing a dropped device's key would also let the server decrypt every share
bundle it relayed to and from that device.

Wire forms: private and public keys are their raw 32 bytes; a sealed bundle is nonce (12 bytes) ||
ciphertext || tag (16 bytes).
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
#: HKDF labels; a new label (or a new version suffix) for any new purpose, never a reused one
MASK_SEED_LABEL = b"edgefl secagg v1 pairwise mask seed"
SHARE_KEY_LABEL = b"edgefl secagg v1 share encryption key"
#: the associated data's prefix: a bundle sealed by anything else never opens here
_AD_PREFIX = b"edgefl secagg v1 share bundle"
_U64 = (1 << 64) - 1


class KeyPair:
    """An X25519 key pair. ``repr`` shows the public key only."""

    __slots__ = ("_private",)

    def __init__(self, private: X25519PrivateKey) -> None:
        self._private = private

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(X25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> KeyPair:
        """The pair of a raw 32-byte private key (e.g. one reconstructed from Shamir shares): every
        32-byte string is a valid X25519 private key (RFC 7748 clamps it when it is used)."""
        _check_length("a private key", raw, KEY_BYTES)
        return cls(X25519PrivateKey.from_private_bytes(bytes(raw)))

    def private_bytes(self) -> bytes:
        """The raw 32-byte private key: what a device Shamir-shares for its mask key pair."""
        return self._private.private_bytes_raw()

    def public_bytes(self) -> bytes:
        return self._private.public_key().public_bytes_raw()

    def agree(self, peer_public: bytes) -> bytes:
        """The 32-byte X25519 shared secret with the holder of ``peer_public``; both ends get the
        same bytes. Raw: derive keys from it (:func:`pairwise_mask_seed`, :func:`share_encryption_key`),
        never use it directly. ValueError for a malformed key or a low-order point, whose
        agreement would be all zeros whatever this side's key is."""
        _check_length("a public key", peer_public, KEY_BYTES)
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
        except ValueError:
            raise ValueError("the peer's public key is a low-order point: the agreement would be all zeros") from None

    def __repr__(self) -> str:
        return f"KeyPair(public={self.public_bytes().hex()})"


def derive(shared_secret: bytes, label: bytes, round_no: int, context: bytes = b"") -> bytes:
    """A 32-byte key from an X25519 shared secret: HKDF-SHA256 with no salt and info =
    len(label) (2 bytes, big-endian) || label || round (8 bytes, big-endian) || context.

    ``context`` should name the run (the same bytes on every device), so two runs never derive the
    same keys from reused key pairs. The length prefix keeps (label, context) pairs unambiguous."""
    _check_length("a shared secret", shared_secret, KEY_BYTES)
    if not label or len(label) > 0xFFFF:
        raise ValueError("a derivation label must be 1 to 65535 bytes")
    info = struct.pack(">H", len(label)) + label + struct.pack(">Q", _u64("round_no", round_no)) + bytes(context)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(bytes(shared_secret))


def pairwise_mask_seed(shared_secret: bytes, round_no: int, context: bytes = b"") -> bytes:
    """The seed of the mask two devices add with opposite signs (edgefl.secagg.prg.mask)."""
    return derive(shared_secret, MASK_SEED_LABEL, round_no, context)


def share_encryption_key(shared_secret: bytes, round_no: int, context: bytes = b"") -> bytes:
    """The ChaCha20-Poly1305 key of the share bundles two devices exchange through the server."""
    return derive(shared_secret, SHARE_KEY_LABEL, round_no, context)


def seal_bundle(key: bytes, bundle: bytes, *, round_no: int, sender: int, recipient: int,
                context: bytes = b"", nonce: bytes | None = None) -> bytes:
    """nonce || ChaCha20-Poly1305(bundle) bound to (round, sender, recipient, context). The nonce is
    random by default (12 bytes from the OS): a share key seals a handful of bundles, far below the
    birthday bound of 96-bit nonces. Pass ``nonce`` only in tests."""
    _check_length("a share-encryption key", key, KEY_BYTES)
    if nonce is None:
        nonce = os.urandom(NONCE_BYTES)
    _check_length("a nonce", nonce, NONCE_BYTES)
    ad = associated_data(round_no=round_no, sender=sender, recipient=recipient, context=context)
    return bytes(nonce) + ChaCha20Poly1305(bytes(key)).encrypt(bytes(nonce), bytes(bundle), ad)


def open_bundle(key: bytes, sealed: bytes, *, round_no: int, sender: int, recipient: int, context: bytes = b"") -> bytes:
    """The bundle :func:`seal_bundle` sealed, or ValueError when the key, the bytes or any part of
    the binding differ."""
    _check_length("a share-encryption key", key, KEY_BYTES)
    if not isinstance(sealed, (bytes, bytearray)) or len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise ValueError(f"a sealed bundle is at least {NONCE_BYTES + TAG_BYTES} bytes (nonce and tag)")
    ad = associated_data(round_no=round_no, sender=sender, recipient=recipient, context=context)
    nonce, body = bytes(sealed[:NONCE_BYTES]), bytes(sealed[NONCE_BYTES:])
    try:
        return ChaCha20Poly1305(bytes(key)).decrypt(nonce, body, ad)
    except InvalidTag:
        raise ValueError(f"the share bundle from {sender} to {recipient} in round {round_no} does not authenticate: "
                         "tampered with, or sealed for another round, pair or key") from None


def associated_data(*, round_no: int, sender: int, recipient: int, context: bytes = b"") -> bytes:
    """prefix || round || sender || recipient (8 bytes each, big-endian) || context: fixed widths
    before the one variable field, so no two bindings share their bytes."""
    if sender == recipient:
        raise ValueError(f"a share bundle goes to another device: sender and recipient are both {sender}")
    return _AD_PREFIX + struct.pack(">QQQ", _u64("round_no", round_no), _u64("sender", sender),
                                    _u64("recipient", recipient)) + bytes(context)


def _u64(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _U64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


def _check_length(what: str, value: object, length: int) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != length:
        got = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise ValueError(f"{what} must be {length} bytes, got {got}")
