"""What gets exported: a zoo model rebuilt from a run's weights file, with what it was trained on.

A weights file written by a run (``models/*.safetensors``) carries its architecture, options,
class names, input shape and dataset in the safetensors metadata, so a file alone is enough.
A bare state dict needs ``model=`` (and options) from the caller. Loading checks names and shapes
against the rebuilt model and says which architecture the weights seem to belong to when they
do not fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from edgefl.data.views import FITTED, View, ViewSettings, is_shape, is_whole, one_line, view_from_record
from edgefl.build import POOLED
from edgefl.errors import EdgeflError
from edgefl.models import build_model, get_spec


class ExportSourceError(EdgeflError):
    """A weights file or run directory that cannot be exported."""


@dataclass
class ModelSource:
    """A model ready to export (eval mode) and the facts its metadata sidecar needs."""

    name: str  # file stem for the exports
    model: str  # zoo name
    model_options: dict[str, Any]
    module: nn.Module
    kind: str  # "classifier" | "decoder"
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str] = field(default_factory=list)
    dataset: str | None = None
    run: str | None = None
    round: int | None = None
    weights_path: str | None = None
    weights_sha256: str | None = None
    run_name: str | None = None  # from the run's run.json, when the weights came from a run
    method: str | None = None
    seed: int | None = None
    view: View | None = None  # the device's feature space the model was trained on (CHFL's views)
    view_settings: ViewSettings | None = None  # a file saved before the fitted view was recorded: refit from seed and device
    client_id: str | None = None  # the device whose private model this is
    run_id: str | None = None  # the server's id of the run that trained it (a fleet device's own model file names it)
    held_out: list[int] | None = None  # a pooled run's held-out samples (indices into train + test): what the export judges on
    pooled: bool = False  # its run pooled train and test (its devices trained on part of the test split)

    @property
    def latent_dim(self) -> int | None:
        return getattr(self.module, "latent", None)


class DecoderForExport(nn.Module):
    """A CVAE's decoder alone, with the forward a phone calls: ``(z, y_onehot) -> sample``."""

    def __init__(self, cvae: nn.Module) -> None:
        super().__init__()
        self.decoder = cvae.decoder
        self.latent = int(cvae.latent)
        self.num_classes = int(cvae.num_classes)

    def forward(self, z: torch.Tensor, y_onehot: torch.Tensor) -> torch.Tensor:
        return self.decoder(z, y_onehot)


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from edgefl.rundir import MetadataError, load_model_file

    try:
        return load_model_file(path)
    except MetadataError as exc:
        raise ExportSourceError(f"{path}: {exc}", hint=_CHANGED) from None
    except Exception as exc:  # safetensors raises its own errors for truncated or foreign files
        raise ExportSourceError(f"{path} is not a readable safetensors weights file ({exc})",
                                hint="pass a models/*.safetensors file from a run directory, or the run directory itself") from None


def _fit(module: nn.Module, state: dict[str, torch.Tensor], model: str, path: Path, from_metadata: bool = False) -> None:
    """Load ``state`` into ``module``, or say why it is not that model (``from_metadata``: the file's
    own metadata chose the model and its shape, so a mismatch means the metadata was changed)."""
    head = getattr(module, "head", None)
    if isinstance(head, nn.Linear) and head.bias is None and "head.bias" in state and "head.bias" not in module.state_dict():
        # CHFL gives a bias-free head (the FedHe CNNs') a bias, so that every device's head has the
        # federation's shape (edgefl/algorithms/chfl.py): its saved models carry it
        module.head = nn.Linear(head.in_features, head.out_features)
    own = module.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or extra or wrong:
        detail = (f"missing {missing[:2]}" if missing else "") + (f" unexpected {extra[:2]}" if extra else "")
        if wrong:
            k = wrong[0]
            detail += f" {k} is {tuple(state[k].shape)}, {model} needs {tuple(own[k].shape)}"
        raise ExportSourceError(f"the weights in {path} are not a {model}" + (" as its metadata describes it" if from_metadata else "")
                                + f": {detail.strip()}",
                                hint=("its metadata (model, model_options, input_shape, num_classes) no longer matches its weights: "
                                      + _CHANGED) if from_metadata else
                                "pass the model the file was trained with (--model), or the run directory it came from")
    module.load_state_dict(state, strict=True)


