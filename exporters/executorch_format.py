"""The ``executorch-train`` export format (issue 37): NAME.train.pte (a training program: one
forward-backward pass, cross-entropy inside, fixed input and label shapes), NAME.pte (the inference
program), each with the job's JSON sidecar. The training file's sidecar also names every parameter
in the order the program holds them (program name -> PyTorch state dict name, shape), the frozen
state dict entries, the optimiser and its settings, and the step parity measured here. Nothing heavy
is imported until a model is exported; the work is in :mod:`edgefl.exporters.executorch_train`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from edgefl.exporters.registry import ExportContext, ExportedFile, ExportError, ExportFormat, Requirement, register_format

PHONES_EXTRA = "pip install -e '.[phones]' in the edgefl checkout"
#: the inference program's parity floor (absolute, on the outputs): see ExecutorchTrainFormat.export
INFERENCE_ATOL = 1e-4


@register_format
class ExecutorchTrainFormat(ExportFormat):
    name = "executorch-train"
    summary = ("NAME.train.pte (ExecuTorch training program: loss inside, fixed batch) and NAME.pte (inference); "
               "the sidecar names the parameters in program order and the optimiser")
    suffixes = (".fedhe.train.pte", ".train.pte", ".pte")
    requires = (Requirement(("executorch",), "executorch (ExecuTorch's exporter and runtime)", hint=PHONES_EXTRA),)

    #: the training program's fixed batch and the optimiser it is meant for (the runtime's SGD);
    #: a device may pass another lr to the runtime's SGD: the program does not hold it
    train_batch: ClassVar[int] = 32
    lr: ClassVar[float] = 0.01
    momentum: ClassVar[float] = 0.0

    def export(self, job: ExportContext, folder: Path) -> list[ExportedFile]:
        import torch

        from edgefl.exporters.export import layout_of
        from edgefl.exporters.executorch_train import (
            METHOD,
            export_inference_program,
            export_training_program,
        )

        src = job.src
        if not job.classifier:
            raise ExportError(f"{src.name}: the {self.name} format trains classifiers only (cross-entropy over labels)")
        # real inputs at the training batch; labels from the model's own answers when none are given
        x = torch.cat([job.sample[0]] * (self.train_batch // job.sample[0].shape[0] + 1))[: self.train_batch]
        pool = job.parity_inputs[0]
        if pool.shape[0] >= self.train_batch:
            x = pool[: self.train_batch]
        with torch.no_grad():
            y = job.module(x).argmax(1)
        job.log(f"{self.name}: {src.name}.train.pte (batch {self.train_batch})")
        prog = export_training_program(job.module, x, y)
        train_path = folder / f"{src.name}.train.pte"
        train_path.write_bytes(prog.buffer)
        parity = _checked(self.lr, max(self.momentum, 0.9), job.module, prog.buffer, x, y, train_path.name)
        train = ExportedFile(train_path, self.name, "float32", self.train_batch, extra={
            "program": "training", "method": METHOD,
            "inputs_spec": [{"name": "input", "shape": list(x.shape), "dtype": "float32", "layout": layout_of((x,), False)},
                            {"name": "labels", "shape": [self.train_batch], "dtype": "int64"}],
            "outputs_spec": ["loss (mean cross-entropy, scalar)", f"logits [{self.train_batch}, {src.num_classes}] (detached)",
                             "then the gradients and the parameters, in the order of 'parameters' (TrainingModule slices them)"],
            "parameters_order": prog.parameters, "frozen_state": prog.frozen,
            "rewritten_for_training": {name: _why_rewritten(job.module.get_submodule(name)) for name in prog.rewritten},
            "optimizer": {"name": "sgd", "lr": self.lr, "momentum": self.momentum, "dampening": 0.0, "weight_decay": 0.0,
                          "nesterov": False, "in_program": False,
                          "note": "the runtime's SGD (get_sgd_optimizer / Kotlin SGD / Swift SGD) steps the program's parameters"},
            "loss": "cross_entropy (mean over the batch)", "step_parity": parity,
            "export_seconds": round(prog.export_seconds, 2), "executorch_version": _version()})
        files = [train]
        # FedHe's program: the same model with its distillation term (inputs teacher, has, alpha)
        fedhe = export_training_program(job.module, x, y, distill=True, num_classes=src.num_classes)
        fedhe_path = folder / f"{src.name}.fedhe.train.pte"
        fedhe_path.write_bytes(fedhe.buffer)
        b, c = self.train_batch, src.num_classes
        # checked like the plain program, with a teacher for half the classes so the term is live
        gen = torch.Generator().manual_seed(0)
        teacher_table = torch.randn(c, c, generator=gen)
        has_class = (torch.arange(c) % 2 == 0).float()
        distill = (teacher_table[y], has_class[y], torch.tensor([0.7]))
        fedhe_parity = _checked(self.lr, max(self.momentum, 0.9), job.module, fedhe.buffer, x, y, fedhe_path.name, distill)
        files.append(ExportedFile(fedhe_path, self.name, "float32", b, extra={
            **{k: v for k, v in train.extra.items() if k not in ("step_parity", "export_seconds")},
            "program": "training-fedhe",
            "inputs_spec": [*train.extra["inputs_spec"],
                            {"name": "teacher", "shape": [b, c], "dtype": "float32", "meaning": "the server's logits of each sample's class"},
                            {"name": "has", "shape": [b], "dtype": "float32", "meaning": "1 where the server has logits for the sample's class"},
                            {"name": "alpha", "shape": [1], "dtype": "float32", "meaning": "weight of the logit loss (method.alpha)"}],
            "loss": "cross_entropy + alpha * sum(has * mean((logits - teacher)^2, 1)) / B (FedHe, logit_loss = mse)",
            "step_parity": fedhe_parity, "export_seconds": round(fedhe.export_seconds, 2)}))
        inf_path = folder / f"{src.name}.pte"
        job.log(f"{self.name}: {inf_path.name} (batch {job.options.batch})")
        inf_path.write_bytes(export_inference_program(job.module, job.sample[0]))
        inf = ExportedFile(inf_path, self.name, "float32", job.options.batch, extra={
            "program": "inference", "method": METHOD, "layout": layout_of(job.sample, False),
            "executorch_version": _version()})
        # the portable kernels are reference kernels summing in their own order: a FedHe CNN's group norm put its
        # logits 5e-5 from PyTorch's on real inputs (1e-5 is the bar of the other formats); top-1 agreement is checked too
        job.judge(inf, _runner(inf_path), atol=INFERENCE_ATOL)
        files.append(inf)
        return files


def _why_rewritten(module) -> str:
    import torch

    if isinstance(module, torch.nn.AvgPool2d):
        return "average pool as a depthwise convolution of constant weights (ExecuTorch 1.5.1 has no avg_pool2d backward kernel)"
    if isinstance(module, torch.nn.ZeroPad2d):
        return "zero padding as concatenations with zeros (ExecuTorch 1.5.1's pad kernel refuses the negative pad of its backward)"
    return "max pool as reshape + amax (ExecuTorch 1.5.1's max-pool backward kernel is wrong)"


def _checked(lr: float, momentum: float, net, buffer: bytes, x, y, name: str, distill: tuple | None = None) -> dict:
    """The program runs in the runtime, and two SGD steps match PyTorch's (an ExportError
    otherwise). With dropout the runtime draws its own masks: the gradients are checked on a
    dropout-free twin's program."""
    from edgefl.exporters.executorch_train import check_runs, export_training_program, step_parity, without_dropout

    check_runs(buffer, x, y, *(distill or ()))
    twin = without_dropout(net)
    if twin is not None:
        buffer = export_training_program(twin, x, y, distill=distill is not None, num_classes=int(distill[0].shape[1])
                                         if distill is not None else None).buffer
    parity = step_parity(twin if twin is not None else net, buffer, x, y, lr, momentum, distill=distill)
    parity["checked_without_dropout"] = twin is not None
    if not parity["ok"]:
        raise ExportError(f"{name}: one SGD step in ExecuTorch's runtime differs from PyTorch's "
                          f"(loss {parity['loss_max_abs_diff']:.2e}, weights {parity['weights_max_abs_diff']:.2e})")
    return parity


def _runner(path: Path):
    import numpy as np
    import torch
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    buffer = path.read_bytes()  # the runtime reads the program from this buffer: it must outlive the module
    module = _load_for_executorch_from_buffer(buffer)

    def run(x: np.ndarray) -> np.ndarray:
        assert buffer
        return module.run_method("forward", (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),))[0].numpy()

    return run


def _version() -> str:
    from importlib.metadata import version

    return version("executorch")
