"""edgefl: federated learning across devices that cannot all run the same model."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("edgefl")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
