"""``pipeline_loss``: the one call a custom model's ``training_step`` makes; plain PyTorch elsewhere."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_roundpipe.runtime.microbatch import Reduction

Runner = Callable[[Any, Any, Callable[[Any, Any], Tensor] | None, Reduction], Any]

_RUNNERS: weakref.WeakKeyDictionary[nn.Module, Runner] = weakref.WeakKeyDictionary()


def pipeline_loss(
    model: nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    reduction: Reduction = "mean",
) -> Tensor:
    """The loss of ``model`` on a batch, computed so that every strategy can train it.

    Under any other strategy this is ``loss_fn(model(inputs), target)`` and autograd does the rest.
    Under ``strategy="roundpipe"`` (for the ``nn.Sequential`` the strategy pipelines) it splits the
    batch into micro-batches, runs the pipelined forward and backward on the workers, adds the
    gradients to the host store and returns the batch loss, detached: backward is already done.
    Return it from ``training_step`` as it is.

    Args:
        model: the ``nn.Sequential`` held by the LightningModule; each entry is a layer (a module it holds twice
            runs twice, its weights shared, as in the Sequential's own forward).
        inputs: the model input, a tensor or a nest of tensors with the batch dimension first.
        target: what ``loss_fn`` compares the output with, split like ``inputs`` (or ``None``).
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        reduction: how ``loss_fn`` reduces over the batch, so micro-batch losses add up to the batch
            loss: ``"mean"`` over samples (default), ``"sum"``, or a function counting the items a
            target averages over (e.g. non-ignored tokens). See
            :data:`lightning_roundpipe.runtime.microbatch.Reduction`.
    """
    runner = _RUNNERS.get(model)
    if runner is None:
        return loss_fn(model(inputs), target)
    return runner(inputs, target, loss_fn, reduction)


def pipeline_forward(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)``, computed so that every strategy can run it: for ``predict_step`` and for the
    outputs a ``validation_step`` or ``test_step`` feeds to metrics.

    Under ``strategy="roundpipe"`` in ``validation_step``, ``test_step`` and ``predict_step`` this runs
    forward only through the pipeline (weights stream through the devices as in training, nothing is
    kept for backward) and returns the output on the host, micro-batches concatenated along dim 0.
    In ``training_step`` use :func:`pipeline_loss` instead.
    """
    runner = _RUNNERS.get(model)
    if runner is None:
        return model(inputs)
    return runner(inputs, None, None, "mean")


def register_runner(model: nn.Module, runner: Runner) -> None:
    """Route ``pipeline_loss(model, ...)`` to ``runner`` (the strategy's engine)."""
    _RUNNERS[model] = runner


def unregister_runner(model: nn.Module) -> None:
    """Undo :func:`register_runner` (at teardown): the model runs plainly again."""
    _RUNNERS.pop(model, None)
