"""Turning models into layer sequences, and the losses that go with them."""

from lightning_roundpipe.models.chunked_loss import chunked_linear_cross_entropy
from lightning_roundpipe.models.tiling import tiled

__all__ = ["chunked_linear_cross_entropy", "tiled"]
