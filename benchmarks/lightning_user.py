"""What a Lightning user gets: a Hugging Face model in an ordinary LightningModule under ``Trainer``.

The module is what a newcomer writes: ``training_step`` returns ``self.model(**batch).loss`` and
``configure_optimizers`` returns ``torch.optim.AdamW(self.parameters(), lr=1e-5)``. The model is a
randomly initialised ``Qwen3ForCausalLM`` of the Qwen3-1.7B shape (``--model``), trained in
``bf16-mixed`` on ``--seqs`` sequences of ``--seq-len`` tokens per optimizer step. Configurations:

- ``plain``: ``strategy="auto"``, the model on the GPU with Hugging Face's gradient checkpointing,
  ``AdamW(fused=True)`` on the GPU, micro-batches of ``--micro-batch`` sequences accumulated;
- ``plain-liger``: ``plain`` with ``liger_kernel.transformers.apply_liger_kernel_to_qwen3()`` called before
  the model is built (Liger's RMSNorm, rotary, SwiGLU and fused linear cross-entropy, as its README says);
- ``plain-compile``: ``plain`` with each decoder block compiled (``block.compile()``, PyTorch's regional
  compilation: Inductor's fused kernels in the blocks, as roundpipe's default has them);
- ``newcomer``: ``strategy="roundpipe"`` and the module exactly as above (every default: on the GPU each
  block compiled, with liger-kernel installed its fused cross-entropy in the output stage);
- ``newcomer-nokernels``: ``RoundPipeStrategy(kernels="none")`` (transformers' own modules, the chunked loss);
- ``newcomer-generic``: ``RoundPipeStrategy(hf_stages="generic")`` (the model's own code around its blocks instead
  of the architecture table's stages: what a model without an entry gets);
- ``newcomer-chunked``: the defaults, but the output stage's chunked loss instead of Liger's fused one;
- ``newcomer-packed`` (``--varlen``): ``RoundPipeStrategy(split_by="packed")`` (each micro-batch's sequences in
  one row without padding, torch's variable-length flash attention), fed the padded batches;
- ``newcomer-flattened`` (``--varlen``): every default, fed the flattened batches of plain's ``-packed``
  configurations (``DataCollatorWithFlattening``), which roundpipe cuts between sequences into packed micro-batches;
- ``newcomer-cudnn``: the defaults with cuDNN first among the SDPA backends (an experiment: see ``experiment``);
  ``newcomer-flash``: flash attention first (no per-shape graph to build); ``newcomer-widthN`` (``--varlen``): each
  micro-batch cut by tokens padded to a multiple of N columns, so shapes repeat (``TokenSplit.width_multiple``);
- ``newcomer-hostN``: the defaults with the optimizer thread's intra-op threads set to N (an experiment);
  ``newcomer-switchN``: the interpreter's switch interval set to N microseconds (an experiment: a thread running
  Python slowed the host step 3.2x in ``host_step.py``, each of the step's many torch calls waiting up to the
  default 5 ms for the GIL);
  ``newcomer-blocking``: the engine's CUDA events made blocking, so that host threads waiting on them sleep
  instead of spinning a core each (an experiment: the host step ran 1.6x slower inside training than alone);
- ``newcomer-split``: ``RoundPipeStrategy(split_decoder_layers=True)`` (half blocks: with ``--profile``, where
  a split stage's time goes);
- ``newcomer-db``: ``RoundPipeStrategy(double_buffer="all")`` (a spare compute copy per weight: an update is
  cast as soon as its math is done, not after the step's last read of the copy; AdamW's math and that cast then
  run in one pass, ``runtime/one_pass.py``); ``newcomer-db-twopass``: the same with torch's AdamW and a separate
  cast (``OnePass.enabled`` off); ``newcomer-dbauto``: ``double_buffer="auto"`` (``"all"`` where the spares fit
  the host, as the JSON's ``double_buffer`` and ``spares`` say). Until 2026-12-08 the one pass was Inductor's
  kernel and ``newcomer-dbauto-native`` its C++ form, the engine's since;
- ``newcomer-gmF``: ``RoundPipeStrategy(gpu_memory=F)`` (the share of the card the plan's stages are sized for);
- ``newcomer-keepcache``: the defaults without ``CacheWatch.release_over_limit`` (the engine gives a device's cached
  blocks back after a batch that left its allocator above ``gpu_memory`` of the card, or of ``--gpu-gib``, since
  2026-12-04; ``cache_releases`` in the result counts them): the reserve left to creep with lengths that vary;
- ``newcomer-nomirror``: the defaults without the copy of each update's fp32 masters to the host's (4 bytes a
  parameter device to host, since 2026-12-07, so that the module's weights move during training as on the host
  path): what that copy costs where the states are on the GPU (an experiment; the module then sits at the last flush);
- ``newcomer-uppool``: the defaults with the weights' device buffers taken from the uploads' own stream's pool, as
  before 2026-12-07 (``WeightUploads.from_compute_pool`` off): what one pool shared with the compute saves in the
  allocator's reserve (NVML), and what it costs; ``newcomer-noahead``: the defaults, but each batch's first upload's
  buffers taken from compute's pool when it starts, after all compute issued before (``WeightUploads.take_ahead``
  off), not in the batch before;
- ``newcomer-autoshare``: the defaults with ``ShareSwitch.automatic`` on (off by default since 2026-12-07): ``"auto"``
  moves a share of the states to the GPU where the host bounds the step, on trial (set in the configuration's own
  process: a setting in the parent's is not seen);
- ``newcomer-nowhole``: the defaults with ``ShareSwitch.whole`` off (on by default since 2026-12-07, when ``"auto"``
  began to move every state to the GPU where a plan about as fast as the host's fits beside them, not only where they
  take at most half of ``gpu_memory``; ``share_switch`` and ``share_weighed`` in the result say whether and why): the
  default before it; ``newcomer-whole``: the same switch on, which is now the defaults;
- ``newcomer-sgd``: ``newcomer-hostopt`` with ``torch.optim.SGD(self.parameters(), lr=1e-5)`` instead of AdamW (an
  experiment: the host's step then moves 12 bytes a parameter through memory instead of AdamW's 28, so where the
  host bounds the step this shows what the devices would give with a lighter one);
- ``newcomer-devopt``: ``RoundPipeStrategy(optimizer_on="device")``: the optimizer's states, the fp32 masters, their
  gradients and two bf16 compute copies kept on the one GPU, the engine's order unchanged (the host step leaves the
  host; since 2026-12-04 the default ``"auto"`` does this where the states take at most half of ``gpu_memory``);
- ``newcomer-hostopt``: ``RoundPipeStrategy(optimizer_on="host")``: the states and the step in host memory (the
  default before 2026-12-04, and still where they do not fit); ``newcomer-sgd``, ``newcomer-noop`` and
  ``newcomer-hostN`` are experiments on this host step and use it too;
- ``newcomer-bnb8``: ``bnb.optim.AdamW8bit(self.parameters(), lr=1e-5)`` with every default (``"auto"`` keeps an
  optimizer from outside torch.optim on the host, where bitsandbytes runs its CPU kernels); ``newcomer-bnb8-device``:
  the same with ``optimizer_on="device"`` (its CUDA kernels; its step synchronizes the device after every
  parameter). What the host path costs such users, and whether "auto" should put them on the GPU;
- ``newcomer-noop``: an optimizer whose step does nothing (the host's math gone, its casts and the transfers left:
  what the devices and the rest of the host's work give);
- ``newcomer-skipF-gmG``: the host optimizer, AdamW's math skipped for the deepest share ``F`` of the parameters
  (their casts and transfers left), and the plan sized for ``gpu_memory=G``: what keeping that share's states on
  the GPU (20 bytes a parameter, taken from the plan's limit) could give where they do not all fit, before
  building it (an experiment: it moves more bytes than the real thing would, and none on the GPU's side);
- ``newcomer-shareF``: ``RoundPipeStrategy(optimizer_on=F)``: the deepest share ``F`` of the trainable parameters'
  states and updates on the GPU, the rest's on the host, the plan sized for what they leave of ``gpu_memory``;
- ``newcomer-capped``: the defaults with torch's caching allocator held to what the plan may use (0.8 of the card,
  or of ``--gpu-gib``, through ``torch.cuda.set_per_process_memory_fraction``; ``gpu_memory=1.0`` of that), so that
  the reserve cannot grow past the plan's limit: past it torch frees cached blocks first (an experiment);
- ``newcomer-sync``: ``RoundPipeStrategy(async_optimizer=False)`` (with ``--precision bf16-true``: no compute
  copy on the host, 8 bytes per parameter with AdamW);
- ``tuned-N``: ``RoundPipeStrategy(num_microbatches=N)`` with ``AdamW(fused=True)`` (the hand-tuned
  settings the issue measured); ``tuned-N-gmF``: with ``gpu_memory=F`` too;
- ``fused-N``: ``tuned-N`` with one fused stage of all layers (``plan="|L"``, nothing measured): at many
  micro-batches, what the host's launches cost (on the full card);
- ``CONFIG-compile`` (e.g. ``newcomer-compile``, ``fused-16-compile``): ``CONFIG`` with
  ``RoundPipeStrategy(compile=True)``, each block's body through ``torch.compile`` (``--compile-backend``);
  ``CONFIG-eager`` (e.g. ``newcomer-eager``): with ``compile=False``, every block eager (with liger-kernel
  installed, its kernels in the blocks: the default until 2026-12-02's eighth session);
- ``zero2-offload-KERNELS``, ``zero3-offload-KERNELS`` (``KERNELS``: ``liger`` or ``compile``, as for plain):
  Lightning's ``DeepSpeedStrategy`` with ZeRO-Offload (stage 2, optimizer states on the host) or ZeRO-3 with
  parameters offloaded too, pinned, ``DeepSpeedCPUAdam``, checkpointing and micro-batches as ``plain`` (DeepSpeed
  from the carried wheels);
- ``plain-packed``, ``plain-liger-packed``, ``plain-compile-packed`` (with ``--varlen``): the plain configuration on
  padding-free batches (transformers' ``DataCollatorWithFlattening``: one row, positions restarting at 0);
- ``newcomer-split-tiled``: ``RoundPipeStrategy(split_decoder_layers=True, tile_tokens=16384)`` and
  nothing else (for one very long sequence, ``--seqs 1 --seq-len 131072``).

``--model`` also takes shapes of other families, built from transformers' classes with random weights
(:data:`OTHER_MODELS`: a Cohere shape and a DeepSeek-V3 shape of 2-3 B parameters, which take the generic path).

``--varlen MIN,MAX`` trains on instruction-like data instead (issue 39): sequences of lengths drawn uniformly
from ``MIN..MAX``, the first quarter of each labelled -100, padded per batch to its longest (mask 0, label
-100); tokens/s then counts real tokens only.

One process per configuration (``_driver``); ``--gpu-gib`` caps the card. Reported: tokens/s between the
optimizer steps after ``--warmup`` (roundpipe's first steps measure the layers and choose its plan),
GPU memory as NVML reports it (the process's card use, sampled at every step) and torch's peak, and the
host's peak resident memory.

    python benchmarks/lightning_user.py --configs plain,newcomer,tuned-4 --out benchmarks/results/lightning-user.json
    python benchmarks/lightning_user.py --configs newcomer,tuned-4 --gpu-gib 24 --out ...-24gib.json
    python benchmarks/lightning_user.py --model qwen3-8b --precision bf16-true --gpu-gib 24 \\
        --configs newcomer,newcomer-sync

``--device cpu --model debug`` is a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import psutil
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _driver import add_in_process_flag, run_or_drive, write
from _zero import zero_offload
from qwen3_shape import SHAPES, Shape, flops_per_token, init_hf, num_parameters

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime.compiles import compilations, compile_seconds
from lightning_roundpipe.runtime.device import max_memory_allocated, reset_peak_memory_stats
from lightning_roundpipe.runtime.one_pass import OnePass

GiB = 2**30


def qwen3(shape: Shape, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``Qwen3ForCausalLM`` of ``shape`` with random weights (repeated blocks: the values do not matter here,
    and drawing 1.7 B normal numbers would take longer than the run)."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, tie_word_embeddings=shape.tied, rope_theta=1_000_000.0,
        max_position_embeddings=1 << 18,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config).to(dtype)  # bf16-true: never an fp32 copy on the host
    model = model.to_empty(device="cpu")
    if shape.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return init_hf(model, config, tile=1 << 20)


OTHER_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, config): 2-3 B parameters, families without an entry in roundpipe's table
    "cohere-2b": ("CohereConfig", "CohereForCausalLM", dict(
        vocab_size=256000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=8, logit_scale=0.0625, tie_word_embeddings=True, max_position_embeddings=1 << 17,
    )),  # 2.03 B: Cohere's vocabulary, LayerNorm, a scale on the logits
    "deepseek-v3-3b": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=129280, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False, max_position_embeddings=1 << 17,
    )),  # 2.95 B: multi-head latent attention, 16 routed experts (4 per token) and a shared one, a dense first block
}  # fmt: skip


def other_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A model of :data:`OTHER_MODELS` with random weights (as :func:`qwen3`; buffers other than the rotary
    tables, such as DeepSeek-V3's routing bias, start at zero)."""
    import transformers

    config_name, model_name, settings = OTHER_MODELS[name]
    config = getattr(transformers, config_name)(**settings)
    with torch.device("meta"):
        model = getattr(transformers, model_name)(config).to(dtype)
    model = model.to_empty(device="cpu")
    for buffer_name, buffer in model.named_buffers():
        if "inv_freq" not in buffer_name:
            buffer.zero_()
    if config.tie_word_embeddings:
        model.tie_weights()
    return init_hf(model, config, tile=1 << 20)


