"""What to pipeline in a LightningModule: a Hugging Face causal LM (through its preset) or the
``nn.Sequential`` that holds every trainable parameter, with a clear error for anything else."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_roundpipe.models import compiled, quantized
from lightning_roundpipe.models.compiled import compile_options
from lightning_roundpipe.options import RoundPipeOptions
from lightning_roundpipe.runtime.microbatch import Split


@dataclass
class Pipelined:
    """The layers the engine runs, and the module whose calls are routed to it."""

    layers: list[nn.Module]
    hf_model: nn.Module | None = None
    """The Hugging Face model (or ``peft`` wrapper) whose ``forward`` is intercepted, if any."""
    sequential: nn.Sequential | None = None
    """Otherwise the ``nn.Sequential`` that ``pipeline_loss`` is called on."""
    kernels: list[str] = field(default_factory=list)
    """The faster kernels bound onto the model's modules (``RoundPipeStrategy(kernels=...)``)."""
    compiled: list[str] = field(default_factory=list)
    """The modules whose ``forward`` was compiled (``RoundPipeStrategy(compile=...)``)."""
    four_bit: int = 0
    """bitsandbytes 4-bit layers (QLoRA's base weights) given their worker-side ``forward``."""
    checkpointing: list[nn.Module] = field(default_factory=list)
    """The model's modules whose own gradient checkpointing was turned off (on again at :meth:`undo`)."""
    split: Split | None = None
    """How its batches are cut into micro-batches (``None``: by samples; ``RoundPipeStrategy(split_by=...)``)."""

    @contextlib.contextmanager
    def undone_on_failure(self) -> Iterator[None]:
        """For the setup steps after binding: a failure leaves the user's model as it was."""
        try:
            yield
        except BaseException:
            self.undo()
            raise

    def undo(self) -> None:
        """The model's modules run their classes' code again: the kernels and compiled forwards come off (at
        teardown, or when setup fails after they were bound)."""
        if self.kernels:
            from lightning_roundpipe.models import hf

            hf.kernels.remove(hf.unwrap(self.hf_model))
        if self.compiled:
            compiled.remove(self.layers)
        if self.four_bit:
            for layer in self.layers:
                quantized.remove(layer)
        for module in self.checkpointing:
            module.gradient_checkpointing = True
        self.checkpointing = []


def pipelined_layers(
    module: nn.Module,
    options: RoundPipeOptions,
    cuda: bool,
    devices: Sequence[torch.device] = (),
    half: bool | None = None,
) -> Pipelined:
    """The layer sequence of ``module``'s model, refusing trainable parameters no gradient would reach; the
    layers' bodies compiled where ``options.compile`` asks, then a Hugging Face model's faster kernels
    (``options.kernels``) on CUDA workers (``cuda``): bound after, so that a compiled module keeps its own
    code for Inductor to fuse, and a block compiled whole traces into the kernels of its submodules.
    ``devices``: the CUDA workers', where ``split_by="auto"`` packs padded batches if torch's flash kernel runs
    on each (``half``: whether the precision computes in half; ``None``: the weights' dtype decides)."""
    pipelined = discover(module, options)
    if options.split_by == "auto" and devices:
        _pack_padded(pipelined, devices, half)
    quantized.refuse_8bit(module)
    pipelined.four_bit = sum(quantized.prepare(layer) for layer in pipelined.layers)
    if pipelined.four_bit:
        rank_zero_info(f"roundpipe: {pipelined.four_bit} 4-bit layers: stored and uploaded packed, run by bitsandbytes")
    if (kwargs := _compiling(options.compile, pipelined, cuda)) is not None:
        pipelined.compiled = compiled.apply(pipelined.layers, kwargs, fallback=options.compile == "auto")
        rank_zero_info(f"roundpipe: torch.compile on the layers' bodies: {', '.join(pipelined.compiled) or 'none'}")
    if pipelined.hf_model is not None:
        from lightning_roundpipe.models import hf

        if hf.kernels.resolve(options.kernels, cuda):
            model, blocks = hf.unwrap(pipelined.hf_model), not pipelined.compiled
            pipelined.kernels = hf.kernels.apply_liger(model, pipelined.layers, blocks=blocks)
            kernels = ", ".join(pipelined.kernels)
            rank_zero_info(f"roundpipe: liger-kernel's kernels in the model's stages: {kernels}")
    return pipelined


