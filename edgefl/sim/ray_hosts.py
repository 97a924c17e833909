"""Worker hosts as Ray actors (``simulation.backend = "ray"``), for simulations that outgrow one
machine: each actor holds a share of the devices (:class:`~edgefl.sim.hosts.HostCore`, the same
code a worker process runs) and asks Ray for ``simulation.ray_cpus`` CPUs and
``simulation.ray_gpus`` GPUs (a fraction shares one GPU between actors).

Requests and replies are the host frames of :mod:`edgefl.sim.hosts`, one ``bytes`` argument and
one ``bytes`` result per call: Ray carries them as they are, nothing of edgefl's is pickled.
Every node needs edgefl installed and the config's data set where the config says it is.
"""

from __future__ import annotations

from typing import Any

import torch

from edgefl.config import SimulationSettings
from edgefl.device import WorkDone
from edgefl.errors import ConfigError
from edgefl.sim.hosts import Host, HostCore, Job, check_reply, pack_frame, states_reply, step_reply, step_request


class _HostActor:
    def __init__(self, config_toml: str, devices: list[str], threads: int | None) -> None:
        self.core = HostCore(config_toml, devices, threads)

    def handle(self, request: bytes) -> bytes:
        try:
            return self.core.handle(request)
        except Exception as exc:  # said to the simulation, which stops the run with it
            return pack_frame({"error": f"{type(exc).__name__}: {exc}"[:2000]}, [])


class RayHost(Host):
    def __init__(self, actor: Any, devices: list[str]) -> None:
        self.actor = actor
        self.devices = devices
        self._pending: Any = None

    def _get(self, ref: Any) -> bytes:
        import ray

        return check_reply(ray.get(ref))

    def submit(self, jobs: list[Job]) -> None:
        self._pending = self.actor.handle.remote(step_request(jobs))

    def collect(self) -> list[tuple[list[bytes], WorkDone | None]]:
        ref, self._pending = self._pending, None
        return step_reply(self._get(ref))

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        return states_reply(self._get(self.actor.handle.remote(pack_frame({"op": "states"}, []))))

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.kill(self.actor)


def start_ray_hosts(sim: SimulationSettings, config_toml: str, shares: list[list[str]], threads: int | None) -> list[Host]:
    try:
        import ray
    except ImportError:
        raise ConfigError('simulation.backend = "ray" needs Ray in this environment',
                          hint="pip install 'edgefl[ray]' (or set simulation.backend = \"local\")") from None
    if not ray.is_initialized():
        try:
            ray.init(address=sim.ray_address, include_dashboard=False, log_to_driver=True, configure_logging=False)
        except ConnectionError as exc:
            raise ConfigError(f"cannot join the Ray cluster at {sim.ray_address}: {exc}",
                              hint="start it (ray start --head) or fix simulation.ray_address (unset: start one here); a cluster "
                                   "with token authentication (ray start's default) also needs RAY_AUTH_MODE=token and its token "
                                   "(~/.ray/auth_token or RAY_AUTH_TOKEN)") from None
    actor = ray.remote(num_cpus=sim.ray_cpus, num_gpus=sim.ray_gpus)(_HostActor)
    per_actor = threads or max(1, int(sim.ray_cpus))
    return [RayHost(actor.remote(config_toml, share, per_actor), share) for share in shares]