class Tokens(Dataset):
    """Random token ids as a Hugging Face batch: ``input_ids`` and ``labels`` (the model shifts them)."""

    def __init__(self, vocab: int, size: int, seq_len: int) -> None:
        self.tokens = torch.randint(0, vocab, (size, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Instructions(Dataset):
    """``--varlen MIN,MAX``: sequences of lengths drawn uniformly from ``MIN..MAX`` (seeded), the first quarter
    of each (its prompt) labelled -100, as an instruction-tuning set; :func:`pad` or transformers'
    ``DataCollatorWithFlattening`` (``-packed`` configurations) makes the batches."""

    def __init__(self, vocab: int, size: int, shortest: int, longest: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(shortest, longest + 1, (size,), generator=g).tolist()
        self.tokens = [torch.randint(1, vocab, (n,), generator=g) for n in self.lengths]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.tokens[i].clone()
        labels[: len(labels) // 4] = -100
        return {"input_ids": self.tokens[i], "labels": labels}


def pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding to the batch's longest (pad id 0, mask 0, label -100), as a per-batch padding collator."""
    width = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for r, item in enumerate(items):
        n = len(item["input_ids"])
        ids[r, :n], labels[r, :n], mask[r, :n] = item["input_ids"], item["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def flatten(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers' padding-free packing: one row, positions restarting at 0, each sequence's first label -100."""
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    return collate([{k: v.tolist() for k, v in item.items()} for item in items])


def allocator_by_stream(engine: Any) -> dict[str, list[float]]:
    """The caching allocator's segments on device 0, by the stream they were allocated on: [reserved, in use] GiB.
    A block freed on one stream is not reused by an allocation on another, so each stream keeps a reserve of its
    own: the engine's streams named (``param_up``, ``compute``...), others by number."""
    names: dict[int, str] = {0: "default"}
    for owner, prefix in ((engine and engine.devices[0], ""), (engine and engine.resident, "resident.")):
        for name, value in vars(owner).items() if owner is not None else ():
            if isinstance(getattr(value, "cuda_stream", None), int):  # (a torch.cuda.Stream)
                names.setdefault(value.cuda_stream, prefix + name)
    totals: dict[str, list[float]] = {}
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", 0) != 0:
            continue
        entry = totals.setdefault(names.get(segment["stream"], str(segment["stream"])), [0.0, 0.0])
        entry[0] += segment["total_size"] / GiB
        entry[1] += segment["allocated_size"] / GiB
    return {name: [round(r, 2), round(a, 2)] for name, (r, a) in sorted(totals.items(), key=lambda kv: -kv[1][0])}


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens of a batch that are not padding."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


class LM(L.LightningModule):
    """The LightningModule a newcomer writes (``fused``: the hand-tuned optimizer)."""

    def __init__(self, model: torch.nn.Module, fused: bool = False, deepspeed: bool = False) -> None:
        super().__init__()
        self.model = model
        self.fused, self.deepspeed = fused, deepspeed
        self.sgd = False
        self.noop = False
        self.bnb8 = False
        self.skip = 0.0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        if self.deepspeed:  # Lightning divides the loss by the accumulation steps and DeepSpeed's backward again
            loss = loss * self.trainer.accumulate_grad_batches
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.deepspeed:  # what DeepSpeed's offload steps the host states with
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(self.parameters(), lr=1e-5, adamw_mode=True)
        if self.sgd:  # an experiment's lighter host step: 12 bytes a parameter through memory, AdamW's 28
            return torch.optim.SGD(self.parameters(), lr=1e-5)
        if self.noop:  # an experiment: no host math at all
            return _NoStep(self.parameters())
        if self.skip:  # an experiment: the deepest share's math skipped (as if its states were on the GPU)
            params, kept, total = list(self.parameters()), 0, sum(p.numel() for p in self.parameters())
            while kept < len(params) and sum(p.numel() for p in params[kept:]) > self.skip * total:
                kept += 1
            return _SkipMath([{"params": params[:kept]}, {"params": params[kept:], "skip": True}], lr=1e-5, fused=True)
        if self.bnb8:  # as QLoRA recipes write it: bitsandbytes' 8-bit AdamW (its CPU kernels on the host)
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(self.parameters(), lr=1e-5)
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=True)
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class ResidentMemory:
    """The process's resident memory sampled every 20 ms on a thread: the peak since the last reading,
    so a step's peak shows where the host's high-water mark (``ru_maxrss``) came from."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def reading(self) -> tuple[float, float]:
        """(resident now, peak since the previous reading), GiB."""
        now = self._process.memory_info().rss
        peak, self._peak = max(self._peak, now), now
        return now / GiB, peak / GiB

    def stop(self) -> None:
        self._stop.set()


class Clock(L.Callback):
    """Optimizer-step times after ``warmup`` steps (up to step ``last``), NVML's reading of the card at
    every step, the peaks; resident host memory before the first batch (the host store built) and at
    every step, with the peak in between."""

    def __init__(self, warmup: int, last: int, resident: ResidentMemory) -> None:
        self.warmup, self.last = warmup, last
        self.stamps: list[float] = []
        self.nvml_gib: list[float] = []
        self.losses: list[float] = []
        self.resident = resident
        self.host_gib: list[dict[str, Any]] = []
        self.tokens: list[int] = []
        """Real (not padding) tokens of each optimizer step so far."""
        self._step_tokens = 0
        self.allocator_calls: list[tuple[int, int]] = []
        """(cudaMalloc calls, cudaFree calls) so far, at the first and the last timed step."""
        self._handle: Any = None
        self._last = time.perf_counter()
        self.step_log: list[dict[str, Any]] = []
        """Each optimizer step's seconds and the plan it ended on: when the plan stopped changing."""
        self._most_reserved = 0.0
        self._excluded = 0.0  # seconds spent reading the allocator's segments: out of the timed steps

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._last = time.perf_counter()
        now, peak = self.resident.reading()
        self.host_gib.append({"at": "train start", "rss": round(now, 2), "peak": round(peak, 2)})

    def _nvml(self) -> float | None:
        try:
            import pynvml

            if self._handle is None:
                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            return pynvml.nvmlDeviceGetMemoryInfo(self._handle).used / GiB
        except Exception:  # no driver library (CPU smoke test)
            return None

    def _progress(self, trainer: L.Trainer) -> None:
        """One line per step on stderr (seconds since the last, the plan): a config that times out still
        says where its time went."""
        now = time.perf_counter()
        engine = getattr(trainer.strategy, "engine", None)
        plan = f" plan {engine.plan} x {engine.num_microbatches}" if engine is not None else ""
        print(f"step {trainer.global_step}: {now - self._last:.2f} s{plan}", file=sys.stderr, flush=True)
        self.step_log.append({"step": trainer.global_step, "s": round(now - self._last, 3), "plan": plan.strip()})
        self._last = now

    def steady(self) -> dict[str, Any]:
        """The first step from which the plan never changed again, and the wall seconds of training before it."""
        first = len(self.step_log)
        while first > 0 and self.step_log[first - 1]["plan"] == self.step_log[-1]["plan"]:
            first -= 1
        if not self.step_log:
            return {}
        return {
            "from_step": self.step_log[first]["step"],
            "after_s": round(sum(e["s"] for e in self.step_log[:first]), 2),
        }

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self._step_tokens += real_tokens(args[0])
        if trainer.fit_loop._should_accumulate():
            return
        self.tokens.append(self._step_tokens)
        self._step_tokens = 0
        self._progress(trainer)
        now, peak = self.resident.reading()
        self.host_gib.append({"at": f"step {trainer.global_step}", "rss": round(now, 2), "peak": round(peak, 2)})
        if torch.cuda.is_available():
            used = self._nvml()
            if used is not None:
                self.nvml_gib.append(used)
            # when the card's memory grows: NVML and the caching allocator's reserve at each step's end
            self.step_log[-1]["nvml_gib"] = None if used is None else round(used, 2)
            reserved = torch.cuda.memory_reserved(0) / GiB
            self.step_log[-1]["reserved_gib"] = round(reserved, 2)
            if reserved > self._most_reserved:  # at each new high: which streams' pools hold it (issue 39)
                self._most_reserved, start = reserved, time.perf_counter()
                self.step_log[-1]["by_stream"] = allocator_by_stream(getattr(trainer.strategy, "engine", None))
                self._excluded += time.perf_counter() - start
                self._last += time.perf_counter() - start  # (not the next step's seconds, nor the timed ones)
        if outputs is not None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss) * trainer.accumulate_grad_batches)  # Lightning's is divided by it
        if trainer.global_step == self.warmup and torch.cuda.is_available():
            reset_peak_memory_stats(0)
        if self.warmup <= trainer.global_step <= self.last:
            engine = getattr(trainer.strategy, "engine", None)
            if engine is None and torch.cuda.is_available():
                torch.cuda.synchronize()  # plain: the step's queued GPU work belongs to it
            self.stamps.append(time.perf_counter() - self._excluded)
            if torch.cuda.is_available() and trainer.global_step in (self.warmup, self.last):
                stats = torch.cuda.memory_stats(0)  # cudaMalloc/cudaFree calls: each free syncs the device
                self.allocator_calls.append((stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)))


def strategy_for(
    config: str, layers: int = 0, compile_with: bool | dict[str, Any] = True, capped: bool = False
) -> tuple[Any, bool]:
    """The ``Trainer(strategy=...)`` of ``config`` and whether its optimizer is the hand-tuned fused one (``capped``:
    the card is capped, for DeepSpeed's buckets);
    ``CONFIG-compile``: ``CONFIG`` with ``compile=compile_with`` (regional ``torch.compile``), ``CONFIG-eager``
    with ``compile=False``."""
    for suffix, choice in (("-compile", compile_with), ("-eager", False)):
        if config.endswith(suffix) and not config.startswith(("plain", "zero")):
            strategy, fused = strategy_for(config.removesuffix(suffix), layers)
            strategy = RoundPipeStrategy() if strategy == "roundpipe" else strategy
            strategy.options.compile = choice  # read when the strategy finds the layers, at setup
            return strategy, fused
    if config in ("plain", "plain-liger", "plain-compile") or config.removesuffix("-packed") in (
        "plain",
        "plain-liger",
        "plain-compile",
    ):
        return "auto", True
    if config.startswith(("zero2-offload", "zero3-offload")):
        return zero_offload(int(config[4]), capped), False
    same = ("newcomer", "newcomer-chunked", "newcomer-cudnn", "newcomer-flash", "newcomer-flattened")
    same += (
        "newcomer-blocking",
        "newcomer-keepcache",
        "newcomer-nomirror",
        "newcomer-uppool",
        "newcomer-noahead",
        "newcomer-whole",
        "newcomer-autoshare",
        "newcomer-nowhole",
    )
    if config in same or config.startswith(("newcomer-width", "newcomer-switch")):
        return "roundpipe", False
    if config in ("newcomer-hostopt", "newcomer-sgd", "newcomer-noop") or config.startswith("newcomer-host"):
        return RoundPipeStrategy(optimizer_on="host"), False  # experiments on the host optimizer's step
    if config.startswith("newcomer-share"):  # newcomer-shareF: RoundPipeStrategy(optimizer_on=F)
        return RoundPipeStrategy(optimizer_on=float(config.removeprefix("newcomer-share"))), False
    if config.startswith("newcomer-skip"):  # newcomer-skipF-gmG
        share = float(config.partition("-gm")[2] or 0.8)
        return RoundPipeStrategy(optimizer_on="host", gpu_memory=share), False
    if config in ("newcomer-devopt", "newcomer-bnb8-device"):
        return RoundPipeStrategy(optimizer_on="device"), False
    if config == "newcomer-bnb8":  # what "auto" does with an optimizer from outside torch.optim
        return "roundpipe", False
    if config == "newcomer-nokernels":
        return RoundPipeStrategy(kernels="none"), False
    if config == "newcomer-generic":
        return RoundPipeStrategy(hf_stages="generic"), False
    if config == "newcomer-packed":
        return RoundPipeStrategy(split_by="packed"), False
    if config == "newcomer-capped":  # the allocator held to the plan's limit in run_one, the plan sized for all of it
        return RoundPipeStrategy(gpu_memory=1.0), False
    if config.startswith("newcomer-gm"):  # e.g. newcomer-gm0.7: the share of the card the planner plans for
        return RoundPipeStrategy(gpu_memory=float(config.removeprefix("newcomer-gm"))), False
    if config in ("newcomer-db", "newcomer-db-twopass"):
        return RoundPipeStrategy(double_buffer="all"), False
    if config == "newcomer-dbauto":  # spares where the host holds them (issue 39)
        return RoundPipeStrategy(double_buffer="auto"), False
    if config == "newcomer-sync":
        return RoundPipeStrategy(async_optimizer=False), False
    if config == "newcomer-split":
        return RoundPipeStrategy(split_decoder_layers=True), False
    if config == "newcomer-split-tiled":
        return RoundPipeStrategy(split_decoder_layers=True, tile_tokens=16384), False
    if config.startswith("fused-"):  # one fused stage of every layer (no measuring): what N costs on the host
        return RoundPipeStrategy(num_microbatches=int(config.split("-", 1)[1]), plan=f"|{layers}"), True
    if config.startswith("tuned-"):  # tuned-N, or tuned-N-gmF with gpu_memory=F
        count, _, share = config.removeprefix("tuned-").partition("-gm")
        return RoundPipeStrategy(num_microbatches=int(count), gpu_memory=float(share or 0.8)), True
    raise ValueError(
        f"unknown configuration {config!r}: plain, plain-liger, plain-compile, newcomer, newcomer-nokernels,"
        " newcomer-chunked, newcomer-generic, newcomer-packed, newcomer-flattened, newcomer-cudnn, newcomer-flash,"
        " newcomer-widthN, newcomer-hostN, newcomer-blocking, newcomer-db, newcomer-db-twopass, newcomer-dbauto,"
        " newcomer-gmFRACTION,"
        " newcomer-capped,"
        " newcomer-sgd, newcomer-keepcache, newcomer-nomirror, newcomer-uppool, newcomer-noahead, newcomer-whole,"
        " newcomer-nowhole, newcomer-autoshare,"
        " newcomer-devopt,"
        " newcomer-hostopt,"
        " newcomer-noop, newcomer-bnb8, newcomer-bnb8-device, newcomer-skipF-gmG, newcomer-shareF,"
        " newcomer-split, newcomer-sync,"
        " newcomer-split-tiled, tuned-N, tuned-N-gmF, fused-N (roundpipe's: -compile or -eager after it),"
        " zero2-offload-liger, zero2-offload-compile, zero3-offload-liger or zero3-offload-compile"
    )


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    shape = SHAPES.get(args.model)
    cuda = args.device == "cuda"
    capped = 0.8 if args.run == "newcomer-capped" else 1.0  # the default gpu_memory, as the allocator's cap
    if cuda and (args.gpu_gib or capped < 1):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(capped * (args.gpu_gib * GiB if args.gpu_gib else total) / total, 0)
    L.seed_everything(0, verbose=False)
    compile_with = {"backend": args.compile_backend} if args.compile_backend else True
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    deepspeed = args.run.startswith("zero")
    plain = args.run.startswith("plain") or deepspeed  # the model on the card: checkpointing, micro-batches
    kernels = args.run.removesuffix("-packed").rsplit("-", 1)[-1]  # liger, compile, or neither
    if args.run.endswith(("-packed", "-flattened")) and not args.varlen:
        raise ValueError(f"{args.run} packs variable-length sequences: give --varlen MIN,MAX")
    # transformers' flattened rows for plain's -packed and newcomer-flattened; newcomer-packed packs padded batches
    flattening = args.run == "newcomer-flattened" or (plain and args.run.endswith("-packed"))
    if deepspeed and kernels not in ("liger", "compile"):
        raise ValueError(f"{args.run}: name its kernels as plain's, zero2-offload-liger or zero2-offload-compile")
    if kernels == "liger" and plain:  # as Liger's README says: patch transformers' Qwen3 before building the model
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3()
    resident = ResidentMemory()
    model = qwen3(shape, dtype) if shape is not None else other_model(args.model, dtype)
    built_gib = resident.reading()
    vocab, layers = model.config.vocab_size, model.config.num_hidden_layers
    strategy, fused = strategy_for(args.run, layers + 2, compile_with, capped=bool(args.gpu_gib))
    if plain:
        model.config.use_cache = False
        model.gradient_checkpointing_enable()
    if kernels == "compile" and plain:  # regional compilation as PyTorch's recipe has it: each block compiled
        for block in model.model.layers:
            block.compile(**({"backend": args.compile_backend} if args.compile_backend else {}))
    module = LM(model, fused=fused, deepspeed=deepspeed)
    module.sgd = args.run == "newcomer-sgd"
    module.noop = args.run == "newcomer-noop"
    module.bnb8 = args.run.startswith("newcomer-bnb8")
    if args.run.startswith("newcomer-skip"):
        module.skip = float(args.run.removeprefix("newcomer-skip").partition("-gm")[0])
    parameters = num_parameters(model)
    steps = args.warmup + args.steps + (args.profile_steps if args.profile else 0)
    per_batch = args.micro_batch if plain else args.seqs
    accumulate = args.seqs // per_batch
    if args.varlen:  # per-batch padding, or (-packed) one row of the batch's sequences without padding
        shortest, longest = (int(n) for n in args.varlen.split(","))
        collate = flatten if flattening else pad
        data = DataLoader(Instructions(vocab, args.seqs * steps, shortest, longest), batch_size=per_batch,
                          collate_fn=collate)  # fmt: skip
    else:
        data = DataLoader(Tokens(vocab, args.seqs * steps, args.seq_len), batch_size=per_batch)
    clock = Clock(args.warmup, args.warmup + args.steps, resident)
    anatomy = Anatomy(args.warmup + args.steps, args.profile_steps)
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=1, precision=args.precision,
        max_steps=steps, accumulate_grad_batches=accumulate, logger=False,
        callbacks=[
            clock, _Remember(), *([_ChunkedLoss()] if args.run == "newcomer-chunked" else []),
            *([_HostTrace(args.warmup)] if args.host_trace and not plain else []),
            *([anatomy] if args.profile else []),
        ],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    start = time.perf_counter()
    norms = torch_norms() if args.norm == "torch" else contextlib.nullcontext()
    norms = loss_kernel_only() if args.block_kernels == "none" else norms
    with norms, experiment(args.run), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        trainer.fit(module, data)
    wall = time.perf_counter() - start
    for warning in caught:  # shown as they would have been, and roundpipe's kept with the result
        print(
            warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno), file=sys.stderr
        )
    seconds = clock.stamps[-1] - clock.stamps[0]
    timed = len(clock.stamps) - 1
    # the tokens of the steps between the first and last stamp (real ones: without padding)
    tokens_per_s = sum(clock.tokens[args.warmup : args.warmup + timed]) / seconds
    result: dict[str, Any] = {
        "tokens_per_s": tokens_per_s,
        "model_tflops": tokens_per_s * flops_per_token(shape, args.seq_len, recompute=True) / 1e12 if shape else None,
        "parameters": parameters,
        "seqs": args.seqs,
        "seq_len": args.seq_len,
        "timed_steps": timed,
        "timed_seconds": seconds,
        "fit_wall_s": wall,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,
        "gpu_nvml_peak_gib": max(clock.nvml_gib, default=None),
        "gpu_torch_peak_gib": max_memory_allocated(0) / GiB if cuda else None,
        "gpu_allocator": allocator_stats() if cuda else None,
        "timed_device_allocs_frees": (  # in the timed steps: a cache that holds the step's memory makes none
            [b - a for a, b in zip(*clock.allocator_calls)] if len(clock.allocator_calls) == 2 else None
        ),
        "gpu_gib_cap": args.gpu_gib or None,
        "cache_releases": getattr(trainer.strategy, "_last_engine", {}).get("cache_releases"),
        "optimizer_states": getattr(trainer.strategy, "_last_engine", {}).get("optimizer_states"),
        "resident_gib": getattr(trainer.strategy, "_last_engine", {}).get("resident_gib"),
        "share_switch": getattr(trainer.strategy, "_last_engine", {}).get("share_switch"),
        "precision": args.precision,
        "host_bytes_per_parameter": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / parameters,
        "losses": clock.losses,
        "step_log": clock.step_log,  # seconds and plan of every step (on a GPU: NVML, the reserve, its streams)
        "steady_plan": clock.steady(),  # time to steady state: the step the last plan began, training seconds before it
        "host_gib_model_built": {"rss": round(built_gib[0], 2), "peak": round(built_gib[1], 2)},
        "host_gib_by_step": clock.host_gib,
        "norm": args.norm,
        "block_kernels": args.block_kernels,
        "roundpipe_warnings": sorted({str(w.message) for w in caught if str(w.message).startswith("roundpipe:")}),
    }
    resident.stop()
    if anatomy.result is not None:
        result["anatomy"] = anatomy.result
    engine_state = getattr(trainer.strategy, "_last_engine", None)
    result.update(engine_state or {})
    if engine_state is not None:  # a plan that began inside the timed steps: the number mixes two plans
        result["plan_changed_while_timed"] = engine_state["plan_since_batch"] // accumulate >= args.warmup
    return result


