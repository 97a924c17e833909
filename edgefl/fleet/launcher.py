"""Entry points of a fleet run: the server, one device, and a whole fleet on one machine.

* :func:`serve` -- ``edgefl server``: the round policy over the endpoint (:mod:`edgefl.server.endpoint`) over
  MQTT (the GPU machine);
* :func:`run_device` -- ``edgefl client``: one device loop (:mod:`edgefl.device`) over MQTT (a Pi);
* :func:`run_fleet` -- ``edgefl fleet``: a broker, the server and one process per device.

The broker URL's scheme picks the transport (:mod:`edgefl.transport.registry`: ``mqtt://``,
``mqtts://``, ``memory://`` and any a program registers); nothing here names one.

Both sides build from the config with :mod:`edgefl.build`, as the simulation does, so a fleet and
a simulation of one config hold identical devices and run the same loops; only the transport
differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console

from edgefl.build import RunParts, build_run, device_model_meta, federation_name
from edgefl.config import RunConfig
from edgefl.errors import EdgeflError
from edgefl.filters import build_chain
from edgefl.rundir import RunDir
from edgefl.transport.topics import Topics, device_ids
from edgefl.userdirs import state_home

if TYPE_CHECKING:
    from edgefl.device import DeviceLoop
    from edgefl.server.session import RunSession
    from edgefl.task import Task

log = logging.getLogger("edgefl.device")


def federation(cfg: RunConfig) -> str:
    """The federation both sides of a fleet use (the simulation names the same)."""
    return federation_name(cfg)


def device_state_dir(federation_name: str, device_id: str) -> Path:
    """Where ``edgefl client`` keeps a device's state unless told (``$XDG_STATE_HOME/edgefl/...``)."""
    return state_home() / "edgefl" / federation_name / device_id


def training_digest(cfg: RunConfig) -> str:
    """What makes a device's saved state belong to a run: everything that shapes its training,
    not where its data lies or how the network is tuned."""
    keep = {k: v for k, v in cfg.to_dict().items() if k not in ("network", "threads", "export", "name")}
    keep["data"] = {k: v for k, v in keep.get("data", {}).items() if k != "data_dir"}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


T = TypeVar("T")


