"""What ``RoundPipeStrategy`` was asked for: every option documented, checked once when the strategy is made.

Every message quotes the user's own call (``RoundPipeStrategy(...)``) and says what would be valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.constants import default_pg_timeout

from lightning_roundpipe.engine import double_buffering
from lightning_roundpipe.models.compiled import compile_options
from lightning_roundpipe.schedule.choose import PLANNERS
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.transfers import OVERLAPS, Overlap

HF_STAGES = ("auto", "table", "generic")
SPLITS = ("auto", "tokens", "packed", "samples")
KERNELS = ("auto", "liger", "none")


@dataclass(kw_only=True)
class RoundPipeOptions:
    """The arguments of :class:`~lightning_roundpipe.RoundPipeStrategy`, validated and normalised:
    ``gpu_memory`` in bytes or a fraction, ``double_buffer`` one of the engine's names, ``timeout`` a
    ``timedelta``, ``plan`` parsed."""

    num_microbatches: int | None = None
    """Micro-batches per round (``M_R``), at least the number of devices: each device runs all of them for
    its stage before the next stage goes to the next device. ``None``: chosen; under ``plan="auto"``
    with the plan, from the layers measured at two micro-batch sizes (docs/tuning.md), otherwise
    ``max(4, 2 x devices)``. A batch smaller than the count runs as fewer micro-batches (the same loss and
    gradients); a count given here is lowered there, with one warning."""
    num_rounds: int = 1
    """Rounds per training batch, which is split into ``num_microbatches * num_rounds`` micro-batches
    along dim 0."""
    plan: StagePlan | str | None = "auto"
    """``"auto"``: the first ``profile_steps`` batches run one layer per stage and measure each layer's
    times and memory, the partitioner picks the plan, and stage times are checked now and then (the
    layers measured again when they drift). Or a :class:`StagePlan` or its printed form ``"3,3|1,2,2,2"``
    (forward stage sizes | backward stage sizes, the first backward stage being the fused one); ``None``
    uses ``StagePlan.uniform``."""
    profile_steps: int = 2
    """Batches measured before the automatic plan is made (on CUDA they reset ``torch.cuda``'s peak
    memory statistics per layer)."""
    planner: str = "fastest"
    """``"fastest"``: of the plans near the partitioner's optimum, the one the pipeline simulator finds
    fastest (1.10x the optimum's own plan on 2 H200s); ``"objective"``: the optimum of the paper's
    objective."""
    check_every: int = 50
    """With ``plan="auto"``, check the stage times every this many batches (0: never)."""
    replan_margin: float = 0.25
    """A check that finds a stage moved by more than this fraction of the slowest stage's time, twice in
    a row, measures the layers again and re-plans."""
    overlap: Overlap = "priority"
    """Weight uploads and gradient downloads: ``"priority"`` (cut into parts issued between activation
    copies), ``"simple"`` (one piece, prefetched a stage ahead) or ``"none"`` (no overlap; for
    comparison)."""
    gpu_memory: float | str = 0.8
    """What the automatic plan may use per device: a fraction of its memory (a cap set with
    ``torch.cuda.set_per_process_memory_fraction`` is honoured), bytes (``24 * 2**30``) or a string such
    as ``"24GiB"``/``"20GB"``. With room to spare the partitioner fuses more layers into the fused stage,
    which recomputes nothing but keeps their activations: lower this to trade speed for memory."""
    async_optimizer: bool = True
    """Apply each optimizer step on a host thread while the devices compute the next one, with gradients
    exactly one step stale (the fast mode). ``False`` gives the numerics of plain training. In the
    asynchronous mode gradient clipping runs on the optimizer thread, the LR and other hyper-parameters
    are those in effect when the step is submitted, and ``p.grad`` is not available in
    ``on_after_backward`` / ``on_before_optimizer_step``."""
    optimizer_on: str | float = "auto"
    """Where the asynchronous optimizer keeps the trainable weights' training states and steps them: ``"host"``
    (host memory, the RoundPipe design), or ``"device"``: on the one GPU, for a model whose fp32 masters, gradients,
    two compute copies and optimizer states (about 20 bytes a trainable parameter with AdamW) fit beside the plan,
    within ``gpu_memory``. The same updates in the same order (staleness one); the host's masters and states are
    brought up to date at every checkpoint, validation and the end of training. One GPU, one node, not
    ``16-mixed``. ``"auto"`` (the default): the device where the states take at most half of ``gpu_memory`` on one
    GPU and the optimizer is one of ``torch.optim``'s (another's step may need the host: ``"device"`` tries it),
    not with ``16-mixed`` or several nodes; else the host. A log line says which and why. Measured on one H200
    (Qwen3-1.7B shape, 8 sequences a step): 42,404 real tokens/s against the host's 22,877 (docs/benchmarks.md).
    A number in (0, 1): that share of the trainable parameters (the deepest layers') on the GPU, the rest on the
    host, for a host-bound step whose states do not all fit."""
    double_buffer: bool | str = False
    """With ``async_optimizer``, a second host compute copy of trainable weights, so each update is cast
    into the copy the step after next reads as soon as it is computed. Without it the next step's first
    stage waits for the cast of its weights, which the current step's last backward stage reads until
    the end: 12-18% of a step measured on 2 GPUs (docs/perf-notes.md). ``"all"`` or ``True``: every
    trainable weight (+2 bytes per trainable parameter in bf16); ``"first"``: only those of the plan's
    first stage; ``"auto"``: ``"all"`` where spares for every trainable weight would fit the host beside the rest
    (groups whose states the GPU holds get none all the same), else none, with a log line; decided when the engine
    is first built and kept through its rebuilds; ``False``. With ``"all"``, ``torch.optim.Adam``/``AdamW``'s host
    math and cast run in one pass over fp32 masters on one node (a C++ kernel built when the engine is), not under
    ``compile=False`` (:mod:`~lightning_roundpipe.runtime.one_pass`). ``"auto"`` is not the default: through
    ``Trainer`` it ran at a quarter of the defaults' speed on an H100 at 24 GiB with the kernel's first form (one
    thread, and the GIL held); its C++ form is not yet measured on a GPU (``benchmarks/gpu_checks.sh
    auto-db-24gib``)."""
    host_memory_check: bool = True
    """Before building the engine, estimate the host memory the run needs (model states with AdamW-sized
    optimizer states, :func:`~lightning_roundpipe.estimate_host_memory`) and refuse with the table if it
    exceeds what is available. ``False`` skips the check (an optimizer with smaller states, memory about
    to be freed)."""
    split_decoder_layers: bool = False
    """A Hugging Face model's decoder blocks become two pipeline layers each, attention and MLP (same
    arithmetic). One stage then holds about half a block's activations, so longer sequences fit, and the
    partitioner balances stages at a finer grain. Costs a stage boundary (the hidden states, host round
    trip included) per block."""
    tile_tokens: int | None = None
    """With ``split_decoder_layers``, the token-wise parts of each layer (the MLP with its norm, the
    attention's input norm) run over at most this many tokens at a time and keep only their inputs for
    backward; a backward stage recomputes them tile by tile (one more forward of them per backward), so
    one tile's intermediates bound their memory instead of the whole sequence's. For sequences too long
    for one layer's activations (e.g. 16384)."""
    hf_stages: str = "auto"
    """How a Hugging Face causal LM is cut into stages: ``"auto"`` takes the architecture table's stages where
    its class has an entry (docs/architectures.md: they split blocks, tile tokens and bind Liger's block
    kernels), and otherwise the generic path, which runs the model's own code around its blocks (any decoder
    whose base model keeps its blocks in a ``ModuleList``; checked against the model on a probe at setup);
    ``"generic"`` takes the generic path for every model; ``"table"`` refuses a class without an entry. A
    log line says which one a model took and why."""
    split_by: str = "auto"
    """How a batch is cut into micro-batches: ``"auto"`` cuts a Hugging Face model's padded batches by tokens
    (rows of similar lengths together, each micro-batch trimmed to its longest row, their costs balanced:
    :mod:`~lightning_roundpipe.models.hf.tokens`), a flattened one (``DataCollatorWithFlattening``'s rows) between
    its sequences into packed micro-batches as ``"packed"`` below, where the model takes packing, and anything
    else by samples; ``"tokens"`` asks for that
    (an ``nn.Sequential`` is refused: its inputs are not token batches); ``"packed"`` also lays each
    micro-batch's sequences end to end in one row without padding, attention kept within each sequence (torch's
    variable-length flash attention on CUDA: :mod:`~lightning_roundpipe.models.hf.packed`; a model of the
    architecture table with SDPA attention, no sliding windows and no experts); ``"samples"`` cuts every batch
    along dim 0 into near-equal counts."""
    kernels: str = "auto"
    """Faster kernels in a Hugging Face model's stages: ``"auto"`` uses liger-kernel's Triton RMSNorm,
    SwiGLU, rotary embedding and fused linear cross-entropy when liger-kernel is installed and the workers
    are CUDA devices (``pip install "lightning-roundpipe[gpu]"``); ``"liger"`` requires them (a clear
    error otherwise); ``"none"`` runs transformers' own modules and the chunked loss. Only this model's
    modules are changed, never the classes: other models in the process keep their code."""
    compile: bool | str | dict[str, Any] = "auto"
    """Regional compilation: each pipelined layer's body runs through ``torch.compile`` (a Hugging Face
    model's decoder blocks, or the attention and MLP of split ones; each layer of an ``nn.Sequential``),
    compiled once per class and device and shared by all blocks and workers. ``"auto"`` compiles a Hugging
    Face model's blocks on CUDA workers where Inductor has Triton, with Liger's fused cross-entropy kept in
    the output stage and Inductor's fusions instead of Liger's block kernels (measured faster: docs/
    benchmarks.md); CPU workers and an ``nn.Sequential`` run eagerly, as does a model the user built with
    liger-kernel's modules. ``True`` compiles with torch.compile's defaults wherever the workers are, a
    dict passes its keyword arguments (``{"mode": "max-autotune-no-cudagraphs"}``), ``False`` runs every
    layer eagerly. The first batches pay the compile (seconds: Inductor's cache), which the layer
    measurement leaves out."""
    evaluate_hf_in_pipeline: bool = True
    """``self.model(**batch)`` of a Hugging Face model in ``validation_step`` / ``test_step`` with labels
    runs forward-only through the pipeline and returns the loss only (``logits`` is ``None``: never
    materialised). ``False`` runs the model's own forward on the host weights instead, with logits (slow
    for large models)."""
    timeout: timedelta | float = default_pg_timeout
    """With ``num_nodes > 1``, how long a collective between nodes may wait for the others before it
    fails (a ``timedelta`` or seconds; as for ``DDPStrategy``, default 30 minutes). A node that hangs
    then stops the others with an error instead of holding them forever. It also bounds start-up: nodes
    launched further apart than this fail to connect."""

    def __post_init__(self) -> None:
        if self.num_microbatches is not None and self.num_microbatches < 1:
            raise ValueError(f"RoundPipeStrategy(num_microbatches={self.num_microbatches}) must be at least 1")
        if self.num_rounds < 1:
            raise ValueError(f"RoundPipeStrategy(num_rounds={self.num_rounds}) must be at least 1")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"RoundPipeStrategy(overlap={self.overlap!r}) must be one of {OVERLAPS}")
        if self.tile_tokens is not None and (not self.split_decoder_layers or self.tile_tokens < 1):
            raise ValueError(
                f"RoundPipeStrategy(tile_tokens={self.tile_tokens}) tiles the layers of split_decoder_layers=True"
                " over a positive number of tokens"
            )
        if self.kernels not in KERNELS:
            raise ValueError(f"RoundPipeStrategy(kernels={self.kernels!r}) must be one of {KERNELS}")
        if self.split_by not in SPLITS:
            raise ValueError(f"RoundPipeStrategy(split_by={self.split_by!r}) must be one of {SPLITS}")
        if self.hf_stages not in HF_STAGES:
            raise ValueError(f"RoundPipeStrategy(hf_stages={self.hf_stages!r}) must be one of {HF_STAGES}")
        compile_options(self.compile)
        self.gpu_memory = parse_memory(self.gpu_memory)
        given = self.double_buffer
        if given != "auto":
            try:
                self.double_buffer = double_buffering(given)
            except ValueError:
                raise ValueError(
                    f"RoundPipeStrategy(double_buffer={given!r}) must be 'all' (or True), 'first', 'auto' or 'none'"
                    " (or False)"
                ) from None
        if self.double_buffer not in ("none", "auto") and not self.async_optimizer:
            raise ValueError(
                f"RoundPipeStrategy(double_buffer={given!r}) double-buffers the asynchronous optimizer's"
                " weight casts; it needs async_optimizer=True"
            )
        share = isinstance(self.optimizer_on, float) and 0.0 < self.optimizer_on < 1.0
        if self.optimizer_on not in ("host", "device", "auto") and not share:
            raise ValueError(
                f"RoundPipeStrategy(optimizer_on={self.optimizer_on!r}) must be 'host', 'device', 'auto' or a share"
                " of the trainable parameters in (0, 1)"
            )
        if (self.optimizer_on == "device" or share) and not self.async_optimizer:
            raise ValueError(f"RoundPipeStrategy(optimizer_on={self.optimizer_on!r}) is the asynchronous optimizer's:"
                             " it needs async_optimizer=True")  # fmt: skip
        self.timeout = _timeout(self.timeout)
        if isinstance(self.plan, str) and self.plan != "auto":
            self.plan = StagePlan.parse(self.plan)
        if self.profile_steps < 1:
            raise ValueError(f"RoundPipeStrategy(profile_steps={self.profile_steps}) must be at least 1")
        if self.planner not in PLANNERS:
            raise ValueError(f"RoundPipeStrategy(planner={self.planner!r}) must be one of {PLANNERS}")
        if self.check_every < 0 or self.replan_margin <= 0:
            raise ValueError(
                f"RoundPipeStrategy(check_every={self.check_every}, replan_margin={self.replan_margin}):"
                " check_every must be at least 0 and replan_margin above 0"
            )

    def synchronous(self) -> RoundPipeOptions:
        """These options for a fit whose steps must run on the main thread: no asynchronous optimizer, nor what is
        its alone (the states on the GPU, spare compute copies: kept, the options would refuse themselves)."""
        return replace(self, async_optimizer=False, optimizer_on="host", double_buffer=False)