def _pack_padded(pipelined: Pipelined, devices: Sequence[torch.device], half: bool | None) -> None:
    """``split_by="auto"``: a padded batch's micro-batches packed (one row each, no padding, torch's varlen flash
    attention) where that kernel runs, if the batch holds padding. Measured on an H200 against micro-batches of
    padded rows (2026-12-04, sequences of 256..4096 tokens): 19,788 against 14,850 real tokens/s at 8 a step,
    41,744 against 35,339 at 32, 33,635 against 25,227 at 32 capped at 24 GiB. Elsewhere (SDPA with a mask per
    micro-batch, memory growing with the square of its tokens) padded rows stay."""
    from lightning_roundpipe.models.hf import TokenSplit, unwrap
    from lightning_roundpipe.models.hf.packed import why_not_flash

    split = pipelined.split
    if not isinstance(split, TokenSplit) or split.unpackable is not None:
        return
    model = unwrap(pipelined.hf_model)
    # every worker: where one could not, its packed rows would take SDPA with a mask the square of their tokens
    checks = (why_not_flash(model, device, half) for device in dict.fromkeys(devices))
    why = next(filter(None, checks), None)
    if why is None:
        split.packed, split.pack_unpadded = True, False
        rank_zero_info("roundpipe: padded batches' micro-batches packed (torch's variable-length flash attention)")
    else:
        rank_zero_info(f"roundpipe: padded batches' micro-batches stay padded (torch's flash kernel cannot run: {why})")


def _compiling(choice: bool | str | dict, pipelined: Pipelined, cuda: bool) -> dict | None:
    """``torch.compile``'s arguments for ``RoundPipeStrategy(compile=choice)``, or ``None``: ``"auto"``
    compiles a Hugging Face model's blocks on CUDA workers, unless the user put liger-kernel's modules in
    them (their choice of kernels stands)."""
    if choice != "auto":
        return compile_options(choice)
    if not compiled.auto_applies(cuda, preset=pipelined.hf_model is not None):
        return None
    if pipelined.four_bit:
        rank_zero_info("roundpipe: the blocks hold bitsandbytes 4-bit layers: left eager (compile=True compiles them)")
        return None
    if foreign := compiled.foreign_kernels(pipelined.layers):
        rank_zero_info(
            f"roundpipe: the blocks run liger-kernel's {', '.join(foreign)} as the model was built: left eager"
            " (compile=True compiles them anyway)"
        )
        return None
    return compile_options(choice)


def discover(module: nn.Module, options: RoundPipeOptions) -> Pipelined:
    """The layers of ``module``'s Hugging Face model (through its preset) or of its ``nn.Sequential``."""
    hf_model = find_hf_model(module)
    if hf_model is not None:
        from lightning_roundpipe.models import hf

        layers, how = hf.pipeline_layers(hf_model, options.split_decoder_layers, options.tile_tokens, options.hf_stages)
        rank_zero_info(f"roundpipe: {how}")
        check_covers_trainable(module, layers, f"the {type(hf.unwrap(hf_model)).__name__} stages' layers")
        packed, model = options.split_by == "packed", hf.unwrap(hf_model)
        if packed:
            hf.check_packable(model, layers)
            hf.require_flash(layers)
        why = hf.packable(model, layers)  # a flattened batch's sequences are packed where the model takes it
        unpackable = None if why is None else f"this model has {why}, which packed micro-batches do not take"
        split = None if options.split_by == "samples" else hf.TokenSplit.for_model(model, packed, unpackable)
        return Pipelined(layers, hf_model=hf_model, split=split, checkpointing=_own_checkpointing_off(model))
    if options.kernels == "liger":
        raise ValueError(
            "RoundPipeStrategy(kernels='liger') applies to a Hugging Face model's stages; this model is an"
            " nn.Sequential, whose layers run as written. Use kernels='auto' or 'none'."
        )
    if options.split_by in ("tokens", "packed"):
        raise ValueError(
            f"RoundPipeStrategy(split_by={options.split_by!r}) cuts a Hugging Face model's padded token batches;"
            " this model is an nn.Sequential, whose batches are cut by samples. Use split_by='auto' or 'samples'."
        )
    if options.split_decoder_layers:
        from lightning_roundpipe.models.hf import PRESETS

        raise ValueError(
            "RoundPipeStrategy(split_decoder_layers=True) splits the decoder blocks of a Hugging Face model"
            f" (presets: {sorted(PRESETS)}); an nn.Sequential is pipelined layer by layer as given,"
            " so split its blocks into separate children instead"
        )
    sequential = find_pipelined_module(module)
    return Pipelined(list(sequential), sequential=sequential)  # (children() would drop a module used twice)


