"""Server messages a device can trust: Ed25519 signatures on every envelope the server sends
(docs/PROTOCOL.md section 3.1, docs/deploy.md).

A signed envelope names its recipient in the header (``to``: a device id, or ``*`` for the round
announcements every device reads) and says ``sig = "ed25519"``; the 64-byte signature follows the
body and covers every byte before it (prefix, header and body, exactly as sent). A device that
knows the server's public key (``edgefl broker-config`` writes the pair; the device gets
``server-signing.pub``, 64 hex digits) refuses unsigned, wrongly signed and misaddressed server
messages; a chunked download is trusted when each of its chunks is. The primitive is the
maintained one from ``cryptography``; nothing here is hand-rolled but the framing.

Keys: the private key is a PKCS#8 PEM file (mode 0600), the public key 32 raw bytes written as
64 hex digits on one line, which any language's Ed25519 library takes as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgefl.errors import ConfigError, PayloadError
from edgefl.safejson import loads

SIGNATURE_BYTES = 64
SCHEME = "ed25519"
EVERYONE = "*"
PRIVATE_FILE = "server-signing.key"
PUBLIC_FILE = "server-signing.pub"


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
    except ImportError:  # pragma: no cover - a dependency of the core package
        raise ConfigError("signing needs the cryptography package", hint="pip install cryptography") from None
    return InvalidSignature, serialization, Ed25519PrivateKey, Ed25519PublicKey


def write_keypair(folder: Path) -> tuple[Path, Path]:
    """A new server signing key pair in ``folder``: (private PEM, public hex). The private file
    is created 0600 and never overwritten."""
    _, serialization, private_cls, _ = _crypto()
    key = private_cls.generate()
    private_path, public_path = folder / PRIVATE_FILE, folder / PUBLIC_FILE
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    public_path.write_text(raw.hex() + "\n")
    return private_path, public_path


class Signer:
    """The server's private key: signs packed envelopes for one recipient."""

    def __init__(self, key) -> None:
        self._key = key

    @classmethod
    def load(cls, path: str | Path) -> Signer:
        _, serialization, private_cls, _ = _crypto()
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot read the signing key {path}: {exc}",
                              hint=f"the {PRIVATE_FILE} that edgefl broker-config wrote (a PKCS#8 PEM Ed25519 key)") from None
        if not isinstance(key, private_cls):
            raise ConfigError(f"{path} is not an Ed25519 private key")
        return cls(key)

    @classmethod
    def from_seed(cls, seed: bytes) -> Signer:
        """A key from its 32-byte seed (the test vectors of docs/PROTOCOL.md)."""
        _, _, private_cls, _ = _crypto()
        return cls(private_cls.from_private_bytes(seed))

    def public_hex(self) -> str:
        _, serialization, _, _ = _crypto()
        return self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()

    def sign(self, packed: bytes, to: str) -> bytes:
        """``packed`` (an envelope as :func:`~edgefl.transport.envelope.pack` wrote it) addressed to
        ``to`` and signed: the header gains ``to`` and ``sig``, the signature follows the body."""
        from edgefl.transport.envelope import MAX_HEADER_BYTES, PREFIX

        magic, version, header_len = PREFIX.unpack_from(packed)
        header = json.loads(packed[PREFIX.size:PREFIX.size + header_len])
        header.update(to=to, sig=SCHEME)
        text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        if len(text) > MAX_HEADER_BYTES:
            raise PayloadError(f"signed header of {len(text)} bytes exceeds {MAX_HEADER_BYTES}")
        signed = PREFIX.pack(magic, version, len(text)) + text + packed[PREFIX.size + header_len:]
        return signed + self._key.sign(signed)


class Verifier:
    """A device's copy of the server's public key."""

    def __init__(self, key) -> None:
        self._key = key

    @classmethod
    def from_hex(cls, text: str) -> Verifier:
        _, _, _, public_cls = _crypto()
        try:
            raw = bytes.fromhex(text.strip())
            if len(raw) != 32:
                raise ValueError(f"{len(raw)} bytes, an Ed25519 public key has 32")
            return cls(public_cls.from_public_bytes(raw))
        except ValueError as exc:
            raise ConfigError(f"not a server public key: {exc}", hint=f"the {PUBLIC_FILE} edgefl broker-config wrote: 64 hex digits") from None

    @classmethod
    def load(cls, path: str | Path) -> Verifier:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the server's public key {path}: {exc.strerror or exc}",
                              hint=f"copy {PUBLIC_FILE} from the folder edgefl broker-config wrote") from None
        return cls.from_hex(text)

    def verify(self, data: bytes, recipient: str) -> dict:
        """Check a whole received envelope (see :meth:`check`) and return its header."""
        header = signed_header(data)
        if header is None:
            raise PayloadError("a server message whose header does not parse")
        self.check(data, header, recipient)
        return header

    def check(self, data: bytes, header: dict, recipient: str) -> None:
        """Raise :class:`PayloadError` unless ``data`` (a whole received envelope whose parsed
        header is ``header``) is signed by the server and addressed to ``recipient`` or everyone."""
        invalid, _, _, _ = _crypto()
        if header.get("sig") != SCHEME:
            raise PayloadError("unsigned server message refused (this device knows the server's key)")
        if header.get("to") not in (recipient, EVERYONE):
            raise PayloadError(f"a server message addressed to {str(header.get('to'))[:64]!r}, not to {recipient!r}: refused")
        if len(data) < SIGNATURE_BYTES:
            raise PayloadError("signed message shorter than its signature")
        try:
            self._key.verify(bytes(data[-SIGNATURE_BYTES:]), bytes(data[:-SIGNATURE_BYTES]))
        except invalid:
            raise PayloadError("the server's signature does not verify: refused (forged or altered)") from None


def signed_header(data: bytes) -> dict | None:
    """The header of a packed envelope, when it parses (for the verifier's checks)."""
    from edgefl.transport.envelope import MAX_HEADER_BYTES, PREFIX

    if len(data) < PREFIX.size:
        return None
    _, _, header_len = PREFIX.unpack_from(data)
    if header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > len(data):
        return None
    try:
        header = loads(bytes(data[PREFIX.size:PREFIX.size + header_len]), "header")
    except PayloadError:
        return None
    return header if isinstance(header, dict) else None


def signing_transport(inner, signer: Signer | None):
    """``inner`` (a server transport) with every envelope it sends signed for its recipient, or
    ``inner`` itself when there is no key."""
    if signer is None:
        return inner
    from edgefl.transport.base import ServerTransport

    class SignedServerTransport(ServerTransport):
        """Signs what the round loop sends; everything else is ``inner``'s."""

        def send(self, device: str, data: bytes) -> None:
            inner.send(device, signer.sign(data, device))

        def announce(self, data: bytes) -> None:
            inner.announce(signer.sign(data, EVERYONE))

        def receive(self, timeout_s: float):
            return inner.receive(timeout_s)

        def now(self) -> float:
            return inner.now()

        def close(self) -> None:
            inner.close()

        @property
        def connects(self) -> int:
            return inner.connects

    return SignedServerTransport()
