"""What a load-generator device uploads: a real client half's upload, trained once per round.

A protocol-level device (:mod:`edgefl.fleet.swarm`) does not train: thousands of them share one
process. Each architecture of the config gets one real client half, built from the config as
``edgefl client`` builds it; the first device of that architecture to be served in a round makes
it train on its own data with that round's download, and every device of the architecture then
uploads those tensors under its own id, round and message id. The server sees the kinds, shapes,
sizes and values a real fleet sends (FedHe's logits of about 1 KB, FedAvg's weights) and runs
every check it runs on a real upload.
"""

from __future__ import annotations

from typing import Any

import torch

from edgefl.build import RunParts
from edgefl.messages import Message


class UploadTemplates:
    """One real client half per architecture, and the upload it made for each round."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self._first_of_arch: dict[str, str] = {}
        for slot in parts.slots:
            self._first_of_arch.setdefault(slot.arch, slot.client_id)
        self._halves: dict[str, Any] = {}
        self._uploads: dict[str, tuple[int, Message]] = {}  # arch -> (round, its upload): only the latest round kept
        self._accuracy: dict[str, tuple[int, float]] = {}
        self.fits = 0  # real trainings run (one per architecture per round)

    def arch_of(self, device_id: str) -> str:
        return self.parts.slot(device_id).arch

    def half(self, arch: str):
        if arch not in self._halves:
            self._halves[arch] = self.parts.client(self._first_of_arch[arch])
        return self._halves[arch]

    def upload(self, arch: str, downlink: Message | None, round_no: int) -> Message:
        held = self._uploads.get(arch)
        if held is None or held[0] != round_no:
            half = self.half(arch)
            message = half.fit(downlink, round_no)
            if message is None:
                message = half.reply("status", round_no, {})
            self._uploads[arch] = held = (round_no, message)
            self.fits += 1
        return held[1]

    def accuracy(self, arch: str, round_no: int) -> float:
        """The real half's accuracy on the run's test set after its latest round."""
        held = self._accuracy.get(arch)
        if held is None or held[0] != round_no:
            half = self.half(arch)
            value = half.evaluate(self.parts.x_test, self.parts.y_test) if half.judged else 0.0
            self._accuracy[arch] = held = (round_no, float(value))
        return held[1]

    def judged(self, arch: str) -> bool:
        return bool(self.half(arch).judged)

    def test_samples(self) -> int:
        return len(self.parts.y_test)


class TemplateClient:
    """What :class:`~edgefl.device.DeviceLoop` needs of a client half, answered from the
    architecture's template: the device loop itself (downloads, chunks, acks, resends) is the
    real one."""

    def __init__(self, device_id: str, templates: UploadTemplates) -> None:
        self.device_id = device_id
        self.templates = templates
        self.arch = templates.arch_of(device_id)
        self.last_train_samples = 0
        self.last_round = 0
        self.on_fit = None  # set by the swarm: called with the round when the device "trains"

    @property
    def client_id(self) -> str:
        return self.device_id

    @property
    def judged(self) -> bool:
        return self.templates.judged(self.arch)

    def fit(self, downlink: Message | None, round_no: int) -> Message:
        template = self.templates.upload(self.arch, downlink, round_no)
        self.last_round = round_no
        self.last_train_samples = template.num_samples
        if self.on_fit is not None:
            self.on_fit(round_no)
        return Message(template.kind, round_no, self.device_id, template.tensors, dict(template.meta))

    def reply(self, kind: str, round_no: int, tensors: dict, **meta: Any) -> Message:
        return Message(kind, round_no, self.device_id, dict(tensors), meta)

    def receive(self, downlink: Message | None) -> None:
        pass  # evaluation requests are answered with the template's accuracy

    # what the device loop's checks and rollback ask of a client half: a template holds no model
    model = torch.nn.Module()

    def downlink_problem(self, downlink: Message) -> str | None:
        return None  # the loop has checked that every value is finite and bounded; a template uses nothing of it

    def carry_state(self) -> dict:
        return {}

    def load_carry_state(self, tensors: dict) -> None:
        pass

    def evaluate(self, x=None, y=None, batch_size: int = 1000) -> float:
        return self.templates.accuracy(self.arch, self.last_round)

    def num_test_samples(self, y_shared) -> int:
        return self.templates.test_samples()
