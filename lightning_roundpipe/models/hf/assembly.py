"""The generic path's stages, built from the probe (:mod:`.anatomy`) and checked on the probe's batch: the
first stage's output, every block's arguments as a stage rebuilds them and the loss must equal the model's
own; the loss is computed the fastest way that gives it (:data:`.generic.HEAD_MODES`, a constant logit scale
moved onto the head's input), and a mixture of experts' load-balancing loss is checked against the router
sums that carry it between stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_roundpipe.models.hf.anatomy import (
    Anatomy,
    first_difference,
    inspect_model,
    probe_batch,
    refuse,
    setting,
)
from lightning_roundpipe.models.hf.generic import (
    CHUNK_TOKENS,
    GenericBlock,
    GenericInput,
    GenericOutput,
    stage_inputs,
)
from lightning_roundpipe.models.hf.router import _add_router_sums, load_balancing
from lightning_roundpipe.models.hf.shells import (
    Captured,
    Given,
    HeadInput,
    StandIn,
    Watched,
    replacing_last,
    run,
    shell,
)


def generic_layers(model: nn.Module) -> tuple[list[nn.Module], str]:
    """The generic path's layers for ``model`` (input, one per block, output) and a line saying how its loss
    is computed; every stage checked against the model's own numbers on the probe batch (in eval mode, so
    that no dropout draws differ)."""
    with _evaluating(model):
        return _generic_layers(model)


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode, then back in its mode through its own ``train`` (transformers' may do more than
    set flags: kernels chosen for training), and every module's flag as it was."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        model.train(modes[0][1])
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
    made_of = [anatomy.base._modules[n] for n in sorted(anatomy.preamble_children)]
    made_of += [model._modules[n] for n in sorted(anatomy.top_before)]
    watched = Watched(made_of, [anatomy.base, model])
    if any(t.requires_grad for t in watched.tensors()):
        watched = None  # trainable: the arguments change with every update
    for i, block in enumerate(anatomy.blocks):
        router = routers[i] if anatomy.aux_coef else None
        sparse = routers[i] is not None or any(hasattr(m, "experts") for m in block.modules())
        layers.append(GenericBlock(block, i, anatomy.last, middle, key, router, anatomy.top_k, sparse, watched))
    with torch.no_grad(), setting(model.config, "output_router_logits", False):
        state = first((batch["input_ids"], batch["attention_mask"], None, batch["labels"]))
        if not torch.equal(state[0], anatomy.calls[0].hidden):
            raise refuse(model, "its embedding, run as the first stage, differs from the model's own")
        for i in range(len(anatomy.blocks)):  # what each stage rebuilds, with its own children only
            difference = first_difference(anatomy.calls[i], layers[1 + i]._calls(state)[i])
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
        base, _ = run(_tail(anatomy), replacing_last(anatomy.last, state[0]), **stage_inputs(state))
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
            out, _ = run(top, None, given=routed, labels=state[3], **stage_inputs(state), **switch)
            losses.append(out.loss.double())
    difference = (losses[0] - losses[1]).item()
    if difference == 0.0:
        return  # it computes no load-balancing loss from the router logits (DeepSeek-V3's routing needs none)
    zeros = torch.zeros(experts, dtype=torch.float32)
    sums = (zeros, zeros.clone(), torch.zeros((), dtype=torch.float32))
    for layer in logits:
        sums = _add_router_sums(sums, layer, state[1], top_k)
    ours = load_balancing(sums).item()
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
    own = [*model.parameters(recurse=False), *model.buffers(recurse=False)]
    own += [
        t for m in model.children() if m is not head and m is not anatomy.base for t in (*m.parameters(), *m.buffers())
    ]
    for mode in ("chunked", "tiled", "model"):
        if mode == "chunked" and (head_name is None or type(head) is not nn.Linear or head.bias is not None):
            tried.append("the head is not a plain linear layer without bias")
            continue
        if mode == "chunked" and own:  # e.g. a learned logit scale: its value on the probe is not its value later
            tried.append("the causal LM holds tensors besides its base model and head, which only its code applies")
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
        out, _ = run(
            _top(anatomy, set(), _tail(anatomy)), replacing_last(anatomy.last, state[0]), **stage_inputs(state)
        )
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
