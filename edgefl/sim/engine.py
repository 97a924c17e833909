"""In-process simulation: the same client and server halves a fleet runs, with the transport
replaced by encoding each message to bytes and decoding it back (so the bytes counted are the
bytes a fleet would send, and the codec is exercised on every message)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edgefl.algorithms import ClientHalf
from edgefl.algorithms.training import evaluate_accuracy
from edgefl.config import RunConfig
from edgefl.data import Dataset, load_dataset
from edgefl.environment import machine, package_versions
from edgefl.messages import Message, decode, encode
from edgefl.rundir import RunDir
from edgefl.sim.setup import (
    build_client,
    build_server,
    check_models_fit,
    device_slots,
    partition_record,
    pooled,
    sample_clients,
    test_subset,
)


@dataclass
class RoundRecord:
    round: int
    selected: list[str]
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    receipts: dict[str, str] = field(default_factory=dict)
    train_loss: dict[str, float] = field(default_factory=dict)
    accuracy: dict[str, Any] | None = None
    round_time_s: float = 0.0
    train_time_s: float = 0.0
    eval_time_s: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)
    virtual_s: dict[str, float | None] = field(default_factory=dict)
    virtual_by_profile: dict[str, float] = field(default_factory=dict)
    stragglers: list[str] = field(default_factory=list)
    round_virtual_s: float | None = None

    def to_json(self, elapsed: float) -> dict[str, Any]:
        return {
            "round": self.round,
            "selected": self.selected,
            "bytes_up": sum(self.bytes_up.values()),
            "bytes_down": sum(self.bytes_down.values()),
            "bytes_up_per_client": self.bytes_up,
            "bytes_down_per_client": self.bytes_down,
            "receipts": self.receipts,
            "train_loss": self.train_loss,
            "accuracy": self.accuracy,
            "server": self.server,
            "round_time_s": round(self.round_time_s, 4),
            "train_time_s": round(self.train_time_s, 4),
            "eval_time_s": round(self.eval_time_s, 4),
            "elapsed_s": round(elapsed, 3),
            **({"virtual_time_s": self.virtual_s, "virtual_time_by_profile": self.virtual_by_profile,
                "stragglers": self.stragglers, "round_virtual_s": self.round_virtual_s} if self.virtual_s else {}),
        }


def transmit(message: Message | None) -> tuple[Message | None, int]:
    """What the wire would do to a message: encode, count, decode."""
    if message is None:
        return None, 0
    data = encode(message)
    return decode(data), len(data)


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
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.console = console or Console(stderr=True)
        self.show_progress = show_progress
        self.on_round = on_round
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        ds = dataset or load_dataset(cfg.data.dataset, cfg.data.data_dir, cfg.data.download)
        self.ds = pooled(ds) if cfg.data.client_test_fraction else ds
        self.slots = device_slots(cfg, self.ds)
        check_models_fit(cfg, self.ds, self.slots)
        self.clients: dict[str, ClientHalf] = {s.client_id: build_client(cfg, self.ds, s) for s in self.slots}
        self.server = build_server(cfg, self.ds, self.slots)
        self.slot_of = {s.client_id: s for s in self.slots}
        self.x_test, self.y_test = test_subset(cfg, self.ds)
        self.history: list[dict[str, Any]] = []

    # --- one round ----------------------------------------------------------------------
    def run_round(self, r: int, advance: Callable[[], None] = lambda: None) -> RoundRecord:
        t0 = time.perf_counter()
        selected = sample_clients(self.cfg, list(self.clients), r)
        rec = RoundRecord(r, selected)
        self.server.begin_round(r)
        # every selected device gets its downlink at the start of the round, before any of them
        # reports, as in a fleet where they train at the same time (an asynchronous server such as
        # FedHe's would otherwise hand later devices what earlier ones reported this round)
        downlinks = {cid: transmit(self.server.downlink(r, cid)) for cid in selected}
        for cid in selected:
            down, n_down = downlinks.pop(cid)
            up = self.clients[cid].fit(down, r)
            up, n_up = transmit(up)
            rec.bytes_down[cid], rec.bytes_up[cid] = n_down, n_up
            slot = self.slot_of[cid]
            if slot.profile is not None:
                t = self.device_time(slot, self.clients[cid].last_train_samples, n_up, n_down)
                rec.virtual_s[cid] = None if t is None else round(t, 4)
                if t is not None and t > self.cfg.clock.deadline_s:
                    rec.stragglers.append(cid)
                    rec.receipts[cid] = f"dropped: straggler ({t:.1f} s > {self.cfg.clock.deadline_s:g} s deadline)"
                    up = None  # it arrives after the round closed: the synchronous round goes on without it
            if up is not None:
                receipt = self.server.receive(up)
                rec.receipts[cid] = receipt.status if not receipt.reason else f"{receipt.status}: {receipt.reason}"
            loss = self.clients[cid].last_train_loss
            if loss is not None:
                rec.train_loss[cid] = round(loss, 6)
            advance()
        if rec.virtual_s:
            self._summarise_clock(rec)
        rec.server = self.server.close_round(r)
        rec.train_time_s = time.perf_counter() - t0
        if r % self.cfg.eval.every == 0 or r == self.cfg.rounds:
            t1 = time.perf_counter()
            rec.accuracy = self.evaluate(r)
            rec.eval_time_s = time.perf_counter() - t1
        rec.round_time_s = time.perf_counter() - t0
        return rec

    def device_time(self, slot, samples: int, up_bytes: int, down_bytes: int) -> float | None:
        """Virtual seconds a device of this class needs for the round: the cost model's compute
        time at the profile's effective speed plus the real message bytes at its bandwidth.
        None when the profile's speed is unknown."""
        from edgefl.models import model_info
        from edgefl.profile.cost import compute_seconds, forward_stats, freeze, transfer_seconds

        shape = tuple(slot.input_shape(self.ds))
        info = model_info(slot.model, num_classes=self.ds.num_classes, input_shape=shape, **slot.model_options)
        stats = forward_stats(slot.model, freeze(slot.model_options), shape, self.ds.num_classes)
        batch = self.cfg.train_for(slot.group).batch_size
        compute = compute_seconds(slot.profile, info.flops_per_sample, samples, batch, info.params, stats)
        if compute is None:
            return None
        return compute + (transfer_seconds(slot.profile, up_bytes, down_bytes) or 0.0)

    def _summarise_clock(self, rec: RoundRecord) -> None:
        by_profile: dict[str, list[float]] = {}
        for cid, t in rec.virtual_s.items():
            if t is not None:
                by_profile.setdefault(self.slot_of[cid].profile.id, []).append(t)
        rec.virtual_by_profile = {k: round(statistics.fmean(v), 4) for k, v in sorted(by_profile.items())}
        finished = [t for cid, t in rec.virtual_s.items() if t is not None and cid not in rec.stragglers]
        rec.round_virtual_s = self.cfg.clock.deadline_s if rec.stragglers else (max(finished) if finished else None)

    def evaluate(self, r: int) -> dict[str, Any]:
        """Accuracy of the model each device would use now, on the shared test set.

        Methods whose server holds global models (FedAvg, FedMHO) are judged by those: each device
        of a global architecture receives it; knowledge methods are judged by each device's own
        model. Devices without a classifier (FedMHO's generator clients) are not judged, and a
        global model no device runs (FedCVAE-Ens) is judged by the server's copy.
        """
        globals_ = self.server.global_models()
        holds_globals = bool(globals_)
        per_client: dict[str, float] = {}
        cache: dict[str, float] = {}
        for cid, client in self.clients.items():
            arch = client.setup.arch
            if not client.judged or (holds_globals and arch not in globals_):
                continue
            # a shared group model scores the same for every member, unless members see the
            # data differently (own view or own test split)
            personal = client.setup.view is not None or client.setup.x_test is not None
            if holds_globals and personal:
                client.receive(self.server.downlink(r + 1, cid))
                per_client[cid] = client.evaluate(self.x_test, self.y_test, self.cfg.eval.batch_size)
            elif holds_globals:
                if arch not in cache:
                    client.receive(self.server.downlink(r + 1, cid))
                    cache[arch] = client.evaluate(self.x_test, self.y_test, self.cfg.eval.batch_size)
                per_client[cid] = cache[arch]
            else:
                per_client[cid] = client.evaluate(self.x_test, self.y_test, self.cfg.eval.batch_size)
        per_arch: dict[str, list[float]] = {}
        for cid, acc in per_client.items():
            per_arch.setdefault(self.clients[cid].setup.arch, []).append(acc)
        for arch, state in globals_.items():
            if arch not in per_arch:
                model = self.server.build_global(arch)
                model.load_state_dict(state)
                per_arch[arch] = [evaluate_accuracy(model, self.x_test, self.y_test, self.cfg.eval.batch_size)]
        scores = list(per_client.values()) or [v[0] for v in per_arch.values()]
        return {
            "overall": statistics.fmean(scores) if scores else None,
            "per_arch": {a: statistics.fmean(v) for a, v in per_arch.items()},
            "per_client": per_client,
        }

    # --- the whole run ------------------------------------------------------------------
    def _start_record(self) -> dict[str, Any]:
        return {
            "name": self.cfg.name,
            "method": self.cfg.method.name,
            "seed": self.cfg.seed,
            "dataset": {"name": self.ds.name, "source": self.ds.source, "train": len(self.ds.y_train), "test_used": len(self.y_test)},
            "versions": package_versions(),
            "machine": machine(),
            "runner": "simulation",
            "deadline_s": self.cfg.clock.deadline_s,
            "device_profiles": {s.profile.id: s.profile.to_dict() for s in self.slots if s.profile is not None},
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        start_record = self._start_record()
        if self.run_dir:
            (self.run_dir.path / "config.toml").write_text(cfg.to_toml())
            self.run_dir.write_json("run.json", start_record)
            self.run_dir.write_json("partition.json", partition_record(self.ds, self.slots))
        t0 = time.perf_counter()
        progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=self.console, transient=True, disable=not self.show_progress,
        )
        with progress:
            rounds_task = progress.add_task("rounds", total=cfg.rounds)
            for r in range(1, cfg.rounds + 1):
                n_sel = len(sample_clients(cfg, list(self.clients), r))
                clients_task = progress.add_task(f"round {r}: clients", total=n_sel)
                rec = self.run_round(r, advance=lambda: progress.advance(clients_task))
                progress.remove_task(clients_task)
                progress.advance(rounds_task)
                record = rec.to_json(time.perf_counter() - t0)
                self.history.append(record)
                if self.run_dir:
                    self.run_dir.append_metrics(record)
                if self.show_progress:
                    self.console.print(round_line(record, cfg.rounds))
                if self.on_round:
                    self.on_round(record)
        summary = self._summary(start_record, time.perf_counter() - t0)
        if self.run_dir:
            self._save_models()
            self.run_dir.write_json("summary.json", summary)
        return summary

    def _summary(self, start_record: dict[str, Any], wall: float) -> dict[str, Any]:
        evaluated = [h for h in self.history if h["accuracy"] is not None and h["accuracy"]["overall"] is not None]
        final = evaluated[-1]["accuracy"] if evaluated else None
        return {
            **start_record,
            "rounds": self.cfg.rounds,
            "final_accuracy": final,
            "best_overall_accuracy": max((h["accuracy"]["overall"] for h in evaluated), default=None),
            "bytes_up_total": sum(h["bytes_up"] for h in self.history),
            "bytes_down_total": sum(h["bytes_down"] for h in self.history),
            "stragglers_total": sum(len(h.get("stragglers", [])) for h in self.history),
            "virtual_time_total_s": (round(sum(h["round_virtual_s"] or 0 for h in self.history), 3)
                                     if any(h.get("round_virtual_s") is not None for h in self.history) else None),
            "wall_time_s": round(wall, 3),
            "run_dir": str(self.run_dir.path) if self.run_dir else None,
        }

    def _save_models(self) -> None:
        assert self.run_dir is not None
        base = model_meta(self.cfg, self.ds)
        globals_ = save_global_models(self.run_dir, self.server, self.cfg, self.ds)
        if not globals_:
            for cid, client in self.clients.items():
                slot = next(s for s in self.slots if s.client_id == cid)
                meta = {**base, "arch": slot.arch, "model": slot.model, "model_options": slot.model_options,
                        "scope": "client", "client_id": cid, "input_shape": list(slot.input_shape(self.ds)),
                        "view": slot.group.view.model_dump(exclude_none=True) if slot.group.view else None}
                self.run_dir.save_model(f"{cid}-{safe_name(slot.arch)}", client.model.state_dict(), meta)


