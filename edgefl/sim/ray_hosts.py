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

from edgefl.build import DeviceSlot
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


def class_shares(slots: list[DeviceSlot], actors: int) -> list[tuple[list[str], bool]]:
    """Devices per actor, and whether its device class computes on CUDA: each device class
    (profile; devices without one form one class) gets actors in proportion to its devices, at
    least one, dealt round-robin within the class."""
    classes: dict[str | None, list[DeviceSlot]] = {}
    for s in slots:
        classes.setdefault(s.profile.id if s.profile else None, []).append(s)
    out = []
    for members in classes.values():
        k = max(1, min(len(members), round(actors * len(members) / len(slots))))
        cuda = members[0].profile is not None and members[0].profile.accelerator.type == "cuda"
        out += [([s.client_id for s in members[i::k]], cuda or members[0].profile is None) for i in range(k)]
    return out


def start_ray_hosts(sim: SimulationSettings, config_toml: str, shares: list[tuple[list[str], bool]], threads: int | None) -> list[Host]:
    """One actor per share; a share whose device class has no CUDA accelerator asks for no GPU
    (Ray then hides the GPUs from it, and ``device = "auto"`` trains it on the CPU). Every actor
    trains with ``threads``, the run's thread count (:func:`edgefl.sim.engine.run_threads`),
    whatever CPUs it asks Ray for: the numbers are those of one process."""
    try:
        import ray
    except ImportError:
        raise ConfigError('simulation.backend = "ray" needs Ray in this environment',
                          hint="pip install -e '.[ray]' in the edgefl checkout (or set simulation.backend = \"local\")") from None
    if not ray.is_initialized():
        try:
            ray.init(address=sim.ray_address, include_dashboard=False, log_to_driver=True, configure_logging=False)
        except ConnectionError as exc:
            raise ConfigError(f"cannot join the Ray cluster at {sim.ray_address}: {exc}",
                              hint="start it (ray start --head) or fix simulation.ray_address (unset: start one here); a cluster "
                                   "with token authentication (ray start's default) also needs RAY_AUTH_MODE=token and its token "
                                   "(~/.ray/auth_token or RAY_AUTH_TOKEN)") from None
    actor = ray.remote(_HostActor)
    per_actor = threads or max(1, int(sim.ray_cpus))
    return [RayHost(actor.options(num_cpus=sim.ray_cpus, num_gpus=sim.ray_gpus if gpu else 0).remote(config_toml, share, per_actor), share)
            for share, gpu in shares]
