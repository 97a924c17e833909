"""The ``edgefl`` command line."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgefl.errors import EdgeflError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated learning across heterogeneous edge devices.")
# Piped output (logs, CI) gets a wide fixed width instead of rich's 80-column fallback, and its
# messages are not wrapped: one message a line, whole paths and reasons, is what grep and log
# readers need (tables still fit the width)
out = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, soft_wrap=not sys.stderr.isatty())


#: every command that loads data takes the folder of its files (data.data_dir)
DataDir = Annotated[Optional[Path], typer.Option("--data-dir", "--data", help="folder holding the dataset's files (sets data.data_dir)")]


def _cli_overrides(overrides: list[str], data_dir: Path | None, track: str | None = None) -> list[str]:
    """The command line's own options as the config overrides they stand for."""
    out = [*overrides, *([f"data.data_dir={data_dir}"] if data_dir else [])]
    if track:
        names = [t.strip() for t in track.split(",") if t.strip()]
        out.append("track=[" + ", ".join(f'"{t}"' for t in names) + "]")
    return out


#: a live page over the run (edgefl dashboard) beside a fleet's server
DashboardAt = Annotated[Optional[str], typer.Option("--dashboard", help="serve the live dashboard at [HOST:]PORT (127.0.0.1 unless a host is named)")]


def _open_dashboard(run_path: Path, where: str | None):
    if not where:
        return None
    from edgefl.dashboard import parse_address, start_dashboard

    host, port = parse_address(where)
    board = start_dashboard(run_path, host, port)
    err.print(f"dashboard: {board.url}")
    return board


#: experiment trackers from the command line (the config's ``track``)
Track = Annotated[Optional[str], typer.Option("--track", help="feed trackers every round: tensorboard, mlflow (comma-separated)")]


def _say_devices(parts) -> None:
    """Which device class got which model (fleets described by profiles: the point of model = "auto")."""
    seen: dict[tuple[str, str, bool], int] = {}
    for slot in parts.slots:
        if slot.profile is not None:
            key = (slot.profile.id, slot.arch, slot.group.model == "auto")
            seen[key] = seen.get(key, 0) + 1
    for (profile, arch, auto), count in seen.items():
        err.print(f"devices: {count} x {profile} -> {arch}" + (" (assigned: the largest model its budgets allow)" if auto else ""))


def _say_data(parts) -> None:
    _say_devices(parts)
    ds, frac = parts.ds, parts.cfg.data.client_test_fraction
    split = (f"{len(ds.y_train)} samples pooled, each device keeping {frac:.0%} of its share to judge on" if frac and not len(ds.y_test)
             else f"{len(ds.y_train)} train / {len(ds.y_test)} test samples")
    err.print(f"data: {ds.name}, {split}, {ds.num_classes} classes, from {ds.source}")
    for path in ds.files:
        err.print(f"  {path}", highlight=False)


def _whole(text: str, option: str) -> str:
    if not text.isdigit():
        raise typer.BadParameter(f"{option} is a whole number or auto, not {text!r}")
    return text


@app.command()
def simulate(
    config: Annotated[Optional[Path], typer.Argument(help="run config (TOML); omitted: the embedded preset")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="override a key, e.g. --set rounds=3 (repeatable)")] = [],  # noqa: B006
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="run directory (default runs/<time>-<name>-s<seed>)")] = None,
    preset: Annotated[str, typer.Option(help="embedded config when CONFIG is omitted: demo, paper or fedhe-paper (FedHe as its paper runs it)")] = "demo",
    show_config: Annotated[bool, typer.Option("--show-config", help="print the resolved config and exit")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress display")] = False,
    data_dir: DataDir = None,
    track: Track = None,
    workers: Annotated[Optional[str], typer.Option("--workers", help="spread the devices over N processes or Ray actors (auto: one per core)")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="local (processes) or ray")] = None,
    address: Annotated[Optional[str], typer.Option("--address", help="--backend ray: the cluster to join (default: start one here)")] = None,
    resume: Annotated[bool, typer.Option(help="continue the stopped run in --out from its last checkpoint "
                                               "(how often: checkpoint_every under simulation); CONFIG defaults to the run's config.toml")] = False,
) -> None:
    """Run a federated training job on a simulated fleet (in this process, or spread over workers)."""
    from edgefl.build import build_run
    from edgefl.config import load_config
    from edgefl.report import accuracy_table, communication_table
    from edgefl.rundir import RunDir
    from edgefl.sim import Simulation

    from edgefl.interrupt import StopRequest
    from edgefl.server.session import build_server

    spread = [f"simulation.workers={workers if workers == 'auto' else _whole(workers, '--workers')}"] if workers else []
    spread += [f'simulation.backend="{backend}"'] if backend else []
    spread += [f'simulation.ray_address="{address}"'] if address else []
    if resume:
        if out_dir is None:
            raise EdgeflError("--resume needs --out: the run directory of the stopped run")
        if not out_dir.is_dir():
            raise EdgeflError(f"{out_dir} does not exist", hint="pass the --out folder of the stopped run")
        if config is None:
            config = out_dir / "config.toml"
            if not config.is_file():
                raise EdgeflError(f"{out_dir} holds no config.toml: is it a run directory?",
                                  hint="pass the stopped run's --out folder, or its config as CONFIG")
    cfg = load_config(config, _cli_overrides(set_, data_dir, track) + spread, preset)
    from edgefl.sim.engine import check_simulable

    check_simulable(cfg)
    parts = build_run(cfg)  # config, data and models checked before anything is written
    build_server(cfg, parts.ds, parts.slots)  # the method's own checks (a one-shot method's rounds...)
    if show_config:  # validated exactly as the run would be
        out.print(cfg.to_toml(), markup=False, highlight=False)
        return
    run = RunDir(out_dir) if resume else RunDir.create(out_dir, cfg.name, cfg.seed)
    n = cfg.fleet.num_clients
    sim = Simulation(cfg, run, console=err, show_progress=not quiet, parts=parts)
    written = run.recorded_rounds() if resume else 0  # the records before the resume: those past the checkpoint are played again
    first = sim.resume() if resume else 1  # a refused resume says why before any header with the new config's numbers
    err.print(f"[bold]{escape(cfg.name)}[/]: {cfg.method.name} on {cfg.data.dataset}, {n} devices, {cfg.rounds} rounds, seed {cfg.seed}")
    err.print(f"run directory: {run.path}")
    _say_data(parts)
    stop = StopRequest(lambda text: err.print(f"[yellow]{text}[/]"), asynchronous=cfg.mode == "async")
    if resume:
        # records written after the checkpoint (a finished run's last ones, a crash past it) are played again: said
        had_finished = "this run had finished; " if run.finished() else ""
        again = written - len(sim.history)
        replay = f"; the {_count(again, 'record')} written after it {'is' if again == 1 else 'are'} played again, with the same numbers" \
            if again > 0 else ""
        if cfg.mode == "async":
            err.print(had_finished + f"resuming after server update {first - 1} of {cfg.rounds} "
                      f"(the checkpoint after record {len(sim.history)}{replay})")
        elif first <= cfg.rounds:
            err.print(had_finished + f"resuming at round {first} of {cfg.rounds} (the checkpoint after round {first - 1}{replay})")
        else:
            err.print(f"all {cfg.rounds} rounds were played: nothing left to resume, the results are written again")
    try:
        with stop, _device_echoes_dropped(True):
            summary = sim.run(should_stop=stop.requested)
    except KeyboardInterrupt:
        summary = {"interrupted": True}
    if summary.get("interrupted"):
        done = len(run.metrics()) if (run.path / "metrics.jsonl").is_file() else 0
        if done:
            out.print(accuracy_table(run))
        again = (f"; continue it: edgefl simulate --resume --out {run.path}" if cfg.simulation.checkpoint_every
                 and (run.path / "server-state.safetensors").is_file() else "")
        tag = sim.session.checkpoint_tag  # an async checkpoint's tag: "update:records:counter"
        current = cfg.mode == "async" and tag.count(":") == 2 and int(tag.split(":")[1]) == done  # taken at the stop
        played = (f"{done} records ({run.metrics()[-1]['round'] if done else 0} of {cfg.rounds} server updates; "
                  + ("checkpointed at the stop)" if current else
                     "a resume goes on from the last checkpoint, playing the records since it again)") if cfg.mode == "async"
                  else f"{done} of {cfg.rounds} rounds")
        err.print(f"interrupted ({stop.signal_name or 'SIGINT'}) after {played}; models, summary and "
                  f"plots of what ran are in {run.path} (edgefl report {run.path}){again}")
        raise typer.Exit(130)
    baseline_stopped = _baseline(cfg, parts, run, quiet)
    out.print(accuracy_table(run))
    _say_verdict(run)
    out.print(communication_table(run))
    _print_rounds_table(run)
    out.print(f"run directory: {run.path}  (plots in {run.path / 'plots'})")
    if baseline_stopped:
        err.print(f"interrupted ({baseline_stopped}) during the Local-only baseline; the run itself is complete in {run.path}, "
                  f"the baseline's rounds so far in {run.path / 'baseline'}")
        raise typer.Exit(130)
    if cfg.export:
        formats = tuple(f for f in cfg.export if f != "int8") or ("onnx", "tflite")  # export = ["int8"]: int8 of both
        err.print(f"exporting the final models: {', '.join(formats)}{' + int8' if 'int8' in cfg.export else ''}")
        try:
            _export_and_print(run.path, run.path / "export", formats, "int8" in cfg.export, 1, True, None, None, None, None)
        except EdgeflError as exc:  # the run itself is saved: say so, then fail
            err.print(f"[red]export failed[/]: {exc}\nthe run is complete in {run.path}; retry with `edgefl export {run.path}`")
            raise typer.Exit(1) from None
        except typer.Exit:
            err.print(f"the run is complete in {run.path}; retry the failed exports with `edgefl export {run.path}`")
            raise
    _fail_on_failed_rounds(summary, run.path)


