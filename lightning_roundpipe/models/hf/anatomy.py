"""The generic path's probe and builder: what a causal LM does around its blocks, learned by running its
own ``forward`` on a tiny batch with stand-ins in the blocks' places, then the stages that reproduce it.

The probe costs an embedding of a dozen tokens, the final norm and the head over them: no block runs.
It finds the base model's ``ModuleList`` of blocks, whether the model wants a block's output as a tensor
or a tuple, which of the model's children run before the first block (from token ids, and from
``inputs_embeds``, as every stage after the first runs it) and after the last, and what each block is
handed. It refuses, naming what is missing, what the stages cannot carry: an encoder-decoder, blocks
called out of order, a block handed another block's output (or the embeddings), a cache that persists
across blocks, or arguments that depend on the token ids or the embeddings' values. Then it builds the
stages and runs them on the same batch: the first stage's output, every block's arguments and the loss
must equal the model's own, and the way the loss is computed (:data:`.generic.HEAD_MODES`) is the
fastest one that gives the model's loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_roundpipe.models.hf.generic import (
    CHUNK_TOKENS,
    GenericBlock,
    GenericInput,
    GenericOutput,
    _inputs,
)
from lightning_roundpipe.models.hf.labels import IGNORE_INDEX
from lightning_roundpipe.models.hf.router import _add_router_sums
from lightning_roundpipe.models.hf.shells import (
    Call,
    Captured,
    Given,
    HeadInput,
    StandIn,
    recorder,
    replacing_last,
    run,
    shell,
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
def _setting(config: Any, name: str, value: Any) -> Iterator[None]:
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


def inspect_model(model: nn.Module) -> tuple[Anatomy, Tensor]:
    """Run the model's ``forward`` over stand-ins on the probe batch (see the module docstring); returns what
    it learned and the model's own loss there (its blocks passing the hidden states through)."""
    base, name = find_blocks(model)
    blocks, config, batch = list(base._modules[name]), model.config, probe_batch(model)
    errors = []
    for as_tuple in (False, True):  # transformers 5's blocks return a tensor; older ones a tuple
        stand_ins = nn.ModuleList([StandIn(i, block, as_tuple) for i, block in enumerate(blocks)])
        trace = _Trace()
        hooks = trace.hooks({n: m for n, m in base.named_children() if n != name}, "base")
        hooks += trace.hooks({n: m for n, m in model.named_children() if m is not base}, "top")
        try:
            with _swapped(base, name, stand_ins), _setting(config, "output_router_logits", False), torch.no_grad():
                out, _ = run(model, trace.driver, **batch, use_cache=False)
        except Exception as error:  # a block output of the other kind, indexed or unpacked
            errors.append(f"{type(error).__name__}: {error}")
            continue
        finally:
            for hook in hooks:
                hook.remove()
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
    anatomy.preamble_children = _preamble(anatomy, trace, batch)
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


def _preamble(anatomy: Anatomy, trace: _Trace, batch: dict[str, Tensor]) -> set[str]:
    """The base model's children its ``forward`` runs before the first block from ``inputs_embeds``, after
    checking that every block is handed the same arguments as from the token ids (what a stage rebuilds)."""
    model, base = anatomy.model, anatomy.base
    stand_ins = nn.ModuleList([StandIn(i, b, anatomy.as_tuple) for i, b in enumerate(anatomy.blocks)])
    again = _Trace()
    hooks = again.hooks({n: m for n, m in base.named_children() if n != anatomy.blocks_name}, "base")
    hooks += again.hooks({n: m for n, m in model.named_children() if m is not base}, "top")
    embeds = torch.randn(trace.calls[0].hidden.shape, generator=torch.Generator().manual_seed(1))
    inputs = dict(attention_mask=batch["attention_mask"], use_cache=False)
    try:
        with (
            _swapped(base, anatomy.blocks_name, stand_ins),
            _setting(model.config, "output_router_logits", False),
            torch.no_grad(),
        ):
            run(
                model,
                recorder(anatomy.last, again.calls),
                inputs_embeds=embeds.to(trace.calls[0].hidden.dtype),
                **inputs,
            )
    except Exception as error:
        raise refuse(
            model, f"its base model cannot start from `inputs_embeds` ({type(error).__name__}: {error})"
        ) from error
    finally:
        for hook in hooks:
            hook.remove()
    for k in range(len(anatomy.blocks)):
        differs = _first_difference(trace.calls[k], again.calls.get(k))
        if differs is not None:
            raise refuse(
                model, f"block {k}'s `{differs}` depends on the token ids or on the embeddings' values (it changes"
                " when the model starts from other `inputs_embeds`); the stages rebuild a block's arguments from the"
                " positions and the padding mask alone",
            )  # fmt: skip
    anatomy.top_before |= again.before("top", ("block", 0))
    return {n for kind, n in again.events if kind == "base"}


