"""In-process simulation: the round loop a fleet server runs (:mod:`edgefl.server.rounds` over :mod:`edgefl.server.endpoint`)
over an in-memory network whose devices are the same device loops a fleet's devices run
(:mod:`edgefl.device`), with a virtual clock for fleets described by device classes.

Every message is packed into the wire envelope and decoded on the other side, so the bytes
counted are the bytes a fleet sends and the codec and the server's checks see every message.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgefl.algorithms import ClientHalf
from edgefl.build import DeviceSlot, RunParts, build_client, build_run, device_model_meta, federation_name
from edgefl.compute import resolve_device
from edgefl.config import RunConfig
from edgefl.data import Dataset
from edgefl.errors import ConfigError, EdgeflError
from edgefl.device import DeviceLoop, WorkDone
from edgefl.environment import machine, source_commit
from edgefl.heartbeat import Heartbeat
from edgefl.methods import get_method
from edgefl.report import human_bytes, lr_note, stage_notes
from edgefl.rundir import RunDir
from edgefl.safetext import printable
from edgefl.filters import build_chain
from edgefl.server.rounds import SyncRounds
from edgefl.server.session import DEVICES_FILE, RunSession, config_changes, safe_name
from edgefl.server.state import decode_tree, encode_tree, savable
from edgefl.sim.batching import FitBatcher
from edgefl.sim.hosts import Host, ProcessHost
from edgefl.sim.kept_clients import KEPT_CHANGED, fit_problem, kept_dir, load_kept, save_kept
from edgefl.sim.network import InMemoryNetwork

log = logging.getLogger("edgefl.sim")


def check_simulable(cfg: RunConfig, runner: str = "a simulation") -> None:
    """Devices that bring their own data cannot be played from one config."""
    if cfg.data.device_held:
        raise ConfigError(f'data.partition = "devices": the devices bring their own data, which {runner} does not have',
                          hint="run edgefl server with this config and edgefl client --data on each device (docs/your-data.md), "
                               "or split a data set: partition = \"iid\" or \"dirichlet\"")


DEVICES_FORMAT = "edgefl-simulation-devices-1"


class Simulation:
    """Runs a :class:`RunConfig` in one process. ``run()`` returns the summary dict."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: RunDir | None = None,
        console: Console | None = None,
        dataset: Dataset | None = None,
        show_progress: bool = True,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        parts: RunParts | None = None,
    ) -> None:
        check_simulable(cfg)
        self.cfg = cfg
        self.run_dir = run_dir
        self.console = console or Console(stderr=True)
        self.show_progress = show_progress
        self.on_round = on_round
        # chosen once for the whole run: every host trains with these threads (numbers depend on it)
        self.threads = run_threads(cfg)
        torch.set_num_threads(self.threads)
        self.parts = parts if parts is not None else build_run(cfg, dataset)
        self.ds, self.slots = self.parts.ds, self.parts.slots
        self.slot_of = {s.client_id: s for s in self.slots}
        self.x_test, self.y_test = self.parts.x_test, self.parts.y_test
        self.clients: dict[str, ClientHalf] = {s.client_id: build_client(cfg, self.ds, s) for s in self.slots}
        self._advance: Callable[[], None] = lambda: None
        self._unpriced: set[str] = set()  # device classes already warned about (no known speed)
        timed = {s.client_id for s in self.slots if s.profile is not None}
        self.compute_device = resolve_device(cfg.device)
        batch = cfg.simulation.batch_clients == "on" or (cfg.simulation.batch_clients == "auto" and self.compute_device.type == "cuda")
        self.batcher = FitBatcher() if batch else None
        self.network = InMemoryNetwork(self._work_seconds, timed, on_work=self._trained, batcher=self.batcher)
        federation = federation_name(cfg)
        self.hosts = start_hosts(cfg, self.slots, self.threads)
        host_of = {device: host for host in self.hosts for device in host.devices}
        for s in self.slots:
            if s.client_id in host_of:
                self.network.attach_remote(s.client_id, host_of[s.client_id])
                continue
            loop = DeviceLoop(self.clients[s.client_id], self.network.endpoint(s.client_id), federation, cfg.network,
                              self.x_test, self.y_test, cfg.eval.batch_size, filters=build_chain(cfg.filter_chain(), "device", cfg.seed, s.client_id))
            self.network.attach(loop)
        self._closer = weakref.finalize(self, close_hosts, list(self.hosts))
        self._events: Callable[[str, dict[str, Any]], None] = lambda kind, info: None
        facts = {"simulation": {"batch_clients": batch, "backend": cfg.simulation.backend, "hosts": len(self.hosts),
                                "threads": self.threads}}
        self._kept_line: str | None = None  # said as the run starts: no device trains
        if cfg.simulation.clients_from:
            facts["simulation"]["clients_from"] = self._replay_kept(cfg.simulation.clients_from)
        if cfg.simulation.keep_clients:
            for loop in self.network.loops.values():
                loop.kept = {}
        self.session = RunSession(self.parts, self.network, federation, runner="simulation", run_dir=run_dir,
                                  deadline_s=cfg.clock.deadline_s, on_event=lambda kind, info: self._events(kind, info), start_facts=facts,
                                  clock=self.network.run_clock())
        self.server = self.session.server
        self.session.device_models = self._device_models
        if run_dir is not None and not self.hosts:  # every device's state is here to save
            self.session.checkpoint_every = cfg.simulation.checkpoint_every
            self.session.save_devices = self._save_devices
        elif run_dir is not None and cfg.simulation.checkpoint_every:
            log.warning("no checkpoints: the devices train in %d worker processes, whose states are not saved "
                        "(simulation.workers = 1 checkpoints every %d rounds)", len(self.hosts), cfg.simulation.checkpoint_every)
        self._joined = False
        self._first_round = 1  # a resumed run goes on from its checkpoint (resume())
        self._resumed = False

    # --- clients kept for another fusion (simulation.keep_clients / clients_from) ------------------------
    def _replay_kept(self, source: str) -> dict[str, Any]:
        """Every device answers round 1 with the upload and trained state an earlier run kept."""
        folder = kept_dir(source)
        kept, facts = load_kept(folder, self.cfg.to_dict(), sorted(self.network.loops), self.cfg.network.max_message_bytes)
        for device, loop in self.network.loops.items():
            message, state = kept[device]
            problem = fit_problem(message, state, self.clients[device].carry_state(), len(self.clients[device].setup.x),
                                  get_method(self.cfg.method.name).uploads)
            if problem:
                raise ConfigError(f"simulation.clients_from: {folder}: device {device!r}: {problem}", hint=KEPT_CHANGED)
            loop.replay = {message.round: (message, state)}
        self._kept_line = (f"clients: no device trains; each answers with the upload and trained model kept in {folder} "
                           f"(by a {facts.get('method')} run at commit {facts.get('edgefl_commit')})")
        # a kernel's sums depend on its threads and device: the server's fusion here runs with this run's
        mixed = [f"{what} {facts[key]} there, {here} here" for key, what, here in
                 (("threads", "threads", self.threads), ("compute_device", "compute device", str(self.compute_device)))
                 if facts.get(key) not in (None, here)]
        if mixed:
            log.warning("the kept clients trained with other settings than this run's server fuses with (%s): the numbers are "
                        "those of neither run throughout; set threads (and device) as the keeping run had them to get its "
                        "numbers", "; ".join(mixed))
        return {"path": str(folder.resolve()), **facts}

    def _save_kept(self) -> None:
        """After the round: each device's upload and trained state into RUN_DIR/clients."""
        assert self.run_dir is not None
        loops = self.network.loops
        missing = sorted(d for d, loop in loops.items() if not loop.kept)
        if missing:
            log.warning("the clients are not kept (simulation.keep_clients): %d device(s) did not train (%s)",
                        len(missing), ", ".join(missing[:5]))
            return
        uploads = {d: loop.kept[max(loop.kept)] for d, loop in loops.items()}  # type: ignore[index]
        states = {d: self.clients[d].carry_state() for d in loops}
        facts = {"edgefl_commit": source_commit(), "machine": machine(), "threads": self.threads,
                 "compute_device": str(self.compute_device)}
        folder = save_kept(self.run_dir.path, self.cfg.to_dict(), uploads, states, facts)
        size = sum(f.stat().st_size for f in folder.iterdir())
        self.console.print(f"clients: kept the {len(uploads)} devices' uploads and trained models in {folder} ({human_bytes(size)}); "
                           "another one-shot server fuses them with simulation.clients_from", markup=False, highlight=False)

    # --- checkpoints --------------------------------------------------------------------------------
    def _save_devices(self, path: Path, round_no: int) -> None:
        """Every device's carried state (model, method state, filters' state) and the virtual
        clock after ``round_no``, beside the server's state (written after this one)."""
        tensors = {f"{device}|{name}": t for device, loop in sorted(self.network.loops.items()) for name, t in loop.carry_state().items()}
        net = self.network
        meta = {"format": DEVICES_FORMAT, "round": round_no, "tag": self.session.checkpoint_tag, "devices": sorted(net.loops),
                "start_told": sorted(d for d, loop in net.loops.items() if loop.start_told),
                "clock": {"now": net.clock, "device_now": net._device_now, "busy_until": dict(net._busy_until)}}
        if self.cfg.mode == "async":
            # between updates, messages are on their way: uploads priced to arrive later, answers
            # and downloads not yet read by their devices, and who the server knows to be online
            skeleton, queued = encode_tree({"network": net.queued(), "online": dict(self.session.endpoint.online)})
            meta["queued"] = skeleton
            tensors.update({f"queued|{k}": t for k, t in queued.items()})
        tmp = path.with_name(path.name + ".tmp")
        save_file(savable(tensors), str(tmp), metadata={"edgefl": json.dumps(meta)})
        os.replace(tmp, path)

    def resume(self) -> int:
        """Restore the run in the run directory from its last checkpoint (the server's state,
        the records so far, every device's state, the virtual clock); returns the next round."""
        if not self.session.checkpoint_every:
            why = ("it spreads devices over worker processes, whose states are not saved (run it with --set simulation.workers=1 "
                   "to checkpoint)" if self.hosts else "simulation.checkpoint_every is 0")
            if not self.hosts and self.run_dir is not None and (self.run_dir.path / DEVICES_FILE).is_file():
                changed = config_changes(self.cfg, self.run_dir.path)
                if changed:  # another run's config altogether: say that, not the interval
                    raise ConfigError(f"the run in {self.run_dir.path} has another config{changed}",
                                      hint="resume with the interrupted run's own config.toml (in its folder)")
                raise ConfigError("a resume needs checkpoints, and the config given sets simulation.checkpoint_every = 0 "
                                  "(the run's own config.toml checkpointed)",
                                  hint="resume with the run's config.toml, or a checkpoint_every above 0 (--set simulation.checkpoint_every=N)")
            raise ConfigError(f"this run cannot be resumed: {why}", hint="start it again")
        first = self.session.resume()
        path = self.run_dir.path / DEVICES_FILE  # type: ignore[union-attr]
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("edgefl", "null"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, ValueError, SafetensorError) as exc:
            raise ConfigError(f"{path}: the devices' checkpoint cannot be read ({exc})", hint="start the run again") from None
        if not isinstance(meta, dict) or meta.get("format") != DEVICES_FORMAT or meta.get("round") != first - 1 \
                or meta.get("devices") != sorted(self.network.loops) or str(meta.get("tag", "")) != self.session.resumed_tag:
            raise ConfigError(f"{path} does not hold this run's devices after round {first - 1} (a checkpoint interrupted "
                              "while it was written, or another run's)", hint="start the run again")
        told = meta.get("start_told")
        for device, loop in self.network.loops.items():
            prefix = device + "|"
            loop.load_carry_state({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
            # a device that said where it started says it no more: not a restart from scratch (a
            # checkpoint of an older version does not list them: none says it again)
            loop.start_told = device in told if isinstance(told, list) else True
        clock = meta["clock"]
        self.network.clock, self.network._device_now = float(clock["now"]), float(clock["device_now"])
        self.network._busy_until = {str(d): float(t) for d, t in clock["busy_until"].items()}
        if self.cfg.mode == "async":
            if "queued" not in meta:
                raise ConfigError(f"{path} holds no messages in flight, which an asynchronous run's checkpoint keeps",
                                  hint="start the run again")
            queued = decode_tree(meta["queued"], {k[len("queued|"):]: v for k, v in tensors.items() if k.startswith("queued|")})
            self.network.restore_queued(queued["network"])
            endpoint = self.session.endpoint
            endpoint.online = {str(d): bool(v) for d, v in queued["online"].items()}
            endpoint.online_count = sum(endpoint.online.values())
            self._joined = True  # the devices joined before the checkpoint: their presence is restored above
        self._first_round = first
        self._resumed = True
        return first

    def _device_models(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every device's weights (from the worker hosts too): what the run's ship plan picks from."""
        self.fetch_client_states()
        return {cid: client.model.state_dict() for cid, client in self.clients.items()}

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.session.policy.history

    def _join(self) -> None:
        if not self._joined:
            # every in-memory device says "online" at virtual time 0: this returns at once
            self.session.policy.wait_for_devices(self.cfg.clock.deadline_s)
            self._joined = True

    def run_round(self, r: int, advance: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """Play one round (``advance`` is called after each device's training)."""
        self._join()
        self._advance = advance
        try:
            policy = self.session.policy
            assert isinstance(policy, SyncRounds), "run_round plays a synchronous round"
            return policy.run_round(r)
        finally:
            self._advance = lambda: None

    def _trained(self, device: str, work: WorkDone) -> None:
        """A device finished its training: the console's bar moves, and so does the dashboard's
        "trained" count (its upload reaches the server only once the whole pass has trained)."""
        live = self.session.live
        if live is not None:
            live.on_event("trained", {"device": device, "round": work.round})
        self._advance()

    def _work_seconds(self, device: str, work: WorkDone) -> float | None:
        seconds = device_time(self.cfg, self.ds, self.slot_of[device], work.samples, work.bytes_up, work.bytes_down)
        profile = self.slot_of[device].profile
        if seconds is None and self.cfg.mode == "async" and profile is not None and profile.id not in self._unpriced:
            # asynchronous: such a device reports at once, again and again, and crowds out the rest
            self._unpriced.add(profile.id)
            from edgefl.profile.assign import measure_advice

            log.warning("device class %s has no known speed: its devices take no virtual time and report as fast as the "
                        "server answers; %s", profile.id, measure_advice(profile, "speed"))
        return seconds

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Play every round (``should_stop``, asked between rounds, ends the run early: models,
        summary and metrics of what was played are written either way)."""
        cfg = self.cfg
        first = self._first_round
        if not self._resumed:
            self.session.write_start()
        if self._kept_line:
            self.console.print(self._kept_line, markup=False, highlight=False)
        if cfg.mode == "async" and not any(slot.profile is not None for slot in self.slot_of.values()):
            # no device class: every download takes no virtual time, so "t=0.0s" on every record is no measurement
            log.warning("no fleet group names a device profile: an asynchronous simulation's virtual clock stays at 0 and "
                        "devices report in turn as the server answers; name profiles in [fleet] groups (profile = ...) "
                        "to give devices their speeds")
        self._join()
        progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=self.console, transient=True, disable=not self.show_progress,
        )
        rounds_task = progress.add_task("rounds", total=cfg.rounds, completed=first - 1)
        # the same progress as plain lines every 10 s when stderr is a log, not a terminal
        heartbeat = Heartbeat(self.console, enabled=self.show_progress and not self.console.is_terminal)

        stage_task: list[Any] = [None]  # the stage under way: a spinner until the next stage, the training or the round's end

        def end_stage() -> None:
            if stage_task[0] is not None:
                progress.remove_task(stage_task[0])
                stage_task[0] = None

        def on_event(kind: str, info: dict[str, Any]) -> None:  # a bar per round, advanced by each device's training
            if kind == "stage":  # an exchange besides training (secure aggregation's keys, shares, unmasking)
                end_stage()
                stage_task[0] = progress.add_task(f"round {info['round']}: stage {info['stage']}, {info['asked']} devices asked", total=None)
                heartbeat.status(f"round {info['round']}/{cfg.rounds}: stage {info['stage']}, {info['asked']} devices asked")
            elif kind == "stage_failed":
                end_stage()
            if kind == "round":
                end_stage()
                r, n = info["round"], len(info["selected"])
                task = progress.add_task(f"round {r}: clients", total=n)
                trained = [0]
                heartbeat.status(f"round {r}/{cfg.rounds}: training, 0/{n} devices done")

                def advance() -> None:
                    progress.advance(task)
                    trained[0] += 1
                    heartbeat.status(f"round {r}/{cfg.rounds}: training, {trained[0]}/{n} devices done")

                self._advance = advance
            elif kind == "evaluating":
                progress.add_task(f"round {info['round']}: evaluating", total=None)
                heartbeat.status(f"round {info['round']}/{cfg.rounds}: evaluating")
            elif kind == "update":  # asynchronous: the bar counts server updates
                progress.update(rounds_task, completed=info["version"])
                heartbeat.status(f"update {info['version']}/{cfg.rounds}")
            elif kind == "closed":
                stage_task[0] = None
                for task in [t.id for t in progress.tasks if t.id != rounds_task]:
                    progress.remove_task(task)
                if cfg.mode == "sync":
                    progress.advance(rounds_task)
                self._advance = lambda: None

        def on_record(record: dict[str, Any]) -> None:
            if self.show_progress:
                self.console.print(round_line(record, cfg.rounds), markup=False)  # plain text: "[deadline]" is an outcome, not a style
                heartbeat.printed()
            if self.on_round:
                self.on_round(record)

        self._events = on_event
        try:
            with progress, heartbeat:
                summary = self.session.run(first, on_record=on_record, should_stop=should_stop)
        except KeyboardInterrupt:
            self.fetch_client_states()
            if self.run_dir and not self.server.global_models():
                self._save_client_models()
            raise
        finally:
            self._events = lambda kind, info: None
        self.fetch_client_states()
        if self.run_dir and not self.server.global_models():
            self._save_client_models()
        if self.run_dir and self.cfg.simulation.keep_clients:
            self._save_kept()
        self.close()
        return summary

    def fetch_client_states(self) -> None:
        """Devices that trained in worker hosts: their models (and what their method carries)
        into :attr:`clients` here, where the run's results are read and saved."""
        for host in self.hosts:
            for device, tensors in host.states().items():
                self.clients[device].load_carry_state(tensors)

    def close(self) -> None:
        """Stop the worker hosts (a run ends with this; after ``run_round`` call it yourself)."""
        self._closer()

    def _save_client_models(self) -> None:
        """Knowledge methods have no global model: each device's own model is the result."""
        assert self.run_dir is not None
        for cid, client in self.clients.items():
            slot = self.slot_of[cid]
            meta = device_model_meta(self.cfg, self.ds, slot, "client")
            self.run_dir.save_model(f"{cid}-{safe_name(slot.arch)}", client.model.state_dict(), meta)


def run_baseline(parts: RunParts, run_dir: RunDir, console: Console, show_progress: bool = True,
                 should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """The Local-only baseline of a run (``simulation.baseline = "local"``): the run's own devices,
    data, seed and training under the ``local`` method, into ``RUN_DIR/baseline``. Returns its summary."""
    from edgefl.baseline import BASELINE_DIR, baseline_parts

    local = baseline_parts(parts)
    target = RunDir.create(run_dir.path / BASELINE_DIR, local.cfg.name, local.cfg.seed)
    if show_progress:
        console.print(f"[bold]baseline[/]: Local-only on the same {len(parts.slots)} devices, data, seed and training "
                      f"(nothing shared), {local.cfg.rounds} rounds -> {target.path}")
    return Simulation(local.cfg, target, console=console, show_progress=show_progress, parts=local).run(should_stop=should_stop)


def record_comparison(run_dir: RunDir, parts: RunParts) -> dict[str, Any]:
    """Put what federation bought into the run's summary.json -- the Local-only baseline beside
    the method (when the run has one) and what FedAvg would have sent -- and re-draw the plots
    with them. Returns the fields added."""
    from edgefl.baseline import compare, fedavg_traffic, verdict, weights_bytes
    from edgefl.report import METHOD_NAMES, draw_plots

    metrics = run_dir.metrics()
    added: dict[str, Any] = {"fedavg_equivalent": fedavg_traffic(metrics, weights_bytes(parts))}
    mine = sum(m["bytes_up"] + m["bytes_down"] for m in metrics)
    theirs = added["fedavg_equivalent"]["bytes_up_total"] + added["fedavg_equivalent"]["bytes_down_total"]
    added["fedavg_equivalent"]["method_share"] = round(mine / theirs, 6) if theirs else None  # this method's bytes per FedAvg byte
    comparison = compare(run_dir)
    if comparison is not None:
        comparison["verdict"] = verdict(comparison, METHOD_NAMES.get(parts.cfg.method.name, parts.cfg.method.name))
        added["baseline"] = comparison
    summary = run_dir.read_json("summary.json") if (run_dir.path / "summary.json").is_file() else {}
    run_dir.write_json("summary.json", {**summary, **added})
    try:
        draw_plots(run_dir)
    except EdgeflError as exc:  # matplotlib missing: the numbers are saved
        log.warning("no plots: %s", exc.message)
    return added


def run_threads(cfg: RunConfig) -> int:
    """The torch intra-op threads every client half of a run trains with: ``threads``, else this
    process's torch default (the machine's cores, unless the caller set another), chosen once.
    A kernel's sums run in an order that depends on its thread count, so this is part of the
    run's determinism: the in-process devices, worker processes and Ray actors all get it (numbers
    are then the same on every backend) and run.json records it (``simulation.threads``)."""
    return cfg.threads or torch.get_num_threads()


def start_hosts(cfg: RunConfig, slots: list[DeviceSlot], threads: int | None = None) -> list[Host]:
    """The worker hosts ``simulation`` asks for (none: every device in this process). Devices
    are dealt round-robin; with Ray, each device class (profile) gets actors of its own. Every
    host trains with ``threads`` (default :func:`run_threads`): workers on one machine then share
    its cores (set ``threads`` = cores / workers for speed: numbers are then those of one process
    with that many threads)."""
    threads = threads or run_threads(cfg)
    sim = cfg.simulation
    devices = [s.client_id for s in slots]
    count = sim.worker_count(len(devices))
    if sim.backend == "local" and count == 1:
        return []
    config = cfg.to_toml()
    shares = [devices[k::count] for k in range(count)]
    if sim.backend == "ray":
        from edgefl.sim.ray_hosts import class_shares, start_ray_hosts

        return start_ray_hosts(sim, config, class_shares(slots, count), threads)
    return [ProcessHost(config, share, threads) for share in shares]


def close_hosts(hosts: list[Host]) -> None:
    for host in hosts:
        host.close()


def device_time(cfg: RunConfig, ds: Dataset, slot: DeviceSlot, samples: int, up_bytes: int, down_bytes: int) -> float | None:
    """Virtual seconds a device of this class needs for a round: the cost model's compute time at
    the profile's effective speed plus the real message bytes at its bandwidth. None when the
    profile's speed is unknown."""
    from edgefl.models import model_info
    from edgefl.profile.cost import compute_seconds, forward_stats, freeze, transfer_seconds

    shape = tuple(slot.input_shape(ds))
    info = model_info(slot.model, num_classes=ds.num_classes, input_shape=shape, **slot.model_options)
    stats = forward_stats(slot.model, freeze(slot.model_options), shape, ds.num_classes)
    batch = cfg.train_for(slot.group).batch_size
    compute = compute_seconds(slot.profile, info.flops_per_sample, samples, batch, info.params, stats)
    if compute is None:
        return None
    return compute + (transfer_seconds(slot.profile, up_bytes, down_bytes) or 0.0)


def round_line(record: dict[str, Any], total: int) -> str:
    acc = record["accuracy"]
    acc_txt = f"acc {acc['overall']:.4f}" if acc and acc["overall"] is not None else "acc  -    "
    outcome = "" if record.get("outcome") in (None, "complete") else f"  [{record['outcome']}]"
    clock = ""
    if record.get("mode") == "async":
        stale = record.get("staleness") or {}
        when = "virtual " if record.get("virtual_clock") else ""
        clock = (f"  {when}t={record['clock_s']:.1f}s  {record['reports']} reports"
                 + (f", staleness mean {stale['mean']:.1f} max {stale['max']}" if stale else "")
                 + (f", {record['refused_stale']} refused stale" if record.get("refused_stale") else ""))
    elif record.get("round_virtual_s") is not None:  # a fleet described by device classes: its virtual time
        by_class = ", ".join(f"{k} {v:.1f}s" for k, v in (record.get("virtual_time_by_profile") or {}).items())
        stragglers = record.get("stragglers") or []
        clock = f"  virtual {record['round_virtual_s']:.1f}s ({by_class})" + (f", {len(stragglers)} straggler(s) dropped" if stragglers else "")
    # secured, who dropped out of which stage, why a stage failed the round: ids and reasons come
    # from devices, so control characters are escaped (the line is printed without markup)
    notes = "".join(f"  {printable(note, 1000)}" for note in stage_notes(record, show=3))
    if (rate := lr_note(record)) is not None:
        notes += f"  {printable(rate, 1000)}"
    # up counts accepted uploads: a round whose uploads were refused says how many beside it
    refused = (record.get("rejected") or {}).get("count") or 0
    up = f"up {human_bytes(record['bytes_up'])}" + (f" ({refused} refused)" if refused else "")
    return (
        f"{'update' if record.get('mode') == 'async' else 'round'} {record['round']:>3}/{total}  {acc_txt}  {up}  "
        f"down {human_bytes(record['bytes_down'])}  {record['round_time_s']:.1f}s{outcome}{clock}{notes}"
    )
