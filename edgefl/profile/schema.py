"""The device-profile schema shared by the shipped catalog and (later) measured profiles.

Every number is a :class:`Quantity`: a value, how it is known (``spec`` from a datasheet,
``measured`` on the device, ``derived`` from other numbers by a rule stated in ``source``, or
``unknown`` with no value) and where it comes from. A fact that cannot be read is ``unknown``,
never a guess. ``docs/profile-schema.md`` documents every field.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgefl.configtools import format_validation_error, read_toml
from edgefl.errors import ConfigError

SCHEMA = "edgefl-device-profile/1"
DeviceClass = Literal["mcu", "sbc", "jetson", "phone", "laptop", "server"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Quantity(_Strict):
    value: float | None = None
    kind: Literal["spec", "measured", "derived", "unknown"]
    source: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Quantity:
        if self.kind == "unknown":
            if self.value is not None:
                raise ValueError("an unknown quantity has no value")
        else:
            if self.value is None:
                raise ValueError(f"a {self.kind} quantity needs a value (or kind = 'unknown')")
            if self.value < 0:
                raise ValueError("quantities are not negative")
            if not self.source.strip():
                raise ValueError(f"a {self.kind} quantity needs its source")
        return self

    @property
    def known(self) -> bool:
        return self.kind != "unknown"


def _unknown() -> Quantity:
    return Quantity(kind="unknown")


class Identity(_Strict):
    os: str = "unknown"
    arch: str = "unknown"
    python: str = "unknown"
    hostname: str | None = None
    torch: str | None = None
    cuda: str | None = None


class CPU(_Strict):
    model: str = "unknown"
    cores: Quantity = Field(default_factory=_unknown)
    clock_mhz: Quantity = Field(default_factory=_unknown)
    simd: str = "unknown"


class Memory(_Strict):
    ram_bytes: Quantity = Field(default_factory=_unknown)
    training_budget_bytes: Quantity = Field(default_factory=_unknown, description="RAM left for training after OS and runtime")
    runtime_bytes: Quantity = Field(default_factory=_unknown, description=(
        "resident memory of an edgefl client before it builds a model (Python, PyTorch, edgefl, MQTT)"))
    step_overhead_bytes: Quantity = Field(default_factory=_unknown, description="training memory beyond weights, optimizer and activations")
    activation_factor: Quantity = Field(default_factory=_unknown, description="bytes autograd and kernels hold per byte of new forward tensors")
    largest_tensor_factor: Quantity = Field(default_factory=_unknown, description=(
        "bytes held per byte of the largest parameter "
        "tensor (the optimizer's temporaries, one tensor at a time)"
    ))
    storage_bytes: Quantity = Field(default_factory=_unknown, description="free storage where runs are kept")


class Compute(_Strict):
    matmul_gflops: Quantity = Field(default_factory=_unknown, description="dense fp32 matrix multiply")
    effective_gflops: Quantity = Field(default_factory=_unknown, description="fp32 training throughput on a real network")
    int8_gops: Quantity = Field(default_factory=_unknown)
    # the full step fit of `edgefl device-profile` (see edgefl.profile.cost): used when all are known
    step_overhead_us: Quantity = Field(default_factory=_unknown, description="fixed cost of a training step (loss, autograd start, optimizer call)")
    layer_overhead_us: Quantity = Field(default_factory=_unknown, description=(
        "per-operator, per-step dispatch cost of a training step "
        "(operators: the aten ops of the forward pass)"
    ))
    conv_overhead_us: Quantity = Field(default_factory=_unknown, description="per convolution call, per step: setting up its forward and backward kernels")
    conv_gflops: Quantity = Field(default_factory=_unknown, description="rate of convolutions, 3 x forward FLOPs per step (0: no separate term)")
    transposed_conv_gflops: Quantity = Field(default_factory=_unknown, description=(
        "rate of transposed convolutions (generators' upsampling), 3 x "
        "forward FLOPs per step (0: no separate term)"
    ))
    linear_gflops: Quantity = Field(default_factory=_unknown, description="rate of matrix multiplies, 3 x forward FLOPs per step (0: no separate term)")
    random_ns_per_element: Quantity = Field(default_factory=_unknown, description="per random number drawn (dropout masks, sampling noise)")
    traffic_ns_per_byte: Quantity = Field(default_factory=_unknown, description=(
        "per byte read and written by "
        "memory-bound operators (norms, activations, pooling, additions)"
    ))
    tensor_overhead_us: Quantity = Field(default_factory=_unknown, description=(
        "per parameter tensor, per step: the optimizer's own operators "
        "for each (a CPU updates tensors one by one)"
    ))
    param_overhead_ns: Quantity = Field(default_factory=_unknown, description="per-parameter, per-step cost (gradients, optimizer update: memory traffic)")


class Accelerator(_Strict):
    type: Literal["none", "cuda", "npu", "gpu", "dsp"] = "none"
    name: str | None = None
    memory_bytes: Quantity = Field(default_factory=_unknown)
    peak_gflops: Quantity = Field(default_factory=_unknown)
    shared_memory: bool = False


class Network(_Strict):
    uplink_mbps: Quantity = Field(default_factory=_unknown)
    downlink_mbps: Quantity = Field(default_factory=_unknown)


class Runtimes(_Strict):
    trains_with: list[Literal["pytorch", "tflite-on-device", "custom"]] = Field(default_factory=list)
    runs: list[Literal["pytorch", "onnx", "tflite", "coreml", "tflite-micro"]] = Field(default_factory=list)
    notes: str = ""


class DeviceProfile(_Strict):
    schema_: str = Field(SCHEMA, alias="schema")
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    name: str
    device_class: DeviceClass = Field(alias="class")
    identity: Identity = Field(default_factory=Identity)
    cpu: CPU = Field(default_factory=CPU)
    memory: Memory = Field(default_factory=Memory)
    compute: Compute = Field(default_factory=Compute)
    accelerator: Accelerator = Field(default_factory=Accelerator)
    network: Network = Field(default_factory=Network)
    runtimes: Runtimes = Field(default_factory=Runtimes)
    notes: str = ""
    measurements: dict[str, Any] | None = Field(None, description="raw per-model results of edgefl device-profile")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_version(self) -> DeviceProfile:
        if self.schema_ != SCHEMA:
            raise ValueError(f"schema {self.schema_!r} is not {SCHEMA!r}")
        return self

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def load_profile(path_or_id: str | Path) -> DeviceProfile:
    """A profile from a TOML file, or from the catalog by id (``pi4-4gb``)."""
    path = Path(path_or_id)
    if not path.suffix and not path.exists():
        ids = catalog()
        if str(path_or_id) in ids:
            return ids[str(path_or_id)]
        close = difflib.get_close_matches(str(path_or_id), list(ids), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"catalog ids: {', '.join(ids)}"
        raise ConfigError(f"no device profile {str(path_or_id)!r}", hint=hint)
    raw = read_toml(path)
    try:
        return DeviceProfile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path} is not a valid device profile:\n{format_validation_error(exc, DeviceProfile)}",
                          hint="docs/profile-schema.md describes every field") from None


def catalog() -> dict[str, DeviceProfile]:
    """The shipped firmware profiles, by id. A broken shipped file is a bug, so it raises."""
    out: dict[str, DeviceProfile] = {}
    for entry in sorted(resources.files("edgefl.firmware_profiles").iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".toml"):
            profile = load_profile(Path(str(entry)))
            if profile.id != entry.name[:-5]:
                raise ConfigError(f"{entry.name}: id {profile.id!r} does not match the file name")
            out[profile.id] = profile
    return out