def allocator_stats() -> dict[str, float]:
    """What the caching allocator went through: near a cap, a request it cannot serve from its cache makes
    it free cached blocks and retry (a device-wide sync each time)."""
    stats = torch.cuda.memory_stats(0)
    return {
        "reserved_peak_gib": stats.get("reserved_bytes.all.peak", 0) / GiB,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "device_allocs": stats.get("num_device_alloc", 0),
        "device_frees": stats.get("num_device_free", 0),
        "ooms": stats.get("num_ooms", 0),
    }


class Anatomy(L.Callback):
    """``--profile``: the device over ``count`` more optimizer steps after the timed ones, its kernel seconds
    by kind (matrix products, attention, norms, element-wise, loss, copies) and the idle between kernels;
    over two or more steps the largest gaps include those between steps, each with the copies that ran
    in it (an idle device with uploads running waits for weights; with none, for the host)."""

    def __init__(self, step: int, count: int = 1) -> None:
        self.step, self.count = step, count
        self.result: dict[str, Any] | None = None
        self._prof: Any = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.fit_loop._should_accumulate() or not torch.cuda.is_available():
            return
        if trainer.global_step == self.step:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.start()
        elif trainer.global_step == self.step + self.count and self._prof is not None:
            from throughput import device_events, kernel_gaps, kernel_kinds

            torch.cuda.synchronize()
            self._prof.stop()
            kernels, copies = device_events(self._prof)
            gaps = kernel_gaps(kernels)
            origin = min(k[0] for k in kernels) if kernels else 0.0
            for gap in gaps.get("largest", []):
                start = origin + gap["at_ms"] * 1e3
                stop = start + gap["ms"] * 1e3
                during = [(a, b, name) for a, b, name in copies if a < stop and b > start]
                gap["copies"] = {
                    name: round(sum(min(b, stop) - max(a, start) for a, b, n in during if n == name) / 1e3, 3)
                    for name in sorted({n for _, _, n in during})
                }  # ms of each kind of copy inside the gap
            self.result = {"steps": self.count, "kinds": kernel_kinds(kernels, copies), "gaps": gaps}