def _timeout(timeout: timedelta | float) -> timedelta:
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta):
        raise TypeError(f"RoundPipeStrategy(timeout={timeout!r}) takes a datetime.timedelta or a number of seconds")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"RoundPipeStrategy(timeout={timeout}) must be positive")
    return timeout


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_memory(value: float | str) -> float:
    """A fraction in (0, 1], or bytes (a number above 1 or a string like ``"24GiB"``), checked."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"RoundPipeStrategy(gpu_memory={value!r}): give a fraction such as 0.8, bytes, or a size"
                " such as '24GiB' or '20GB'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit and number * _UNITS[unit] <= 1:
            raise ValueError(f"RoundPipeStrategy(gpu_memory={value!r}) is not a usable size")
        value = number * _UNITS[unit]
    if not value > 0:
        raise ValueError(f"RoundPipeStrategy(gpu_memory={value!r}) must be positive")
    return float(value)


def device_memory_limit(devices: list[torch.device], memory: float = 0.8) -> float | None:
    """Bytes the partitioner may plan a stage for: ``memory`` bytes, or that fraction of the smallest
    worker device (``None`` on CPU, where nothing limits a stage)."""
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None
    if memory > 1:
        return memory
    total = min(torch.cuda.get_device_properties(d).total_memory for d in cuda)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:  # a cap set with torch.cuda.set_per_process_memory_fraction
        total = int(total * min(get_fraction(d) for d in cuda))
    return memory * total