def connect_retrying(connect: Callable[[], T], wait_s: float, say: Callable[[str], None] = log.warning) -> T:
    """``connect()``, tried again with growing pauses (1 s doubling to 30 s) while the broker is
    unreachable, for at most ``wait_s`` seconds (``inf``: until it answers, what a device started
    at boot before its broker needs; 0: one try)."""
    from edgefl.errors import BrokerUnreachable, SubscriptionsUnconfirmed

    deadline = time.monotonic() + wait_s
    pause = 1.0
    while True:
        try:
            return connect()
        except BrokerUnreachable as exc:
            if time.monotonic() + pause > deadline:
                if isinstance(exc, SubscriptionsUnconfirmed):  # the broker runs: its own hint says where to look
                    raise
                # a device does not start brokers (the hint of a server or `edgefl fleet` would say so)
                raise BrokerUnreachable(exc.message, hint="check --broker and that the fleet's broker runs; a device started "
                                                          "before its broker keeps trying with --broker-wait inf") from None
            say(f"{exc.message}; trying again in {pause:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 30.0)


def run_device(cfg: RunConfig, device_id: str, broker: str, timeout_s: float | None = None,
               username: str | None = None, password: str | None = None, ca_file: str | None = None,
               state_dir: Path | None = None, broker_wait_s: float = 0.0, verifier: Any = None,
               progress: Callable[[str], None] | None = None) -> dict[int, dict[str, Any]]:
    """Serve one device until the server's run is done (``state_dir``: where it keeps its state
    to resume after a crash; None keeps nothing; ``progress``: told a line a round)."""
    from edgefl.device import DeviceLoop
    from edgefl.device_state import DeviceStateStore
    from edgefl.transport.registry import device_transport

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    # the server checks that every model takes its input; the images stay 8-bit until this
    # device's own samples are taken (a quarter of the memory: what lets a 512 MiB Pi train)
    parts = build_run(cfg, check=False, raw_pixels=True)
    client = parts.client(device_id)  # a ConfigError naming the fleet's ids for a stranger
    x_test, y_test = parts.x_test, parts.y_test
    model_meta = device_model_meta(cfg, parts.ds, parts.slot(device_id), "device")
    del parts  # the whole data set: the device keeps its own samples and the test subset
    topics = Topics(federation(cfg))
    store = DeviceStateStore(state_dir, device_id, topics.federation, training_digest(cfg)) if state_dir else None
    if store is not None:
        store.check_writable()  # before it joins: not a run trained through only to lose its model at the end
    options = connection_options(packet_limit(cfg), cfg.network.keepalive_s, cfg.network.protocol, username, password, ca_file)
    transport = connect_retrying(lambda: device_transport(broker, topics, device_id, **options), broker_wait_s)
    try:
        loop = DeviceLoop(client, transport, topics.federation, cfg.network, x_test, y_test, cfg.eval.batch_size, store, verifier,
                          build_chain(cfg.filter_chain(), "device", cfg.seed, device_id))
        loop.on_answer = progress
        saved = loop.restore()
        if saved is not None:
            log.warning("%s: found the state it saved after round %d in %s (used if the server runs the same run)",
                        device_id, saved, state_dir)
        results = loop.run(timeout_s)
        save_final_model(loop, model_meta, log.warning)
        return results
    finally:
        transport.close()


def run_device_held(device_id: str, broker: str, federation_name: str, data: Path, *, loader: str | None = None,
                    profile: dict[str, Any] | None = None, timeout_s: float | None = None, username: str | None = None,
                    password: str | None = None, ca_file: str | None = None, state_dir: Path | None = None,
                    say: Callable[[str], None] = log.warning, broker_wait_s: float = 0.0, verifier: Any = None,
                    progress: Callable[[str], None] | None = None) -> dict[int, dict[str, Any]]:
    """Serve one device that trains on data only it holds (``data``): it gets its task from the
    server (:mod:`edgefl.enrol`), needs no run config and no data set of the server's."""
    from edgefl.config import NetworkSettings
    from edgefl.device import DeviceLoop
    from edgefl.device_state import DeviceStateStore, check_state_dir
    from edgefl.enrol import join_run, task_digest
    from edgefl.fleet.broker import MQTT_MAX_PACKET
    from edgefl.transport.registry import device_transport

    topics = Topics(federation_name)
    if state_dir:  # before it joins (the store itself needs the task, to know its config)
        check_state_dir(Path(state_dir))
    defaults = NetworkSettings()  # the task brings the run's own settings; these only carry the join
    options = connection_options(MQTT_MAX_PACKET, defaults.keepalive_s, defaults.protocol, username, password, ca_file)
    transport = connect_retrying(lambda: device_transport(broker, topics, device_id, **options), broker_wait_s, say)
    try:
        joined = join_run(transport, device_id, topics.federation, data, loader=loader, profile=profile, timeout_s=timeout_s, say=say,
                          verifier=verifier)
        task = joined.task
        if task.threads:
            import torch

            torch.set_num_threads(task.threads)
        say(f"{device_id}: {task.method.name} run {task.run}, training {task.model.arch} on {joined.samples - joined.validation} of its "
            f"{joined.samples} samples ({joined.validation} held out to validate), from {joined.source}")
        for note in joined.notes:
            say(f"{device_id}: {note}")
        store = DeviceStateStore(state_dir, device_id, topics.federation, task_digest(task)) if state_dir else None
        loop = DeviceLoop(joined.client, transport, topics.federation, task.network, None, None, task.eval_batch_size, store, verifier,
                          build_chain(task.filter_chain(), "device", task.seed, device_id))
        loop.on_answer = progress
        loop.restore()
        results = loop.run(timeout_s)
        save_final_model(loop, task_model_meta(task), say)
        return results
    finally:
        transport.close()


def task_model_meta(task: Task) -> dict[str, Any]:
    """The model-file metadata of a device that got its task from the server (:mod:`edgefl.task`):
    what the task says of the model and the samples. The task does not name the server's data set,
    so an export of this file is told it (``edgefl export FILE --dataset NAME``)."""
    data = task.data
    return {"num_classes": len(data.class_names), "input_shape": list(data.input_shape), "class_names": list(data.class_names),
            "method": task.method.name, "arch": task.model.arch, "model": task.model.name, "model_options": dict(task.model.options),
            "scope": "device", "client_id": task.device, "seed": task.seed}


def save_final_model(loop: DeviceLoop, meta: dict[str, Any], say: Callable[[str], None]) -> Path | None:
    """When the run ended (not a timeout) and the device keeps state, write its model into the
    state folder (``model.safetensors``, edgefl.device_state) and say where: a method that keeps
    one model per device ships it from there (the server never holds it). A failure to write is
    said, never raised: the run is over and the device's part in it is done."""
    if not loop.finished:
        return None
    if loop.state is None:
        if loop.served:
            say(f"{loop.device}: the run is over; this device keeps no state (--no-state), so its model was not saved: where "
                "the run's ship.json names this device's model, nobody has it (run devices with a --state-dir)")
        return None
    if not loop.served:  # never trained in this run: its weights are not the run's result
        say(f"{loop.device}: the run is over; this device trained no round of it, so it saved no model")
        return None
    try:
        path = loop.state.save_model(loop.client.model.state_dict(), {**meta, "round": max(loop.served), "run": loop.run_id})
    except EdgeflError as exc:
        say(f"{loop.device}: the run is over, but its model could not be saved: {exc.message} (hint: {exc.hint}; the run's "
            "ship.json may name this device's model: the model it trained is lost with this process)")
        return None
    # its task does not name the server's data set, whose test samples check the export
    dataset = "" if meta.get("dataset") else " --dataset NAME, NAME the run's data set: the server's ship.json names it"
    say(f"{loop.device}: the run is over; its own model is in {path} (to phone files: edgefl export {path}{dataset}; "
        "the run's ship.json says which model phones get)")
    return path


def serve(cfg: RunConfig, broker: str, run_dir: RunDir | None, console: Console | None = None,
          on_event: Callable[[str, dict[str, Any]], None] | None = None,
          username: str | None = None, password: str | None = None, ca_file: str | None = None,
          join_timeout_s: float | None = None, resume: bool = False, parts: RunParts | None = None,
          should_stop: Callable[[], bool] = lambda: False, signing_key: Path | None = None) -> dict[str, Any]:
    """Run the server side of ``cfg`` against the devices that join through ``broker`` (``parts``:
    the run already built, so a caller can check config and data before it creates anything;
    ``signing_key``: sign every message to the devices, edgefl.transport.signing)."""
    from edgefl.server.session import RunSession
    from edgefl.transport.registry import server_transport
    from edgefl.transport.signing import Signer, signing_transport

    signer = Signer.load(signing_key) if signing_key is not None else None  # a bad key file fails before anything starts

    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    parts = parts if parts is not None else build_run(cfg)
    topics = Topics(federation(cfg))
    # not connected yet: a resume is checked before any connection is made
    session = RunSession(parts, None, topics.federation, runner="fleet", run_dir=run_dir,
                         deadline_s=cfg.network.round_deadline_s, on_event=on_event, save_state_each_round=True,
                         start_facts={"broker": broker})
    first = session.resume() if resume else 1
    transport = server_transport(broker, topics, **connection_options(packet_limit(cfg), cfg.network.keepalive_s, cfg.network.protocol,
                                                                      username, password, ca_file))
    session.endpoint.connect(signing_transport(transport, signer))
    if not resume:
        session.write_start()
    elif on_event:
        on_event("resumed", {"round": first})
    try:
        session.policy.wait_for_devices(join_timeout_s if join_timeout_s is not None else cfg.network.round_deadline_s,
                                        should_stop)  # Ctrl-C while waiting: stop waiting, end before round 1
        _refuse_if_every_device_declined(session)
        summary = session.run(first, should_stop=should_stop)
    finally:
        transport.close()
    summary["history"] = session.policy.history
    return summary


def _refuse_if_every_device_declined(session: RunSession) -> None:
    """A run whose every device declined cannot train: said with their reasons, before rounds that
    would each fail for want of a quorum."""
    enrolment = session.enrolment
    if enrolment is None:
        return
    declined = enrolment.declined()
    if not declined or len(declined) < len(session.endpoint.device_ids):
        return
    reasons: dict[str, list[str]] = {}
    for device in declined:
        reasons.setdefault(enrolment.devices[device].reason, []).append(device)
    said = "; ".join(f"{', '.join(devices[:5])}{' ...' if len(devices) > 5 else ''}: {reason}" for reason, devices in reasons.items())
    raise EdgeflError(f"every device declined the run, so no round can train ({said[:1500]})",
                      hint="fix what the reasons name (the config, or the devices' data) and start the server and devices again")


def run_fleet(cfg: RunConfig, config_path: Path | None, run_dir: RunDir | None, console: Console | None = None,
              broker: str | None = None, device_timeout_s: float = 600.0, broker_kind: str = "auto",
              on_event: Callable[[str, dict[str, Any]], None] | None = None, parts: RunParts | None = None,
              should_stop: Callable[[], bool] = lambda: False, keep: bool = False) -> dict[str, Any]:
    """A broker (mosquitto on a free loopback port unless ``broker`` is given), the server in this
    process and one ``edgefl client`` process per device; with an in-process transport
    (``memory://NAME``) no broker and one thread per device instead.

    Their files (device logs and state, the broker's config and log) go into a temporary
    ``edgefl-fleet-*`` folder, removed after a clean run (every round complete, every device exited
    with 0) unless ``keep``; kept, and named, when anything failed (``summary["logs"]`` is None
    when it was removed)."""
    from edgefl.fleet.broker import mosquitto_binary, start_embedded, start_mosquitto
    from edgefl.transport.registry import transport_for

    console = console or Console(stderr=True)
    # a process of its own could not reach an in-process hub: its devices are threads of this one
    in_process = broker is not None and transport_for(broker).in_process
    work = Path(tempfile.mkdtemp(prefix="edgefl-fleet-"))
    local = None
    if broker is None:
        if broker_kind == "mosquitto" or (broker_kind == "auto" and mosquitto_binary() is not None):
            local = start_mosquitto(work / "broker", max_packet_bytes=packet_limit(cfg))
            console.print(f"broker: mosquitto at {local.url} (log {work / 'broker' / 'mosquitto.log'})")
        else:
            local = start_embedded(work / "broker")
            console.print(f"[yellow]warning:[/] no mosquitto binary: using the embedded pure-Python broker at {local.url} "
                          "(MQTT 3.1.1, loopback only, slower; apt-get install mosquitto for real runs)")
            cfg = cfg.model_copy(update={"network": cfg.network.model_copy(update={"protocol": "3.1.1"})})
        broker = local.url
    if config_path is None or cfg.network.federation is None:
        cfg = cfg.model_copy(update={"network": cfg.network.model_copy(update={"federation": cfg.network.federation or _fed_name(cfg)})})
    config_path = work / "config.toml"
    config_path.write_text(cfg.to_toml())
    ids = device_ids(cfg.fleet.num_clients)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen | _DeviceThread] = {}
    logs = work / "devices"
    logs.mkdir()
    clean = False
    try:
        for device in ids:
            if in_process:
                procs[device] = _DeviceThread(cfg, device, broker, device_timeout_s, work / "state" / device, logs / f"{device}.log")
                continue
            with open(logs / f"{device}.log", "wb") as log:
                procs[device] = subprocess.Popen(
                    [sys.executable, "-m", "edgefl", "client", "--broker", broker, "--config", str(config_path),
                     "--device-id", device, "--timeout", str(device_timeout_s), "--state-dir", str(work / "state" / device)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        console.print(f"started {len(procs)} device {'threads' if in_process else 'processes'} (logs in {logs})")
        summary = serve(cfg, broker, run_dir, console, on_event, parts=parts, should_stop=should_stop)
        # devices exit by themselves after the run's "done"; an interrupted run announces none
        deadline = time.monotonic() + (0 if summary.get("interrupted") else 60)
        for device, proc in procs.items():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                console.print(f"[yellow]{device} did not exit after the run: stopping it[/]")
        summary["device_exit_codes"] = {d: p.poll() for d, p in procs.items()}
        summary["logs"] = str(logs)
        if run_dir is not None:  # the devices' own models (FedHe, CHFL...) into the run directory, as a simulation saves them
            from edgefl.server.shipping import adopt_device_models

            try:
                adopted = adopt_device_models(run_dir, {d: work / "state" / d for d in ids})
            except OSError as exc:
                console.print(f"[yellow]the devices' models could not be copied into {run_dir.path}: {exc}[/]")
            else:
                if adopted:
                    summary["ship"] = run_dir.read_json("ship.json")
        clean = (not keep and not summary.get("interrupted") and not summary.get("failed_rounds")
                 and set(summary["device_exit_codes"].values()) <= {0})
        if clean:
            summary["logs"] = None
        return summary
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if local is not None:
            local.stop()
        if clean:
            shutil.rmtree(work, ignore_errors=True)
        else:  # a failure (or --keep): what the devices and the broker wrote is where it says
            console.print(f"device logs and broker files kept in {work}")


class _DeviceThread:
    """One device of an in-process fleet: :func:`run_device` in a thread, with the part of
    ``subprocess.Popen`` that :func:`run_fleet` uses (an exit code: 0 returned, 1 raised, with
    the traceback in its log). A thread cannot be stopped: one still running when the run ends
    is left to stop at its own timeout, or with the process (a daemon)."""

    def __init__(self, cfg: RunConfig, device: str, broker: str, timeout_s: float, state_dir: Path, log_path: Path) -> None:
        self.code: int | None = None
        self.left = False

        def serve_device() -> None:
            try:
                run_device(cfg, device, broker, timeout_s, state_dir=state_dir)
                self.code = 0
            except BaseException:
                log_path.write_text(traceback.format_exc())
                self.code = 1

        self.thread = threading.Thread(target=serve_device, name=f"edgefl-{device}", daemon=True)
        self.thread.start()

    def wait(self, timeout: float | None = None) -> int | None:
        self.thread.join(0 if self.left else timeout)
        if self.thread.is_alive():
            raise subprocess.TimeoutExpired(self.thread.name, timeout or 0)
        return self.code

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        """Leave it (see the class): nothing waits for it any more."""
        self.left = True

    def kill(self) -> None:
        self.left = True


def connection_options(max_packet_bytes: int, keepalive_s: int, protocol: str, username: str | None, password: str | None,
                       ca_file: str | None) -> dict[str, Any]:
    """What every transport's factory is handed: MQTT's connection settings, which a transport
    that needs fewer ignores (edgefl.transport.registry), so no caller asks which transport it is."""
    return {"max_packet_bytes": max_packet_bytes, "keepalive_s": keepalive_s, "protocol": protocol, "username": username,
            "password": password, "ca_file": ca_file}


def packet_limit(cfg: RunConfig) -> int:
    """The broker's packet limit: one chunk (or one unchunked message) plus headroom for the envelope."""
    from edgefl.fleet.broker import MQTT_MAX_PACKET

    return min(max(cfg.network.chunk_bytes, cfg.network.chunk_threshold) + (1 << 16), MQTT_MAX_PACKET)


def _fed_name(cfg: RunConfig) -> str:
    """A fresh federation per local fleet, so a retained announcement of an earlier run is never read."""
    import uuid

    return f"{federation_name(cfg)[:40]}-{uuid.uuid4().hex[:8]}"