def model_meta(cfg: RunConfig, ds: Dataset) -> dict[str, Any]:
    """What every saved model's metadata carries about the run (edgefl export reads it)."""
    return {"num_classes": ds.num_classes, "input_shape": list(ds.input_shape), "class_names": list(ds.class_names),
            "dataset": ds.name, "round": cfg.rounds, "method": cfg.method.name}


def save_global_models(run_dir: RunDir, server, cfg: RunConfig, ds: Dataset) -> dict[str, Any]:
    """Write the server's global models and its artifacts (FedMHO's sample grid) into the run
    directory; the same for a simulation and a fleet. Returns the global models written."""
    globals_ = server.global_models()
    for arch, state in globals_.items():
        model, options, shape = server.global_spec(arch)
        meta = {**model_meta(cfg, ds), "arch": arch, "model": model, "model_options": options, "scope": "global",
                "input_shape": list(shape)}
        run_dir.save_model(f"global-{safe_name(arch)}", state, meta)
    server.write_artifacts(run_dir.path)
    return globals_


def safe_name(arch: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in arch).strip("_")


def round_line(record: dict[str, Any], total: int) -> str:
    acc = record["accuracy"]
    acc_txt = f"acc {acc['overall']:.4f}" if acc and acc["overall"] is not None else "acc  -    "
    return (
        f"round {record['round']:>3}/{total}  {acc_txt}  up {human_bytes(record['bytes_up'])}  "
        f"down {human_bytes(record['bytes_down'])}  {record['round_time_s']:.1f}s"
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
