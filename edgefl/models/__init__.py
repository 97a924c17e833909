"""The model zoo: named builders with measured metadata.

>>> from edgefl.models import build_model, model_info
>>> net = build_model("resnet18", num_classes=10, input_shape=(1, 28, 28), width=0.25)
"""

from edgefl.models.registry import (
    ModelInfo,
    ModelSpec,
    build_model,
    count_flops,
    dp_sgd_ready,
    example_inputs,
    get_spec,
    model_info,
    model_names,
)
from edgefl.models.split import SplitClassifier

# Importing the families registers their builders: the registry itself imports none of them, so
# the package (always imported before any of its modules) is where the zoo is assembled.
from edgefl.models import cnn, cvae, mlp, resnet, vgg  # noqa: F401  isort: skip

__all__ = [
    "ModelInfo", "ModelSpec", "SplitClassifier", "build_model", "count_flops", "dp_sgd_ready", "example_inputs",
    "get_spec", "model_info", "model_names",
]
