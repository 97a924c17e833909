"""A real mosquitto broker on a free loopback port, started and stopped by the test (the product's
own launcher, edgefl.fleet.broker, so tests and `edgefl fleet` start brokers the same way)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from edgefl.fleet.broker import free_port, mosquitto_binary, start_mosquitto

__all__ = ["free_port", "mosquitto"]


@contextmanager
def mosquitto(tmp: Path, extra_config: str = ""):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto; ./dev.sh test does it as root)")
    broker = start_mosquitto(tmp / "mosquitto", extra_config=extra_config)
    try:
        yield broker.url
    finally:
        broker.stop()
