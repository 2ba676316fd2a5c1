"""The generic path's probe: what a causal LM does around its blocks, learned by running its own ``forward``
on a tiny batch with stand-ins in the blocks' places (:mod:`.assembly` builds the stages from it).

The probe costs an embedding of a dozen tokens, the final norm and the head over them: no block runs.
It finds the base model's ``ModuleList`` of blocks, whether the model wants a block's output as a tensor
or a tuple, which of the model's children run before the first block (from token ids, and from
``inputs_embeds``, as every stage after the first runs it) and after the last, and what each block is
handed. It refuses, naming what is missing, what the stages cannot carry: an encoder-decoder, blocks
called out of order, a block handed another block's output (or the embeddings), a cache that persists
across blocks, or arguments that depend on the token ids or the embeddings' values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_roundpipe.models.hf.labels import IGNORE_INDEX
from lightning_roundpipe.models.hf.shells import (
    Call,
    StandIn,
    recorder,
    run,
)

PROBE_SHAPE = (2, 6)
"""Rows and tokens of the probe batch: the second row padded at its end, so padding masks are exercised."""


@dataclass
class Anatomy:
    """What the probe learned about one causal LM (see the module docstring)."""

    model: nn.Module
    base: nn.Module
    blocks_name: str
    blocks: list[nn.Module]
    as_tuple: bool
    embedding_children: set[str] = field(default_factory=set)
    """The base model's children run before the first block from token ids (the first stage's)."""
    preamble_children: set[str] = field(default_factory=set)
    """Those run before the first block from ``inputs_embeds`` (every stage that runs the model's forward)."""
    tail_children: set[str] = field(default_factory=set)
    """The base model's children run after the last block (the final norm)."""
    top_children: set[str] = field(default_factory=set)
    """The causal LM's children other than its base model (the head)."""
    top_before: set[str] = field(default_factory=set)
    """Those run before the first block (none in transformers' models), from token ids or ``inputs_embeds``."""
    calls: dict[int, Call] = field(default_factory=dict)
    """What the model handed each block on the probe batch."""
    router: tuple[type, int] | None = None
    """The router's class and which of its outputs are the logits (``_can_record_outputs``)."""
    aux_coef: float = 0.0
    num_experts: int = 0
    top_k: int = 0

    @property
    def last(self) -> int:
        return len(self.blocks) - 1


def refuse(model: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"roundpipe cannot pipeline {type(model).__name__} through its generic path: {what}. Keep the model as an"
        " `nn.Sequential` trained with `lightning_roundpipe.pipeline_loss`, or add a function of the model"
        " returning its layers to `lightning_roundpipe.models.hf.PRESETS`."
    )


def find_blocks(model: nn.Module) -> tuple[nn.Module, str]:
    """The base model and the name of its ``ModuleList`` of decoder blocks, or a clear refusal."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise refuse(model, "it is an encoder-decoder (its decoder's blocks read the encoder's output)")
    if model.get_output_embeddings() is None:
        raise refuse(model, "it has no output embeddings (an LM head): the generic path trains causal LMs")
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module) or base is model:
        raise refuse(model, "it keeps no base model under its `base_model_prefix`")
    lists = [(n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise refuse(model, f"its base model ({type(base).__name__}) keeps no `ModuleList` of decoder blocks")
    name, _ = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    return base, name


def probe_batch(model: nn.Module) -> dict[str, Tensor]:
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, PROBE_SHAPE, generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, 0] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@contextlib.contextmanager
def _swapped(module: nn.Module, name: str, replacement: nn.Module) -> Iterator[None]:
    """``module``'s child ``name`` replaced for the duration (the probe's stand-ins on the user's model)."""
    original = module._modules[name]
    module._modules[name] = replacement
    try:
        yield
    finally:
        module._modules[name] = original


@contextlib.contextmanager
def setting(config: Any, name: str, value: Any) -> Iterator[None]:
    """A config attribute set for the duration, where the config has it."""
    if not hasattr(config, name):
        yield
        return
    original = getattr(config, name)
    setattr(config, name, value)
    try:
        yield
    finally:
        setattr(config, name, original)


class _Trace:
    """The order in which the model's children and its blocks run: ``("child", name)``, ``("block", i)``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.outputs: dict[int, Tensor] = {}
        self.calls: dict[int, Call] = {}

    def hooks(self, modules: dict[str, nn.Module], where: str) -> list[Any]:
        return [
            m.register_forward_pre_hook(lambda _m, _a, name=name: self.events.append((where, name)))
            for name, m in modules.items()
        ]

    def driver(self, stand_in: StandIn, call: Call) -> Any:
        """Record the call and pass a copy of the hidden states on (a tensor of its own: the next block must
        be handed exactly this one)."""
        self.events.append(("block", stand_in.index))
        self.calls[stand_in.index] = call
        self.outputs[stand_in.index] = call.hidden.clone()
        return stand_in.output(self.outputs[stand_in.index])

    def before(self, where: str, event: tuple[str, Any]) -> set[str]:
        end = self.events.index(event) if event in self.events else len(self.events)
        return {name for kind, name in self.events[:end] if kind == where}

    def after(self, where: str, event: tuple[str, Any]) -> set[str]:
        start = self.events.index(event) + 1 if event in self.events else len(self.events)
        return {name for kind, name in self.events[start:] if kind == where}


def _traced(
    model: nn.Module, base: nn.Module, name: str, stand_ins: nn.ModuleList, driver: Any, trace: _Trace, **inputs: Any
) -> Any:
    """``model(**inputs)`` with ``stand_ins`` in place of its blocks and ``driver`` deciding for them, its
    children's calls traced into ``trace``, without gradients or router logits; the model as it was after."""
    hooks = trace.hooks({n: m for n, m in base.named_children() if n != name}, "base")
    hooks += trace.hooks({n: m for n, m in model.named_children() if m is not base}, "top")
    try:
        with _swapped(base, name, stand_ins), setting(model.config, "output_router_logits", False), torch.no_grad():
            return run(model, driver, **inputs, use_cache=False)[0]
    finally:
        for hook in hooks:
            hook.remove()


def inspect_model(model: nn.Module) -> tuple[Anatomy, Tensor]:
    """Run the model's ``forward`` over stand-ins on the probe batch (see the module docstring); returns what
    it learned and the model's own loss there (its blocks passing the hidden states through)."""
    base, name = find_blocks(model)
    blocks, batch = list(base._modules[name]), probe_batch(model)
    errors = []
    for as_tuple in (False, True):  # transformers 5's blocks return a tensor; older ones a tuple
        stand_ins = nn.ModuleList([StandIn(i, block, as_tuple) for i, block in enumerate(blocks)])
        trace = _Trace()
        try:
            out = _traced(model, base, name, stand_ins, trace.driver, trace, **batch)
        except Exception as error:  # a block output of the other kind, indexed or unpacked
            errors.append(f"{type(error).__name__}: {error}")
            continue
        order = [i for kind, i in trace.events if kind == "block"]
        if not order or order != list(range(len(order))):
            raise refuse(model, f"its forward calls its blocks in the order {order[:12]}, not each once from the first")
        if all(trace.calls[k].hidden is trace.outputs[k - 1] for k in range(1, len(order))):
            break
        errors.append("a block was not handed the previous block's output")
    else:
        raise refuse(model, f"its forward does not hand each block's output to the next ({'; '.join(errors)})")
    anatomy = Anatomy(model, base, name, blocks[: len(order)], as_tuple, calls=trace.calls)
    _check_arguments(anatomy, trace)
    anatomy.embedding_children = trace.before("base", ("block", 0))
    anatomy.tail_children = trace.after("base", ("block", anatomy.last))
    anatomy.top_children = {n for kind, n in trace.events if kind == "top"}
    anatomy.top_before = trace.before("top", ("block", 0))
    _preamble(anatomy, trace, batch)
    loss = getattr(out, "loss", None)
    if not isinstance(loss, Tensor):
        raise refuse(model, "its forward returned no `loss` for the labels it was given")
    return anatomy, loss


def _check_arguments(anatomy: Anatomy, trace: _Trace) -> None:
    """Refuse block arguments a stage cannot rebuild: a cache, another block's output or the embeddings."""
    from transformers.cache_utils import Cache

    seen: dict[int, str] = {}  # storage of each hidden state so far: what it is
    for k in range(len(anatomy.blocks)):
        call = trace.calls[k]
        seen[_storage(call.hidden)] = "the embeddings" if k == 0 else f"block {k - 1}'s output"
        for key, value in _named_leaves(call):
            if isinstance(value, Cache):
                raise refuse(anatomy.model, f"block {k} is handed a cache (`{key}`) that persists across blocks")
            if isinstance(value, Tensor) and _storage(value) in seen:
                raise refuse(
                    anatomy.model, f"block {k} is handed {seen[_storage(value)]} (as `{key}`): a block that reads"
                    " another block's hidden states needs them carried between stages, which the pipeline does not do",
                )  # fmt: skip
        seen[_storage(trace.outputs[k])] = f"block {k}'s output"


def _preamble(anatomy: Anatomy, trace: _Trace, batch: dict[str, Tensor]) -> None:
    """The model's children its ``forward`` runs before the first block from ``inputs_embeds`` (the base model's
    into ``preamble_children``, the causal LM's into ``top_before``), after checking that every block is handed
    the same arguments as from the token ids (what a stage rebuilds): with the probe's padding mask and without
    one (an unpadded batch's arguments are recorded once per shape)."""
    model, base, name = anatomy.model, anatomy.base, anatomy.blocks_name
    embeds = torch.randn(trace.calls[0].hidden.shape, generator=torch.Generator().manual_seed(1))
    embeds = embeds.to(trace.calls[0].hidden.dtype)
    for mask in (batch["attention_mask"], None):
        stand_ins = nn.ModuleList([StandIn(i, b, anatomy.as_tuple) for i, b in enumerate(anatomy.blocks)])
        if mask is None:  # the model's own calls without a mask, to compare with
            trace = _Trace()
            _traced(model, base, name, stand_ins, trace.driver, trace, input_ids=batch["input_ids"])
        again = _Trace()
        try:
            driver = recorder(anatomy.last, again.calls)
            _traced(model, base, name, stand_ins, driver, again, inputs_embeds=embeds, attention_mask=mask)
        except Exception as error:
            raise refuse(
                model, f"its base model cannot start from `inputs_embeds` ({type(error).__name__}: {error})"
            ) from error
        for k in range(len(anatomy.blocks)):
            differs = first_difference(trace.calls[k], again.calls.get(k))
            if differs is not None:
                raise refuse(
                    model, f"block {k}'s `{differs}` depends on the token ids or on the embeddings' values (it changes"
                    " when the model starts from other `inputs_embeds`); the stages rebuild a block's arguments from"
                    " the positions and the padding mask alone",
                )  # fmt: skip
        anatomy.top_before |= again.before("top", ("block", 0))
        anatomy.preamble_children |= {n for kind, n in again.events if kind == "base"}


def _named_leaves(call: Call) -> list[tuple[str, Any]]:
    named = [(f"argument {i + 1}", a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
    return [(key, leaf) for key, value in named for leaf in tree_flatten(value)[0]]


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def first_difference(a: Call, b: Call | None) -> str | None:
    """The name of the first argument in which two calls of a block differ, ``None`` when they agree."""
    if b is None:
        return "call"
    if len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs) or a.positional != b.positional:
        return "arguments"
    for (key, x), (_, y) in zip(_named_leaves(a), _named_leaves(b)):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return key
        elif type(x) is not type(y) or (not isinstance(x, Tensor) and x != y):
            return key
    if len(_named_leaves(a)) != len(_named_leaves(b)):
        return "arguments"
    return None