def _baseline(cfg, parts, run, quiet: bool) -> str | None:
    """After a finished run: the Local-only baseline when the config asks for it, then what
    federation bought into summary.json and the plots. Returns the signal's name when the
    baseline was interrupted (the run itself is complete either way)."""
    from edgefl.baseline import wants_baseline
    from edgefl.interrupt import StopRequest
    from edgefl.sim.engine import record_comparison, run_baseline

    stopped = None
    if wants_baseline(cfg):
        stop = StopRequest(lambda text: err.print(f"[yellow]{text}[/]"))
        try:
            with stop:
                summary = run_baseline(parts, run, err, show_progress=not quiet, should_stop=stop.requested)
            if summary.get("interrupted"):
                stopped = stop.signal_name or "SIGINT"
        except KeyboardInterrupt:
            stopped = stop.signal_name or "SIGINT"
    elif cfg.simulation.baseline != "none":
        err.print(f"no baseline: the method is {cfg.method.name} itself")
    record_comparison(run, parts)
    return stopped


def _say_verdict(run) -> None:
    """The comparison in one sentence under the table (summary.json's baseline.verdict)."""
    if not (run.path / "summary.json").is_file():
        return
    verdict = (run.read_json("summary.json").get("baseline") or {}).get("verdict")
    if verdict:
        colour = "green" if " beats " in verdict else "red" if " BELOW " in verdict else "yellow"
        out.print(f"[bold {colour}]{verdict}[/]")


#: exit status of a run that finished but in which rounds failed (no quorum by the deadline)
EXIT_ROUNDS_FAILED = 3


@contextmanager
def _stoppable(asynchronous: bool = False):
    """SIGINT/SIGTERM finish the current round (:class:`~edgefl.interrupt.StopRequest`), and a
    heartbeat line keeps a log alive while the server waits for devices."""
    from edgefl.heartbeat import Heartbeat
    from edgefl.interrupt import StopRequest

    with StopRequest(lambda text: err.print(f"[yellow]{text}[/]"), asynchronous) as stop, Heartbeat(err, every_s=10 if not err.is_terminal else 30,
                                                                                          enabled=True) as beat:
        yield stop, beat


@contextmanager
def _second_signal(run_path: Path):
    """A second Ctrl-C (or SIGTERM) stops at once: the run session has written what it had; say so
    and exit 130 like the first, instead of a bare "Aborted."."""
    try:
        yield
    except KeyboardInterrupt:
        err.print(f"interrupted at once (second signal); what was saved is in {run_path}")
        raise typer.Exit(130) from None


def _fail_on_interrupt(summary: dict, stop, run_path: Path, how_to_continue: str) -> None:
    if summary.get("interrupted"):
        err.print(f"interrupted ({stop.signal_name or 'SIGINT'}) after {summary.get('rounds_played')} of {summary.get('rounds')} "
                  f"rounds; models, summary and plots of what ran are in {run_path}{how_to_continue}")
        raise typer.Exit(130)


def _fail_on_failed_rounds(summary: dict, run_path: Path) -> None:
    """A run whose rounds failed did not achieve what was asked: say which, exit non-zero."""
    failed = summary.get("failed_rounds") or []
    if failed:
        from edgefl.safetext import console_text

        why = _failures(run_path)
        stage_failed = [r for r in failed if r in why]
        cause = "no quorum by the deadline" if not stage_failed else "; ".join(
            [f"round {r}: {console_text(why[r])}" for r in stage_failed[:5]] + (["..."] if len(stage_failed) > 5 else [])
            + (["the others: no quorum by the deadline"] if len(stage_failed) < len(failed) else []))
        err.print(f"[red]{len(failed)} of {summary.get('rounds', '?')} rounds failed[/] (rounds {failed}): {cause}; "
                  f"each device's receipt is in {run_path / 'metrics.jsonl'}")
        raise typer.Exit(EXIT_ROUNDS_FAILED)


