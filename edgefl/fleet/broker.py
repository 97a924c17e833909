"""A mosquitto broker for a fleet on one machine: loopback only, a free port, a temp config."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from edgefl.errors import EdgeflError


MQTT_MAX_PACKET = 268_435_455


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mosquitto_binary() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto"):
        if Path(candidate).exists():
            return candidate
    return None


@dataclass
class LocalBroker:
    process: subprocess.Popen
    port: int
    config_path: Path

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def start_mosquitto(workdir: Path, port: int | None = None, extra_config: str = "", max_packet_bytes: int | None = None,
                    persistence: bool = False, timeout_s: float = 10.0) -> LocalBroker:
    """Start mosquitto bound to 127.0.0.1 and wait until it accepts connections."""
    binary = mosquitto_binary()
    if binary is None:
        raise EdgeflError("no mosquitto binary found", hint="install it (apt-get install mosquitto / brew install mosquitto)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "mosquitto.conf"
    lines = [f"listener {port} 127.0.0.1", "allow_anonymous true", "max_queued_messages 100000",
             "user root" if _is_root() else ""]
    if persistence:
        lines += ["persistence true", f"persistence_location {workdir}/", "autosave_interval 1"]
    else:
        lines.append("persistence false")
    if max_packet_bytes:
        # MQTT's own ceiling is 256 MiB - 1; a larger value makes the broker advertise an invalid limit
        lines.append(f"max_packet_size {min(max_packet_bytes, MQTT_MAX_PACKET)}")
    conf.write_text("\n".join(line for line in lines if line) + "\n" + extra_config)
    log = open(workdir / "mosquitto.log", "ab")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    _wait_listening(proc, port, timeout_s, "mosquitto", workdir / "mosquitto.log")
    return LocalBroker(proc, port, conf)


def _wait_listening(proc: subprocess.Popen, port: int, timeout_s: float, what: str, log: Path) -> None:
    """Poll the port until the broker accepts connections; a broker that exits or never listens
    is an error naming its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise EdgeflError(f"{what} exited at start: see {log}") from None
            time.sleep(0.05)
    proc.kill()
    raise EdgeflError(f"{what} did not accept connections on port {port} within {timeout_s:g} s (log: {log})")


def start_embedded(workdir: Path, port: int | None = None, timeout_s: float = 20.0) -> LocalBroker:
    """Start the pure-Python fallback broker (amqtt, MQTT 3.1.1) on 127.0.0.1 in its own process."""
    import importlib.util
    import sys

    if importlib.util.find_spec("amqtt") is None:
        raise EdgeflError("no mosquitto binary and no embedded broker (amqtt) installed",
                          hint="apt-get install mosquitto (preferred), or pip install -e '.[broker]' in the edgefl checkout")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "embedded-broker.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "edgefl.fleet.embedded_broker", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    _wait_listening(proc, port, timeout_s, "the embedded broker", workdir / "embedded-broker.log")
    return LocalBroker(proc, port, workdir / "embedded-broker.log")


def _is_root() -> bool:
    import os

    return hasattr(os, "geteuid") and os.geteuid() == 0
