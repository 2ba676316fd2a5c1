"""What crosses a stage boundary: the one type every stage takes and returns."""

from __future__ import annotations

from torch import Tensor

State = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, tuple[Tensor, Tensor, Tensor] | None]
"""What travels between stages: hidden states, 2-D padding mask, position ids, labels, and the router
sums (tokens per expert, router probability per expert, counted rows) of the layers so far."""