def _failures(run_path: Path) -> dict[int, str]:
    """round -> why a stage failed it (the records' ``failure``), from the run's metrics.jsonl."""
    import json

    out: dict[int, str] = {}
    try:
        lines = (run_path / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("failure"):
            out[record.get("round")] = str(record["failure"])
    return out


class _EchoedEvents(logging.Filter):
    """Drops the log records that repeat an event the console printer already shows (the server
    logs each refusal for library users and simulations, and the fleet console prints the same
    refusal as an event line: without this, every refusal appeared twice)."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        super().__init__()
        self.kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "edgefl_event", None) not in self.kinds


@contextmanager
def _events_printed_not_logged(kinds: tuple[str, ...] = ("rejected", "warning"), logger: str = "edgefl.server"):
    """While a console prints these events, the logger does not repeat them."""
    server_log = logging.getLogger(logger)
    echo = _EchoedEvents(kinds)
    server_log.addFilter(echo)
    try:
        yield
    finally:
        server_log.removeFilter(echo)


def _device_echoes_dropped(same_console: bool):
    """Where the devices log to the server's console (a simulation, a fleet of threads), a device's
    "upload refused" repeats the server's "rejected from" line: dropped (a refusal showed twice)."""
    return _events_printed_not_logged(("upload-refused",), "edgefl.device") if same_console else nullcontext()


PER_DEVICE_LINES_MAX = 64  # larger fleets print counts: ten thousand "joined" lines help nobody


def _fleet_printer(console: Console, total: int, beat=None, devices: int = 0):
    """Fleet progress as lines: who joined, who uploaded, round state (and the status a
    :class:`~edgefl.heartbeat.Heartbeat` repeats while the server waits). A fleet of more than
    PER_DEVICE_LINES_MAX devices gets no line per device, only the round's counts. Ids, statuses
    and reasons can come from the network: escaped (no markup, no control characters)."""
    from edgefl.report import lr_note, stage_notes
    from edgefl.safetext import console_text as safe

    waiting: dict[str, Any] = {}
    per_device = devices <= PER_DEVICE_LINES_MAX

    def on_event(kind: str, info: dict) -> None:
        if beat is not None:
            beat.printed()
            if kind == "round":
                waiting.update(round=info["round"], selected=len(info["selected"]), reported=0)
            elif kind == "upload" and waiting:
                waiting["reported"] += 1
            elif kind == "evaluating":
                beat.status(f"round {info['round']}/{total}: evaluating")
            elif kind == "stage":
                beat.status(f"round {info['round']}/{total}: stage {safe(info['stage'])}, waiting for {info['asked']} devices")
            if kind in ("round", "upload") and waiting:
                beat.status(f"round {waiting['round']}/{total}: {waiting['reported']}/{waiting['selected']} devices reported, waiting")
        if kind == "twins":  # said whatever --per-device: a fleet misconfigured, not one device's news
            console.print(f"warning: two processes run as device {safe(info['device'])}: one that started earlier came online after a "
                          "newer one (each takes the broker connection from the other until the older sees the newer and "
                          "stops); give every device its own --device-id")
            return
        if kind in ("presence", "upload", "late", "enrolled") and not per_device:
            return
        if kind == "presence":
            console.print(f"  {safe(info['device'])} {'joined' if info['online'] else 'went offline'}")
        elif kind == "resumed":
            console.print(f"resuming at round {info['round']}")
        elif kind == "joined":
            missing = info["missing"]
            declined = info.get("declined") or []
            console.print(f"{info['online']} devices {'ready' if 'declined' in info else 'online'}"
                          + (f"; starting without {safe(_few(missing), 1000)}" if missing else "")
                          + (f"; declined: {safe(_few(declined), 1000)}" if declined else ""))
        elif kind == "enrolled":
            console.print(f"  {safe(info['device'])} ready: {info.get('samples')} samples of its own ({info.get('validation')} held out)"
                          + (f", {safe(info['source'], 200)}" if info.get("source") else ""))
        elif kind == "declined":
            console.print(f"  [yellow]{safe(info['device'])} declined[/]: {safe(info['reason'], 500)}")  # whole: enrolment keeps 500 characters
        elif kind == "warning":
            console.print(f"  [yellow]{safe(info['device'])}[/]: {safe(info['reason'], 700)}")  # whole: the reason is the point
        elif kind == "round":
            console.print(f"[bold]round {info['round']}/{total}[/]: {len(info['selected'])} devices selected")
        elif kind == "upload":
            console.print(f"  {safe(info['device'])} uploaded ({safe(info['status'])})")
        elif kind == "late":
            console.print(f"  {safe(info['device'])} late upload for round {info['round']} ({safe(info['status'])})")
        elif kind == "rejected":
            console.print(f"  [yellow]{safe(info['device'])} rejected[/]: {safe(info['reason'])}")
        elif kind == "extended":
            console.print(f"  [yellow]round {info['round']} extended[/]: {info['reported']} of {info['quorum']} needed")
        elif kind == "stage":
            console.print(f"  round {info['round']} stage {safe(info['stage'])}: {info['asked']} devices asked")
        elif kind == "stage_failed":
            console.print(f"  [red]round {info['round']} failed in stage {safe(info['stage'])}[/]")
        elif kind == "closed" and info.get("mode") == "async":  # no rounds: a record after some server updates
            acc = info["accuracy"]
            reporters = info.get("reports_per_client") or {}
            console.print(f"update {info['round']}/{total}: {info.get('reports', 0)} reports from {len(reporters)} devices"
                          + (f" ({safe(_few(sorted(reporters)), 1000)})" if reporters and per_device else "")
                          + (f", acc {acc['overall']:.4f}" if acc and acc.get("overall") is not None else "")
                          + f", {info['round_time_s']:.1f}s"
                          + "".join(f", {safe(note, 1000)}" for note in stage_notes(info)))
        elif kind == "closed":
            acc = info["accuracy"]
            console.print(f"round {info['round']} {info['outcome']}: {len(info['reported'])}/{len(info['selected'])} reported"
                          + (f" (target {info['target']}, {len(info['late'])} late)" if info.get("target", 0) < len(info["selected"]) else "")
                          + (f", missing {safe(_few(info['missing']), 1000)}" if info["missing"] else "")
                          + (f", acc {acc['overall']:.4f}" if acc else "") + f", {info['round_time_s']:.1f}s"
                          + "".join(f", {safe(note, 1000)}" for note in stage_notes(info))
                          + (f", {safe(rate, 1000)}" if (rate := lr_note(info)) else ""))
    return on_event



def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _few(ids: list[str], show: int = 8) -> str:
    return ", ".join(ids[:show]) + (f" and {len(ids) - show} more" if len(ids) > show else "")


@app.command()
def fleet(
    config: Annotated[Optional[Path], typer.Argument(help="run config (TOML); omitted: the embedded preset")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="override a key, e.g. --set rounds=3 (repeatable)")] = [],  # noqa: B006
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="run directory")] = None,
    broker: Annotated[Optional[str], typer.Option(help="use this broker instead of starting mosquitto (memory://NAME: no broker, "
                                                       "the devices are threads of this process)")] = None,
    preset: Annotated[str, typer.Option(help="embedded config when CONFIG is omitted")] = "demo",
    keep: Annotated[bool, typer.Option("--keep", help="keep the temporary folder (device logs, broker files) after a clean run too "
                                                      "(it is always kept when the run fails)")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the run in --out when it recorded no round")] = False,
    data_dir: DataDir = None,
    track: Track = None,
    dashboard: DashboardAt = None,
) -> None:
    """A fleet on this machine: a broker, the server and one process per device, over MQTT (or,
    with --broker memory://NAME, the server and one thread per device in this process)."""
    from edgefl.build import build_run
    from edgefl.config import load_config
    from edgefl.fleet.launcher import run_fleet
    from edgefl.rundir import RunDir

    if broker is not None:
        from edgefl.transport.registry import transport_for

        transport_for(broker)  # a scheme of no transport is refused before anything is built or written
    cfg = load_config(config, _cli_overrides(set_, data_dir, track), preset)
    from edgefl.sim.engine import check_simulable

    check_simulable(cfg, "a local fleet started from one config")
    from edgefl.sim.kept_clients import refuse_outside_simulation

    refuse_outside_simulation(cfg, "edgefl fleet")
    parts = build_run(cfg)  # config, data and models checked before anything is written
    _say_data(parts)
    run = RunDir.create(out_dir, cfg.name, cfg.seed, overwrite=overwrite)
    kind = "threads" if (broker or "").startswith("memory://") else "processes"  # memory://: every device a thread of this process
    err.print(f"[bold]{escape(cfg.name)}[/]: {cfg.method.name} fleet of {cfg.fleet.num_clients} device {kind}, {cfg.rounds} rounds")
    err.print(f"run directory: {run.path}")
    board = _open_dashboard(run.path, dashboard)
    with _stoppable(cfg.mode == "async") as (stop, beat), _discarded_on_failure(run), _second_signal(run.path), _events_printed_not_logged(), \
            _device_echoes_dropped(kind == "threads"):
        summary = run_fleet(cfg, config, run, err, broker, on_event=_fleet_printer(err, cfg.rounds, beat, cfg.fleet.num_clients), parts=parts,
                            should_stop=stop.requested, keep=keep)
    if board is not None:  # the page of the finished run: edgefl dashboard RUN_DIR
        board.stop()
    acc = summary["final_accuracy"]
    out.print(f"final accuracy {acc['overall']:.4f}" if acc else "no evaluated round")
    out.print(f"run directory: {run.path}")
    _fail_on_interrupt(summary, stop, run.path, "")
    _fail_on_failed_rounds(summary, run.path)


#: --broker of edgefl server and client: the scheme picks the transport (edgefl.transport.registry)
BROKER_HELP = "broker URL: mqtt://HOST:PORT, mqtts://HOST:PORT for TLS (docs/deploy.md)"


def _reachable_broker(broker: str, command: str) -> None:
    """Refuse, before anything is built or written, a broker URL of no registered transport
    (naming those there are) or of one that only this process reaches (memory://)."""
    from edgefl.transport.registry import transport_for

    if transport_for(broker).in_process:
        raise EdgeflError(f"edgefl {command} --broker {broker}: that transport reaches only this process, so nothing could join it",
                          hint="a server and its devices in one process: edgefl fleet --broker " + broker)


@contextmanager
def _discarded_on_failure(run):
    """A run that fails before its first round (no broker, a bad password) leaves no run
    directory behind to block the same command's re-run; one with rounds is kept as it is."""
    try:
        yield
    except BaseException:
        if run is not None and run.path.is_dir() and not run.recorded_rounds():
            try:
                run.discard_unrecorded(written_here=True)
                err.print(f"removed the run directory {run.path}: the run failed before its first round")
            except (EdgeflError, OSError) as exc:
                err.print(f"[yellow]kept the run directory {run.path}[/]: {exc}")
        raise


