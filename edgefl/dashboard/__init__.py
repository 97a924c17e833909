"""``edgefl dashboard`` and ``--dashboard``: a live, read-only web page over a run directory
(:mod:`edgefl.dashboard.app`). Needs ``pip install -e '.[dashboard]' in the edgefl checkout`` (Starlette, uvicorn)."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edgefl.errors import EdgeflError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Dashboard:
    url: str
    server: object
    thread: threading.Thread | None

    def stop(self) -> None:
        self.server.should_exit = True  # type: ignore[attr-defined]
        if self.thread is not None:
            self.thread.join(timeout=5)


def parse_address(text: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (loopback unless a host is named)."""
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise EdgeflError(f"--dashboard {text!r}: expected PORT or HOST:PORT, e.g. 8050 or 0.0.0.0:8050") from None
    if not 0 <= number <= 65535:
        raise EdgeflError(f"--dashboard {text!r}: port out of range")
    return (host or "127.0.0.1"), number


def start_dashboard(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8050, token: str | None = None,
                    background: bool = True) -> Dashboard:
    """Serve the dashboard of ``run_dir``; a host other than loopback gets an access token (one is
    drawn when none is given). ``background``: in a daemon thread (beside a run), else blocking."""
    try:
        import uvicorn

        from edgefl.dashboard.app import create_app
    except ImportError:
        raise EdgeflError("the dashboard needs starlette and uvicorn", hint="pip install -e '.[dashboard]' in the edgefl checkout") from None
    if host not in LOOPBACK and token is None:
        token = secrets.token_urlsafe(16)
    app = create_app(run_dir, token=token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    if not background:
        server.run()
        return Dashboard(url, server, None)
    thread = threading.Thread(target=server.run, name="edgefl-dashboard", daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < end:
        time.sleep(0.05)
    if not server.started:
        raise EdgeflError(f"the dashboard could not listen on {host}:{port}", hint="pick another port: --dashboard PORT")
    if port == 0:  # an OS-chosen port: read it back
        sock = server.servers[0].sockets[0]
        port = sock.getsockname()[1]
        url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    return Dashboard(url, server, thread)
