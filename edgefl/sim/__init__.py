"""The in-process simulation: the round loop over an in-memory network of device loops."""

from edgefl.sim.engine import Simulation

__all__ = ["Simulation"]