@app.command()
def server(
    broker: Annotated[str, typer.Option(help=BROKER_HELP)],
    config: Annotated[Path, typer.Option(help="run config (TOML)")],
    set_: Annotated[list[str], typer.Option("--set", help="override a key (repeatable)")] = [],  # noqa: B006
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="run directory")] = None,
    username: Annotated[Optional[str], typer.Option(help="MQTT username")] = None,
    password_env: Annotated[str, typer.Option(help="environment variable holding the MQTT password")] = "EDGEFL_MQTT_PASSWORD",
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file", help="CA certificate of a TLS broker")] = None,
    resume: Annotated[bool, typer.Option(help="continue the interrupted run in --out from its last saved round")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the run in --out when it recorded no round "
                                                                  "(a run with rounds is never replaced)")] = False,
    signing_key: Annotated[Optional[Path], typer.Option(
        "--signing-key", help="sign every message to the devices with this Ed25519 key (server-signing.key from edgefl broker-config); "
                              "devices given its .pub refuse anything unsigned")] = None,
    data_dir: DataDir = None,
    track: Track = None,
    dashboard: DashboardAt = None,
) -> None:
    """Run the server half of a config over MQTT (the GPU server of a real fleet)."""

    from edgefl.build import build_run
    from edgefl.config import load_config
    from edgefl.fleet.launcher import serve
    from edgefl.rundir import RunDir

    _reachable_broker(broker, "server")
    cfg = load_config(config, _cli_overrides(set_, data_dir, track), "demo")
    from edgefl.sim.kept_clients import refuse_outside_simulation

    refuse_outside_simulation(cfg, "edgefl server")
    parts = build_run(cfg)  # config, data and models checked before anything is written
    _say_data(parts)
    if resume:
        if out_dir is None:
            raise EdgeflError("--resume needs --out: the run directory of the interrupted run")
        run = RunDir(out_dir)
        if run.finished():  # resuming would rewrite its summary, models and plots with nothing played
            err.print(f"{run.path} holds a finished run: nothing to resume (its results stay as they are)")
            return
    else:
        run = RunDir.create(out_dir, cfg.name, cfg.seed, overwrite=overwrite)
    err.print(f"run directory: {run.path}; waiting for {cfg.fleet.num_clients} devices on {broker}")
    board = _open_dashboard(run.path, dashboard)
    with (_stoppable(cfg.mode == "async") as (stop, beat), _discarded_on_failure(run if not resume else None), _second_signal(run.path),
          _events_printed_not_logged()):
        summary = serve(cfg, broker, run, err, _fleet_printer(err, cfg.rounds, beat, cfg.fleet.num_clients), username, os.environ.get(password_env),
                        str(ca_file) if ca_file else None, resume=resume, parts=parts, should_stop=stop.requested, signing_key=signing_key)
    if board is not None:  # the page of the finished run: edgefl dashboard RUN_DIR
        board.stop()
    acc = summary["final_accuracy"]
    out.print(f"final accuracy {acc['overall']:.4f}" if acc else "no evaluated round")
    _fail_on_interrupt(summary, stop, run.path, f" (continue it: edgefl server ... --out {run.path} --resume)")
    _fail_on_failed_rounds(summary, run.path)


@app.command()
def client(
    broker: Annotated[str, typer.Option(help=BROKER_HELP)],
    device_id: Annotated[str, typer.Option("--device-id", help="this device's id in the federation, e.g. client-3")],
    data: Annotated[Optional[Path], typer.Option(
        "--data", help="this device's own data (a folder of images per class, IDX files, a CSV/Parquet table, .npz or "
                       ".safetensors): the server sends the task (docs/your-data.md)")] = None,
    federation: Annotated[Optional[str], typer.Option(
        help="the federation to join (the server's network.federation, else its run name); not needed with --config")] = None,
    loader: Annotated[Optional[str], typer.Option(help="read --data with your own function: module:function or file.py:function")] = None,
    profile: Annotated[Optional[str], typer.Option(
        help="this device's profile (catalog id or a file from edgefl device-profile), sent to the server, which refuses a device "
             "too small for its model")] = None,
    config: Annotated[Optional[Path], typer.Option(
        help="simulation-style share instead of --data: the server's run config, and --data-dir with the whole data set; the "
             "device takes the share the simulation of that config would give it")] = None,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="with --config: the folder of the run's data set")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="with --config: override a key (repeatable)")] = [],  # noqa: B006
    timeout: Annotated[Optional[float], typer.Option(help="give up after this many seconds")] = None,
    username: Annotated[Optional[str], typer.Option(help="MQTT username (default: the device id)")] = None,
    password_env: Annotated[str, typer.Option(help="environment variable holding the MQTT password")] = "EDGEFL_MQTT_PASSWORD",
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file", help="CA certificate of a TLS broker")] = None,
    state_dir: Annotated[Optional[Path], typer.Option(
        "--state-dir", help="where the device keeps its model and method state to resume after a crash "
                            "(default: $XDG_STATE_HOME/edgefl/FEDERATION/DEVICE)")] = None,
    keep_state: Annotated[bool, typer.Option("--keep-state/--no-state", help="save state after every round")] = True,
    broker_wait: Annotated[float, typer.Option(
        "--broker-wait", help="keep trying to reach the broker for this many seconds (inf: until it answers, for a device "
                              "started at boot; 0: give up at once)")] = 0.0,
    server_key: Annotated[Optional[Path], typer.Option(
        "--server-key", help="the server's public key (server-signing.pub from edgefl broker-config): refuse every server "
                             "message it did not sign")] = None,
) -> None:
    """Run one device of a fleet over MQTT (what a Raspberry Pi or Jetson runs): on its own data
    (--data; the task comes from the server), or on the share of a run config (--config)."""

    from edgefl.fleet.launcher import device_state_dir, federation as federation_of, run_device, run_device_held

    _reachable_broker(broker, "client")
    password = os.environ.get(password_env)
    user = username or (device_id if password else None)
    from edgefl.transport.signing import Verifier

    verifier = Verifier.load(server_key) if server_key is not None else None
    if verifier is None:
        err.print("[yellow]note:[/] no --server-key: this device cannot tell the server's messages from forged ones "
                  "(docs/deploy.md, signing)")
    if config is None:
        if data is None:
            raise EdgeflError("edgefl client needs the device's own data (--data PATH) or a run config (--config RUN.toml)",
                              hint="a real device: --data /path/to/its/samples --federation NAME (docs/your-data.md)")
        if data_dir is not None or set_:
            raise EdgeflError("--data-dir and --set belong to --config (the simulation-style share)",
                              hint="a device with its own data needs only --data (and --federation)")
        fed = federation or "edgefl"
        if federation is None:
            err.print("[yellow]note:[/] no --federation: joining 'edgefl' (broker-config's default); the server prints its federation")
        if keep_state and state_dir is None:
            state_dir = device_state_dir(fed, device_id)
        raw_profile = None
        if profile is not None:
            from edgefl.profile import load_profile

            raw_profile = load_profile(profile).to_dict()
        with _device_stopped(device_id, state_dir if keep_state else None):
            results = run_device_held(device_id, broker, fed, data, loader=loader, profile=raw_profile, timeout_s=timeout, username=user,
                                      password=password, ca_file=str(ca_file) if ca_file else None,
                                      state_dir=state_dir if keep_state else None,
                                      say=lambda text: err.print(text, markup=False, highlight=False),
                                      broker_wait_s=broker_wait, verifier=verifier, progress=_device_progress)
        err.print(f"{device_id}: {len(results)} rounds served")
        return
    from edgefl.config import load_config

    if data is not None and data_dir is None:
        data_dir = data  # --config with --data: the data set's folder, as before
    cfg = load_config(config, _cli_overrides(set_, data_dir), "demo")
    from edgefl.sim.kept_clients import refuse_outside_simulation

    refuse_outside_simulation(cfg, "edgefl client")
    if federation is not None and federation != federation_of(cfg):
        raise EdgeflError(f"--federation {federation} differs from the config's {federation_of(cfg)}", hint="drop --federation with --config")
    if keep_state and state_dir is None:
        state_dir = device_state_dir(federation_of(cfg), device_id)
    with _device_stopped(device_id, state_dir if keep_state else None):
        results = run_device(cfg, device_id, broker, timeout, user, password,
                             str(ca_file) if ca_file else None, state_dir if keep_state else None, broker_wait_s=broker_wait,
                             verifier=verifier, progress=_device_progress)
    err.print(f"{device_id}: {len(results)} rounds served")


@contextmanager
def _device_stopped(device_id: str, state_dir: Path | None):
    """Ctrl-C of `edgefl client` says what it leaves and exits 130 (it exited without a word)."""
    try:
        yield
    except KeyboardInterrupt:
        kept = (f"; its state is in {state_dir}: started again with the same command it goes on in the server's run"
                if state_dir is not None else " (--no-state: nothing kept)")
        err.print(f"{device_id}: stopped{kept}")
        raise typer.Exit(130) from None


def _device_progress(line: str) -> None:
    """A device's line a round (its journal under systemd): ids come from the config, statuses from
    the server, both printable-escaped by the device loop."""
    err.print(line, markup=False, highlight=False)


