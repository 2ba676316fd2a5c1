"""A flight: what the workers share while one batch passes through the pipeline.

Boundary activations and gradients travel through mailboxes keyed like
:mod:`lightning_roundpipe.schedule.dataflow`; a mailbox drops its value after its last reader, so
the host holds only the stage inputs still needed for recompute. Gradient downloads are ordered
per flat group by a chain of gates fixed when the flight is built, so gradients are summed in the
same order on every run whatever the thread timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_roundpipe.runtime.workers import Gate
from lightning_roundpipe.schedule.dataflow import Key, consumer_counts
from lightning_roundpipe.schedule.dispatch import Schedule
from lightning_roundpipe.schedule.plan import StageKind


class _Mailbox:
    __slots__ = ("gate", "readers", "value")

    def __init__(self, gate: Gate, readers: int) -> None:
        self.gate = gate
        self.readers = readers
        self.value: Any = None


class Flight:
    """Shared state of one batch: micro-batches, loss weights, mailboxes, losses and gradient order."""

    def __init__(
        self,
        call: int,
        schedule: Schedule,
        inputs: list[Any],
        targets: list[Any],
        weights: list[float],
        grad_scale: float,
        loss_fn: Callable[[Any, Any], Tensor],
        abort: threading.Event,
        grad_chain: dict[int, Gate],
        groups_of_slot: Callable[[int], tuple[int, ...]],
    ) -> None:
        self.call = call
        self.schedule = schedule
        self.inputs = inputs
        self.targets = targets
        self.weights = weights
        self.grad_scale = grad_scale
        self.loss_fn = loss_fn
        self.abort = abort
        self.losses: list[Tensor | None] = [None] * len(inputs)
        self._gates: list[Gate] = []
        self._lock = threading.Lock()
        counts = consumer_counts((a for _, a in schedule.actions()), schedule.plan)
        self._boxes = {key: _Mailbox(self._gate(), n) for key, n in counts.items()}
        self.grad_order: dict[tuple[int, int], tuple[list[Gate], Gate]] = {}
        for rnd in range(schedule.num_rounds):
            for stage in schedule.plan.stages():
                if stage.kind is StageKind.FORWARD:
                    continue
                groups = groups_of_slot(stage.slot)
                done = self._gate()
                waits = [grad_chain[g] for g in groups if g in grad_chain]
                self.grad_order[(rnd, stage.slot)] = (waits, done)
                for g in groups:
                    grad_chain[g] = done

    def _gate(self) -> Gate:
        gate = Gate(self.abort)
        self._gates.append(gate)
        return gate

    def input(self, key: Key) -> Any:
        """The micro-batch itself for ``("act", 0, m)``, which exists before any action runs."""
        return self.inputs[key[2]]

    def put(self, key: Key, value: Any) -> None:
        box = self._boxes.get(key)
        if box is None:  # nobody reads it in this schedule
            return
        box.value = value
        box.gate.set()

    def take(self, key: Key) -> Any:
        """Wait for ``key`` and return its value; the last reader frees it."""
        if key[0] == "act" and key[1] == 0:
            value = self.input(key)
        else:
            box = self._boxes[key]
            box.gate.wait()
            value = box.value
        box = self._boxes.get(key)
        if box is not None:
            with self._lock:
                box.readers -= 1
                if box.readers == 0:
                    box.value = None
        return value

    def open_all_gates(self) -> None:
        """After an abort: wake every thread waiting on this flight."""
        for gate in self._gates:
            gate.set()

    def batch_loss(self) -> Tensor:
        """Sum of the weighted micro-batch losses in micro-batch order: the loss of the whole batch."""
        missing = [m for m, loss in enumerate(self.losses) if loss is None]
        if missing:
            raise RuntimeError(f"internal error: no loss for micro-batches {missing}")
        total = torch.zeros((), dtype=torch.float32)
        for loss in self.losses:
            total = total + loss  # type: ignore[operator]
        return total