def _named_leaves(call: Call) -> list[tuple[str, Any]]:
    named = [(f"argument {i + 1}", a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
    return [(key, leaf) for key, value in named for leaf in tree_flatten(value)[0]]


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _first_difference(a: Call, b: Call | None) -> str | None:
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


def generic_layers(model: nn.Module) -> tuple[list[nn.Module], str]:
    """The generic path's layers for ``model`` (input, one per block, output) and a line saying how its loss
    is computed; every stage checked against the model's own numbers on the probe batch (in eval mode, so
    that no dropout draws differ)."""
    with _evaluating(model):
        return _generic_layers(model)


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _generic_layers(model: nn.Module) -> tuple[list[nn.Module], str]:
    anatomy, want = inspect_model(model)
    batch = probe_batch(model)
    last_hidden = anatomy.calls[anatomy.last].hidden
    _load_balancing(anatomy, (last_hidden, batch["attention_mask"], None, batch["labels"], None))
    first = GenericInput(_top(anatomy, anatomy.embedding_children), anatomy.num_experts)
    middle = _top(anatomy, anatomy.preamble_children)
    key = id(model)
    routers = [_router_path(anatomy, block) for block in anatomy.blocks]
    layers: list[nn.Module] = [first]
    for i, block in enumerate(anatomy.blocks):
        router = routers[i] if anatomy.aux_coef else None
        sparse = routers[i] is not None or any(hasattr(m, "experts") for m in block.modules())
        layers.append(GenericBlock(block, i, anatomy.last, middle, key, router, anatomy.top_k, sparse))
    with torch.no_grad(), _setting(model.config, "output_router_logits", False):
        state = first((batch["input_ids"], batch["attention_mask"], None, batch["labels"]))
        if not torch.equal(state[0], anatomy.calls[0].hidden):
            raise refuse(model, "its embedding, run as the first stage, differs from the model's own")
        for i in range(len(anatomy.blocks)):  # what each stage rebuilds, with its own children only
            difference = _first_difference(anatomy.calls[i], layers[1 + i]._calls(state)[i])
            if difference is not None:
                raise refuse(model, f"block {i}'s `{difference}`, rebuilt by a stage, differs from the model's own")
        last = (last_hidden, *state[1:4], None)
        output, why = _output_stage(anatomy, last, want)
    layers.append(output)
    where = f"{type(anatomy.base).__name__}.{anatomy.blocks_name}"
    aux = f"; its load-balancing loss from router sums (coefficient {anatomy.aux_coef:g})" if anatomy.aux_coef else ""
    return layers, f"the model's own code around its {len(anatomy.blocks)} blocks ({where}); loss: {why}{aux}"


def _base(anatomy: Anatomy, keep: set[str]) -> nn.Module:
    """The base model's shell: stand-ins for its blocks, its own children named in ``keep``."""
    stand_ins = nn.ModuleList([StandIn(i, b, anatomy.as_tuple) for i, b in enumerate(anatomy.blocks)])
    return shell(anatomy.base, {anatomy.blocks_name: stand_ins}, keep)


def _top(anatomy: Anatomy, keep: set[str], base: nn.Module | None = None, **parts: nn.Module) -> nn.Module:
    """The causal LM's shell around the base model's (``keep``: the base model's children it runs), or around
    ``base``; with ``parts`` in place of its own children, and its own where the model runs them in the stage
    (all of them after the blocks, none but those run before the first block otherwise)."""
    tail = base is not None or bool(parts)
    children = {_prefix(anatomy): base if base is not None else _base(anatomy, keep), **parts}
    return shell(anatomy.model, children, anatomy.top_children if tail else anatomy.top_before)


def _tail(anatomy: Anatomy) -> nn.Module:
    """The base model's shell that runs its code after the blocks on a stage's hidden states."""
    return _base(anatomy, anatomy.preamble_children | anatomy.tail_children)


def _prefix(anatomy: Anatomy) -> str:
    return next(n for n, m in anatomy.model.named_children() if m is anatomy.base)


def _router_spec(anatomy: Anatomy) -> tuple[type | None, str | None, int] | None:
    """Where transformers records this model's router logits: (class, class-name suffix, output index)."""
    spec = (getattr(type(anatomy.base), "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return None
    if isinstance(spec, list):
        spec = spec[0]
    if isinstance(spec, type):
        return spec, None, 1  # transformers' own default index for outputs other than hidden states
    if isinstance(spec, str):
        return None, spec, 1
    return getattr(spec, "target_class", None), getattr(spec, "class_name", None), getattr(spec, "index", 0)


def _router_path(anatomy: Anatomy, block: nn.Module) -> tuple[str, int] | None:
    """The name of ``block``'s router inside it and which of its outputs are the logits, if it has one."""
    spec = _router_spec(anatomy)
    if spec is None:
        return None
    cls, suffix, index = spec
    for name, m in block.named_modules():
        if (cls is not None and isinstance(m, cls)) or (suffix is not None and type(m).__name__.endswith(suffix)):
            return name, index
    return None


def _load_balancing(anatomy: Anatomy, state: tuple[Any, ...]) -> None:
    """Whether the model adds a load-balancing loss (``output_router_logits``), checked to be the one the
    router sums give: the model's own loss with random router logits, less its loss without them, against
    ``router_aux_loss_coef`` times the sums' value. Sets ``anatomy``'s experts, top-k and coefficient."""
    model, config = anatomy.model, anatomy.model.config
    if not getattr(config, "output_router_logits", False):
        return
    experts = next((int(getattr(config, n)) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, n, None)), 0)  # fmt: skip
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    with torch.no_grad():
        base, _ = run(_tail(anatomy), replacing_last(anatomy.last, state[0]), **_inputs(state))
    if "router_logits" not in getattr(type(base), "__dataclass_fields__", {}):
        return  # its outputs carry no router logits: no load-balancing loss to add
    if not experts or not top_k:
        raise refuse(model, "it asks for router logits but its config names no number of experts or top-k")
    g = torch.Generator().manual_seed(2)
    logits = tuple(torch.randn(state[0].shape[0] * state[0].shape[1], experts, generator=g) for _ in range(2))
    top = _top(anatomy, set(), Given())
    outputs = {k: v for k, v in base.items() if k != "router_logits"}
    losses = []
    with torch.no_grad():
        switched = {"output_router_logits": False}
        routed_and_switched = ((type(base)(**outputs, router_logits=logits), {}), (base, switched))
        for routed, switch in routed_and_switched:
            out, _ = run(top, None, given=routed, labels=state[3], **_inputs(state), **switch)
            losses.append(out.loss.double())
    difference = (losses[0] - losses[1]).item()
    if difference == 0.0:
        return  # it computes no load-balancing loss from the router logits (DeepSeek-V3's routing needs none)
    zeros = torch.zeros(experts, dtype=torch.float32)
    sums = (zeros, zeros.clone(), torch.zeros((), dtype=torch.float32))
    for layer in logits:
        sums = _add_router_sums(sums, layer, state[1], top_k)
    per_expert, probs_sum, rows = sums
    ours = ((per_expert / rows * (probs_sum / rows)).sum() * experts).item()
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not abs(difference - coef * ours) <= 1e-4 * max(abs(difference), 1e-6):
        raise refuse(
            model, f"its load-balancing loss ({difference:.6g} on a probe) is not transformers' standard one that"
            f" roundpipe carries through the stages as router sums ({coef:g} x {ours:.6g})",
        )  # fmt: skip
    if not any(_router_path(anatomy, block) for block in anatomy.blocks):
        raise refuse(model, "it computes a load-balancing loss but roundpipe cannot find its router modules")
    anatomy.aux_coef, anatomy.num_experts, anatomy.top_k = coef, experts, top_k


def _output_stage(anatomy: Anatomy, state: tuple[Any, ...], want: Tensor) -> tuple[GenericOutput, str]:
    """The fastest output stage whose loss on the probe batch is the model's own (chunks and tiles of a few
    tokens there, so that work cut by tokens is checked)."""
    model = anatomy.model
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_children() if m is head), None)
    tried, scale = [], None
    for mode in ("chunked", "tiled", "model"):
        if mode == "chunked" and (head_name is None or type(head) is not nn.Linear or head.bias is not None):
            tried.append("the head is not a plain linear layer without bias")
            continue
        if mode == "chunked":
            scale = _logit_scale(anatomy, state, head)
            if scale is False:
                tried.append("the logits are not the head's output times a constant")
                continue
            stage = GenericOutput(_top(anatomy, set(), _tail(anatomy), **{head_name: HeadInput()}), anatomy.last,
                                  mode, head=head, chunk_tokens=5, scale=scale)  # fmt: skip
        elif mode == "tiled":
            given = _top(anatomy, set(), Given())
            stage = GenericOutput(_top(anatomy, set(), Captured(_tail(anatomy))), anatomy.last, mode, given=given,
                                  chunk_tokens=5)  # fmt: skip
        else:
            stage = GenericOutput(_top(anatomy, set(), _tail(anatomy)), anatomy.last, mode)
        try:
            got = stage(state)
        except Exception as error:
            tried.append(f"{mode}: {type(error).__name__}: {error}")
            continue
        if _close(got, want):
            stage.chunk_tokens, stage.aux_coef = CHUNK_TOKENS, anatomy.aux_coef
            note = _MODE_NOTES[mode] + (
                "" if scale is None or mode != "chunked" else f", the logits scaled by {scale:g}"
            )
            return stage, note + (f" ({'; '.join(tried)})" if tried else "")
        tried.append(f"the {mode} loss {got.item():.6g} is not the model's {want.item():.6g}")
    raise refuse(model, f"no way of computing its loss gave the model's own ({'; '.join(tried)})")


def _logit_scale(anatomy: Anatomy, state: tuple[Any, ...], head: nn.Module) -> float | bool | None:
    """What the model multiplies its head's output by before the loss (Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``): ``None`` for nothing, ``False`` when the logits are not a constant times the
    head's output (a soft cap, a bias, a function of the tokens)."""
    seen: list[Tensor] = []
    hook = head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        out, _ = run(_top(anatomy, set(), _tail(anatomy)), replacing_last(anatomy.last, state[0]), **_inputs(state))
    finally:
        hook.remove()
    logits = getattr(out, "logits", None)
    if len(seen) != 1 or not isinstance(logits, Tensor) or logits.shape != seen[0].shape:
        return False
    z, logits = seen[0].double(), logits.double()
    if torch.equal(z, logits):
        return None
    scale = ((z * logits).sum() / (z * z).sum().clamp_min(1e-30)).item()
    tolerance = 1e-6 if seen[0].dtype == torch.float32 else 1e-2
    return scale if torch.allclose(logits, scale * z, rtol=tolerance, atol=tolerance * z.abs().max().item()) else False


_MODE_NOTES = {
    "chunked": "chunked cross-entropy on the head's input (no full-vocabulary logits)",
    "tiled": "the model's code from its base model's output to the logits, over tiles of tokens",
    "model": "the model's own loss over whole logits",
}


def _close(got: Tensor, want: Tensor) -> bool:
    tolerance = 1e-5 if want.dtype == torch.float32 and got.dtype == torch.float32 else 2e-3
    return bool(torch.isclose(got.double(), want.double(), rtol=tolerance, atol=tolerance * 1e-2))
