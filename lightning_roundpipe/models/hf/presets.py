"""Which ``*ForCausalLM`` classes can be pipelined, and how each is cut into layers.

Every architecture of :data:`~lightning_roundpipe.models.hf.families.FAMILIES` is cut by
:func:`decoder_layers` as its entry says; ``PRESETS`` maps each to it. An architecture of another shape
gets a function of the model returning its stages (``PRESETS[name] = function``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from torch import nn

from lightning_roundpipe.models.hf.detect import unwrap
from lightning_roundpipe.models.hf.families import FAMILIES, Family, FamilyMismatch
from lightning_roundpipe.models.hf.stages import AttentionStage, DecoderStage, InputStage, MlpStage, OutputStage


def decoder_layers(
    model: nn.Module, split: bool = False, tile_tokens: int | None = None, family: Family | None = None
) -> list[nn.Module]:
    """Embedding, the decoder blocks (each as two layers when ``split``, their token-wise parts tiled
    over ``tile_tokens`` tokens), final norm and head, as the architecture's ``family`` entry says (by
    default its own entry in ``FAMILIES``)."""
    name = type(model).__name__
    family = family or FAMILIES[name]
    inner = model.model
    config = model.config
    layers = list(inner.layers[: config.num_hidden_layers])
    family.check(name, config, layers)
    experts = int(getattr(config, "num_experts", 0) or 0) if getattr(config, "output_router_logits", False) else 0
    stages: list[nn.Module] = [
        InputStage(inner.embed_tokens, experts, family.multiplier(config, family.embedding_multiplier))
    ]
    for i, layer in enumerate(layers):
        if split:
            stages += [
                AttentionStage(layer, inner.rotary_emb, config, i, family, tile_tokens),
                MlpStage(layer, config, family, tile_tokens),
            ]
        else:
            stages.append(DecoderStage(layer, inner.rotary_emb, config, i, family))
    aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0)) if experts else 0.0
    divisor = family.multiplier(config, family.logits_divisor)
    softcap = getattr(config, family.logits_softcap, None) if family.logits_softcap else None
    stages.append(OutputStage(inner.norm, model.lm_head, aux_coef=aux_coef, divisor=divisor, softcap=softcap))
    return stages


PRESETS: dict[str, Callable[..., list[nn.Module]]] = {name: decoder_layers for name in FAMILIES}
"""Architecture (class name) to the function building its layer sequence: ``preset(model)``; a preset
that can split each decoder block into an attention layer and an MLP layer also takes ``split=True``."""


PATHS = ("auto", "table", "generic")
"""``RoundPipeStrategy(hf_stages=...)``: ``"auto"`` takes the architecture table's stages where the model's class
has an entry and the generic path (:mod:`.anatomy`) otherwise; ``"table"`` only the table; ``"generic"`` the
generic path for every model."""


def build_layers(
    model: nn.Module, split_decoder_layers: bool = False, tile_tokens: int | None = None, path: str = "auto"
) -> list[nn.Module]:
    """The layer sequence for a Hugging Face causal LM (see :func:`pipeline_layers`)."""
    return pipeline_layers(model, split_decoder_layers, tile_tokens, path)[0]


def pipeline_layers(
    model: nn.Module, split_decoder_layers: bool = False, tile_tokens: int | None = None, path: str = "auto"
) -> tuple[list[nn.Module], str]:
    """The layer sequence for a Hugging Face causal LM, and a line saying which path it took and why; a
    clear error for a model neither path can run.

    ``path`` (:data:`PATHS`): the architecture table's stages, with what they do faster, or the generic
    path's, which run the model's own code around its blocks and need no entry.

    ``split_decoder_layers``: each decoder block becomes two layers, attention and MLP, with the same
    arithmetic. A stage can then end inside a block: one stage's activations are about half a block's
    (what bounds the longest sequence), and stages balance at a finer grain. ``tile_tokens`` (with
    the split): the token-wise parts of each layer (the MLP with its norm, the attention's input norm)
    run over at most that many tokens at a time and keep only their inputs
    (:mod:`~lightning_roundpipe.models.tiling`)."""
    if path not in PATHS:
        raise ValueError(f"RoundPipeStrategy(hf_stages={path!r}) must be one of {PATHS}")
    if tile_tokens is not None:
        if not split_decoder_layers:
            raise ValueError(
                f"tile_tokens={tile_tokens} tiles the attention and MLP layers that split_decoder_layers=True"
                " makes; pass both"
            )
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens={tile_tokens} must be at least 1")
    hf = unwrap(model)
    name = type(hf).__name__
    wrapped = [n for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"]
    if wrapped:
        raise ValueError(
            f"roundpipe cannot pipeline LoRA adapters on parameters (peft's ParamWrapper, e.g. {wrapped[0]}): peft"
            " re-registers those parameters on every forward, which the workers' weight-less module copies do"
            " not follow. `target_modules='all-linear'` does this to a mixture of experts' experts and router;"
            " target the linear layers instead, e.g. target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']."
        )
    dispatched = [n or "<root>" for n, m in hf.named_modules() if hasattr(m, "_hf_hook")]
    if dispatched:
        raise ValueError(
            f"{name} was dispatched by accelerate (hooks on {dispatched[0]}, ...: from_pretrained(device_map=...) or"
            " dispatch_model): roundpipe keeps the weights on the host and streams them to the GPUs itself. Load"
            " the model without a device_map (on the CPU; inside `configure_model` it is built under roundpipe's"
            " own device context)."
        )
    preset = None if path == "generic" else PRESETS.get(name) or _inherited(hf)
    if preset is None and path == "table":
        raise ValueError(
            f"roundpipe's architecture table has no entry for {name}; it has {sorted(PRESETS)}. Use"
            " RoundPipeStrategy(hf_stages='auto') (the generic path runs the model's own code around its blocks)."
        )
    if preset is None:
        why = "hf_stages='generic'" if path == "generic" else "its class has no entry in the architecture table"
        return _generic(hf, name, why, split_decoder_layers)
    if path == "auto" and not split_decoder_layers:
        try:
            return preset(hf), f"{name} takes the architecture table's stages"
        except FamilyMismatch as mismatch:  # the entry does not describe this model: its own code does
            return _generic(hf, name, f"the table's entry does not apply: {mismatch}", split_decoder_layers)
    note = f"{name} takes the architecture table's stages"
    if not split_decoder_layers:
        return preset(hf), note
    if "split" not in inspect.signature(preset).parameters:
        raise ValueError(
            f"the {name} preset cannot split decoder layers (its function takes no `split` argument); use"
            " RoundPipeStrategy(split_decoder_layers=False) or give the preset a `split` keyword"
        )
    if tile_tokens is None:
        return preset(hf, split=True), note + ", blocks split in two"
    if "tile_tokens" not in inspect.signature(preset).parameters:
        raise ValueError(f"the {name} preset cannot tile its layers (its function takes no `tile_tokens`)")
    return preset(hf, split=True, tile_tokens=tile_tokens), note + f", blocks split in two, tiled by {tile_tokens}"


def _generic(hf: nn.Module, name: str, why: str, split: bool) -> tuple[list[nn.Module], str]:
    if split:
        raise ValueError(
            f"split_decoder_layers=True cuts blocks in two as the architecture table's entry says; {name} takes"
            f" the generic path ({why}), whose blocks run whole. Use split_decoder_layers=False."
        )
    from lightning_roundpipe.models.hf.assembly import generic_layers

    layers, how = generic_layers(hf)
    return layers, f"{name} takes the generic path ({why}): {how}"


def _inherited(model: nn.Module) -> Callable[..., list[nn.Module]] | None:
    """The preset of a subclass of a supported architecture that runs its parent's ``forward`` (a renamed
    or extended class, e.g. with a method added): its parent's entry. One that overrides ``forward`` may
    compute anything: none."""
    for parent in type(model).__mro__[1:]:
        if parent.__name__ in FAMILIES and getattr(parent, "forward", None) is type(model).forward:
            return functools.partial(decoder_layers, family=FAMILIES[parent.__name__])
    return None
