"""Next-token labels as Hugging Face shifts them, and the count a micro-batch's loss is weighted by."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def shift_labels(labels: Tensor) -> Tensor:
    """Token t is predicted from positions < t: labels move one step left, the last position ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def counted_tokens(labels: Tensor) -> Tensor:
    """The micro-batch's share of the batch loss: its tokens that have a (shifted) label."""
    return (shift_labels(labels) != IGNORE_INDEX).sum()
