"""Distributed K-FAC (SC20 / KAISA): layers, decompositions, placement and the preconditioner.

:class:`KFAC` is the public entry point (also ``interlace.KFAC``); the other modules are pure
pieces it is built from and that tests and the simulator call directly.
"""

from interlace.kfac.preconditioner import KFAC, PHASES, KFACWarning

__all__ = ["KFAC", "PHASES", "KFACWarning"]
