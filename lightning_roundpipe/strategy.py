"""``RoundPipeStrategy``: Lightning glue around the pipeline engine.

One process drives every device (world size 1, no launcher, no distributed sampler). The model and
optimizer stay on the host; ``training_step`` runs the pipelined forward and backward through
:func:`lightning_roundpipe.pipeline_loss`; ``backward`` only installs the host gradients where hooks,
clipping and the optimizer look for them; the optimizer steps the host master weights.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only as _fabric_rank_zero_only
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_roundpipe import api
from lightning_roundpipe._flavor import lightning_package, sibling
from lightning_roundpipe.engine import PipelineEngine, double_buffering
from lightning_roundpipe.memory import check_host_memory, estimate_host_memory
from lightning_roundpipe.runtime.device import CudaWorkerDevice, WorkerDevice
from lightning_roundpipe.runtime.exchange import NodeExchange
from lightning_roundpipe.runtime.microbatch import Reduction
from lightning_roundpipe.runtime.optimizer_worker import UpdateSpec
from lightning_roundpipe.schedule.choose import PLANNERS
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.transfers import OVERLAPS, Overlap

pl = lightning_package(globals())
_precision = sibling("precision", globals())
_checkpoint_io = sibling("checkpoint_io", globals())
_ParallelStrategy = pl.strategies.ParallelStrategy
_rank_zero_only = pl.utilities.rank_zero_only
_TrainerFn = pl.trainer.states.TrainerFn
_call = pl.trainer.call
_is_overridden = pl.utilities.model_helpers.is_overridden
rank_zero_warn = pl.utilities.rank_zero_warn


class RoundPipeStrategy(_ParallelStrategy):  # type: ignore[misc,valid-type]
    """Train models larger than GPU memory: model states on the host, stages dispatched round-robin.

    Args:
        num_microbatches: micro-batches per round (``M_R``), at least the number of devices; each
            device runs all of them for its stage before the next stage goes to the next device.
            ``None`` means devices + 1.
        num_rounds: rounds per training batch; the batch is split into
            ``num_microbatches * num_rounds`` micro-batches along dim 0.
        plan: ``"auto"`` (the default): the first ``profile_steps`` batches run one layer per stage and
            measure each layer's times and memory, then the partitioner picks the plan; stage times
            are checked now and then and the layers measured again when they drift. Or an explicit
            :class:`~lightning_roundpipe.schedule.StagePlan` or its printed form ``"3,3|1,2,2,2"``
            (forward stage sizes | backward stage sizes, the first backward stage being the fused
            last-forward/first-backward stage); ``None`` uses ``StagePlan.uniform``.
        profile_steps: batches measured before the automatic plan is computed. On CUDA these batches
            measure each layer's memory peaks, which resets ``torch.cuda`` peak memory statistics.
        planner: how the automatic plan is chosen from the measured costs: ``"fastest"`` (the
            default: of the plans near the partitioner's optimum, the one the pipeline simulator finds
            fastest; 1.10x the optimum's own plan measured on 2 H200s, see
            :mod:`~lightning_roundpipe.schedule.choose`) or ``"objective"`` (the optimum of the
            paper's objective).
        check_every: with ``plan="auto"``, every this many batches the stage times are checked
            against those the plan first measured (0: never).
        replan_margin: a check that finds a stage moved by more than this fraction of the slowest
            stage's time, twice in a row, measures the layers again and re-plans.
        overlap: how weight uploads and gradient downloads overlap compute: ``"priority"`` (cut
            into parts issued between activation copies; the default), ``"simple"`` (one piece,
            prefetched a stage ahead) or ``"none"`` (no overlap; for comparison).
        gpu_memory: what the automatic plan may use on each device: a fraction of the device's memory
            (``0.8``, the default; a cap set with ``torch.cuda.set_per_process_memory_fraction`` is
            honoured), a number of bytes (``24 * 2**30``) or a string such as ``"24GiB"``/``"20GB"``.
            With room to spare the partitioner fuses more layers into the fused stage, which
            recomputes nothing but keeps their activations: lower this to trade speed for memory.
        async_optimizer: apply each optimizer step on a host thread while the devices compute the
            next one, with gradients exactly one step stale (the default, and the fast mode).
            ``False`` gives the numerics of plain training. In the asynchronous mode gradient
            clipping (``Trainer(gradient_clip_val=...)``) runs on the optimizer thread, the LR and
            other hyper-parameters are those in effect when the step is submitted, and ``p.grad``
            is not available in ``on_after_backward`` / ``on_before_optimizer_step``.
        double_buffer: with ``async_optimizer``, a second host compute copy of trainable weights, so
            each update is cast into the copy the step after next reads as soon as it is computed.
            Without it the next step's first stage waits for the cast of its weights, which the
            current step's last backward stage reads until the end: 12-18% of a step measured on 2
            GPUs (docs/perf-notes.md). ``"all"`` or ``True``: every trainable weight (+2 bytes per
            trainable parameter in bf16); ``"first"``: only those of the plan's first stage; ``False``.
        host_memory_check: before building the engine, estimate the host memory the run needs (model
            states with AdamW-sized optimizer states, see :func:`~lightning_roundpipe.estimate_host_memory`)
            and refuse with the table if it exceeds what is available. ``False`` skips the check (an
            optimizer with smaller states, memory about to be freed).
        split_decoder_layers: a Hugging Face model's decoder blocks become two pipeline layers each,
            attention and MLP (same arithmetic). One stage then holds about half a block's activations,
            so longer sequences fit, and the partitioner balances stages at a finer grain. Costs a
            stage boundary (the hidden states, host round trip included) per block.
        tile_tokens: with ``split_decoder_layers``, the token-wise parts of each layer (the MLP with its
            norm, the attention's input norm) run over at most this many tokens at a time and keep only
            their inputs for backward; a backward stage recomputes them tile by tile (one more forward
            of them per backward), so one tile's intermediates bound their memory instead of the whole
            sequence's. For sequences too long for one layer's activations (e.g. 16384).
        timeout: with ``num_nodes > 1``, how long a collective between nodes may wait for the others
            before it fails (a ``timedelta`` or seconds; as for ``DDPStrategy``, default 30 minutes). A
            node that hangs then stops the others with an error instead of holding them forever. It also
            bounds start-up: nodes launched further apart than this fail to connect.
        evaluate_hf_in_pipeline: ``self.model(**batch)`` of a Hugging Face model in ``validation_step`` /
            ``test_step`` with labels runs forward-only through the pipeline and returns the loss only
            (``logits`` is ``None``: never materialised). ``False`` runs the model's own forward on the host
            weights instead, with logits (slow for large models).
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for any Lightning
            strategy; normally filled in by the Trainer from ``accelerator=``, ``devices=`` and
            ``precision=``.
    """

    strategy_name = "roundpipe"

    def __init__(
        self,
        num_microbatches: int | None = None,
        num_rounds: int = 1,
        plan: StagePlan | str | None = "auto",
        profile_steps: int = 2,
        planner: str = "fastest",
        check_every: int = 50,
        replan_margin: float = 0.25,
        overlap: Overlap = "priority",
        gpu_memory: float | str = 0.8,
        async_optimizer: bool = True,
        double_buffer: bool | str = False,
        host_memory_check: bool = True,
        split_decoder_layers: bool = False,
        tile_tokens: int | None = None,
        evaluate_hf_in_pipeline: bool = True,
        timeout: timedelta | float = default_pg_timeout,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if num_microbatches is not None and num_microbatches < 1:
            raise ValueError(f"RoundPipeStrategy(num_microbatches={num_microbatches}) must be at least 1")
        if num_rounds < 1:
            raise ValueError(f"RoundPipeStrategy(num_rounds={num_rounds}) must be at least 1")
        if overlap not in OVERLAPS:
            raise ValueError(f"RoundPipeStrategy(overlap={overlap!r}) must be one of {OVERLAPS}")
        self.overlap = overlap
        self.split_decoder_layers = split_decoder_layers
        if tile_tokens is not None and (not split_decoder_layers or tile_tokens < 1):
            raise ValueError(
                f"RoundPipeStrategy(tile_tokens={tile_tokens}) tiles the layers of split_decoder_layers=True"
                " over a positive number of tokens"
            )
        self.tile_tokens = tile_tokens
        self.gpu_memory = parse_memory(gpu_memory)
        self.double_buffer = double_buffering(double_buffer)
        if self.double_buffer != "none" and not async_optimizer:
            raise ValueError(
                f"RoundPipeStrategy(double_buffer={double_buffer!r}) double-buffers the asynchronous optimizer's"
                " weight casts; it needs async_optimizer=True"
            )
        self.async_optimizer = async_optimizer
        self.host_memory_check = host_memory_check
        self.evaluate_hf_in_pipeline = evaluate_hf_in_pipeline
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        if not isinstance(timeout, timedelta):
            raise TypeError(f"RoundPipeStrategy(timeout={timeout!r}) takes a datetime.timedelta or a number of seconds")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"RoundPipeStrategy(timeout={timeout}) must be positive")
        self.timeout = timeout
        self.num_microbatches = num_microbatches
        self.num_rounds = num_rounds
        self.plan = StagePlan.parse(plan) if isinstance(plan, str) and plan != "auto" else plan
        if profile_steps < 1:
            raise ValueError(f"RoundPipeStrategy(profile_steps={profile_steps}) must be at least 1")
        self.profile_steps = profile_steps
        if planner not in PLANNERS:
            raise ValueError(f"RoundPipeStrategy(planner={planner!r}) must be one of {PLANNERS}")
        self.planner = planner
        if check_every < 0 or replan_margin <= 0:
            raise ValueError(
                f"RoundPipeStrategy(check_every={check_every}, replan_margin={replan_margin}): check_every must be"
                " at least 0 and replan_margin above 0"
            )
        self.check_every, self.replan_margin = check_every, replan_margin
        self.engine: PipelineEngine | None = None
        self._pipelined: nn.Module | None = None
        self._interceptor: Any = None
        self._in_training_step = False
        self._in_eval_step = False
        self._step_loss: Tensor | None = None
        self._num_nodes = 1
        self._grad_group: Any = None
        self._exchange: NodeExchange | None = None

    # ------------------------------------------------------------------ one process, many devices
    @property
    @override
    def root_device(self) -> torch.device:
        """The host: the model, optimizer and batches live there; workers bring data to devices."""
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """Several nodes: one process per node, data parallel across them."""
        return self._num_nodes > 1

    @property
    @override
    def world_size(self) -> int:
        return self._num_nodes

    @property
    @override
    def global_rank(self) -> int:
        return self.node_rank

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        if self._num_nodes == 1 or self.cluster_environment is None:
            return 0
        return self.cluster_environment.node_rank()

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes < 1:
            raise ValueError(f"`Trainer(strategy='roundpipe', num_nodes={num_nodes})` must be at least 1")
        self._num_nodes = num_nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        if self._num_nodes == 1:
            return None
        return {"num_replicas": self._num_nodes, "rank": self.node_rank}

    @property
    def worker_devices(self) -> list[torch.device]:
        return list(self.parallel_devices or [torch.device("cpu")])

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        self.accelerator.setup_device(self.worker_devices[0])
        if self._num_nodes > 1:
            self._setup_distributed()

    def _setup_distributed(self) -> None:
        """One process per node joins a gloo process group (host tensors are what nodes exchange), plus a
        second group for the gradients the optimizer thread reduces, so they never interleave with the
        main thread's collectives (metrics, barriers)."""
        import torch.distributed as dist

        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank)
        self.cluster_environment.set_world_size(self._num_nodes)
        _rank_zero_only.rank = _fabric_rank_zero_only.rank = self.node_rank
        _init_dist_connection(self.cluster_environment, "gloo", self.node_rank, self._num_nodes, timeout=self.timeout)
        self._grad_group = dist.new_group(backend="gloo", timeout=self.timeout)

    @override
    def model_to_device(self) -> None:
        """The model stays on the host: the engine moves weights to devices stage by stage."""

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    def _broadcast_weights(self) -> None:
        """Every node starts from node 0's weights and buffers, as DDP does (after checking that every
        node holds the same model: a mismatch would otherwise pair collectives of different sizes)."""
        assert self.engine is not None
        mine = [(g.kind, str(g.data.dtype), g.data.numel()) for g in self.engine.store.groups]
        everyone: list[Any] = [None] * self._num_nodes
        torch.distributed.all_gather_object(everyone, mine)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                pairs = zip(theirs, everyone[0])
                first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(theirs), len(everyone[0])))
                raise ValueError(
                    f"node {rank}'s model differs from node 0's ({len(theirs)} vs {len(everyone[0])} flat groups,"
                    f" first difference at group {first}). Every node must build the same model with the same"
                    " trainable parameters."
                )
        for group in self.engine.store.groups:
            torch.distributed.broadcast(group.data, 0)
        self.engine.store.mark_dirty()
        self.engine.store.sync_compute()

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def checkpoint_io(self) -> Any:
        if self._checkpoint_io is None:
            self._checkpoint_io = _checkpoint_io.StreamingCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Adds the engine's state (counters, plan, pending-update compute copies) to a full checkpoint."""
        if self.engine is not None and "optimizer_states" in checkpoint:
            checkpoint["roundpipe"] = self.engine.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._exchange is not None:  # keep only the states of the groups this node updates
            for optimizer in self.optimizers:
                for g, owner in self._exchange.owner.items():
                    if owner != self.node_rank:
                        for p, _ in self.engine.store.groups[g].params:  # type: ignore[union-attr]
                            optimizer.state.pop(p, None)
        if self.engine is not None and "roundpipe" in checkpoint:
            self.engine.load_state_dict(checkpoint["roundpipe"])

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> Any:
        return self._precision_plugin if self._precision_plugin is not None else _precision.RoundPipePrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = _precision.convert(plugin)

    # ------------------------------------------------------------------ setup and teardown
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        fitting = trainer.state.fn == _TrainerFn.FITTING
        if fitting and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "roundpipe supports automatic optimization only: remove `self.automatic_optimization = False`"
                " and let Lightning call the optimizer."
            )
        self._setup_engine(training=fitting)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_engine(self, training: bool = True) -> None:
        """The engine over the model's layers; without ``training`` (validate, test, predict) it only
        runs forward passes and has no optimizer thread."""
        module = self.lightning_module
        hf_model = find_hf_model(module)
        if hf_model is not None:
            from lightning_roundpipe.models import hf

            layers = hf.build_layers(hf_model, self.split_decoder_layers, self.tile_tokens)
            check_covers_trainable(module, layers, f"the {type(hf.unwrap(hf_model)).__name__} preset's layers")
        else:
            if self.split_decoder_layers:
                from lightning_roundpipe.models.hf import PRESETS

                raise ValueError(
                    "RoundPipeStrategy(split_decoder_layers=True) splits the decoder blocks of a Hugging Face model"
                    f" (presets: {sorted(PRESETS)}); an nn.Sequential is pipelined layer by layer as given,"
                    " so split its blocks into separate children instead"
                )
            sequential = find_pipelined_module(module)
            layers = list(sequential.children())
        asynchronous = self.async_optimizer and training
        if self._num_nodes > 1 and self.precision_plugin.precision == "16-mixed":
            raise ValueError(
                "precision='16-mixed' across nodes is not supported yet: every node would have to agree on"
                " skipping a step. Use precision='bf16-mixed' (no loss scaling needed) with num_nodes > 1."
            )
        if asynchronous:
            if self.precision_plugin.precision == "16-mixed":
                raise ValueError(
                    "precision='16-mixed' with the asynchronous optimizer is not supported yet: loss scaling needs"
                    " the step's overflow check before the next step starts. Use precision='bf16-mixed', or"
                    " RoundPipeStrategy(async_optimizer=False)."
                )
            hooks = ("on_after_backward", "on_before_optimizer_step")
            overridden = [h for h in hooks if _is_overridden(h, module)]
            if overridden:
                rank_zero_warn(
                    f"{type(module).__name__} overrides {overridden}; with"
                    " RoundPipeStrategy(async_optimizer=True) gradients are applied on a host thread one step later"
                    " and `p.grad` is None in these hooks. Use async_optimizer=False to inspect gradients there."
                )
        params = [p for layer in layers for p in layer.parameters()]
        compute_dtype = self.precision_plugin.compute_dtype
        state_bytes = 8.0 / self._num_nodes if training else 0.0  # AdamW's two fp32 moments, sharded over nodes
        estimate = estimate_host_memory(
            params, compute_dtype, asynchronous, state_bytes, double_buffer=self.double_buffer
        )
        if self.host_memory_check:
            check_host_memory(estimate)  # refuse now, with the numbers, rather than be killed halfway
        devices: list[WorkerDevice] = []
        for index, device in enumerate(self.worker_devices):
            if device.type == "cuda":
                devices.append(CudaWorkerDevice(device, index))
            elif device.type == "cpu":
                devices.append(WorkerDevice(device, index))
            else:
                raise ValueError(
                    f"roundpipe workers run on CUDA devices or CPU threads, not {device.type!r}: use"
                    " `accelerator='gpu'` or `accelerator='cpu'`."
                )
        self.engine = PipelineEngine(
            layers,
            devices,
            plan=self.plan,
            microbatches_per_round=self.num_microbatches,
            num_rounds=self.num_rounds,
            overlap=self.overlap,
            compute_dtype=self.precision_plugin.compute_dtype,
            autocast_dtype=self.precision_plugin.compute_dtype,
            asynchronous=asynchronous,
            profile_steps=self.profile_steps,
            planner=self.planner,
            check_every=self.check_every,
            replan_margin=self.replan_margin,
            memory_limit=device_memory_limit(self.worker_devices, self.gpu_memory),
            double_buffer=self.double_buffer if asynchronous else "none",
        )
        if self._num_nodes > 1:
            self._broadcast_weights()
            self._exchange = NodeExchange(self.engine.store, self._grad_group, self.node_rank, self._num_nodes)
            if asynchronous:
                self.engine.use_exchange(self._exchange)
        if hf_model is not None:
            from lightning_roundpipe.models import hf

            def run(inputs: Any, target: Any) -> Tensor:
                if self._in_eval_step:
                    assert self.engine is not None
                    return self.engine.evaluate(inputs, target, lambda out, _: out, hf.counted_tokens)
                return self._train_batch(inputs, target, lambda out, _: out, hf.counted_tokens)

            self._interceptor = hf.Interceptor(
                hf_model, run, lambda: self._in_training_step,
                lambda: self._in_eval_step and self.evaluate_hf_in_pipeline,
            )  # fmt: skip
        else:
            self._pipelined = sequential
            api.register_runner(sequential, self._run_pipeline)

    @override
    def teardown(self) -> None:
        if self._interceptor is not None:
            self._interceptor.restore()
            self._interceptor = None
        if self._pipelined is not None:
            api.unregister_runner(self._pipelined)
            self._pipelined = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().teardown()

    # ------------------------------------------------------------------ the training step
    def _run_pipeline(
        self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor], reduction: Reduction
    ) -> Tensor:
        """``pipeline_loss`` (or, with ``loss_fn=None``, ``pipeline_forward``) on the pipelined ``nn.Sequential``."""
        assert self._pipelined is not None
        if self._in_eval_step and self.engine is not None:
            # validation_step/test_step/predict_step: forward only, through the pipeline
            return self.engine.evaluate(inputs, target, loss_fn, reduction)
        if not self._in_training_step:
            # anywhere else (a callback, on_validation_epoch_end, ...): a plain forward on the host weights
            output = self._pipelined(inputs)
            return output if loss_fn is None else loss_fn(output, target)
        if loss_fn is None:
            raise RuntimeError(
                "`pipeline_forward` cannot run in `training_step` under roundpipe: the backward happens inside the"
                " pipeline, so compute the loss there with `pipeline_loss(self.model, inputs, target, loss_fn)`."
            )
        return self._train_batch(inputs, target, loss_fn, reduction)

    def _train_batch(
        self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor], reduction: Reduction
    ) -> Tensor:
        if self._step_loss is not None:
            raise RuntimeError(
                "the pipelined model was called twice in one `training_step`. Under roundpipe each call runs the"
                " whole backward, so call it once per step and return its loss."
            )
        assert self.engine is not None and self.lightning_module is not None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        grad_scale = self.precision_plugin.loss_scale / accumulate
        loss = self.engine.train_batch(
            inputs, target, loss_fn, reduction, grad_scale=grad_scale, last_of_step=self._last_of_step()
        )
        finite = bool(torch.isfinite(loss))
        if self._num_nodes > 1 and self.precision_plugin.precision != "16-mixed":
            # every node must stop on the same step, or the others wait in the gradient exchange
            flag = torch.tensor([1.0 if finite else 0.0])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            finite = bool(flag.item())
        if not finite and self.precision_plugin.precision != "16-mixed":
            # 16-mixed skips the step and lowers the loss scale; here an update would spoil every weight
            step = self.lightning_module.trainer.global_step
            raise FloatingPointError(
                f"the loss of the batch at step {step} is {loss.item()} (here or on another node); roundpipe stops"
                " before applying a"
                " non-finite update (the weights are those of the last good step, and Lightning's `on_exception`"
                " hooks can still save them). Lower the learning rate, clip gradients (`gradient_clip_val`),"
                " check the data, or use precision='16-mixed' to skip such steps."
            )
        self._step_loss = loss
        return loss

    def _last_of_step(self) -> bool:
        """Whether Lightning steps the optimizer after this batch (automatic optimisation, asked of its
        training loop; one pipeline call per ``training_step`` is enforced above). ``False`` when it
        cannot tell, or when the module's own ``optimizer_step`` decides: the engine then learns the
        step's batches at ``optimizer_step``, a little later."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if not self.async_optimizer or not self.lightning_module.automatic_optimization:
            return False
        if _is_overridden("optimizer_step", self.lightning_module):
            return False  # it may run the closure alone and skip the step (Lightning documents that)
        try:
            return not trainer.fit_loop.epoch_loop._should_accumulate()
        except AttributeError:  # a Lightning without this loop method
            return False

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._step_loss = None
        self._in_training_step = True
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._in_training_step = False
        if output is None and self._num_nodes > 1:
            raise RuntimeError(
                "`training_step` returned None with num_nodes > 1: skipping a batch on one node would leave the"
                " others waiting in the gradient exchange. Return the loss on every node."
            )
        if output is None and self._step_loss is not None:
            raise RuntimeError(
                "`training_step` returned None after `pipeline_loss` already ran the backward; its gradients"
                " cannot be taken back. Skip the batch before calling `pipeline_loss`."
            )
        return output

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._in_eval_step = True
        try:
            return step(*args, **kwargs)
        finally:
            self._in_eval_step = False

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._step_loss is None:
            raise RuntimeError(
                "Under strategy='roundpipe', `training_step` must compute its loss with"
                " `lightning_roundpipe.pipeline_loss(self.model, inputs, target, loss_fn)` and return it:"
                " a loss computed on the host model is never backpropagated."
            )
        assert self.lightning_module is not None and self.engine is not None
        expected = self._step_loss / self.lightning_module.trainer.accumulate_grad_batches
        if not torch.equal(closure_loss.detach().float().cpu(), expected):
            raise RuntimeError(
                f"`training_step` returned a loss ({closure_loss.item():.6g}) that is not the value"
                f" `pipeline_loss` computed ({self._step_loss.item():.6g}). Under roundpipe only the pipeline's"
                " gradients are applied, so return `pipeline_loss(...)` unchanged; put extra loss terms"
                " inside `loss_fn`."
            )
        self._step_loss = None
        if not self.async_optimizer:
            self.engine.store.install_grads()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self.engine is not None
        if not self.async_optimizer:
            exchange = self._exchange
            if exchange is not None:
                inner = closure
                trainer = self.lightning_module.trainer

                def closure() -> Any:  # gradients to their owners, clipped over all nodes, before the step
                    result = inner()
                    exchange.reduce_all()
                    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm in (None, "norm"):
                        exchange.clip_norm(float(trainer.gradient_clip_val))  # Lightning's own clip is then a no-op
                    exchange.drop_foreign_grads()  # the optimizer steps (and keeps state for) this node's groups
                    return result

            output = super().optimizer_step(optimizer, closure, model, **kwargs)
            if exchange is not None:
                exchange.broadcast_all()
            self.engine.store.clear_grads()
            self.engine.store.mark_dirty()  # the next batch uploads the updated weights
            return output
        closure_result = closure()  # training_step, with the pipelined forward and backward
        trainer = self.lightning_module.trainer
        _call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        _call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if closure_result is None:
            return None
        spec = UpdateSpec.capture(optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        self.engine.submit_step(spec)  # clipping and the update happen on the optimizer thread
        spec.optimizer._opt_called = True  # what an LR scheduler's step wrapper records: the step was taken
        return closure_result

    def _flush(self) -> None:
        """Let the pending update reach the master weights (before they are read or saved)."""
        if self.engine is not None:
            self.engine.flush()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._flush()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._flush()
        state = super().optimizer_state(optimizer)
        if self._exchange is not None:  # each node holds the states of its groups: gather them (collective)
            shards: list[Any] = [None] * self._num_nodes
            torch.distributed.all_gather_object(shards, state["state"])
            state = {**state, "state": {k: v for shard in shards for k, v in shard.items()}}
        return state

    @override
    def on_train_end(self) -> None:
        self._flush()
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        if self.engine is not None:
            self.engine.begin_evaluation()  # flushes; the masters are what is evaluated
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        if self.engine is not None:
            self.engine.end_evaluation()
        super().on_validation_end()

    @override
    def on_test_start(self) -> None:
        if self.engine is not None:
            self.engine.begin_evaluation()  # flushes; the masters are what is evaluated
        super().on_test_start()

    @override
    def on_test_end(self) -> None:
        if self.engine is not None:
            self.engine.end_evaluation()
        super().on_test_end()

    @override
    def on_predict_start(self) -> None:
        if self.engine is not None:
            self.engine.begin_evaluation()  # flushes; the masters are what is evaluated
        super().on_predict_start()

    @override
    def on_predict_end(self) -> None:
        if self.engine is not None:
            self.engine.end_evaluation()
        super().on_predict_end()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="RoundPipe: host-resident model states, round-robin stages",
            )


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
