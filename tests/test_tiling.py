"""A token-wise layer run over tiles of tokens gives the numbers of the untiled layer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from torch import nn

from lightning_roundpipe.models.tiling import tiled


class Mlp(nn.Module):
    def __init__(self, tile_tokens: int | None, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 48), nn.Linear(48, 16)
        self.drop = nn.Dropout(dropout)
        self.tile_tokens = tile_tokens
        self.autocast_seen: list[bool] = []

    def branch(self, h: torch.Tensor) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return self.down(self.drop(F.silu(self.up(self.norm(h)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + tiled(self, self.branch, x, self.tile_tokens)


def grads_of(module: nn.Module, x: torch.Tensor, g: torch.Tensor, autocast: bool = False):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(g)
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("tile", [1, 7, 40, 1000])
def test_tiles_give_the_untiled_output_and_gradients(tile):
    x, g = torch.randn(2, 20, 16), torch.randn(2, 20, 16)
    want = grads_of(Mlp(None), x, g)
    got = grads_of(Mlp(tile), x, g)
    assert relative_error(got[0], want[0]) <= 1e-6 and relative_error(got[1], want[1]) <= 1e-6
    for a, b in zip(got[2], want[2]):
        assert relative_error(a, b) <= 1e-5


def test_recompute_runs_under_the_calls_autocast_and_matches_within_bf16():
    x, g = torch.randn(1, 32, 16), torch.randn(1, 32, 16)
    want = grads_of(Mlp(None), x, g, autocast=True)
    module = Mlp(8)
    got = grads_of(module, x, g, autocast=True)
    assert module.autocast_seen == [True] * 8  # 4 tiles forward, 4 recomputed in backward
    for a, b in zip([got[1], *got[2]], [want[1], *want[2]]):
        assert relative_error(a, b) <= 2e-2


def test_without_autograd_the_tiles_build_no_graph():
    x = torch.randn(3, 10, 16)
    module = Mlp(4)
    with torch.no_grad():
        out = module(x)
    assert out.grad_fn is None
    assert torch.allclose(out, Mlp(None)(x).detach(), atol=1e-6)
    frozen = copy.deepcopy(module).requires_grad_(False)
    assert frozen(x).grad_fn is None  # nothing requires a gradient: the plain path


def test_an_input_that_needs_no_gradient_still_gives_weight_gradients():
    x, g = torch.randn(1, 9, 16), torch.randn(1, 9, 16)
    module, reference = Mlp(2), Mlp(None)
    module(x).backward(g)
    reference(x).backward(g)
    for a, b in zip(module.parameters(), reference.parameters()):
        assert relative_error(a.grad, b.grad) <= 1e-5


def test_random_draws_and_bad_tiles_are_refused():
    with pytest.raises(ValueError, match="Dropout"):
        Mlp(4, dropout=0.1)(torch.randn(1, 9, 16))
    Mlp(4, dropout=0.1).eval()(torch.randn(1, 9, 16))  # no draws in eval mode
    with pytest.raises(ValueError, match="at least 1"):
        Mlp(0)(torch.randn(1, 9, 16))


def test_tiles_keep_the_inputs_rank_and_shared_tensors_get_every_use():
    """A (batch, sequence, hidden) input gives (1, tile, hidden) tiles (transformers' MoE blocks unpack
    three dimensions); a parameter used by two submodules, and a submodule registered twice, sum both
    uses; integer buffers travel along."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.weight = self.a.weight
            self.again = self.a
            self.register_buffer("steps", torch.tensor(3))
            self.shapes: list[tuple[int, ...]] = []

        def branch(self, h: torch.Tensor) -> torch.Tensor:
            self.shapes.append(tuple(h.shape))
            return self.again(torch.tanh(self.b(self.a(h)))) * self.steps

        def forward(self, x: torch.Tensor, tile_tokens: int | None) -> torch.Tensor:
            return tiled(self, self.branch, x, tile_tokens)

    x, g = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    grads = []
    for tile_tokens in (None, 4):
        module = Shared()
        module(x, tile_tokens).backward(g)
        grads.append([p.grad for p in module.parameters()])
    assert module.shapes == [(1, 4, 8), (1, 4, 8), (1, 4, 8)] * 2  # 12 tokens: forward, then recompute
    for a, b in zip(*grads):
        assert relative_error(b, a) <= 1e-6
