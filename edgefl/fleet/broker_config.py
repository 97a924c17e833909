"""``edgefl broker-config``: a mosquitto configuration for a real deployment.

Writes into one folder:

* ``mosquitto.conf``: a TLS listener (or a plain one with ``--no-tls``, for a closed test
  network) on every interface or on the one address ``--bind`` names, no anonymous access, the username as client id (so no device can take another's
  session), persistence, the packet and queue limits the protocol assumes;
* ``passwords``: one credential per device and one for the server, hashed with mosquitto's own
  ``mosquitto_passwd`` when installed (else the same PBKDF2-SHA512 ``$7$`` format, computed here);
* ``credentials.csv``: the plain passwords, to hand to each device once;
* ``acl``: the server reads and writes the federation's topics; a device may write only its own
  ``up`` and ``presence`` topics and read only its own ``down`` topic and the round announcements;
* ``certs/``: a CA and a server certificate made with the ``openssl`` binary (when found), with
  the ``openssl`` commands in ``certs/README`` otherwise.

Secrets (``passwords``, ``credentials.csv``, ``acl``, ``certs/ca.key``, ``certs/server.key``) are
mode 0600 from the moment they exist: each is written into a new 0600 file (or made by
``mosquitto_passwd``/``openssl`` inside a private 0700 folder) and renamed over its final name, so
no other local user can read a password or key in between, even where a file of that name existed.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from edgefl.errors import EdgeflError
from edgefl.fleet.broker import MQTT_MAX_PACKET
from edgefl.transport.topics import ROOT, check_name, device_ids

SERVER_USER = "edgefl-server"


@dataclass
class BrokerConfig:
    directory: Path
    config: Path
    passwords: Path
    acl: Path
    credentials: Path
    certs: Path | None
    devices: list[str]
    bind: str | None = None  # the listener's address; None: every interface
    signing_key: Path | None = None  # the server's Ed25519 key (server-signing.key); devices get server-signing.pub


def acl_text(federation: str) -> str:
    base = f"{ROOT}/{federation}"
    # mosquitto gives `topic` lines above the first `user` line to anonymous clients only (this broker
    # has none); `pattern` lines apply to every user, so whatever the devices need is a pattern
    return "\n".join([
        "# every client may read the round announcements (a pattern, so it applies to every user;",
        "# mosquitto warns that it holds no %u or %c: expected)",
        f"pattern read {base}/round",
        "# every device (%u = its username = its device id) only its own topics",
        f"pattern write {base}/dev/%u/up",
        f"pattern read {base}/dev/%u/down",
        "# its own presence read too: a device sees another process that took its id (docs/PROTOCOL.md)",
        f"pattern readwrite {base}/presence/%u",
        "",
        "# the server may use every topic of the federation",
        f"user {SERVER_USER}",
        f"topic readwrite {base}/#",
        "",
    ])


def check_bind(address: str | None) -> str | None:
    """``--bind``: an IP address or a host name (one word: it goes into a config line); None or
    "" for every interface."""
    if not address:
        return None
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    if re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", address):
        return address
    raise EdgeflError(f"--bind {address!r} is not an IP address or a host name",
                      hint="an address of this machine, e.g. 192.168.1.10, 127.0.0.1 (this machine only), or leave it out for every interface")


def config_text(directory: Path, port: int, tls: bool, max_packet_bytes: int, devices: int = 0, bind: str | None = None) -> str:
    lines = [
        "# mosquitto configuration written by `edgefl broker-config` (docs/deploy.md)",
        "# the listener comes first: a listener option above it would open a default one on 1883",
        *(["# on every interface (IPv4 and IPv6): `edgefl broker-config --bind ADDRESS` names one"] if bind is None
          else [f"# on {bind} only (--bind)"]),
        f"listener {port}" + (f" {bind}" if bind is not None else ""),
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {directory / 'passwords'}",
        f"acl_file {directory / 'acl'}",
        "# a device's client id is its username: no device can take over another's session",
        "use_username_as_clientid true",
        "persistence true",
        f"persistence_location {directory / 'data'}/",
        "autosave_interval 30",
        f"max_packet_size {min(max_packet_bytes, MQTT_MAX_PACKET)}",
        "# queued QoS 1 messages per client: a fleet's downloads and acks must not be dropped, and the server",
        "# takes every device's retained presence plus a round's uploads at once (two per device, at least 10000)",
        f"max_queued_messages {max(10000, 2 * devices + 1000)}",
        "persistent_client_expiration 7d",
    ]
    if tls:
        lines += [
            "# TLS for the listener above (devices get certs/ca.crt and connect to mqtts://HOST:PORT)",
            f"cafile {directory / 'certs' / 'ca.crt'}",
            f"certfile {directory / 'certs' / 'server.crt'}",
            f"keyfile {directory / 'certs' / 'server.key'}",
            "tls_version tlsv1.2",
        ]
    return "\n".join(lines) + "\n"


def pbkdf2_entry(username: str, password: str, iterations: int = 101) -> str:
    """mosquitto 2's ``$7$`` password format (PBKDF2-SHA512, 12-byte salt), for hosts without
    ``mosquitto_passwd``; mosquitto reads it the same way."""
    salt = secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"{username}:$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only, from creation on.

    A new 0600 file is renamed over ``path``: an existing file is never truncated and refilled (it
    would keep its old mode, and a reader holding it open would see the new content)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # O_EXCL, mode 0600
    try:
        os.fchmod(fd, 0o600)  # mkstemp's mode, whatever a caller's umask would have made of it
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _private_workdir(parent: Path) -> Path:
    """A 0700 folder next to the final files (same filesystem, so a rename moves them): tools that
    write secrets with their own file modes (mosquitto_passwd, openssl) write them in here."""
    return Path(tempfile.mkdtemp(dir=parent, prefix=".edgefl-"))


def write_passwords(path: Path, credentials: dict[str, str]) -> str:
    tool = shutil.which("mosquitto_passwd")
    if tool:
        work = _private_workdir(path.parent)
        try:
            plain = work / "passwords"
            write_secret(plain, "".join(f"{u}:{p}\n" for u, p in credentials.items()))
            # -U hashes the plain passwords in place (and makes a .tmp backup next to the file)
            subprocess.run([tool, "-U", str(plain)], check=True, capture_output=True, umask=0o077)
            os.chmod(plain, 0o600)
            os.replace(plain, path)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return "mosquitto_passwd"
    write_secret(path, "".join(pbkdf2_entry(u, p) + "\n" for u, p in credentials.items()))
    return "edgefl (PBKDF2-SHA512, mosquitto's $7$ format)"


#: what openssl writes, and who may read it (the keys stay with their owner)
CERT_FILES = {"ca.key": 0o600, "server.key": 0o600, "ca.crt": 0o644, "server.crt": 0o644, "server.csr": 0o644, "ca.srl": 0o644}


def make_certs(certs: Path, hostname: str, days: int = 825) -> bool:
    """A CA and a server certificate for ``hostname`` with the openssl binary; False when absent."""
    certs.mkdir(parents=True, exist_ok=True)
    commands = [
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
         "-subj", "/CN=edgefl-ca"],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={hostname}"],
        ["openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.crt",
         "-days", str(days), "-extfile", "san.cnf"],
    ]
    san = f"subjectAltName=DNS:{hostname},DNS:localhost,IP:127.0.0.1\n"
    (certs / "san.cnf").write_text(san)
    (certs / "README").write_text("Certificates for the broker's TLS listener. Made with (umask 077):\n\n"
                                  + "\n".join(" ".join(c) for c in commands) + "\n\nDevices need ca.crt only (--ca-file).\n")
    if shutil.which("openssl") is None:
        return False
    work = _private_workdir(certs)
    try:
        (work / "san.cnf").write_text(san)
        for cmd in commands:
            # umask 077: whatever openssl creates is its owner's only, keys included
            subprocess.run(cmd, cwd=work, check=True, capture_output=True, umask=0o077)
        for name, mode in CERT_FILES.items():
            if (work / name).exists():
                os.chmod(work / name, mode)  # the certificates are public: the broker and devices read them
                os.replace(work / name, certs / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return True


def write_broker_config(directory: Path, devices: int, federation: str, port: int = 8883, tls: bool = True,
                        hostname: str = "localhost", max_packet_bytes: int = (1 << 20) + (1 << 16),
                        bind: str | None = None) -> BrokerConfig:
    """``bind``: the address the listener binds (None: every interface, what devices on a network need)."""
    if devices < 1:
        raise EdgeflError("--devices must be at least 1")
    bind = check_bind(bind)
    try:
        check_name(federation, "federation")
    except ValueError as exc:
        raise EdgeflError(str(exc), hint="use the run's network.federation (a topic level, no '/', '+' or '#')") from None
    directory = directory.resolve()
    if (directory / "passwords").exists():
        raise EdgeflError(f"{directory} already holds a broker configuration",
                          hint="pick another --out folder; existing credentials are never overwritten")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "data").mkdir(exist_ok=True)
    ids = device_ids(devices)
    credentials = {SERVER_USER: secrets.token_urlsafe(18), **{d: secrets.token_urlsafe(18) for d in ids}}
    write_passwords(directory / "passwords", credentials)
    cred_file = directory / "credentials.csv"
    write_secret(cred_file, "username,password\n" + "".join(f"{u},{p}\n" for u, p in credentials.items()))
    # not secret, but mosquitto warns about (and later versions refuse) a world-readable ACL file
    write_secret(directory / "acl", acl_text(federation))
    certs = None
    if tls:
        certs = directory / "certs"
        make_certs(certs, hostname)
    (directory / "mosquitto.conf").write_text(config_text(directory, port, tls, max_packet_bytes, devices, bind))
    from edgefl.transport.signing import write_keypair

    signing_key, _ = write_keypair(directory)  # the server signs what it sends; devices verify with the .pub
    return BrokerConfig(directory, directory / "mosquitto.conf", directory / "passwords", directory / "acl", cred_file, certs, ids, bind,
                        signing_key)
