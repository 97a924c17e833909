"""``edgefl broker-config``: a mosquitto configuration for a real deployment.

Writes into one folder:

* ``mosquitto.conf``: a TLS listener (or a plain one with ``--no-tls``, for a closed test
  network), no anonymous access, the username as client id (so no device can take another's
  session), persistence, the packet and queue limits the protocol assumes;
* ``passwords``: one credential per device and one for the server, hashed with mosquitto's own
  ``mosquitto_passwd`` when installed (else the same PBKDF2-SHA512 ``$7$`` format, computed here);
* ``credentials.csv`` (mode 0600): the plain passwords, to hand to each device once;
* ``acl``: the server reads and writes the federation's topics; a device may write only its own
  ``up`` and ``presence`` topics and read only its own ``down`` topic and the round announcements;
* ``certs/``: a CA and a server certificate made with the ``openssl`` binary (when found), with
  the ``openssl`` commands in ``certs/README`` otherwise.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import shutil
import subprocess
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


def acl_text(federation: str) -> str:
    base = f"{ROOT}/{federation}"
    # mosquitto applies `topic` lines to the user named above them: the ones for everybody first
    return "\n".join([
        "# every client may read the round announcements",
        f"topic read {base}/round",
        "# every device (%u = its username = its device id) only its own topics",
        f"pattern write {base}/dev/%u/up",
        f"pattern read {base}/dev/%u/down",
        f"pattern write {base}/presence/%u",
        "",
        "# the server may use every topic of the federation",
        f"user {SERVER_USER}",
        f"topic readwrite {base}/#",
        "",
    ])


def config_text(directory: Path, port: int, tls: bool, max_packet_bytes: int) -> str:
    lines = [
        "# mosquitto configuration written by `edgefl broker-config` (docs/deploy.md)",
        "# the listener comes first: a listener option above it would open a default one on 1883",
        f"listener {port}",
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
        "# queued QoS 1 messages per client: a fleet's downloads and acks must not be dropped",
        "max_queued_messages 10000",
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


def write_passwords(path: Path, credentials: dict[str, str]) -> str:
    tool = shutil.which("mosquitto_passwd")
    if tool:
        path.write_text("".join(f"{u}:{p}\n" for u, p in credentials.items()))
        os.chmod(path, 0o600)
        subprocess.run([tool, "-U", str(path)], check=True, capture_output=True)
        return "mosquitto_passwd"
    path.write_text("".join(pbkdf2_entry(u, p) + "\n" for u, p in credentials.items()))
    os.chmod(path, 0o600)
    return "edgefl (PBKDF2-SHA512, mosquitto's $7$ format)"


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
    (certs / "san.cnf").write_text(f"subjectAltName=DNS:{hostname},DNS:localhost,IP:127.0.0.1\n")
    (certs / "README").write_text("Certificates for the broker's TLS listener. Made with:\n\n"
                                  + "\n".join(" ".join(c) for c in commands) + "\n\nDevices need ca.crt only (--ca-file).\n")
    if shutil.which("openssl") is None:
        return False
    for cmd in commands:
        subprocess.run(cmd, cwd=certs, check=True, capture_output=True)
    os.chmod(certs / "ca.key", 0o600)
    os.chmod(certs / "server.key", 0o600)
    return True


def write_broker_config(directory: Path, devices: int, federation: str, port: int = 8883, tls: bool = True,
                        hostname: str = "localhost", max_packet_bytes: int = (1 << 20) + (1 << 16)) -> BrokerConfig:
    if devices < 1:
        raise EdgeflError("--devices must be at least 1")
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
    cred_file.write_text("username,password\n" + "".join(f"{u},{p}\n" for u, p in credentials.items()))
    os.chmod(cred_file, 0o600)
    (directory / "acl").write_text(acl_text(federation))
    certs = None
    if tls:
        certs = directory / "certs"
        make_certs(certs, hostname)
    (directory / "mosquitto.conf").write_text(config_text(directory, port, tls, max_packet_bytes))
    return BrokerConfig(directory, directory / "mosquitto.conf", directory / "passwords", directory / "acl", cred_file, certs, ids)
