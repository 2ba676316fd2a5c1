"""Mixture-of-experts router logits, summed layer by layer into what the load-balancing loss needs."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class _RouterLogits(list):
    """Collects the router's logits (its output ``index`` where it returns several) while the block runs
    (nothing when there is no router)."""

    def __init__(self, router: nn.Module | None, index: int = 0) -> None:
        super().__init__()
        self.router = router
        self.index = index
        self.handle: Any = None

    def __enter__(self) -> _RouterLogits:
        if self.router is not None:
            self.handle = self.router.register_forward_hook(
                lambda _m, _i, out: self.append(out[self.index] if isinstance(out, tuple) else out)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.remove()


def _router_of(mlp: nn.Module | None, attribute: str | None) -> nn.Module | None:
    """The module whose (first) output is the block's router logits: the family's router attribute of a
    sparse block (``mlp.gate``, GPT-OSS's ``mlp.router``), if the block has experts (Qwen2-MoE's may not)."""
    if mlp is None or attribute is None or not hasattr(mlp, "experts"):
        return None
    return getattr(mlp, attribute, None)


def _add_router_sums(
    sums: tuple[Tensor, Tensor, Tensor], logits: Tensor, attention_mask: Tensor | None, top_k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's share of the load-balancing loss, as transformers' ``load_balancing_loss_func`` sums it."""
    per_expert, probs_sum, rows = sums
    probs = torch.softmax(logits.float(), dim=-1)
    selected = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
    if attention_mask is None:
        weight = torch.ones(probs.shape[0], dtype=torch.float32, device=probs.device)
    else:
        weight = attention_mask.reshape(-1).to(torch.float32)
    counts = torch.zeros_like(per_expert).scatter_add_(0, selected, weight.repeat_interleave(top_k))
    return per_expert + counts, probs_sum + (probs * weight[:, None]).sum(0), rows + weight.sum()


def load_balancing(sums: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The load-balancing loss of the layers whose router logits the sums hold (transformers'
    ``load_balancing_loss_func``, without ``router_aux_loss_coef``)."""
    per_expert, probs_sum, rows = sums
    return (per_expert / rows * (probs_sum / rows)).sum() * per_expert.numel()