def load_weights_file(path: str | Path, model: str | None = None, model_options: dict[str, Any] | None = None,
                      num_classes: int | None = None, input_shape: tuple[int, ...] | None = None) -> ModelSource:
    """Rebuild the model a weights file holds. Metadata in the file wins over nothing; explicit
    arguments win over metadata (and a clash of model names is an error)."""
    path = Path(path)
    if not path.is_file():
        raise ExportSourceError(f"{path} does not exist", hint="pass a run directory or a .safetensors weights file")
    state, meta = _read_safetensors(path)
    _check_meta(meta, path)
    name = model or meta.get("model")
    if name is None:
        raise ExportSourceError(f"{path} does not say which architecture it holds", hint="pass --model NAME (see `edgefl models`)")
    if model and meta.get("model") and model != meta["model"]:
        raise ExportSourceError(f"{path} holds a {meta['model']}, not a {model}", hint=f"drop --model or pass --model {meta['model']}")
    spec = get_spec(name)
    options = dict(meta.get("model_options") or {}) if model_options is None else dict(model_options)
    classes = int(num_classes or meta.get("num_classes") or 10)
    shape = tuple(input_shape or meta.get("input_shape") or spec.default_input_shape)
    torch.manual_seed(0)
    module = build_model(name, num_classes=classes, input_shape=shape, **options)
    _fit(module, state, name, path, from_metadata=not (model or model_options is not None or num_classes or input_shape)
         and bool(meta.get("model")))
    module.eval()
    kind = "classifier"
    if spec.kind != "classifier":
        module, kind = DecoderForExport(module).eval(), "decoder"
    from edgefl.exporters.metadata import sha256_file

    run = path.parent.parent if path.parent.name == "models" else None
    facts = _run_facts(run) if run is not None else {}
    view, view_settings = _view(meta.get("view"), shape, path)
    client = meta.get("client_id")
    stem = path.stem
    if stem == "model" and isinstance(client, str) and client:  # a device's STATE_DIR/model.safetensors: files named for it
        from edgefl.rundir import safe_name

        stem = safe_name(f"{client[:64]}-{name}")
    return ModelSource(
        name=stem, model=name, model_options=options, module=module, kind=kind, num_classes=classes,
        input_shape=shape, class_names=list(meta.get("class_names") or [str(i) for i in range(classes)]),
        dataset=meta.get("dataset"), run=str(run) if run is not None else None,
        round=meta.get("round"), weights_path=str(path), weights_sha256=sha256_file(path),
        run_name=facts.get("name"), method=facts.get("method") or meta.get("method"),
        seed=facts.get("seed") if facts.get("seed") is not None else meta.get("seed"), view=view,
        view_settings=view_settings, run_id=meta.get("run"),
        client_id=client[:200] if isinstance(client, str) else None, held_out=meta.get("held_out_indices"),
        pooled=bool(facts.get("pooled")),
    )


_CHANGED = ("the file's metadata was changed after edgefl wrote it (edgefl trusts none of it): restore the file from a copy, "
            "or run the training again to save it anew")


#: what each metadata field edgefl reads must be (the file may have been changed by anyone)
_META_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model": ("a model name", lambda v: isinstance(v, str) and 0 < len(v) <= 100),
    "model_options": ("an object of options", lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)),
    "num_classes": ("a class count from 1 to 100000", lambda v: is_whole(v, 1, 100_000)),
    "input_shape": ("a list of one to three sizes", is_shape),
    "class_names": ("a list of names of at most 200 characters each",
                    lambda v: isinstance(v, list) and len(v) <= 100_000 and all(isinstance(n, str) and len(n) <= 200 for n in v)),
    "dataset": ("a data set's name", lambda v: isinstance(v, str) and len(v) <= 200),
    "round": ("a round number", lambda v: is_whole(v, 0, 10**9)),
    "seed": ("a seed, a whole number from 0", lambda v: is_whole(v, 0, 2**63 - 1)),
    "client_id": ("a device id", lambda v: isinstance(v, str) and len(v) <= 200),
    "method": ("a method name", lambda v: isinstance(v, str) and len(v) <= 100),
    "run": ("a run id", lambda v: isinstance(v, str) and len(v) <= 64),
    "held_out_indices": ("a list of sample indices", lambda v: isinstance(v, list) and 0 < len(v) <= 10**7
                         and all(is_whole(i, 0, 10**9) for i in v)),
}


def _check_meta(meta: dict[str, Any], path: Path) -> None:
    for key, (what, fits) in _META_CHECKS.items():
        value = meta.get(key)
        if value is not None and not fits(value):
            raise ExportSourceError(f"{path}: its metadata field {key!r} is {str(value)[:40]!r}, not {what}",
                                    hint=_CHANGED)
    names, classes = meta.get("class_names"), meta.get("num_classes")
    if names is not None and classes is not None and len(names) != classes:
        raise ExportSourceError(f"{path}: its metadata names {len(names)} classes but counts {classes}",
                                hint=_CHANGED)