@app.command()
def loadgen(
    broker: Annotated[str, typer.Option(help="mqtt://HOST:PORT of the fleet's broker")],
    config: Annotated[Path, typer.Option(help="the run config the server uses (TOML)")],
    devices: Annotated[Optional[str], typer.Option(help="which of the fleet's devices this process plays: A:B (indices, "
                                                        "end exclusive); default all")] = None,
    data_dir: DataDir = None,
    set_: Annotated[list[str], typer.Option("--set", help="override a key (repeatable)")] = [],  # noqa: B006
    compute_s: Annotated[float, typer.Option(help="median seconds a device takes from download to upload")] = 1.0,
    compute_spread: Annotated[float, typer.Option(help="sigma of the lognormal spread around it")] = 0.5,
    dropout: Annotated[float, typer.Option(help="chance that a selected device drops out of its round")] = 0.0,
    rejoin_s: Annotated[float, typer.Option(help="seconds a dropped device stays offline")] = 30.0,
    churn: Annotated[float, typer.Option(help="random disconnects per device per minute (each reconnects)")] = 0.0,
    connect_per_s: Annotated[float, typer.Option(help="connections opened per second at start")] = 2000.0,
    seed: Annotated[int, typer.Option(help="seeds delays, drop-outs and churn")] = 0,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 3600.0,
    stats: Annotated[Optional[Path], typer.Option(help="write what the devices saw (per round: published, accepted, late, "
                                                       "refused, unanswered) to this JSON file")] = None,
    username: Annotated[Optional[str], typer.Option(help="MQTT username for every device (default: none)")] = None,
    password_env: Annotated[str, typer.Option(help="environment variable holding the MQTT password")] = "EDGEFL_MQTT_PASSWORD",
) -> None:
    """Play many devices of a fleet from one process: protocol-level devices (the real device loop
    and MQTT session each, uploads made by one real client half per architecture) with compute
    delays, drop-outs and reconnects, to load a server and broker with thousands of devices."""
    import json

    from edgefl.config import load_config
    from edgefl.fleet.swarm import LoadSettings, run_load
    from edgefl.transport.topics import device_ids

    cfg = load_config(config, _cli_overrides(set_, data_dir), "demo")
    from edgefl.sim.kept_clients import refuse_outside_simulation

    refuse_outside_simulation(cfg, "edgefl loadgen")
    ids = device_ids(cfg.fleet.num_clients)
    if devices is not None:
        try:
            a, b = (int(v) if v else None for v in devices.split(":"))
        except ValueError:
            raise EdgeflError(f"--devices {devices!r}: expected A:B, e.g. 0:5000") from None
        if (a or 0) >= len(ids) or (b is not None and b > len(ids)):
            err.print(f"[yellow]warning:[/] --devices {devices} reaches past the fleet's {len(ids)} devices (0:{len(ids)})")
        ids = ids[a:b]
        if not ids:
            raise EdgeflError(f"--devices {devices!r} selects none of the fleet's {cfg.fleet.num_clients} devices")
    settings = LoadSettings(compute_s, compute_spread, dropout, rejoin_s, churn, connect_per_s, seed)
    from edgefl.fleet.launcher import federation

    err.print(f"connecting {len(ids)} devices ({ids[0]} .. {ids[-1]}) of federation {federation(cfg)!r} to {broker} "
              "(the server must run the same config)")
    result = run_load(cfg, broker, ids, settings, timeout_s=timeout, username=username, password=os.environ.get(password_env),
                      on_connected=lambda s: err.print(f"{len(ids)} devices connected in {s:.1f} s"))
    if stats is not None:
        stats.write_text(json.dumps(result, indent=1))
    if result["interrupted"]:
        err.print(f"interrupted: {result['finished']}/{len(ids)} devices had seen the run end" + (f"; stats in {stats}" if stats else ""))
        raise typer.Exit(130)
    done = result["finished"]
    err.print(f"{done}/{len(ids)} devices saw the run end; {result['template_fits']} template trainings; "
              f"{result['disconnects']} disconnects")
    if done < len(ids):
        raise typer.Exit(1)


@app.command("broker-config")
def broker_config(
    devices: Annotated[int, typer.Option(help="how many devices get a credential")],
    out_dir: Annotated[Path, typer.Option("--out", help="folder to write (must not hold a configuration yet)")],
    federation: Annotated[str, typer.Option(help="the federation the ACL confines devices to (network.federation)")] = "edgefl",
    port: Annotated[int, typer.Option(help="listener port")] = 8883,
    tls: Annotated[bool, typer.Option("--tls/--no-tls", help="TLS listener (certificates made with openssl)")] = True,
    hostname: Annotated[str, typer.Option(help="the broker's host name, for its certificate")] = "localhost",
    bind: Annotated[Optional[str], typer.Option(help="the address the listener binds (an address of the broker's machine; "
                                                     "127.0.0.1: this machine only); default: every interface")] = None,
) -> None:
    """Write a mosquitto configuration for a real fleet: TLS, one password per device, an ACL per device."""
    from edgefl.fleet.broker_config import write_broker_config

    made = write_broker_config(out_dir, devices, federation, port, tls, hostname, bind=bind)
    out.print(f"wrote {made.config}")
    out.print(f"  listener: port {port} on {made.bind or 'every interface'}")
    out.print(f"  passwords for {len(made.devices)} devices and the server: {made.passwords} (plain text once: {made.credentials})")
    out.print(f"  ACL: {made.acl}")
    if made.signing_key is not None:
        out.print(f"  server signing key: {made.signing_key} (edgefl server --signing-key; keep it with the server), "
                  f"{made.signing_key.with_suffix('.pub')} for every device (edgefl client --server-key)")
    if made.certs is not None:
        have = (made.certs / "server.crt").exists()
        out.print(f"  TLS: {made.certs}" + ("" if have else " [yellow](openssl not found: run the commands in certs/README)[/]"))
    out.print(f"start it with: mosquitto -c {made.config}   (docs/deploy.md)")


def _export_formats_help() -> str:
    """The registered export formats, one paragraph each, for `edgefl export --help` (the registry
    is light: listing it imports no converter)."""
    from edgefl.exporters.registry import FORMATS

    return "Formats:\n\n" + "\n\n".join(f"{name}: {cls.summary}" for name, cls in FORMATS.items())


@app.command(epilog=_export_formats_help())
def export(
    source: Annotated[Path, typer.Argument(help="a run directory, or a .safetensors weights file")],
    format_: Annotated[str, typer.Option("--format", help="comma-separated export formats (listed below)")] = "onnx,tflite",
    int8: Annotated[bool, typer.Option("--int8", help="also write int8 files, calibrated on real training samples")] = False,
    batch: Annotated[int, typer.Option(help="the fixed batch of the phone files (a TFLite file keeps it: resizing it at run "
                                            "time fails under the XNNPACK delegate; the dynamic-batch ONNX file takes any)")] = 1,
    dynamic_batch: Annotated[bool, typer.Option("--dynamic-batch/--no-dynamic-batch", help="also write a dynamic-batch ONNX file")] = True,
    channels_last: Annotated[Optional[bool], typer.Option("--channels-last/--channels-first",
                                                          help="TFLite image inputs/outputs NHWC (the default, TFLite's "
                                                               "convention) or NCHW like PyTorch; ONNX files stay NCHW")] = None,
    micro: Annotated[bool, typer.Option("--micro", help="also TFLite Micro (the micro format): integer-only int8 file as a C array "
                                                         "(NAME.int8.h), the op resolver it needs and its measured tensor arena")] = False,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="output folder (default RUN_DIR/export)")] = None,
    model: Annotated[Optional[str], typer.Option(help="architecture of a weights file without metadata")] = None,
    select: Annotated[Optional[str], typer.Option(help="only the run's models whose file name contains this (among all it saved)")] = None,
    every: Annotated[bool, typer.Option("--all", help="every model the run saved, each device's private model included (default: what "
                                                      "ship.json ships to phones)")] = False,
    dataset: Annotated[Optional[str], typer.Option(help="dataset for parity and calibration (default: the one trained on)")] = None,
    data_dir: DataDir = None,
) -> None:
    """Export what a run ships to phones (RUN_DIR/ship.json: the global model of each architecture,
    or for FedHe, CHFL and other per-device methods the best device's model per architecture), or
    any zoo model's weights file, to ONNX and TFLite, checked against PyTorch."""
    formats = tuple(f.strip() for f in format_.split(",") if f.strip())
    _export_and_print(source, out_dir, formats, int8, batch, dynamic_batch, channels_last, model, select, dataset, data_dir, micro, every)


def _export_footer(formats: tuple[str, ...], int8: bool) -> str:
    """What the table's columns promise, for the formats this export wrote (no word of a file it did not)."""
    said = ["float files match PyTorch within rtol 1e-4 / atol 1e-5"]
    if int8 and "tflite" in formats:
        said.append("int8 TFLite files are integer-only")
    if int8 and "onnx" in formats:
        said.append("int8 ONNX files keep float inputs and outputs")
    said.append("latency: median of one call at the file's batch on one thread here")
    said.append("each file has a .json sidecar (names, shapes, dtypes, quantisation, normalisation, labels, SHA-256)")
    return "; ".join(said)


