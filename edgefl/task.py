"""The federation's task: what a device needs to take part, sent by the server (docs/your-data.md).

A real device holds only its own data, its id and credentials, and the broker's address. It asks
the server to join (an envelope of type ``join``, ``info.stage = "hello"``); the server answers
with a ``task`` envelope whose ``info.task`` is a :class:`Task`: the method and its options, the
model this device trains, the classes, input shape and normalisation its samples must match,
the training settings, the share of its data it holds out for validation, and the run id. The
device reads its data against the task (:mod:`edgefl.data.held`), then says ``ready`` with its
sample and class counts, or ``decline`` with the reason.

Everything here is bounded and checked like an upload: the task comes over the network. A leaf
of the device side: it imports the config's settings models, never ``edgefl.server``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edgefl.config import NetworkSettings, TrainSettings
from edgefl.configtools import format_validation_error
from edgefl.errors import ConfigError, PayloadError

TASK_VERSION = 1
MAX_CLASSES = 10_000
MAX_NAME_CHARS = 200
MAX_FEATURES = 100_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskData(_Strict):
    """What the device's samples must be: classes, input shape and how raw values become inputs."""

    kind: Literal["image", "tabular"]
    class_names: list[str] = Field(min_length=2, max_length=MAX_CLASSES)
    input_shape: list[int] = Field(min_length=1, max_length=4)
    pixel_divisor: float | None = Field(None, gt=0, le=1e6, description="images: model input = pixels / divisor")
    mean: list[float] | None = Field(None, max_length=MAX_FEATURES, description="tabular: standardisation (x - mean) / std")
    std: list[float] | None = Field(None, max_length=MAX_FEATURES)
    feature_names: list[str] | None = Field(None, max_length=MAX_FEATURES)
    label_column: str = Field("label", min_length=1, max_length=MAX_NAME_CHARS)
    resize: bool = Field(True, description="images of another size are resized (true) or refused (false)")
    validation_fraction: float = Field(0.1, gt=0, lt=1, description="share of the device's own samples held out to report accuracy on")

    @field_validator("class_names", "feature_names")
    @classmethod
    def _names(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return names
        if any(not (0 < len(n) <= MAX_NAME_CHARS) for n in names):
            raise ValueError(f"names are 1-{MAX_NAME_CHARS} characters")
        if len(set(names)) != len(names):
            raise ValueError("names must be distinct")
        return names

    @field_validator("input_shape")
    @classmethod
    def _shape(cls, shape: list[int]) -> list[int]:
        if any(not 1 <= d <= 65_536 for d in shape):
            raise ValueError("every input dimension is between 1 and 65536")
        return shape

    @model_validator(mode="after")
    def _consistent(self) -> TaskData:
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std come together")
        if self.mean is not None and self.std is not None:
            if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
                raise ValueError("mean and std have one positive std per feature")
        if self.kind == "tabular" and self.feature_names is not None and [len(self.feature_names)] != self.input_shape:
            raise ValueError("feature_names lists one name per input feature")
        return self


class TaskModel(_Strict):
    """The model this device trains (a zoo model, resolved: never "auto")."""

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    options: dict[str, Any] = Field(default_factory=dict)
    arch: str = Field(min_length=1, max_length=1000)

    @field_validator("name")
    @classmethod
    def _zoo(cls, name: str) -> str:
        from edgefl.models import model_names

        if name not in model_names():
            raise ValueError(f"{name!r} is not a model this edgefl knows (an older version on the device?)")
        return name


class TaskMethod(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    options: dict[str, Any] = Field(default_factory=dict)


class TaskFilter(_Strict):
    """One link of the run's filter chain, as the device must run it (``[[filters]]`` of the config)."""

    name: str = Field(min_length=1, max_length=64)
    options: dict[str, Any] = Field(default_factory=dict, max_length=64)


class Task(_Strict):
    """One device's part in a run, as the server sends it (``info.task`` of a ``task`` envelope)."""

    version: Literal[1] = TASK_VERSION
    run: str = Field(min_length=1, max_length=64, description="the server's run id (info.run of every later message)")
    federation: str = Field(min_length=1, max_length=64)
    device: str = Field(min_length=1, max_length=64)
    seed: int = Field(ge=0, le=2**63 - 1)
    rounds: int = Field(ge=1, le=1_000_000)
    mode: Literal["sync", "async"] = "sync"
    method: TaskMethod
    model: TaskModel
    data: TaskData
    train: TrainSettings
    network: NetworkSettings
    eval_batch_size: int = Field(1000, ge=1, le=1_000_000)
    threads: int | None = Field(None, ge=1, le=1024)
    compute: Literal["auto", "cpu", "cuda"] = "auto"
    filters: list[TaskFilter] = Field(default_factory=list, max_length=16, description="the filter chain, in order")

    @model_validator(mode="after")
    def _method(self) -> Task:
        from edgefl.filters import get_filter
        from edgefl.methods import get_method

        spec = get_method(self.method.name)  # ConfigError for a method this device does not know
        spec.parse_options(self.method.options)
        for entry in self.filters:
            try:
                cls = get_filter(entry.name)
            except KeyError as exc:  # a ConfigError passes pydantic by: parse_task says the device cannot serve the task
                raise ConfigError(f"{exc.args[0]}; or upgrade this device's edgefl, if the server's has it built in") from None
            cls.Options.model_validate(entry.options)
        return self

    def filter_chain(self) -> list[tuple[str, dict[str, Any]]]:
        return [(f.name, dict(f.options)) for f in self.filters]

    def to_info(self) -> dict[str, Any]:
        info = self.model_dump(mode="json")
        if not info["filters"]:
            del info["filters"]  # a run without filters sends the task devices of earlier versions know
        return info


def parse_task(info: Any) -> Task:
    """A task from the network, checked field by field; :class:`PayloadError` says what is wrong."""
    if not isinstance(info, dict):
        raise PayloadError("a task is a JSON object")
    try:
        return Task.model_validate(info)
    except ValidationError as exc:
        raise PayloadError(f"the server's task is invalid:\n{format_validation_error(exc, Task)}") from None
    except ConfigError as exc:  # an unknown method, or options this version does not take
        raise PayloadError(f"the server's task cannot be served by this device: {exc.message}"
                           + (f" ({exc.hint})" if exc.hint else "")) from None