@contextlib.contextmanager
def experiment(config: str) -> Iterator[None]:
    """What an experimental configuration changes for the whole run, before the library does it itself:
    ``newcomer-cudnn`` puts cuDNN first among the SDPA backends (process-wide flags, which the worker
    threads read). (``newcomer-flce2048``, Liger's fused cross-entropy in 2,048-token chunks, measured
    2026-12-02, is the default since.)"""
    if config in ("newcomer-cudnn", "newcomer-flash"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        if config == "newcomer-flash":  # cuDNN builds a graph per new shape: with lengths that vary, every one
            order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        with sdpa_kernel([*order, SDPBackend.MATH], set_priority=True):
            yield
        return
    if config == "newcomer-blocking":  # host waits on the engine's CUDA events sleep instead of spinning a core
        from lightning_roundpipe.runtime.device import CudaWorkerDevice

        def blocking(self: CudaWorkerDevice, stream: Any) -> Any:
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
            return event

        with mock.patch.object(CudaWorkerDevice, "record", blocking):
            yield
        return
    if config == "newcomer-keepcache":  # the allocator's reserve left where the batches took it
        from lightning_roundpipe.engine.cache import CacheWatch

        with mock.patch.object(CacheWatch, "release_over_limit", lambda self: 0):
            yield
        return
    if config == "newcomer-db-twopass":  # the spares without the one-pass kernel: torch's AdamW, then the cast
        with mock.patch.object(OnePass, "enabled", False):
            yield
        return
    if config in ("newcomer-uppool", "newcomer-noahead"):  # the weights' device buffers from the uploads' own pool
        from lightning_roundpipe.runtime.uploads import WeightUploads

        switch = "from_compute_pool" if config == "newcomer-uppool" else "take_ahead"
        with mock.patch.object(WeightUploads, switch, False):
            yield
        return
    if config == "newcomer-nomirror":  # the device's masters not copied to the host's after each update
        from lightning_roundpipe.runtime.resident import ResidentStates

        with mock.patch.object(ResidentStates, "_mirror", lambda self, g, updated: None):
            yield
        return
    if config in ("newcomer-whole", "newcomer-nowhole", "newcomer-autoshare"):  # every state, or a share, to the GPU
        from lightning_roundpipe.host_clock import ShareSwitch

        switch = "automatic" if config == "newcomer-autoshare" else "whole"
        with mock.patch.object(ShareSwitch, switch, config != "newcomer-nowhole"):
            yield
        return
    if config.startswith("newcomer-host") and config != "newcomer-hostopt":  # the optimizer thread's intra-op
        # threads (torch's are per thread)
        from lightning_roundpipe.runtime.optimizer_worker import OptimizerWorker

        threads, run = int(config.removeprefix("newcomer-host")), OptimizerWorker._run

        def _run(self: OptimizerWorker, job: Any) -> None:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            run(self, job)

        with mock.patch.object(OptimizerWorker, "_run", _run):
            yield
        return
    if config.startswith("newcomer-switch"):  # the interpreter's switch interval in microseconds (default 5000)
        before = sys.getswitchinterval()
        sys.setswitchinterval(int(config.removeprefix("newcomer-switch")) * 1e-6)
        try:
            yield
        finally:
            sys.setswitchinterval(before)
        return
    if config.startswith("newcomer-width"):
        from lightning_roundpipe.models.hf.tokens import TokenSplit

        TokenSplit.width_multiple = int(config.removeprefix("newcomer-width"))
        try:
            yield
        finally:
            TokenSplit.width_multiple = 1
        return
    yield


def _torch_rms_norm(kernel: Any) -> Any:
    """``--norm torch``: the norms bound by ``kernels="auto"`` run ``torch.nn.functional.rms_norm`` (one
    launch each way from C++) instead of liger-kernel's Python path, which was a quarter of a block's host
    time at small micro-batches (docs/perf-notes.md, 2026-12-02, sixth). The result in the input's dtype,
    as transformers' norms return it; the rounding differs from their "llama" casting (the normalised
    value is not rounded before the weight multiplies it)."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        if not hidden_states.is_cuda:
            return type(self).forward(self, hidden_states)
        eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-6)
        weight = self.weight.to(hidden_states.dtype)
        with torch.autocast("cuda", enabled=False):
            return torch.nn.functional.rms_norm(hidden_states, hidden_states.shape[-1:], weight, eps)

    forward.__roundpipe_kernel__ = True  # type: ignore[attr-defined]
    return forward


@contextlib.contextmanager
def torch_norms() -> Iterator[None]:
    """``--norm torch`` for one run: what the strategy binds onto the norms (restored after: ``--in-process``
    runs several configurations in one process)."""
    from lightning_roundpipe.models.hf import kernels

    bound = kernels._rms_norm
    kernels._rms_norm = _torch_rms_norm
    try:
        yield
    finally:
        kernels._rms_norm = bound


@contextlib.contextmanager
def loss_kernel_only() -> Iterator[None]:
    """``--block-kernels none`` for one run: ``kernels="auto"`` binds only Liger's fused linear cross-entropy
    in the output stage; the blocks keep transformers' norms, MLPs and rotary embedding, which Inductor fuses
    itself when they are compiled (``CONFIG-compile``). Whether Liger's kernels inside a compiled block help
    or break its graph is what this measures."""
    from lightning_roundpipe.models.hf import kernels

    def loss_only(model: torch.nn.Module, layers: list[torch.nn.Module], blocks: bool = True) -> list[str]:
        for layer in layers:
            if getattr(layer, "fused_loss", None) is False:
                layer.fused_loss = True
                return ["fused linear cross-entropy x1"]
        return []

    bound = kernels.apply_liger
    kernels.apply_liger = loss_only
    try:
        yield
    finally:
        kernels.apply_liger = bound


class _ChunkedLoss(L.Callback):
    """``newcomer-chunked``: Liger's kernels in the blocks, the chunked loss in the output stage (what the
    fused linear cross-entropy is measured against)."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for layer in trainer.strategy.engine.layers:
            if getattr(layer, "fused_loss", False):
                layer.fused_loss = False  # a plain attribute: the workers' replicas take it at the next batch


