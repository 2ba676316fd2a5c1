"""A randomly initialised decoder with Qwen3's shapes, as an ``nn.Sequential`` (no downloads).

Layers: embedding, ``num_layers`` decoder blocks (RMSNorm, grouped-query attention with per-head
q/k RMSNorm and rotary embeddings, SwiGLU MLP), and a head (final norm, LM head tied to the
embedding, chunked cross-entropy). The labels ride along with the hidden states, so the last layer
returns the loss: ``model((tokens, labels))`` is the mean token loss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_roundpipe.models import chunked_linear_cross_entropy
from lightning_roundpipe.models.tiling import tiled


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = True
    """The LM head shares the embedding's weight (Qwen3-1.7B and 4B; the 8B's is its own)."""


SHAPES = {
    "qwen3-1.7b": Shape(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=151936),
    "qwen3-4b": Shape(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=9728, vocab=151936),
    "qwen3-8b": Shape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936, tied=False),
    "debug": Shape(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=97),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def _compute_dtype(x: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Embed(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.vocab, shape.hidden))

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        tokens, labels = batch
        h = F.embedding(tokens, self.weight)
        return h.to(_compute_dtype(h)), labels  # the residual stream in the compute dtype


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    def __init__(self, shape: Shape, rope_theta: float = 1_000_000.0) -> None:
        super().__init__()
        s = shape
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.input_norm = RMSNorm(s.hidden)
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim)
        self.k_norm = RMSNorm(s.head_dim)
        self.post_norm = RMSNorm(s.hidden)
        self.gate = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.hidden, bias=False)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, labels = batch
        x = x + _attention(self, x)
        return x + _mlp(self, x), labels


def _qkv(m: nn.Module, x: Tensor) -> Tensor:
    """The token-wise part of attention: norm, projections, q/k norms; q, k, v side by side per token."""
    h = m.input_norm(x)
    q = m.q_norm(m.q_proj(h).unflatten(-1, (m.heads, m.head_dim))).flatten(-2)
    k = m.k_norm(m.k_proj(h).unflatten(-1, (m.kv_heads, m.head_dim))).flatten(-2)
    return torch.cat([q, k, m.v_proj(h)], dim=-1)


def _attention(m: nn.Module, x: Tensor, tile_tokens: int | None = None) -> Tensor:
    """The attention branch of a block (``m`` holds its modules: a :class:`Block` or an :class:`AttentionHalf`);
    ``tile_tokens``: its token-wise part over at most that many tokens at a time, keeping only ``x``."""
    b, t, _ = x.shape
    if tile_tokens is None:  # as measured in every untiled run
        h = m.input_norm(x)
        q = m.q_norm(m.q_proj(h).view(b, t, m.heads, m.head_dim))
        k = m.k_norm(m.k_proj(h).view(b, t, m.kv_heads, m.head_dim))
        v = m.v_proj(h).view(b, t, m.kv_heads, m.head_dim)
    else:
        qkv = tiled(m, functools.partial(_qkv, m), x, tile_tokens)
        q, k, v = qkv.split([m.heads * m.head_dim, m.kv_heads * m.head_dim, m.kv_heads * m.head_dim], dim=-1)
        q, k = q.view(b, t, m.heads, m.head_dim), k.view(b, t, m.kv_heads, m.head_dim)
        v = v.contiguous().view(b, t, m.kv_heads, m.head_dim)  # a copy: SDPA keeping a view keeps all of qkv
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * m.inv_freq[None, :]
    cos, sin = (f(angles)[None, :, None, :].to(q.dtype) for f in (torch.cos, torch.sin))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    attn = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return m.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


def _mlp(m: nn.Module, x: Tensor) -> Tensor:
    h = m.post_norm(x)
    return m.down(F.silu(m.gate(h)) * m.up(h))


class AttentionHalf(nn.Module):
    """A block's attention branch and its residual as a layer of its own, on the block's own parameters;
    ``tile_tokens``: its token-wise part (norms and projections) over at most that many tokens at a time."""

    def __init__(self, block: Block, tile_tokens: int | None = None) -> None:
        super().__init__()
        self.tile_tokens = tile_tokens
        self.heads, self.kv_heads, self.head_dim = block.heads, block.kv_heads, block.head_dim
        for name in ("input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            setattr(self, name, getattr(block, name))
        self.register_buffer("inv_freq", block.inv_freq, persistent=False)

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, labels = batch
        return x + _attention(self, x, self.tile_tokens), labels


class MlpHalf(nn.Module):
    """A block's MLP branch and its residual as a layer of its own, on the block's own parameters;
    ``tile_tokens``: the branch over at most that many tokens at a time (``tile_tokens``)."""

    def __init__(self, block: Block, tile_tokens: int | None = None) -> None:
        super().__init__()
        self.post_norm, self.gate, self.up, self.down = block.post_norm, block.gate, block.up, block.down
        self.tile_tokens = tile_tokens

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, labels = batch
        return x + tiled(self, functools.partial(_mlp, self), x, self.tile_tokens), labels


class Head(nn.Module):
    """Final norm, LM head (tied to the embedding) and the chunked loss."""

    def __init__(self, shape: Shape, embed: Embed) -> None:
        super().__init__()
        self.norm = RMSNorm(shape.hidden)
        self.weight = embed.weight

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, labels = batch
        return chunked_linear_cross_entropy(self.norm(x), self.weight, labels)


def build(shape: Shape) -> nn.Sequential:
    """Build on the current default device (use ``torch.device('meta')`` and :func:`init` for speed)."""
    embed = Embed(shape)
    return nn.Sequential(embed, *(Block(shape) for _ in range(shape.layers)), Head(shape, embed))


def split_blocks(model: nn.Sequential, tile_tokens: int | None = None) -> nn.Sequential:
    """The same model (the same parameters) with each block as two layers, attention and MLP: what
    ``RoundPipeStrategy(split_decoder_layers=True)`` does to a Hugging Face model. ``tile_tokens``: the
    token-wise parts of both halves over at most that many tokens at a time (the Hugging Face preset's
    ``tile_tokens`` reaches the attention's input norm only: transformers runs the q/k norms). Call
    after :func:`init`."""
    layers = [model[0]]
    for block in list(model)[1:-1]:
        layers += [AttentionHalf(block, tile_tokens), MlpHalf(block, tile_tokens)]
    return nn.Sequential(*layers, model[-1])


@torch.no_grad()
def init(model: nn.Sequential, seed: int = 0) -> nn.Sequential:
    """Random normal weights (std 0.02), ones for norms; recomputes buffers lost on the meta device and
    re-ties the head to the embedding (``to_empty`` unties shared parameters)."""
    model[-1].weight = model[0].weight
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    for block in model:
        if isinstance(block, Block):
            d = block.head_dim
            block.inv_freq.copy_(1.0 / 1_000_000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return model


@torch.no_grad()
def init_hf(model: nn.Module, config: object, seed: int = 0, tile: int | None = None) -> nn.Module:
    """Random weights for a Hugging Face model built on the meta device and moved with ``to_empty``:
    normal (std 0.02), ones for norms, and the rotary tables taken from a freshly built rotary module.

    ``tile``: parameters of more elements are filled by repeating one random block of ``tile``
    elements. The host draws normal numbers at about 0.2 G/s, a copy runs at memory speed: 30 B
    parameters take minutes one way and seconds the other. For throughput and memory runs, where
    the values do not matter (routers and small tensors still get their own draws)."""
    g = torch.Generator().manual_seed(seed)
    block = None if tile is None else torch.empty(tile).normal_(0.0, 0.02, generator=g)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif block is None or p.numel() <= block.numel():
            p.normal_(0.0, 0.02, generator=g)
        else:
            flat, piece = p.view(-1), block.to(p.dtype)
            for start in range(0, flat.numel(), piece.numel()):
                stop = min(flat.numel(), start + piece.numel())
                flat[start:stop].copy_(piece[: stop - start])
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            fresh = type(module)(config=config)
            for name, buffer in fresh.named_buffers():
                getattr(module, name).copy_(buffer)
    return model


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(shape: Shape, seq_len: int, recompute: bool) -> float:
    """Matmul and attention FLOPs per token for forward + backward (+ the recomputed block forward)."""
    s = shape
    block = 2 * (s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden)
    block += 2 * 3 * s.hidden * s.ffn
    block += 2 * 2 * seq_len * s.heads * s.head_dim * 0.5  # causal QK^T and PV
    head = 2 * s.hidden * s.vocab
    forward = s.layers * block + head
    return 3 * forward + (s.layers * block if recompute else 0)