def _export_and_print(source, out_dir, formats, int8, batch, dynamic_batch, channels_last, model, select, dataset,
                      data_dir=None, micro=False, every=False) -> None:
    from rich.table import Table

    from edgefl.exporters import default_out_dir, export_model, sources_from_path
    from edgefl.exporters.registry import chosen_formats

    if not formats:
        raise EdgeflError("--format names no format: nothing would be exported", hint="--format onnx,tflite (or one of them)")
    if micro and "tflite" not in formats:
        raise EdgeflError("--micro needs the TFLite format", hint="--format tflite (or onnx,tflite)")
    chosen = chosen_formats((*formats, *(("micro",) if micro else ())))  # an unknown name gets a did-you-mean
    for fmt in chosen:  # a missing converter is said before any model is loaded
        fmt.check_available()
    formats = tuple(fmt.name for fmt in chosen)
    failed: list[tuple[str, EdgeflError | OSError]] = []  # one model's failure: reported, the others still exported
    sources = sources_from_path(source, model=model, select=select, every=every, on_error=lambda f, exc: failed.append((f.stem, exc)))
    unnamed = [s.name for s in sources if s.kind == "classifier" and not s.dataset]
    if not dataset and sources and len(unnamed) == len(sources):  # a bare file (a device's model): a usage error, said first
        from edgefl.exporters.export import no_dataset_error

        raise no_dataset_error(unnamed)
    out_dir = default_out_dir(source) if out_dir is None else out_dir
    total = len(sources) + len(failed)
    created = not Path(out_dir).exists()
    _check_writable(Path(out_dir))
    ds = None
    if (dataset or data_dir) and (dataset or sources):  # no model loaded and no --dataset: nothing to load it for
        from edgefl.data import load_dataset

        ds = load_dataset(dataset or sources[0].dataset, data_dir)
    table = Table(title=f"exports in {out_dir}")
    for col in ("file", "size", "precision", "batch", "max |diff|", "test acc", "agree", "latency", "mobile / micro"):
        table.add_column(col, justify="left" if col == "file" else "right")
    for name, _ in failed:
        table.add_row(f"[red]{name}: FAILED[/] (not loadable)", "-", "-", "-", "-", "-", "-", "-", "reason below")
    try:
        with err.status("exporting") as status:
            for src in sources:
                try:
                    files = export_model(src, out_dir, formats=formats, int8=int8, batch=batch, dynamic_batch=dynamic_batch,
                                         channels_last=channels_last, dataset=ds,
                                         log=lambda m, s=src: status.update(f"{s.name}: {m}"))
                except (EdgeflError, OSError) as exc:
                    failed.append((src.name, exc))
                    table.add_row(f"[red]{src.name}: FAILED[/] (no file of it kept)", "-", "-", "-", "-", "-", "-", "-", "reason below")
                    continue
                _add_rows(table, files)
    except KeyboardInterrupt:
        out.print(table)
        err.print("interrupted: the table shows what was exported before")
        raise typer.Exit(130) from None
    exported = len(failed) < total
    if exported:
        out.print(table)
        out.print(_export_footer(formats, int8))
    plan = Path(source) / "ship.json"
    if plan.is_file() and not every and not select and not failed:  # which of these files each phone class gets (edgefl assign)
        import json

        for phone, pick in (json.loads(plan.read_text()).get("phones") or {}).items():
            out.print(f"{phone}: {pick.get('arch') or 'nothing fits'} ({pick.get('why', '')})", markup=False, highlight=False)
    if failed:
        for name, exc in failed:  # the whole reason and what to do, which the table's cell cannot hold
            hint = getattr(exc, "hint", None)
            err.print(f"[red]{escape(name)}[/]: {escape(_reason(exc))}" + (f"\n  hint: {escape(hint)}" if hint else ""))
        if created and Path(out_dir).is_dir() and not any(Path(out_dir).iterdir()):
            Path(out_dir).rmdir()  # nothing was exported: no empty folder left behind
        err.print(f"[red]{len(failed)} of {total} models failed[/]: {', '.join(name for name, _ in failed)}")
        from edgefl.exporters.export import NotItsDataset

        # the data set passed fits none of the failed models: bad input (2), as a usage error is
        raise typer.Exit(2 if all(isinstance(exc, NotItsDataset) for _, exc in failed) else 1)


def _reason(exc: EdgeflError | OSError) -> str:
    return exc.message if isinstance(exc, EdgeflError) else f"{exc.strerror or exc} ({getattr(exc, 'filename', '')})"


def _check_writable(folder: Path) -> None:
    """A folder that cannot take the files is one line with a hint, before any work."""
    from edgefl.userdirs import check_writable

    check_writable(folder, "into", "pass a writable folder with --out, or free some space")


def _add_rows(table, files) -> None:
    for f in files:
        mob, micro, lat = f.extra.get("mobile_usability"), f.extra.get("micro"), f.extra.get("latency")
        notes = []
        if mob:
            notes.append(f"NNAPI {mob['nnapi']['supported_nodes']}/{mob['nnapi']['nodes']}")
        if f.extra.get("integer_only"):
            notes.append("integer-only")
        if micro:
            notes.append(f"TFLM arena {_bytes(micro['arena_bytes'])}, {micro['c_header']}")
        table.add_row(
            f.path.name, _bytes(f.path.stat().st_size), f.precision, "dynamic" if f.batch is None else str(f.batch),
            f"{f.parity.max_abs_diff:.1e}" if f.parity else (f"rel {f.extra['relative_error']:.1e}" if "relative_error" in f.extra else "-"),
            "-" if f.accuracy is None else f"{f.accuracy:.4f}", "-" if f.agreement is None else f"{f.agreement:.3f}",
            "-" if not lat else f"{lat['median_ms']:.3g} ms", ", ".join(notes) or "-",
        )


