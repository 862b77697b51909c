"""interlace: faster distributed PyTorch training by interlacing computation with communication."""

__version__ = "0.1.0"

__all__ = ["__version__"]