def _view(record: Any, input_shape: tuple[int, ...], path: Path) -> tuple[View | None, ViewSettings | None]:
    """The fitted view a device's model was trained through, checked against the model's input
    (or, from a file that recorded the view's settings only, those settings)."""
    if record is None:
        return None, None
    try:
        if isinstance(record, dict) and not set(record) & FITTED:
            try:
                return None, ViewSettings.model_validate(record)
            except ValidationError as exc:
                raise ValueError(one_line(exc)) from None
        view = view_from_record(record)
    except ValueError as exc:
        raise ExportSourceError(f"{path} was trained on a per-device view of the data, but its view record is unusable: {exc}",
                                hint="export it from a run of this edgefl version, or pass a model trained without fleet.groups[].view") from None
    if tuple(view.output_shape) != tuple(input_shape):
        raise ExportSourceError(f"{path}: its view gives inputs of shape {list(view.output_shape)}, but the model takes {list(input_shape)}",
                                hint="the file's metadata is inconsistent; export the run's own models/*.safetensors")
    return view, None


def _run_facts(run: Path) -> dict[str, Any]:
    """Name, method and seed from a run's run.json (empty when it has none or it is unreadable)."""
    import json

    try:
        record = json.loads((run / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    out: dict[str, Any] = {}
    if isinstance(record.get("name"), str):
        out["name"] = record["name"][:200]
    if isinstance(record.get("method"), str):
        out["method"] = record["method"][:100]
    if isinstance(record.get("seed"), int) and not isinstance(record.get("seed"), bool):
        out["seed"] = record["seed"]
    source = (record.get("dataset") or {}).get("source") if isinstance(record.get("dataset"), dict) else None
    out["pooled"] = isinstance(source, str) and POOLED in source  # edgefl.build.pooled marks the data set's source so
    return out


def _models_on_devices(run_dir: Path) -> tuple[str, str]:
    """The devices a run's ship.json says hold the models to ship (``arch: device``, joined), or "",
    and the run's data set as the plan names it ("NAME" when it does not)."""
    try:
        plan = json.loads((run_dir / "ship.json").read_text())
    except (OSError, ValueError):
        return "", "NAME"
    models = plan.get("models") if isinstance(plan, dict) else None
    if not isinstance(models, dict):
        return "", "NAME"
    held = [f"{str(arch)[:80]}: {str(entry.get('device'))[:64]}" for arch, entry in list(models.items())[:32]
            if isinstance(entry, dict) and entry.get("device") and not entry.get("file")]
    dataset = plan.get("dataset")
    named = isinstance(dataset, str) and 0 < len(dataset) <= 100 and all(ch.isalnum() or ch in "._-" for ch in dataset)
    return ", ".join(held), dataset if named else "NAME"  # a file's text goes into a command line only when plainly a name


def sources_from_path(path: str | Path, model: str | None = None, select: str | None = None, every: bool = False,
                      on_error: Callable[[Path, EdgeflError], None] | None = None, **kw) -> list[ModelSource]:
    """A weights file, or the models a run directory ships to phones (ship.json: its global
    models, or for a method that keeps a model per device the best device's per architecture);
    ``every``: every model it saved, each device's private one included; ``select`` keeps the
    files whose name contains it. ``on_error``: a run directory's file that cannot be loaded is handed to it and
    skipped (the others are still exported) instead of raising."""
    path = Path(path)
    if path.is_dir():
        folder = path / "models"
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            on_devices, dataset = _models_on_devices(path)
            if on_devices:  # a fleet of real devices, a method with a model per device: the server never held one
                raise ExportSourceError(
                    f"{path} holds no model: its method keeps one on each device, and its ship.json names the devices whose "
                    f"models phones should get ({on_devices})",
                    hint="each device wrote its model into its state folder when the run ended: on that device, or on a copy "
                         f"of its file, run edgefl export STATE_DIR/model.safetensors --dataset {dataset}")
            raise ExportSourceError(f"{path} has no models/*.safetensors", hint="is this a finished run directory? runs save their models when they end")
        shipped = [f for f in files if f.name.startswith("global-")] or [f for f in files if f.name.startswith("ship-")]
        chosen = files if every or not shipped else shipped
        if select:
            chosen = [f for f in files if select in f.stem]
            if not chosen:
                raise ExportSourceError(f"no model in {folder} matches {select!r}", hint="models: " + ", ".join(f.stem for f in files))
        sources = []
        for f in chosen:
            try:
                sources.append(load_weights_file(f, model, **kw))
            except EdgeflError as exc:
                if on_error is None:
                    raise
                on_error(f, exc)
        return sources
    return [load_weights_file(path, model, **kw)]


def from_module(module: nn.Module, model: str, num_classes: int, input_shape: tuple[int, ...], *,
                dataset: str | None = None, class_names: list[str] | None = None, **options: Any) -> ModelSource:
    """Wrap an in-memory zoo model (tests, notebooks, the end of a run). Without ``class_names``
    the export takes the class names of the dataset it checks the model on."""
    spec = get_spec(model)
    module = module.eval()
    kind = "classifier"
    if spec.kind != "classifier":
        module, kind = DecoderForExport(module).eval(), "decoder"
    return ModelSource(name=model, model=model, model_options=dict(options), module=module, kind=kind,
                       num_classes=num_classes, input_shape=tuple(input_shape), dataset=dataset,
                       class_names=list(class_names) if class_names else [])