def _own_checkpointing_off(model: nn.Module) -> list[nn.Module]:
    """The model's own gradient checkpointing (``gradient_checkpointing_enable()``) turned off while roundpipe trains
    it: each stage is recomputed by roundpipe already, so the layers' own recompute would be a third forward (it
    runs, on the stage's weights, where a layer checkpoints itself otherwise). Returns the modules to turn it on
    again."""
    modules = [m for m in model.modules() if m.__dict__.get("gradient_checkpointing") is True]
    for m in modules:
        m.gradient_checkpointing = False
    if modules:
        rank_zero_info(
            "roundpipe: the model's own gradient checkpointing is off while it trains here (roundpipe recomputes each"
            " stage itself); it is on again after fit"
        )
    return modules


def find_hf_model(module: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model (or ``peft`` wrapper of one) inside ``module``, if any.

    Looked for only when ``transformers`` was imported: a model cannot be one otherwise.
    """
    if "transformers" not in sys.modules:
        return None
    from lightning_roundpipe.models import hf

    for _, child in module.named_modules():
        if hf.is_hf_model(child):
            return child
    return None


def check_covers_trainable(module: nn.Module, layers: list[nn.Module], what: str) -> None:
    """Refuse trainable parameters outside the pipelined layers: no gradient would ever reach them."""
    inside = {id(p) for layer in layers for p in layer.parameters()}
    outside = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"these trainable parameters of {type(module).__name__} are not in {what}: {outside[:8]}"
            f"{' ...' if len(outside) > 8 else ''}. They would never be trained: freeze them, or move them into"
            " the pipelined model."
        )


def find_pipelined_module(module: nn.Module) -> nn.Sequential:
    """The ``nn.Sequential`` that holds every trainable parameter of ``module`` (the outermost one)."""
    compiled = [name or "<root>" for name, m in module.named_modules() if type(m).__name__ == "OptimizedModule"]
    if compiled:
        raise ValueError(
            f"roundpipe cannot pipeline a `torch.compile`d module ({', '.join(compiled[:4])}): it runs each layer"
            " of the `nn.Sequential` on its own worker, with weights streamed in per stage. Remove"
            " `torch.compile` around the model."
        )
    trainable = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
    sequentials = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Sequential)]
    for _, seq in sequentials:
        inside = {id(p) for p in seq.parameters()}
        if trainable.keys() <= inside and len(seq) > 0:
            return seq
    if not sequentials:
        raise ValueError(
            f"roundpipe pipelines an `nn.Sequential` whose children are the layers, but {type(module).__name__}"
            " holds none. Keep the model as `self.model = nn.Sequential(...)` and return"
            " `lightning_roundpipe.pipeline_loss(self.model, inputs, target, loss_fn)` from `training_step`."
        )
    best_name, best = max(sequentials, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    outside = [name for pid, name in trainable.items() if pid not in {id(p) for p in best.parameters()}]
    raise ValueError(
        f"roundpipe pipelines one `nn.Sequential` holding every trainable parameter, but these trainable"
        f" parameters of {type(module).__name__} are outside `{best_name or '<root>'}`: {outside[:8]}"
        f"{' ...' if len(outside) > 8 else ''}. Move them into a layer of the Sequential, or freeze them."
    )
