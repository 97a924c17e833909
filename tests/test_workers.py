"""Client halves spread over worker processes or Ray actors give the numbers of one process."""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from edgefl.config import validate_config
from edgefl.server.session import TIMING_FIELDS
from edgefl.sim.engine import Simulation
from edgefl.sim.hosts import check_reply, pack_frame, read_frame, serve, unpack_frame, write_frame
from tests.conftest import method_config


def _run(method: str, threads: int | None = 1, run_dir=None, **simulation) -> Simulation:
    """``threads`` None: left at its default (the run takes this process's torch threads and gives
    every host the same, so kernels sum in the same order everywhere)."""
    raw = method_config(method, rounds=2)
    raw["simulation"] = simulation
    if threads is not None:
        raw["threads"] = threads
    sim = Simulation(validate_config(raw), run_dir=run_dir, show_progress=False)
    sim.run()
    return sim


@pytest.fixture
def two_threads():
    """This process's torch default as on a 2-core machine (the suite's conftest sets 1): worker
    processes used to get 2 // workers threads then, and Ray actors their ray_cpus."""
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(1)


def _numbers(sim: Simulation) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMING_FIELDS} for record in sim.history]


def _assert_identical(one: Simulation, other: Simulation) -> None:
    assert _numbers(one) == _numbers(other)
    for cid, client in one.clients.items():
        for name, tensor in client.model.state_dict().items():
            assert torch.equal(other.clients[cid].model.state_dict()[name], tensor), (cid, name)


@pytest.mark.parametrize("method", ["fedhe", "fedin", "felo"])
def test_worker_processes_give_the_numbers_of_one_process(method):
    alone = _run(method)
    spread = _run(method, workers=2)
    assert len(spread.hosts) == 2 and all(h.proc.poll() is not None for h in spread.hosts)  # stopped at the end
    _assert_identical(alone, spread)


def test_with_threads_left_at_the_default_workers_give_the_numbers_of_one_process(two_threads, tmp_path):
    import json

    from edgefl.rundir import RunDir

    alone = _run("fedhe", threads=None)
    spread = _run("fedhe", threads=None, run_dir=RunDir.create(tmp_path / "spread", "w", 0), workers=2)
    assert alone.threads == spread.threads == two_threads  # chosen once, by the process that starts the run
    _assert_identical(alone, spread)
    assert json.loads((tmp_path / "spread" / "run.json").read_text())["simulation"]["threads"] == two_threads


def test_workers_are_never_more_than_devices():
    raw = method_config("fedavg")
    raw["simulation"] = {"workers": 64}
    assert validate_config(raw).simulation.worker_count(4) == 4
    raw["simulation"] = {"workers": 0}
    with pytest.raises(Exception, match="between 1 and 1024"):
        validate_config(raw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_cluster(monkeypatch):
    """A Ray head on loopback, started and stopped by the test (as `ray start` on a cluster's head)."""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    # Ray swaps 127.0.0.1 for the machine's own address unless told this is a one-machine cluster:
    # the head and this driver both stay on loopback
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    port = _free_port()
    # a loopback-only head for this test: no token authentication (a real cluster keeps it: docs/simulation.md)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR: "0", "RAY_AUTH_MODE": "disabled"}
    subprocess.run([exe, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        ray.shutdown()
        subprocess.run([exe, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_backend_gives_the_numbers_of_one_process(ray_cluster, two_threads):
    # threads left at the default: each actor asks Ray for 1 CPU, yet trains with the run's 2 threads
    alone = _run("fedhe", threads=None)
    spread = _run("fedhe", threads=None, backend="ray", ray_address=ray_cluster, workers=2, ray_cpus=1)
    assert len(spread.hosts) == 2
    _assert_identical(alone, spread)


def test_a_host_failure_is_answered_with_its_reason_and_stops_the_run():
    requests = io.BytesIO()
    write_frame(requests, pack_frame({"op": "init", "devices": ["client-0"], "threads": 1},
                                     [validate_config(method_config("fedhe")).to_toml().encode()]))
    write_frame(requests, pack_frame({"op": "nonsense"}, []))
    requests.seek(0)
    replies = io.BytesIO()
    serve(requests, replies)  # the worker process's loop: it answers, and keeps serving
    replies.seek(0)
    with pytest.raises(RuntimeError, match="a simulation worker failed: ValueError: unknown host request 'nonsense'"):
        check_reply(read_frame(replies))


def test_host_frames_refuse_what_does_not_add_up():
    frame = pack_frame({"op": "step"}, [b"abc", b""])
    assert unpack_frame(frame) == ({"op": "step"}, [b"abc", b""])
    with pytest.raises(ValueError, match="holds"):
        unpack_frame(frame + b"x")
    buf = io.BytesIO()
    write_frame(buf, b"hello")
    buf.seek(0)
    assert read_frame(buf) == b"hello" and read_frame(buf) is None
    with pytest.raises(ValueError, match="announces"):
        read_frame(io.BytesIO((1 << 40).to_bytes(8, "big")))


def test_cli_workers_must_be_a_count(tmp_path):
    res = subprocess.run([sys.executable, "-m", "edgefl", "simulate", "--workers", "two", "--quiet", "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "whole number or auto" in res.stderr


def test_ray_actors_follow_device_classes_and_only_cuda_classes_ask_for_a_gpu():
    from edgefl.build import build_run
    from edgefl.sim.ray_hosts import class_shares

    raw = method_config("fedavg")
    raw["fleet"] = {"groups": [{"model": "mlp", "count": 6, "profile": "pi4-4gb", "options": {"hidden": [16]}},
                               {"model": "mlp", "count": 2, "profile": "jetson-orin-nano", "options": {"hidden": [16]}}]}
    slots = build_run(validate_config(raw)).slots
    shares = class_shares(slots, 4)
    by_class = {s.client_id: s.profile.id for s in slots}
    assert sorted(len(devices) for devices, _ in shares) == [2, 2, 2, 2]  # 3 actors for 6 Pis, 1 for 2 Jetsons
    for devices, gpu in shares:
        assert len({by_class[d] for d in devices}) == 1  # one class per actor
        assert gpu == (by_class[devices[0]] == "jetson-orin-nano")
    assert sorted(d for devices, _ in shares for d in devices) == sorted(by_class)
    raw.pop("fleet")
    plain = build_run(validate_config(method_config("fedavg"))).slots
    assert all(gpu for _, gpu in class_shares(plain, 2))  # no classes: ray_gpus applies to every actor