@app.command()
def models(
    num_classes: Annotated[int, typer.Option(help="classes of the head")] = 10,
    input_shape: Annotated[str, typer.Option(help="input shape without batch, e.g. 1,28,28")] = "",
    phones: Annotated[bool, typer.Option("--phones", help="also say which models export as ExecuTorch training programs "
                                         "(edgefl export --format executorch-train), and why not (needs the phones extra; slow)")] = False,
) -> None:
    """List the model zoo: parameters and FLOPs per sample are measured on the default input."""
    from edgefl.models import get_spec, model_info, model_names
    from edgefl.models.registry import dp_sgd_status

    table = Table(title="edgefl model zoo (FLOPs = 2 x multiply-adds, forward, batch 1; DP-SGD: trains with train.dp_sgd as it "
                        "is, or with options.norm = \"group\")")
    for col, justify in (("name", "left"), ("kind", "left"), ("params", "right"), ("FLOPs/sample", "right"),
                         ("input", "left"), ("feature width", "right"), ("DP-SGD", "left"), ("description", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "description")  # type: ignore[arg-type]
    from rich.progress import track

    from edgefl.heartbeat import Heartbeat

    with Heartbeat(err) as beat:
        infos, dp_sgd = {}, {}
        for name in track(model_names(), description="measuring the zoo (cached after the first run)", console=err, transient=True):
            beat.status(f"measuring {name}")
            shape = tuple(int(s) for s in input_shape.split(",")) if input_shape else None
            if shape is not None and get_spec(name).family == "mlp":
                shape = (int(sum(shape)),) if len(shape) == 1 else None
            infos[name] = model_info(name, num_classes=num_classes, input_shape=shape)
            dp_sgd[name] = dp_sgd_status(name)  # issue 36: whether Opacus' per-sample gradients take it at its defaults
    trains: dict[str, str] = {}
    if phones:  # issue 37: whether ExecuTorch's training path takes each model at its defaults
        from edgefl.exporters.executorch_train import trainability

        table.add_column("phone training (ExecuTorch)", justify="left")
        for name, info in infos.items():
            ok, reason = trainability(name, num_classes, tuple(info.input_shape))
            trains[name] = "yes" if ok else f"no: {reason}"
    for name, info in infos.items():
        table.add_row(name, info.kind, f"{info.params:,}", _si(info.flops_per_sample), "x".join(map(str, info.input_shape)),
                      str(info.feature_dim or "-"), dp_sgd[name], info.description, *([trains[name]] if phones else []))
    out.print(table)


@app.command("device-profile")
def device_profile(
    out_file: Annotated[Optional[Path], typer.Option("--out", help="write the profile (catalog schema, TOML)")] = None,
    models_: Annotated[str, typer.Option("--models", help="comma-separated candidates, e.g. lenet5,resnet18:width=0.25")] = "",
    quick: Annotated[bool, typer.Option("--quick", help="two small models, short runs (under 20 s)")] = False,
    batch: Annotated[int, typer.Option(help="training batch size")] = 32,
    steps: Annotated[int, typer.Option(help="timed training steps per model")] = 5,
    broker: Annotated[Optional[str], typer.Option(help="also measure round trip and throughput to mqtt://HOST:PORT")] = None,
    profile_id: Annotated[Optional[str], typer.Option("--id", help="profile id (default: from the hostname)")] = None,
    device_class: Annotated[Optional[str], typer.Option("--class", help="mcu|sbc|jetson|phone|laptop|server (default: guessed)")] = None,
    runs_dir: Annotated[Path, typer.Option(help="where runs are kept (its free space is reported)")] = Path("."),
) -> None:
    """Measure this machine: identity, CPU, memory, storage, accelerator, matmul speed, and each
    candidate model's training step (time, effective GFLOP/s, peak memory in a child process)."""
    import tomli_w

    from edgefl.profile.measure import DEFAULT_MODELS, QUICK_MODELS, ModelCandidate, profile_host

    names = [m for m in models_.split(",") if m.strip()] or (QUICK_MODELS if quick else DEFAULT_MODELS)
    candidates = [ModelCandidate.parse(m) for m in names]
    if quick:
        steps, batch = min(steps, 3), min(batch, 16)
    total = 2 + len(candidates) + (1 if broker else 0)
    from rich.progress import Progress

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("measuring", total=total)

        def step(msg: str) -> None:
            progress.update(task, description=msg, advance=1)
            if not err.is_terminal:
                err.print(f"measuring {msg}")

        profile, details = profile_host(
            candidates, batch=batch, steps=steps, matmul_n=512 if quick else 1024, matmul_seconds=0.5 if quick else 2.0,
            runs_dir=runs_dir, broker=broker, profile_id=profile_id, device_class=device_class, on_step=step,
        )
    host = Table(title=f"device profile: {profile.name}")
    host.add_column("fact")
    host.add_column("value")
    for fact, value in (
        ("class", profile.device_class), ("os / arch", f"{profile.identity.os} / {profile.identity.arch}"),
        ("python / torch", f"{profile.identity.python} / {profile.identity.torch}"), ("cpu", profile.cpu.model),
        ("cores / clock", f"{_qty(profile.cpu.cores, lambda v: f'{v:g}')} / {_qty(profile.cpu.clock_mhz, lambda v: f'{v:g} MHz')}"),
        ("RAM / available", f"{_qty(profile.memory.ram_bytes, _bytes)} / {_qty(profile.memory.training_budget_bytes, _bytes)}"),
        ("free storage", _qty(profile.memory.storage_bytes, _bytes)),
        ("accelerator", profile.accelerator.name or profile.accelerator.type),
        ("matmul fp32", _qty(profile.compute.matmul_gflops, lambda v: f"{v:g} GFLOP/s")),
        ("effective training", _qty(profile.compute.effective_gflops, lambda v: f"{v:g} GFLOP/s")),
    ):
        host.add_row(fact, str(value))
    if "fit" in details:  # the cost model's host terms, fitted from the models below
        f = details["fit"]
        rate = lambda v: f"{v:.0f}" if v else "no term"  # noqa: E731  (0: the fit found no such term)
        host.add_row("step fit", f"{f['step_overhead_us'] / 1e3:.2f} ms + {f['conv_overhead_us']:.0f} us/conv call; conv "
                     f"{rate(f['conv_gflops'])}, transposed {rate(f['transposed_conv_gflops'])}, matmul {rate(f['linear_gflops'])} GFLOP/s; "
                     f"{f['random_ns_per_element']:.1f} ns/random number, {f['traffic_ns_per_byte']:.3f} ns/byte moved; "
                     f"optimizer {f['tensor_overhead_us']:.0f} us/tensor + {f['param_overhead_ns']:.2f} ns/param")
        host.add_row("memory fit", f"activations x {f['activation_factor']:.2f} + {f['largest_tensor_factor']:.1f} x largest "
                     f"parameter tensor + {_bytes(f['memory_overhead_bytes'])}")
    if "broker" in details:
        b = details["broker"]
        host.add_row("broker", f"{b['url']}: RTT {b['rtt_ms_p50']:.2f} ms (p50), {b['throughput_mbps']:.1f} Mbit/s")
    out.print(host)
    per_model = Table(title=f"training step, batch {batch} (peak memory measured in a child process)")
    for col in ("model", "params", "step", "train GFLOP/s", "inference / sample", "peak train memory", "note"):
        per_model.add_column(col, justify="left" if col in ("model", "note") else "right")
    for m in details["models"]:
        if "error" in m:
            per_model.add_row(m.get("label", m["model"]), "", "", "", "", "", f"[red]{m['error']}")
            continue
        per_model.add_row(m["label"], f"{m['params']:,}", f"{m['step_s'] * 1000:.1f} ms", f"{m['train_gflops']:.2f}",
                          f"{m['infer_s_per_sample'] * 1e3:.3f} ms", _bytes(m["train_memory_bytes"]),
                          f"cuda peak {_bytes(m['cuda_peak_bytes'])}" if "cuda_peak_bytes" in m else "")
    out.print(per_model)
    if out_file:
        doc = profile.to_dict()
        doc["measurements"] = {"models": [{k: v for k, v in m.items() if k != "step_s_all"} for m in details["models"]],
                               "matmul": details["matmul"], **({"broker": details["broker"]} if "broker" in details else {})}
        out_file.write_text(f"# written by edgefl device-profile; schema docs/profile-schema.md\n{tomli_w.dumps(doc)}")
        out.print(f"wrote {out_file}")


@app.command()
def assign(
    profile_ref: Annotated[Optional[str], typer.Option("--profile", help="a catalog id (edgefl profiles) or a profile TOML file "
                                                                         "(with --config: default the group's profile)")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="take the method, training settings, deadline, headroom, "
                                                                    "candidates and input shape from this run config")] = None,
    group: Annotated[Optional[int], typer.Option(help="with --config: the fleet group (0-based) to judge; default: the first "
                                                      "group with a profile, else 0")] = None,
    method: Annotated[Optional[str], typer.Option(help="the method the device joins (fedmho allows generator clients) "
                                                       "\\[default: fedavg, or the config's]")] = None,
    deadline: Annotated[Optional[float], typer.Option(help="round deadline, seconds \\[default: 60, or the config's clock.deadline_s]")] = None,
    headroom: Annotated[Optional[float], typer.Option(help="share of the training budget a round may use \\[default: 0.8, or the "
                                                           "config's clock.headroom]")] = None,
    samples: Annotated[Optional[int], typer.Option(help="training samples per round \\[default: 600, or the group's share of the "
                                                        "data set, x epochs, capped by train.max_steps]")] = None,
    epochs: Annotated[Optional[int], typer.Option(help="local epochs per round \\[default: 1]")] = None,
    batch: Annotated[Optional[int], typer.Option(help="batch size \\[default: 32, or the group's train.batch_size]")] = None,
    optimizer: Annotated[Optional[str], typer.Option(help="adam | momentum | sgd (optimizer state: 8 / 4 / 0 bytes per parameter) "
                                                          "\\[default: adam, or the group's]")] = None,
    models_: Annotated[str, typer.Option("--models", help="candidates (default: the config's clock.candidates, else the zoo "
                                                          "ladder), e.g. vgg9,cvae-small")] = "",
    data_dir: DataDir = None,
) -> None:
    """Pick the largest zoo model a device can train, and say which bound decided for every candidate."""
    import dataclasses

    from edgefl.profile import load_profile
    from edgefl.profile.assign import Budgets, assign as do_assign, measure_advice, parse_candidates

    budgets, shape, classes, candidates = Budgets(), (1, 28, 28), 10, None
    if config is not None:
        from edgefl.build import group_budgets, load_run_dataset
        from edgefl.config import load_config
        from edgefl.data.views import make_view

        cfg = load_config(config, _cli_overrides([], data_dir), "demo")
        groups = cfg.fleet.groups
        index = group if group is not None else next((i for i, g in enumerate(groups) if g.profile), 0)
        if not 0 <= index < len(groups):
            raise EdgeflError(f"--group {index}: {config} has fleet groups 0..{len(groups) - 1}")
        chosen_group = groups[index]
        ds = load_run_dataset(cfg)  # the group's share of the data set, its input shape and classes
        budgets = group_budgets(cfg, ds, chosen_group)
        shape = tuple(make_view(chosen_group.view, ds.input_shape, cfg.seed, "probe").output_shape if chosen_group.view else ds.input_shape)
        classes = ds.num_classes
        method = method or cfg.method.name
        profile_ref = profile_ref or chosen_group.profile
        if cfg.clock.candidates and not models_:
            candidates = parse_candidates(",".join(cfg.clock.candidates))
        err.print(f"{config}: fleet group {index} ({chosen_group.model}, {chosen_group.count} device(s)), {cfg.method.name}, "
                  f"{ds.name} {list(shape)}")
    elif group is not None:
        raise EdgeflError("--group needs --config (the run config whose fleet group to judge)")
    if profile_ref is None:
        raise EdgeflError("which device? pass --profile (a catalog id or a profile file)",
                          hint="or --config RUN.toml with a fleet group that names a profile (edgefl profiles lists the catalog)")
    explicit = {"headroom": headroom, "deadline_s": deadline, "samples": samples, "epochs": epochs, "batch": batch, "optimizer": optimizer}
    budgets = dataclasses.replace(budgets, **{k: v for k, v in explicit.items() if v is not None})  # an option beats the config
    if not 0 < budgets.headroom <= 1:
        raise EdgeflError(f"--headroom {budgets.headroom}: must be in (0, 1]")
    if budgets.optimizer not in ("adam", "momentum", "sgd"):
        raise EdgeflError(f"--optimizer {budgets.optimizer!r}: choose adam, momentum or sgd")
    profile = load_profile(profile_ref)
    method = method or "fedavg"
    if models_:
        candidates = parse_candidates(models_)
    from edgefl.heartbeat import Heartbeat

    with err.status("measuring each candidate's memory and time (cached after the first run)"), Heartbeat(err) as beat:
        beat.status(f"assign {profile.id}: measuring the candidates")
        result = do_assign(profile, budgets, method, candidates, input_shape=shape, num_classes=classes)
    table = Table(title=f"{profile.id}: {budgets.samples} samples x {budgets.epochs} epoch(s), batch {budgets.batch}, "
                        f"deadline {budgets.deadline_s:g} s, {budgets.headroom:.0%} of {_qty(profile.memory.training_budget_bytes, _bytes)}")
    for col in ("candidate", "kind", "params", "FLOPs/sample", "train memory", "round time", "verdict"):
        table.add_column(col, justify="right" if col in ("params", "FLOPs/sample", "train memory", "round time") else "left")
    for v in result.verdicts:
        e = v.estimate
        mark = "[bold green]chosen" if result.chosen is v else ("fits" if v.fits else f"[red]{v.bound}")
        if v.unchecked:
            mark += f" [dim](unchecked: {', '.join(v.unchecked)})"
        table.add_row(v.label, e.kind, f"{e.params:,}", _si(e.flops_per_sample), _bytes(e.train_memory_bytes),
                      "?" if e.round_s is None else f"{e.round_s:.1f} s", mark)
    out.print(table)
    mem = profile.memory
    mcu = profile.device_class == "mcu"
    if mem.runtime_bytes.known:
        out.print(f"the {'firmware' if mcu else 'edgefl client'} runtime itself takes {_bytes(mem.runtime_bytes.value)} "
                  f"({mem.runtime_bytes.kind}: {mem.runtime_bytes.source}); the training budget is at most RAM minus that")
    else:
        out.print(f"[yellow]this profile does not give the {'firmware' if mcu else 'client'} runtime's footprint[/] "
                  f"(memory.runtime_bytes): {measure_advice(profile, 'memory')}")
    if any(e.estimate.round_s is None for e in result.verdicts):
        out.print(f"[yellow]round times are unknown[/] (compute.effective_gflops): {measure_advice(profile, 'speed')}")
    if result.chosen is None:
        out.print(f"[bold red]{profile.id} cannot take part:[/] {result.reason}")
        raise typer.Exit(1)
    out.print(f"[bold]{profile.id} -> {result.chosen.label}[/]: {result.reason}")