class _HostTrace(L.Callback):
    """``--host-trace``: the optimizer thread's updates and casts, per step: the seconds of math, the span of the
    casts (from the step's last math to its last cast) and the thread's idle before the step's first math."""

    def __init__(self, skip: int) -> None:
        self.skip, self.trace = skip, None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.trace = trainer.strategy.engine.crew.record_trace()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        steps: dict[int, dict[str, list[float]]] = {}
        for entry in self.trace or ():
            if entry[0] == "update":
                steps.setdefault(entry[1], {"starts": [], "ends": [], "casts": []})
                steps[entry[1]]["starts"].append(entry[3])
                steps[entry[1]]["ends"].append(entry[4])
            elif entry[0] == "cast" and entry[1] in steps:
                steps[entry[1]]["casts"].append(entry[3])
        rows, previous = [], None
        for step in sorted(steps):
            s = steps[step]
            last = max(s["casts"], default=max(s["ends"]))
            rows.append({
                "step": step,
                "math_s": round(sum(b - a for a, b in zip(s["starts"], s["ends"])), 4),
                "math_span_s": round(max(s["ends"]) - min(s["starts"]), 4),
                "cast_span_s": round(last - max(s["ends"]), 4),
                "idle_before_s": None if previous is None else round(min(s["starts"]) - previous, 4),
            })  # fmt: skip
            previous = last
        state = getattr(trainer.strategy, "_last_engine", None)
        if state is not None:
            state["host_trace"] = rows[self.skip :]
            state["main_threads"] = torch.get_num_threads()  # per thread: the optimizer thread may differ


