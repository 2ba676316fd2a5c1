"""The generic path's stages: any decoder-only causal LM, cut at its blocks, with the model's own code
around them (:mod:`.shells`). Built by :mod:`.anatomy` after its probe checked the model.

Every stage calls the causal LM's ``forward`` (a shell of it, whose base model is a shell too), so what
the model passes from one to the other reaches the blocks as it would.

- :class:`GenericInput` runs the ``forward`` from the token ids until the first block is called, and keeps
  what that block would have received: the embedding, with whatever the model does to it before its
  blocks (a multiplier, a dropout).
- :class:`GenericBlock` runs one block as it is, with the arguments the model's ``forward`` hands it (the
  mask for its kind of attention, the positions, the rotary tables, anything else), recorded by running
  that ``forward`` from ``inputs_embeds`` over stand-ins: once per micro-batch and stage, shared by the
  stage's blocks, from the positions and the 2-D padding mask that travel (never an O(seq^2) mask).
- :class:`GenericOutput` runs the ``forward`` with the stage's hidden states in the last block's place:
  the final norm, the head and the loss as the model computes them. Where the probe found a plain linear
  head and the standard loss, the head's input is taken and the loss computed in chunks (Liger's fused
  kernel on CUDA); where the logits go through more (a scale, a soft cap) token by token, the model's
  code after its base model runs over tiles of tokens; otherwise the model computes its own loss.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_roundpipe.models.hf.attention import _let_go
from lightning_roundpipe.models.hf.labels import IGNORE_INDEX, head_loss, shift_labels
from lightning_roundpipe.models.hf.router import _add_router_sums, _RouterLogits, load_balancing
from lightning_roundpipe.models.hf.shells import Call, Watched, first_input, recorder, replacing_last, run
from lightning_roundpipe.models.hf.state import State
from lightning_roundpipe.models.tiling import tiled

HEAD_MODES = ("chunked", "tiled", "model")
"""How the output stage computes the loss: ``"chunked"`` (a plain linear head and the standard loss: the
head's input in chunks, never full-vocabulary logits), ``"tiled"`` (the model's code from the base model's
output to the logits, over tiles of tokens) or ``"model"`` (the model's own loss over whole logits)."""

CHUNK_TOKENS = 2048
"""Tokens per chunk of the head's loss (as the table's output stage)."""

_RECENT = threading.local()
"""Per thread (one worker, one device): the recorded block calls of the micro-batch passing through."""


@contextlib.contextmanager
def _own_random_numbers(device: torch.device) -> Iterator[None]:
    """The device generator as it was, after code whose random draws are thrown away (the stage's layer
    draws the same numbers whether or not it ran the model's forward first: forward stages and
    recomputes cut the blocks into stages differently). The worker holds this generator's lock."""
    generator = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    state = generator.get_state()
    try:
        yield
    finally:
        generator.set_state(state)


def stage_inputs(state: State) -> dict[str, Any]:
    """What the base model's ``forward`` is given in every stage after the first: the stage's hidden states
    as ``inputs_embeds`` (without their graph: only what the model derives from the positions and the mask
    is kept), the padding mask and the positions that travel."""
    hidden, attention_mask, position_ids, _, _ = state
    return dict(
        inputs_embeds=hidden.detach(), attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )


class GenericInput(nn.Module):
    """The token embedding as the model makes it for its first block; router sums start at zero."""

    def __init__(self, shell: nn.Module, num_experts: int = 0) -> None:
        super().__init__()
        self.shell = shell
        self.num_experts = num_experts

    def compile_targets(self) -> tuple[nn.Module, ...]:
        return ()

    def forward(self, batch: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]) -> State:
        input_ids, attention_mask, position_ids, labels = batch
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        _, hidden = run(self.shell, first_input, **inputs)
        if hidden is None:
            raise RuntimeError("the model's forward returned without calling its first block")
        sums = None
        if self.num_experts:
            zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=hidden.device)
            sums = (zeros, zeros.clone(), torch.zeros((), dtype=torch.float32, device=hidden.device))
        return hidden, attention_mask, position_ids, labels, sums