@app.command()
def profiles() -> None:
    """List the shipped device profiles (firmware_profiles/): class, CPU, RAM, training budget, speed."""
    from edgefl.profile import catalog

    table = Table(title="edgefl device profiles (s = spec, m = measured, d = derived, ? = unknown)")
    for col in ("id", "class", "name", "cpu", "RAM", "training budget", "eff. GFLOP/s", "trains with"):
        table.add_column(col, no_wrap=col not in ("name",))
    for p in catalog().values():
        table.add_row(p.id, p.device_class, p.name, f"{p.cpu.model}", _qty(p.memory.ram_bytes, _bytes),
                      _qty(p.memory.training_budget_bytes, _bytes), _qty(p.compute.effective_gflops, lambda v: f"{v:g}"),
                      ", ".join(p.runtimes.trains_with) or "-")
    out.print(table)


def _option_list(model) -> str:
    """``key (default), ...`` of an options model (a default made by a factory shown as made)."""
    fields = model.model_fields.items()
    return ", ".join(f"{key} (required)" if field.is_required() else f"{key} ({field.get_default(call_default_factory=True)!r})"
                     for key, field in fields)


@app.command()
def methods() -> None:
    """List the methods a run's \\[method] name can be, with what they send and their options (plug-ins included)."""
    from rich.markup import escape

    from edgefl.methods import METHODS

    table = Table(title=escape("edgefl methods ([method] name = ... plus options; docs/methods.md, plug-ins: docs/adding-a-method.md)"))
    for col in ("name", "what it does", "uploads / downloads", "traits", "options (default)", "from"):
        table.add_column(col, no_wrap=col == "name")
    for name, spec in sorted(METHODS.items()):
        traits = [t for t, on in (("one-shot", spec.one_shot), ("uses late reports", spec.asynchronous),
                                  ("generator clients", spec.generator_clients), ("secure aggregation", not spec.needs_individual_uploads))
                  if on]
        try:
            options = _option_list(spec.options_model)
            spec.client_class(), spec.server_class()
        except EdgeflError as exc:  # a plug-in's spec that names what cannot be imported: said in its row
            options = f"BROKEN: {exc.message}"
        module = spec.client_path.split(":")[0]
        table.add_row(escape(name), escape(spec.description), escape(f"{', '.join(spec.uploads)} / {', '.join(spec.downloads) or '-'}"),
                      ", ".join(traits) or "-", escape(options or "-"), "edgefl" if module.startswith("edgefl.") else escape(module))
    out.print(table)


@app.command()
def filters() -> None:
    """List the filters a run's \\[\\[filters]] can name, with their options (docs/filters.md)."""
    from edgefl.filters import FILTERS

    from rich.markup import escape

    table = Table(title=escape("edgefl filters ([[filters]] name = ... plus options; applied in the order listed)"))
    for col in ("name", "what it does", "options (default)"):
        table.add_column(col, no_wrap=col == "name")
    for name, cls in sorted(FILTERS.items()):
        options = _option_list(cls.Options)
        table.add_row(name, cls.summary or (cls.__doc__ or "").strip().split("\n")[0], options or "-")
    out.print(table)


def _bytes(v: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024:
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} PiB"


def _qty(q, fmt) -> str:
    return "?" if not q.known else f"{fmt(q.value)} ({q.kind[0]})"


@app.command()
def dashboard(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (running or finished)")],
    host: Annotated[str, typer.Option(help="address to listen on; any other than 127.0.0.1 asks for an access token")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8050,
) -> None:
    """A live, read-only web page over a run: devices, the current round, accuracy, traffic, refusals."""
    from edgefl.dashboard import start_dashboard

    if not run_dir.is_dir() or not (run_dir / "run.json").is_file():
        raise EdgeflError(f"{run_dir} is not a run directory (no run.json)", hint="pass a folder under runs/, or the --out of a run")
    board = start_dashboard(run_dir, host, port)
    err.print(f"dashboard of {run_dir}: {board.url}  (Ctrl-C stops it)")
    try:
        board.thread.join()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        board.stop()


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run directory")]) -> None:
    """Re-draw a run's plots and print its tables."""
    from edgefl.report import accuracy_table, communication_table, draw_plots, participation_notes
    from edgefl.rundir import RunDir
    from edgefl.safetext import console_text

    if not run_dir.is_dir():
        raise EdgeflError(f"{run_dir} is not a directory", hint="pass a run directory, e.g. runs/<time>-<name>-s<seed>")
    run = RunDir(run_dir)
    paths = draw_plots(run)
    out.print(accuracy_table(run))
    _say_verdict(run)
    out.print(communication_table(run))
    _print_rounds_table(run)
    for note in participation_notes(run):
        out.print(f"[yellow]{console_text(note)}[/]")
    for p in paths:
        out.print(f"wrote {p}")


def _print_rounds_table(run) -> None:
    """A run with stages (secure aggregation): which rounds were secured, who dropped out where,
    why rounds failed."""
    from edgefl.report import rounds_table

    table = rounds_table(run)
    if table is not None:
        out.print(table)


def _si(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}P"


def main() -> None:
    from edgefl.plugins import load_plugins, plugin_failures

    load_plugins()  # methods and filters from outside edgefl (docs/adding-a-method.md): every command knows them
    for failure in plugin_failures():
        err.print(f"warning: edgefl plug-in not loaded: {failure}", markup=False, highlight=False)
    try:
        app()
    except EdgeflError as exc:
        # the message may quote a file, a key or a value that looks like markup ("x[/]"): escaped
        err.print(f"[bold red]error:[/] {escape(exc.message)}", markup=True, highlight=False)
        if exc.hint:
            err.print(f"  hint: {exc.hint}", markup=False, highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
