"""fxstar: train PyTorch models larger than accelerator memory by compiling the training step."""

from fxstar import _C

__version__ = "0.1.0"
__all__ = ["_C", "__version__"]
