"""Distributed K-FAC (SC20 / KAISA, SPD-KFAC): :class:`KFAC` and the pieces it is built from."""

from interlace.kfac.preconditioner import KFAC, PHASES, KFACWarning

__all__ = ["KFAC", "PHASES", "KFACWarning"]