class _NoStep(torch.optim.Optimizer):
    """``newcomer-noop``: an optimizer whose step changes nothing."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})

    def step(self, closure: Any = None) -> None:
        return None


class _SkipMath(torch.optim.AdamW):
    """``newcomer-skipF-gmG``: AdamW whose groups marked ``skip`` are left as they are."""

    def step(self, closure: Any = None) -> None:
        groups = self.param_groups
        self.param_groups = [group for group in groups if not group.get("skip")]
        try:
            super().step(closure)
        finally:
            self.param_groups = groups


class _Remember(L.Callback):
    """Keeps what roundpipe chose (plan, micro-batches, host step) before teardown closes the engine."""

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        engine.flush()
        trainer.strategy._last_engine = {
            "plan": str(engine.plan),
            "microbatches": engine.num_microbatches,
            "predicted_bubble": engine.planner.predicted_bubble,
            "candidate_periods_s": {str(k): v for k, v in engine.planner.candidate_periods.items()},
            "host_step_s": trainer.strategy.host_step_s,
            "fused_optimizer": [g.get("fused") for g in trainer.optimizers[0].param_groups],
            "one_pass": {
                "enabled": OnePass.enabled,
                "off_because": OnePass._failed,
                "checked": len(OnePass._checked),
                "compile_s": OnePass.compile_s,  # at the engine's build (a cold cache compiles the C++)
                "groups_updated": getattr(engine.crew.optimizer, "one_pass_groups", None),  # by the kernel
            },
            "double_buffer": engine.steps.double_buffer,  # "auto" as the engine took it
            "spares": sum(g.spare is not None for g in engine.store.groups),
            "store_bytes_per_param": engine.store.nbytes() / max(1, engine.store.num_parameters),
            "pinned_gib": engine.pool.pinned_bytes / GiB,
            "cache_releases": engine.caches.releases,
            "optimizer_states": "host" if engine.resident is None else "device" if engine.resident.whole else "share",
            "resident_gib": 0.0 if engine.resident is None else engine.resident.need / GiB,  # the states on the GPU
            "share_switch": trainer.strategy._share.outcome,  # "auto" moved a share to the GPU: paces, kept or not
            "share_weighed": trainer.strategy._share.weighed,  # its last offer: the times, the share or none, why
            "transit_peak_gib": engine.pool.peak_buffer_bytes / GiB,
            "kernels": trainer.strategy.kernels,
            "compilations": compilations(),  # torch.compile's in the process (compile=...), and their seconds
            "compile_s": compile_seconds(),
            # the measurement the plan came from: plans can be simulated again offline, at any micro-batch size
            "layer_profile": engine.planner.fitted.state() if engine.planner.fitted is not None else None,
            "fused_loss": any(getattr(layer, "fused_loss", False) for layer in engine.layers),
            "recovered_batches": engine.recovery.recovered,
            "frozen_bytes": sum(g.data.nbytes for g in engine.store.groups if g.kind == "frozen"),
            "handoff_s": engine.stats.handoff,  # the host's turn + the first slot's cast wait and upload
            "host_turn_s": statistics.median(engine.stats._turns) if engine.stats._turns else None,
            "first_upload_s": statistics.median(engine.stats._first_uploads) if engine.stats._first_uploads else None,
            "host_gap": engine.stats.host_gap,
            "worker_waits_s": engine.worker_waits,  # per batch, by what the workers' threads waited for
            "cache_lowered": engine.caches.lowered,  # plans made for less memory after allocator frees
            "cache_reverted": engine.caches.reverted,  # a smaller plan tried, not faster, undone
            "cache_trials": engine.caches.trials,  # each trial's limits and seconds per sample (tried, before)
            "memory_limit_gib": engine.planner.memory_limit / GiB if engine.planner.memory_limit else None,
            "plan_since_batch": engine.planner.plan_since,  # the batch the running plan began with
            # what the plan's times and memory are for (tokens per micro-batch; issue 39's lengths that vary)
            "planned_tokens": engine.planner.planned_elements,
            "memory_tokens": engine.planner.memory_elements,
            "widest_row": engine.planner.row_elements,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="plain,newcomer,tuned-4")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted([*SHAPES, *OTHER_MODELS]))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seqs", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--varlen", default="", help="MIN,MAX: sequences of lengths drawn from MIN..MAX, per-batch padding or packed"
    )
    parser.add_argument("--micro-batch", type=int, default=4, help="plain: sequences per accumulated batch")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gpu-gib", type=float, default=0.0)
    parser.add_argument("--precision", default="bf16-mixed", choices=("bf16-mixed", "bf16-true"))
    parser.add_argument("--profile", action="store_true", help="more steps under the profiler: kernel kinds, gaps")
    parser.add_argument("--profile-steps", type=int, default=1, help="steps under the profiler (2: the gap between)")
    parser.add_argument("--config-timeout", type=float, default=0.0)
    parser.add_argument(
        "--norm", default="liger", choices=("liger", "torch"),
        help="roundpipe's RMSNorm on CUDA: liger-kernel's or torch.nn.functional.rms_norm (an experiment)",
    )  # fmt: skip
    parser.add_argument(
        "--block-kernels", default="liger", choices=("liger", "none"),
        help="none: only Liger's fused cross-entropy; the blocks keep transformers' modules (an experiment)",
    )  # fmt: skip
    parser.add_argument("--host-trace", action="store_true", help="roundpipe: the optimizer thread's math and casts")
    parser.add_argument("--compile-backend", default="", help="CONFIG-compile: torch.compile's backend (its default)")
    parser.add_argument("--out", default=None)
    add_in_process_flag(parser)
    args = parser.parse_args(argv)
    command = sys.argv[1:] if argv is None else argv
    results = run_or_drive(__file__, args, run_one, lambda done: write(args.out, command, __file__, done))
    if results is None:
        return
    baselines = [r for r in results if "tokens_per_s" in r and r["config"].startswith(("plain", "zero"))]
    plain = max(baselines, key=lambda r: r["tokens_per_s"], default=None)  # the best baseline of this run
    print(f"\n{'config':24} {'tok/s':>8} {'/best':>7} {'NVML GiB':>9} {'torch GiB':>9} {'host GiB':>9}  plan / M")
    for r in results:
        if "tokens_per_s" not in r:
            print(f"{r['config']:24} failed: {r.get('error', '')[-200:]}")
            continue
        ratio = r["tokens_per_s"] / plain["tokens_per_s"] if plain else float("nan")
        print(
            f"{r['config']:24} {r['tokens_per_s']:8.0f} {ratio:7.3f} {r['gpu_nvml_peak_gib'] or 0:9.2f}"
            f" {r['gpu_torch_peak_gib'] or 0:9.2f} {r['host_peak_rss_gib']:9.2f}  {r.get('plan', '-')} / "
            f"{r.get('microbatches', '-')}"
        )
    for r in results:
        kinds = r.get("anatomy", {}).get("kinds")
        if kinds:
            parts = ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(kinds["seconds_by_kind"].items(), key=lambda kv: -kv[1])
            )
            print(f"{r['config']}: device seconds over {r['anatomy']['steps']} steps: {parts};"
                  f" idle {kinds['idle_between_kernels_s']:.3f} of {kinds['span_s']:.3f}")  # fmt: skip
        if r.get("host_trace"):
            rows = r["host_trace"]
            med = {k: statistics.median(row[k] for row in rows if row[k] is not None) for k in rows[0] if k != "step"}
            print(f"{r['config']}: the optimizer thread, medians over {len(rows)} steps: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))  # fmt: skip
        if r.get("steady_plan") and r.get("plan"):
            print(f"{r['config']}: the plan last changed at step {r['steady_plan']['from_step']},"
                  f" {r['steady_plan']['after_s']} s into training")  # fmt: skip
        if r.get("plan_changed_while_timed"):
            print(f"{r['config']}: the plan changed inside the timed steps (at batch {r['plan_since_batch']}):"
                  " tokens/s mixes two plans; raise --warmup")  # fmt: skip
        if r.get("worker_waits_s"):
            waits = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["worker_waits_s"].items(), key=lambda kv: -kv[1]))
            print(f"{r['config']}: seconds per batch the workers waited: {waits}")
    write(args.out, command, __file__, results)


if __name__ == "__main__":
    main()
