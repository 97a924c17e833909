"""Simulation engine and the shared fleet set-up."""

from edgefl.sim.engine import Simulation

__all__ = ["Simulation"]
