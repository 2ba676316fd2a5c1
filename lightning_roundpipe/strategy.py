"""``RoundPipeStrategy``: Lightning glue around the pipeline engine.

One process drives every device (world size 1 per node, no launcher). The model and optimizer stay on
the host. The hooks here call named collaborators: :mod:`~lightning_roundpipe.options` (the arguments,
checked), :mod:`~lightning_roundpipe.discovery` (what to pipeline), :mod:`~lightning_roundpipe.build`
(the engine), :mod:`~lightning_roundpipe.routing` (where a call of the model goes in each step) and
:mod:`~lightning_roundpipe.nodes` (several nodes). ``training_step`` runs the pipelined forward and
backward; ``backward`` only installs the host gradients where hooks, clipping and the optimizer look for
them; the optimizer steps the host master weights, on a host thread in the asynchronous mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_roundpipe._flavor import lightning_package, sibling
from lightning_roundpipe.build import (
    ONE_OPTIMIZER,
    EngineArguments,
    build_again,
    build_engine,
    check_optimizers,
    could_share,
    fresh_engine,
    needs_main_thread,
    setup_optimizers,
)
from lightning_roundpipe.callbacks import FlushFirst
from lightning_roundpipe.discovery import pipelined_layers
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.host_clock import HostStepClock, ShareSwitch
from lightning_roundpipe.host_optimizer import use_fused_kernels
from lightning_roundpipe.models import quantized
from lightning_roundpipe.options import RoundPipeOptions
from lightning_roundpipe.routing import PipelineCalls
from lightning_roundpipe.runtime.updates import UpdateSpec
from lightning_roundpipe.schedule.plan import StagePlan
from lightning_roundpipe.schedule.transfers import Overlap

pl = lightning_package(globals())
_precision = sibling("precision", globals())
_checkpoint_io = sibling("checkpoint_io", globals())
_processes = sibling("processes", globals())
_TrainerFn = pl.trainer.states.TrainerFn
_call = pl.trainer.call
_is_overridden = pl.utilities.model_helpers.is_overridden
rank_zero_warn = pl.utilities.rank_zero_warn


class RoundPipeStrategy(_processes.NodeProcesses):  # type: ignore[misc,valid-type]
    """Train models larger than GPU memory: model states on the host, stages dispatched round-robin.

    Arguments in full: :class:`~lightning_roundpipe.options.RoundPipeOptions`; when to change them: docs/tuning.md.

    Args:
        num_microbatches: micro-batches per round, at least the devices (``None``: chosen, with the plan).
        num_rounds: rounds per training batch (``num_microbatches * num_rounds`` micro-batches in all).
        plan: ``"auto"`` (measure the layers, then partition), a ``StagePlan`` or ``"3,3|1,2,2,2"``.
        profile_steps: batches that measure the layers before the automatic plan is made.
        planner: ``"fastest"`` (simulated) or ``"objective"`` (the paper's objective).
        check_every, replan_margin: batches between checks of the stage times (0: never); how far they may drift.
        overlap: weight and gradient copies: ``"priority"``, ``"simple"`` or ``"none"``.
        gpu_memory: what a plan may use per device: a fraction (``0.8``), bytes or ``"24GiB"``.
        async_optimizer: the host optimizer steps while the devices compute the next step (staleness 1).
        double_buffer: a second compute copy of the weights: ``"all"``/``True``, ``"first"``, ``"auto"`` or ``False``.
        optimizer_on: the asynchronous optimizer's states and steps on the ``"host"``, the one GPU
            (``"device"``), or ``"auto"``: the GPU where they take at most half of ``gpu_memory`` and the optimizer
            is one of ``torch.optim``'s; a share in (0, 1): that share of the states (the deepest layers') on the GPU.
        host_memory_check: refuse, with the estimate, a run the host cannot hold.
        split_decoder_layers, tile_tokens: a Hugging Face model's blocks as attention and MLP layers; tiled.
        split_by: micro-batches by ``"tokens"`` (``"auto"``: a padded Hugging Face batch's, packed where torch's
            varlen flash kernel runs; a flattened one's between its sequences, packed), ``"packed"`` (by tokens,
            each micro-batch's sequences in one row without padding) or ``"samples"``.
        hf_stages: a Hugging Face model's stages: ``"auto"`` (the table's, else generic), ``"generic"``, ``"table"``.
        kernels: a Hugging Face model's stages with liger-kernel's kernels: ``"auto"``, ``"liger"`` or ``"none"``.
        compile: ``torch.compile`` of the layers: ``"auto"`` (HF blocks on CUDA), ``True``, ``False`` or its kwargs.
        evaluate_hf_in_pipeline: a Hugging Face model's validation/test loss goes through the pipeline.
        timeout: with ``num_nodes > 1``, how long a collective waits for the other nodes.
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for any strategy (the Trainer's).
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
        optimizer_on: str | float = "auto",
        host_memory_check: bool = True,
        split_decoder_layers: bool = False,
        tile_tokens: int | None = None,
        hf_stages: str = "auto",
        split_by: str = "auto",
        kernels: str = "auto",
        compile: bool | str | dict[str, Any] = "auto",
        evaluate_hf_in_pipeline: bool = True,
        timeout: timedelta | float = default_pg_timeout,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        arguments = locals()  # every argument but the Trainer's four is an option of the same name
        self.options = RoundPipeOptions(**{f.name: arguments[f.name] for f in dataclasses.fields(RoundPipeOptions)})
        super().__init__(
            self.options.timeout, accelerator=accelerator, parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )  # fmt: skip
        self.engine: PipelineEngine | None = None
        self.measure_grad_norm = False  # async: each step's gradient norm on the optimizer thread (the monitor's)
        self.kernels: list[str] = []  # the faster kernels bound onto a Hugging Face model at setup
        self._calls: PipelineCalls | None = None
        self._host_clock, self._share = HostStepClock(), ShareSwitch()  # (auto: a share of the states to the GPU)
        self._host_clock.on_bound = lambda host, device: self._share.offer(self.engine, host, device)

    @property
    def async_optimizer(self) -> bool:
        return self.options.async_optimizer

    # ------------------------------------------------------------------ checkpoints and precision
    @property
    @override
    def checkpoint_io(self) -> Any:
        if self._checkpoint_io is None:  # made when first asked for: a CheckpointIO plugin may still come
            self._checkpoint_io = _checkpoint_io.StreamingCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Adds the engine's state (counters, plan, pending-update compute copies) to a full checkpoint."""
        if self.engine is not None and not self.engine.crew.whole_after_failure():
            return  # (a warning says why)
        if self.engine is not None and "optimizer_states" in checkpoint:
            checkpoint["roundpipe"] = self.engine.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        use_fused_kernels(self.optimizers, calibrate=False)  # the saved groups' settings came back
        if self.engine is not None:
            self._nodes.keep_own_states(self.optimizers, self.engine)
            if "roundpipe" in checkpoint:
                _load_engine_state(self, checkpoint["roundpipe"])

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
                f" and let Lightning call the optimizer. {ONE_OPTIMIZER}"
            )
        if fitting:  # first: optimizer_on="auto" leaves optimizers other than torch.optim's on the host
            setup_optimizers(self, trainer)
            trainer.callbacks.insert(0, FlushFirst(self._flush))  # before the user's epoch and training ends
            why = self.async_optimizer and needs_main_thread(self.lightning_module, self.optimizers, _is_overridden)
            if why:  # a hook or an optimizer the optimizer thread cannot serve
                rank_zero_warn(why)
                self.options = self.options.synchronous()
        self._setup_engine(trainer, training=fitting)
        if fitting:
            check_optimizers(self.optimizers, self.engine, self._nodes.count, self.async_optimizer)
            self._share.watch(could_share(self.engine, _engine_arguments(self)), self._host_clock)
        self.setup_precision_plugin()

    def _setup_engine(self, trainer: Any, training: bool) -> None:
        """The engine over the model's layers, and the model's calls routed to it."""
        module = self.lightning_module
        cuda = all(d.type == "cuda" for d in self.worker_devices)
        asynchronous = self.async_optimizer and training
        self.precision_plugin.check_supported(asynchronous, self.num_nodes)
        if asynchronous:
            _warn_about_gradient_hooks(module)
        half = self.precision_plugin.compute_dtype in (torch.bfloat16, torch.float16) or None  # None: weights say
        pipelined = pipelined_layers(module, self.options, cuda, self.worker_devices if cuda else (), half)
        self.kernels = pipelined.kernels
        with pipelined.undone_on_failure():  # the host memory check, the nodes' agreement
            self.engine = build_engine(
                pipelined.layers, self.worker_devices, self.options, self.precision_plugin.compute_dtype,
                asynchronous, training, self._nodes.count, self.precision_plugin.autocast_dtype, self.optimizers,
            )  # fmt: skip
            self._nodes.join(self.engine, asynchronous)
        steps_after = lambda: asynchronous and _lightning_steps_after(module)  # noqa: E731
        self._calls = PipelineCalls(
            self.engine, pipelined, trainer, self.precision_plugin, self._nodes, steps_after,
            self.options.evaluate_hf_in_pipeline,
        )  # fmt: skip

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            callbacks = self.lightning_module.trainer.callbacks
            callbacks[:] = [c for c in callbacks if not isinstance(c, FlushFirst)]
        if self._calls is not None:
            self._calls.uninstall()
            self._calls = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().teardown()

    # ------------------------------------------------------------------ the training step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._calls is not None and self.engine is not None
        # a new engine if parameters were frozen or unfrozen between steps (BackboneFinetuning)
        self.engine = self._calls.engine = build_again(self.engine, _engine_arguments(self))
        self._share.apply(self, lambda: _engine_arguments(self))  # where the host's step bounds it: host_clock
        with self._calls.training_step():
            output = super().training_step(*args, **kwargs)
        self._calls.check_output(output)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._calls is not None
        with self._calls.evaluation_step():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._calls is not None
        with self._calls.evaluation_step():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._calls is not None
        with self._calls.evaluation_step():
            return super().predict_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        assert self._calls is not None and self.engine is not None
        self._calls.take_loss(closure_loss)
        if not self.async_optimizer:
            self.engine.store.install_grads()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self.engine is not None
        trainer = self.lightning_module.trainer
        if not self.async_optimizer:
            closure = self._nodes.step_closure(closure, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            with self._host_clock.timing(self._device_step_s(), optimizer) as timed:
                output = super().optimizer_step(optimizer, timed(closure), model, **kwargs)
            self._nodes.after_step()
            self.engine.store.clear_grads()
            self.engine.store.mark_dirty()  # the next batch uploads the updated weights
            return output
        self._host_clock.update(self.engine.crew.optimizer.last_update, self._device_step_s(), optimizer)
        closure_result = closure()  # training_step, with the pipelined forward and backward
        _call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        _call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        if closure_result is None:
            return None
        scaling = self.precision_plugin
        settings = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm, self.measure_grad_norm, scaling.scaler)
        spec = UpdateSpec.capture(optimizer, *settings, scaling.step_scale(self.engine))
        self.engine.submit_step(spec)  # clipping and the update happen on the optimizer thread
        spec.optimizer._opt_called = True  # what an LR scheduler's step wrapper records: the step was taken
        return closure_result

    def _device_step_s(self) -> float | None:
        """Seconds the GPUs compute for one optimizer step, from the last measured batch (CPU workers: none)."""
        compute = self.engine.stats.compute_s if self.engine is not None else None
        cuda = compute is not None and any(d.type == "cuda" for d in self.worker_devices)
        return compute * self.lightning_module.trainer.accumulate_grad_batches if cuda else None

    @property
    def host_step_s(self) -> float | None:
        return self._host_clock.host_step_s  # the last host optimizer step's seconds (RoundPipeMonitor logs it)

    def _flush(self) -> None:
        """Let the pending update reach the master weights (before they are read or saved)."""
        if self.engine is not None:
            self.engine.flush()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._flush()  # 4-bit base weights are the loaded model's, not written again
        return quantized.without_base(super().lightning_module_state_dict(), self.lightning_module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        self._flush()  # a pending update must not land on the loaded weights
        quantized.load_without_base(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._flush()
        return self._nodes.gather_states(super().optimizer_state(optimizer))

    @override
    def on_train_end(self) -> None:
        self._flush()
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:  # Lightning's hooks do nothing: one body serves validation, test, predict
        if self.engine is not None:
            self.engine.begin_evaluation()  # flushes; the masters are what is evaluated

    @override
    def on_validation_end(self) -> None:
        if self.engine is not None:
            self.engine.end_evaluation()

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="RoundPipe: host-resident model states, round-robin stages"
            )


def _warn_about_gradient_hooks(module: Any) -> None:
    """The asynchronous optimizer applies gradients on its own thread: hooks that read them see none."""
    overridden = [h for h in ("on_after_backward", "on_before_optimizer_step") if _is_overridden(h, module)]
    if overridden:
        rank_zero_warn(
            f"{type(module).__name__} overrides {overridden}; with"
            " RoundPipeStrategy(async_optimizer=True) gradients are applied on a host thread one step later"
            " and `p.grad` is None in these hooks. Use async_optimizer=False to inspect gradients there."
        )


def _engine_arguments(strategy: Any) -> EngineArguments:
    return EngineArguments(
        strategy._calls.pipelined.layers, strategy.worker_devices, strategy.options, strategy.precision_plugin,
        strategy.optimizers, strategy._nodes.count,
    )  # fmt: skip


def _load_engine_state(strategy: Any, state: dict[str, Any]) -> None:
    """A checkpoint's engine state; mid-run (the learning-rate finder restores the checkpoint it saved before its
    trial steps) on a new engine, as at a resume."""
    ran = strategy.engine
    strategy.engine = strategy._calls.engine = fresh_engine(ran, _engine_arguments(strategy))
    if strategy.engine is not ran:
        strategy._nodes.join(strategy.engine, strategy.engine.asynchronous)
    strategy.engine.load_state_dict(state)


def _lightning_steps_after(module: Any) -> bool:
    """Whether Lightning steps the optimizer after the current batch, asked of its training loop. ``False``
    when it cannot tell or the module's own ``optimizer_step`` decides: the engine learns it a little later."""
    if not module.automatic_optimization:
        return False
    if _is_overridden("optimizer_step", module):
        return False  # it may run the closure alone and skip the step (Lightning documents that)
    try:
        return not module.trainer.fit_loop.epoch_loop._should_accumulate()
    except AttributeError:  # a Lightning without this loop method
        return False
