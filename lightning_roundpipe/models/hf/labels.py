"""Next-token labels as Hugging Face shifts them, the count a micro-batch's loss is weighted by, and the head's
loss computed in chunks from its input."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lightning_roundpipe.models.chunked_loss import chunked_linear_cross_entropy
from lightning_roundpipe.models.hf.kernels import fused_linear_cross_entropy

IGNORE_INDEX = -100


def shift_labels(labels: Tensor) -> Tensor:
    """Token t is predicted from positions < t: labels move one step left, the last position ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def counted_tokens(labels: Tensor) -> Tensor:
    """The micro-batch's share of the batch loss: its tokens that have a (shifted) label."""
    return (shift_labels(labels) != IGNORE_INDEX).sum()


def head_loss(
    hidden: Tensor, weight: Tensor, labels: Tensor, fused: bool, chunk_size: int, softcap: float | None = None
) -> Tensor:
    """Next-token cross-entropy of ``hidden @ weight.T`` (soft-capped), mean over the counted tokens, never with
    full-vocabulary logits: Liger's fused kernel on CUDA tensors where ``fused``, the chunked loss otherwise."""
    if fused and hidden.is_cuda:
        return fused_linear_cross_entropy(hidden, weight, shift_labels(labels), IGNORE_INDEX, softcap)
    return chunked_linear_cross_entropy(hidden, weight, shift_labels(labels), IGNORE_INDEX, chunk_size, softcap)