class GenericBlock(nn.Module):
    """Block ``index``, called with what the model's ``forward`` hands it (see the module docstring); a
    mixture-of-experts block adds its router's logits (``router``: the submodule's name and which output)
    to the running sums where the load-balancing loss is computed."""

    def __init__(
        self, block: nn.Module, index: int, last: int, shell: nn.Module, model_key: int,
        router: tuple[str, int] | None = None, top_k: int = 0, sparse: bool = False, watched: Watched | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.block = block
        self.shell = shell
        self.index, self.last, self.model_key = index, last, model_key
        self.router, self.top_k, self.sparse = router, top_k, sparse
        self.watched = watched
        """The modules the block arguments are made of, where none holds a trainable parameter: without a
        padding mask and with plain positions, the arguments depend only on the batch's shape and on them."""

    def compile_targets(self) -> tuple[nn.Module, ...]:
        """The block, unless it routes tokens to experts (as the table's mixture-of-experts blocks, eager)."""
        return () if self.sparse else (self.block,)

    def forward(self, state: State) -> State:
        hidden, attention_mask, position_ids, labels, sums = state
        call = self._calls(state)[self.index]
        router = self.block.get_submodule(self.router[0]) if self.router and sums is not None else None
        with _RouterLogits(router, self.router[1] if self.router else 0) as logits:
            if call.positional:
                out = self.block(hidden, *call.args, **call.kwargs)
            else:
                out = self.block(*call.args, hidden_states=hidden, **call.kwargs)
        if logits:
            assert sums is not None
            sums = _add_router_sums(sums, logits[0], attention_mask, self.top_k)
        return (out[0] if isinstance(out, tuple) else out), attention_mask, position_ids, labels, sums

    def _calls(self, state: State) -> dict[int, Call]:
        """The blocks' calls for this micro-batch: recorded by the first block of a stage it meets, shared by
        the blocks after it (the pass is told by its labels, a new tensor at every upload, as for the table's
        attention inputs). Without a padding mask and with plain positions they depend on the shape alone
        (the probe refused arguments made from the tokens or the embeddings' values) and on the watched
        modules: recorded once per shape for every stage and micro-batch of the worker. Made in every stage,
        transformers' check for packed positions waits for the device each time: on one H200 that added about
        1.4 ms to each measured block (2026-12-03), and the plans made from it were slower."""
        hidden, attention_mask, position_ids, labels, _ = state
        made: dict[Any, tuple[Any, ...]] | None = getattr(_RECENT, "made", None)
        if made is None:
            made = _RECENT.made = {}
        shape = (*hidden.shape[:2], hidden.dtype, hidden.device, torch.is_inference_mode_enabled())
        if attention_mask is None and position_ids is None and self.watched is not None:
            plain, stamp = (self.model_key, "plain"), (shape, self.watched.version())
            entry = made.get(plain)
            if entry is None or entry[0] != stamp:
                entry = made[plain] = (stamp, self._record(state))
            return entry[1]
        if labels is None:
            return self._record(state)
        last = made.get(self.model_key)
        same = last is not None and last[0]() is labels and last[1] is attention_mask and last[2] is position_ids
        if same and last[3] == shape:
            return last[4]
        calls = self._record(state)
        entry = made[self.model_key] = (weakref.ref(labels), attention_mask, position_ids, shape, calls)
        weakref.finalize(labels, _let_go, made, self.model_key, entry)
        return calls

    def _record(self, state: State) -> dict[int, Call]:
        calls: dict[int, Call] = {}
        with _own_random_numbers(state[0].device):
            _, stopped = run(self.shell, recorder(self.last, calls), **stage_inputs(state))
        if stopped is None:
            raise RuntimeError(f"the model's forward returned without calling block {self.last}")
        return calls


class GenericOutput(nn.Module):
    """The model's code after its blocks, and the loss (see the module docstring); plus the load-balancing
    loss, ``aux_coef`` times the router sums' value, where the model adds one (its own is switched off:
    its router logits are not collected, the sums are).

    ``shell``: the causal LM's shell, whose head is a :class:`~.shells.HeadInput` (``"chunked"``) or the
    head, and whose base model is the base model's shell (``"tiled"``: inside a :class:`~.shells.Captured`);
    ``given``: for ``"tiled"``, the causal LM's shell whose base model is a :class:`~.shells.Given`."""

    def __init__(
        self, shell: nn.Module, last: int, mode: str, head: nn.Module | None = None, given: nn.Module | None = None,
        aux_coef: float = 0.0, chunk_tokens: int = CHUNK_TOKENS, scale: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if mode not in HEAD_MODES:
            raise ValueError(f"head mode {mode!r} is not one of {HEAD_MODES}")
        self.shell = shell
        self.given = given
        self.head = head
        """The LM head (``"chunked"``: its weight is the chunked loss's; otherwise it lives in the shells)."""
        self.last, self.mode, self.aux_coef, self.chunk_tokens = last, mode, aux_coef, chunk_tokens
        self.scale = scale
        """``"chunked"``: the constant the model multiplies the head's output by (Cohere's ``logit_scale``), applied
        to the head's input instead (the same product up to rounding; checked on the probe)."""
        self.no_router_logits = {"output_router_logits": False} if hasattr(shell.config, "output_router_logits") else {}
        self.fused_loss: bool | None = False if mode == "chunked" else None
        """Liger's fused linear cross-entropy on CUDA tensors (:mod:`.kernels`), ``"chunked"`` mode only."""

    def compile_targets(self) -> tuple[nn.Module, ...]:
        return ()

    def forward(self, state: State) -> Tensor:
        hidden, _, _, labels, sums = state
        if labels is None:
            raise ValueError("training through roundpipe needs `labels` in the batch (the loss is computed there)")
        driver, inputs = replacing_last(self.last, hidden), {**stage_inputs(state), **self.no_router_logits}
        if self.mode == "chunked":
            _, x = run(self.shell, driver, **inputs)
            if x is None:
                raise RuntimeError("the model's forward returned without calling its LM head")
            assert self.head is not None
            if self.scale is not None:
                x = x * self.scale
            loss = head_loss(x, self.head.weight, labels, bool(self.fused_loss), self.chunk_tokens)
        elif self.mode == "tiled":
            _, base = run(self.shell, driver, **inputs)
            loss = self._tiled_loss(_without_router_logits(base), labels)
        else:
            counted = (shift_labels(labels) != IGNORE_INDEX).sum().clamp_min(1)
            out, _ = run(self.shell, driver, labels=labels, num_items_in_batch=counted, **inputs)
            loss = out.loss
        return loss if sums is None else loss + self.aux_coef * load_balancing(sums)

    def _tiled_loss(self, base: Any, labels: Tensor) -> Tensor:
        """Mean cross-entropy over the counted tokens of the logits the model's code makes from each tile of
        the base model's output: never more than a tile's logits, each tile recomputed in backward."""
        assert self.given is not None
        hidden = _last_hidden(base)
        targets = shift_labels(labels)
        template = type(base)

        def token_losses(tile: Tensor, tile_targets: Tensor) -> Tensor:
            given = template(last_hidden_state=tile)
            out, _ = run(self.given, None, given=given, use_cache=False, **self.no_router_logits)
            logits = out.logits.float()
            losses = F.cross_entropy(
                logits.flatten(0, -2), tile_targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            )
            return losses.view(*tile.shape[:-1], 1)

        losses = tiled(self.given, token_losses, hidden, self.chunk_tokens, side=targets)
        return losses.sum() / (targets != IGNORE_INDEX).sum().clamp_min(1)


def _last_hidden(output: Any) -> Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _without_router_logits(output: Any) -> Any:
    """The base model's output without router logits (the stand-ins collected none; the model would compute
    its load-balancing loss on an empty tuple): the router sums carry them instead."""
    if getattr(output, "router_logits", None) is None:
        return output
    return type(output)(**{k: v for k, v in output.items() if k != "router_logits"})
