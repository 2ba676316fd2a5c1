"""Where a call of the pipelined model goes, by the step Lightning is running.

In ``training_step`` a call of ``pipeline_loss`` (or of the Hugging Face model's ``forward``) runs the
whole pipelined forward and backward on the engine, once per step, and its loss is what the step must
return; in ``validation_step``, ``test_step`` and ``predict_step`` it runs forward only through the
pipeline; anywhere else (a callback, an epoch-end hook, generation) the model runs on the host weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_roundpipe import api
from lightning_roundpipe.discovery import Pipelined
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.nodes import Nodes
from lightning_roundpipe.runtime.microbatch import Reduction


class PipelineCalls:
    """Routes the pipelined model's calls to ``engine`` while installed (from setup to teardown).

    Args:
        engine, pipelined: the engine and what it pipelines (a Hugging Face model or an ``nn.Sequential``).
        trainer: the Trainer (its gradient accumulation and step count).
        precision: the strategy's precision plugin (loss scale; ``"16-mixed"`` skips non-finite steps).
        nodes: the strategy's nodes (a non-finite loss stops every node at once).
        last_of_step: whether Lightning steps the optimizer after the current batch.
        evaluate_hf: ``RoundPipeStrategy(evaluate_hf_in_pipeline=...)``.
    """

    def __init__(
        self,
        engine: PipelineEngine,
        pipelined: Pipelined,
        trainer: Any,
        precision: Any,
        nodes: Nodes,
        last_of_step: Callable[[], bool],
        evaluate_hf: bool = True,
    ) -> None:
        self.engine, self.pipelined, self.trainer, self.precision, self.nodes = (
            engine,
            pipelined,
            trainer,
            precision,
            nodes,
        )
        self._last_of_step = last_of_step
        self.step_loss: Tensor | None = None
        """The loss the pipeline computed in the running training step (``None``: not called yet)."""
        self._training = self._evaluating = False
        self._interceptor: Any = None
        if pipelined.hf_model is not None:
            from lightning_roundpipe.models import hf

            def run(inputs: Any, target: Any) -> Tensor:
                if self._evaluating:
                    return self.engine.evaluate(inputs, target, lambda out, _: out, hf.counted_tokens, pipelined.split)
                return self._train(inputs, target, lambda out, _: out, hf.counted_tokens, pipelined.split)

            self._interceptor = hf.Interceptor(
                pipelined.hf_model, run, lambda: self._training, lambda: self._evaluating and evaluate_hf
            )
        else:
            assert pipelined.sequential is not None
            api.register_runner(pipelined.sequential, self._run)

    def uninstall(self) -> None:
        """The model runs plainly again (its own modules' code too: the faster kernels come off)."""
        if self._interceptor is not None:
            self._interceptor.restore()
            self._interceptor = None
        self.pipelined.undo()
        if self.pipelined.sequential is not None:
            api.unregister_runner(self.pipelined.sequential)

    @contextlib.contextmanager
    def training_step(self) -> Iterator[None]:
        self.step_loss = None
        self._training = True
        try:
            yield
        finally:
            self._training = False

    @contextlib.contextmanager
    def evaluation_step(self) -> Iterator[None]:
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False

    def _run(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor] | None, reduction: Reduction) -> Any:
        """``pipeline_loss`` (or, with ``loss_fn=None``, ``pipeline_forward``) on the pipelined ``nn.Sequential``."""
        if self._evaluating:  # validation_step/test_step/predict_step: forward only, through the pipeline
            return self.engine.evaluate(inputs, target, loss_fn, reduction)
        if not self._training:  # anywhere else: a plain forward on the host weights
            assert self.pipelined.sequential is not None
            output = self.pipelined.sequential(inputs)
            return output if loss_fn is None else loss_fn(output, target)
        if loss_fn is None:
            raise RuntimeError(
                "`pipeline_forward` cannot run in `training_step` under roundpipe: the backward happens inside the"
                " pipeline, so compute the loss there with `pipeline_loss(self.model, inputs, target, loss_fn)`."
            )
        return self._train(inputs, target, loss_fn, reduction)

    def _train(
        self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor], reduction: Reduction, split: Any = None
    ) -> Tensor:
        if self.step_loss is not None:
            raise RuntimeError(
                "the pipelined model was called twice in one `training_step`. Under roundpipe each call runs the"
                " whole backward, so call it once per step and return its loss."
            )
        grad_scale = self.precision.step_scale(self.engine) / self.trainer.accumulate_grad_batches
        loss = self.engine.train_batch(
            inputs, target, loss_fn, reduction, grad_scale=grad_scale, last_of_step=self._last_of_step(), split=split
        )
        # 16-mixed skips the step and lowers the loss scale; otherwise an update would spoil every weight
        skips = self.precision.precision == "16-mixed"
        if not skips and not self.nodes.all_finite(bool(torch.isfinite(loss))):
            raise FloatingPointError(
                f"the loss of the batch at step {self.trainer.global_step} is {loss.item()} (here or on another"
                " node); roundpipe stops before applying a non-finite update (the weights are those of the last"
                " good step, and Lightning's `on_exception` hooks can still save them). Lower the learning rate,"
                " clip gradients (`gradient_clip_val`), check the data, or use precision='16-mixed' to skip such"
                " steps."
            )
        self.step_loss = loss
        return loss

    def check_output(self, output: Any) -> None:
        """What ``training_step`` returned, against what the pipeline already did."""
        if output is None and self.nodes.count > 1:
            raise RuntimeError(
                "`training_step` returned None with num_nodes > 1: skipping a batch on one node would leave the"
                " others waiting in the gradient exchange. Return the loss on every node."
            )
        if output is None and self.step_loss is not None:
            raise RuntimeError(
                "`training_step` returned None after `pipeline_loss` already ran the backward; its gradients"
                " cannot be taken back. Skip the batch before calling `pipeline_loss`."
            )

    def take_loss(self, closure_loss: Tensor) -> None:
        """Lightning's backward of ``closure_loss``: it must be the pipeline's loss, whose backward ran."""
        if self.step_loss is None:
            raise RuntimeError(
                "Under strategy='roundpipe', `training_step` must compute its loss with"
                " `lightning_roundpipe.pipeline_loss(self.model, inputs, target, loss_fn)` and return it:"
                " a loss computed on the host model is never backpropagated."
            )
        expected = self.step_loss / self.trainer.accumulate_grad_batches
        returned = closure_loss.detach().float().cpu()
        if not torch.allclose(returned, expected, rtol=0.0, atol=0.0, equal_nan=True):  # NaN is NaN (16-mixed skips)
            raise RuntimeError(
                f"`training_step` returned a loss ({closure_loss.item():.6g}) that is not the value"
                f" `pipeline_loss` computed ({self.step_loss.item():.6g}). Under roundpipe only the pipeline's"
                " gradients are applied, so return `pipeline_loss(...)` unchanged; put extra loss terms"
                " inside `loss_fn`."
            )
        self.step_loss = None
