"""Measured costs: per-layer times and memory from recorded batches, per-worker busy time, stage times.

A batch runs with ``flight.record`` set: each worker notes, for every compute action, timer points
before its forward, after its forward (and loss), after its backward, and the activation bytes
autograd saved. Under the profiling plan (one layer per stage) each action is one layer, so its
times are that layer's; under any plan they give stage times and each worker's busy time.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean, median
from typing import Any

from lightning_roundpipe.runtime.device import WorkerDevice
from lightning_roundpipe.runtime.flight import Flight
from lightning_roundpipe.runtime.host_store import HostStore
from lightning_roundpipe.schedule.actions import Action
from lightning_roundpipe.schedule.partition import LayerCosts
from lightning_roundpipe.schedule.partition import stage_times as stage_times_of_plan
from lightning_roundpipe.schedule.plan import StagePlan


def records_complete(flight: Flight) -> bool:
    """Whether every timer point of the flight has been reached (device events complete)."""
    for records in flight.records.values():
        if records:
            end = records[-1][3]
            if not isinstance(end, tuple) and not end.query():
                return False
    return True


def timeline(flight: Flight) -> list[tuple[int, str, float, float]]:
    """(worker, action, start, end) of a recorded batch, seconds from its first worker's start. Workers
    are aligned by the host time their job started: exact on CPU, approximate across GPUs."""
    origin = min(host for _, host in flight.references.values())
    out = []
    for worker, records in flight.records.items():
        reference, host = flight.references[worker]
        offset = host - origin
        for action, start, _, end, _ in records:
            begin = offset + WorkerDevice.since(reference, start)
            out.append((worker, str(action), begin, begin + WorkerDevice.elapsed(start, end)))
    return sorted(out, key=lambda row: (row[0], row[2]))


def idle_gaps(rows: list[tuple[int, str, float, float]]) -> dict[str, dict[str, float]]:
    """Where a worker's device sat idle inside a recorded batch (rows as from :func:`timeline`): the
    gaps between its consecutive compute actions, summed by what came next: ``"same stage"`` (the next
    micro-batch of the slot just run: its input or the host issuing it was late) or ``"next stage"``
    (the first micro-batch of another slot: its weights, its input, or the switch itself), and the
    kind of action (``"next stage, backward"``). Each entry holds ``seconds``, ``count`` and the
    ``largest`` gap. An action's time starts after its waits, so the gaps hold every wait of the
    compute stream."""
    out: dict[str, dict[str, float]] = {}
    last: dict[int, tuple[str, float]] = {}
    for worker, text, start, end in sorted(rows, key=lambda row: (row[0], row[2])):
        action = Action.parse(text)
        slot = f"{action.round}:{action.slot}"
        if worker in last:
            previous_slot, previous_end = last[worker]
            kind = ("same stage" if slot == previous_slot else "next stage") + f", {action.op.name.lower()}"
            gap = max(0.0, start - previous_end)
            entry = out.setdefault(kind, {"seconds": 0.0, "count": 0, "largest": 0.0})
            entry["seconds"] += gap
            entry["count"] += 1
            entry["largest"] = max(entry["largest"], gap)
        last[worker] = (slot, end)
    return out


def stage_times(flight: Flight) -> dict[int, list[float]]:
    """Per slot, the compute time of each of its micro-batches (seconds)."""
    out: dict[int, list[float]] = defaultdict(list)
    for records in flight.records.values():
        for action, start, _, end, _ in records:
            out[action.slot].append(WorkerDevice.elapsed(start, end))
    return out


def stage_times_at(
    flight: Flight, store: HostStore, plan: StagePlan, profile: LayerProfile | None, planned: LayerCosts | None,
    elements: float,
) -> dict[int, list[float]]:  # fmt: skip
    """A recorded batch's stage times, each micro-batch's as if it held the ``elements`` input elements the
    plan's costs (``planned``, from ``profile``) are for: scaled by the measured costs' stage times at the two
    sizes (a fixed cost per micro-batch included). Batches of other lengths (a language model's, padded per
    batch and cut by tokens) are then no drift; compared as they were, every check on a longer batch looked
    like a slowdown and measured the layers again."""
    times, sizes = stage_times(flight), flight.microbatch_elements
    if profile is None or planned is None or not elements or not sizes:
        return times
    if all(abs(n - elements) <= 0.01 * elements for n in sizes):
        return times
    target, predicted = stage_times_of_plan(planned, plan), {}
    scaled: dict[int, list[float]] = {slot: [] for slot in times}
    for records in flight.records.values():
        for action, start, _, end, _ in records:
            n = sizes[action.microbatch]
            if n not in predicted:
                predicted[n] = stage_times_of_plan(profile.costs(store, n), plan)
            at = predicted[n][action.slot]
            scaled[action.slot].append(WorkerDevice.elapsed(start, end) * (target[action.slot] / at if at > 0 else 1.0))
    return scaled


def microbatch_sizes(flight: Flight) -> list[float]:
    """Each micro-batch's size in the unit costs are measured in: its input elements (tokens, for a language
    model; micro-batches cut by tokens differ), or its share of the samples where the flight has no sizes."""
    count = len(flight.targets)
    if len(flight.microbatch_elements) == count:
        return [float(n) for n in flight.microbatch_elements]
    return [flight.samples / max(1, count)] * count


def busy_seconds(flight: Flight) -> dict[int, float]:
    """Per worker, seconds its device spent computing this batch."""
    return {
        worker: sum(WorkerDevice.elapsed(start, end) for _, start, _, end, _ in records)
        for worker, records in flight.records.items()
    }


class LayerProfile:
    """Per-layer samples gathered under the profiling plan (one layer per stage), by micro-batch size in
    input elements (tokens, for a language model: :func:`microbatch_sizes`).

    The batches measuring the layers may run at two micro-batch sizes (the engine halves the second's
    when it chooses the micro-batch count itself), and a language model's micro-batches cut by tokens each
    have a size of their own: per layer, time and memory are fitted as ``a + b * elements`` through the
    sizes measured (:func:`_at`), which :meth:`costs` evaluates at any size. A fixed cost per micro-batch
    (kernel launches, the host issuing a stage's work, small matrices running below the device's rate) is
    what makes many small micro-batches slower than their share; with one size measured, costs scale in
    proportion to the elements.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.samples: dict[str, dict[tuple[int, float], list[float]]] = {
            kind: defaultdict(list)
            for kind in ("forward", "recompute", "backward", "activations", "forward_peaks", "backward_transients")
        }
        self._first: dict[str, dict[tuple[int, float], list[float]]] = {
            kind: defaultdict(list) for kind in ("forward_peaks", "backward_transients")
        }
        """Memory peaks of the first batch's first micro-batch (they carry the run's one-off allocations)."""
        self.sizes: set[float] = set()
        """Input elements of the micro-batches measured."""
        self.batches = 0

    @staticmethod
    def plan(num_layers: int) -> StagePlan:
        return StagePlan.uniform(num_layers, forward_size=1, backward_size=1)

    def add(self, flight: Flight) -> None:
        stages = flight.schedule.plan.stages()
        sizes = microbatch_sizes(flight)
        self.sizes.update(sizes)
        for records in flight.records.values():
            for action, start, mid, end, saved in records:
                layer = (stages[action.slot].start, sizes[action.microbatch])
                if mid is None:
                    self.samples["forward"][layer].append(WorkerDevice.elapsed(start, end))
                else:
                    self.samples["recompute"][layer].append(WorkerDevice.elapsed(start, mid))
                    self.samples["backward"][layer].append(WorkerDevice.elapsed(mid, end))
                    self.samples["activations"][layer].append(saved)
        for action, nbytes in flight.memory:
            layer = (stages[action.slot].start, sizes[action.microbatch])
            kind = "forward_peaks" if action.op.value == "F" else "backward_transients"
            # a run's first micro-batch allocates one-offs (the matrix library's workspace): kept aside
            # for :meth:`costs` to leave out where it scales to much larger samples
            first = self.batches == 0 and action.microbatch == 0
            (self._first if first else self.samples)[kind][layer].append(nbytes)
        self.batches += 1

    def costs(self, store: HostStore, elements: float | None = None, one_offs: bool = True) -> LayerCosts:
        """Costs of one micro-batch of ``elements`` input elements (``None``: the largest size measured). Times
        are medians (the first micro-batches of a run carry one-offs); memory the largest seen at a size and,
        fitted over several sizes, above every one (a limit must hold for every micro-batch), 0 where not
        measured; the last layer's forward is its recompute (it only runs in the fused stage, where forward
        and recompute are one). ``one_offs=False`` leaves out the first micro-batch's peaks where others were
        measured: they hold the run's one-off allocations (the matrix library's workspace, seen on an H200),
        which the fit would otherwise scale with the elements; for costs far beyond the measured sizes."""
        sizes = sorted(self.sizes)
        at = sizes[-1] if elements is None else elements

        def fitted(kind: str, layer: int, pick: Any, bound: bool = False) -> float:
            points = [(s, pick(v)) for s in sizes if (v := self._of(kind, (layer, s), one_offs))]
            return _at(points, at, bound)

        def time(kind: str, layer: int) -> float:
            return fitted(kind, layer, median)

        forward = [
            time("forward", i) if self._has("forward", i) else time("recompute", i) for i in range(self.num_layers)
        ]
        backward = [time("recompute", i) + time("backward", i) for i in range(self.num_layers)]
        params, grads = layer_bytes(store)
        acts = [int(fitted("activations", i, fmean, True)) for i in range(self.num_layers)]
        forward_peaks = [int(fitted("forward_peaks", i, max, True)) for i in range(self.num_layers)]
        transients = [int(fitted("backward_transients", i, max, True)) for i in range(self.num_layers)]
        return LayerCosts(
            tuple(forward), tuple(backward), tuple(params), tuple(grads), tuple(forward_peaks), tuple(acts),
            tuple(transients),
        )  # fmt: skip

    def state(self) -> dict[str, Any]:
        """The measurements as plain lists, for a checkpoint: a resumed run plans again from the same ones
        (after running out of memory, or when the allocator keeps freeing) instead of not at all."""

        def rows(table: dict[str, dict[tuple[int, float], list[float]]]) -> dict[str, list[list[Any]]]:
            return {
                kind: [[layer, size, list(v)] for (layer, size), v in by.items() if v] for kind, by in table.items()
            }

        return {"num_layers": self.num_layers, "samples": rows(self.samples), "first": rows(self._first),
                "sizes": sorted(self.sizes), "batches": self.batches}  # fmt: skip

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LayerProfile:
        profile = cls(int(state["num_layers"]))
        for table, saved in ((profile.samples, state["samples"]), (profile._first, state["first"])):
            for kind, rows in saved.items():
                for layer, size, values in rows:
                    table[kind][(int(layer), float(size))] = [float(v) for v in values]
        profile.sizes, profile.batches = {float(s) for s in state["sizes"]}, int(state["batches"])
        return profile

    def _of(self, kind: str, key: tuple[int, float], one_offs: bool) -> list[float]:
        """A layer's samples at one size; for memory peaks, with the first micro-batch's (``one_offs``, or
        when it has no other)."""
        first = self._first[kind][key] if kind in self._first else []
        return self.samples[kind][key] + first if one_offs or not self.samples[kind][key] else self.samples[kind][key]

    def _has(self, kind: str, layer: int) -> bool:
        return any(self.samples[kind][(layer, s)] for s in self.sizes)


class TransferRate:
    """What a stage boundary's round trip through the host costs at any micro-batch size: a boundary's
    bytes per input element and the upload rate of the first slot's weights, both from recorded batches."""

    def __init__(self) -> None:
        self.boundary_per_element = 0.0
        self.upload_rate = 0.0
        """Bytes per second host to device (0: not measured; CPU workers copy nothing)."""

    def measure(self, flight: Flight) -> None:
        if flight.boundary_bytes and flight.samples:  # the widest boundary: the largest micro-batch's
            self.boundary_per_element = flight.boundary_bytes / max(microbatch_sizes(flight))
        if len(flight.first_upload) == 2:
            self.timed(flight.first_upload_bytes, WorkerDevice.elapsed(*flight.first_upload))

    def timed(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` went up in ``seconds`` (the first slot's weights; with the optimizer on the device, which
        uploads none of them, its compute copies as it takes them from the host)."""
        if seconds > 0 and nbytes > 1 << 24:  # a transfer long enough to time
            self.upload_rate = nbytes / seconds

    def round_trip(self, elements: float) -> float:
        """Seconds one micro-batch's boundary of ``elements`` input elements takes down to the host and back
        up (0 when the device's transfers were not measured)."""
        if not self.upload_rate:
            return 0.0
        return 2 * self.boundary_per_element * elements / self.upload_rate


def _at(points: list[tuple[float, float]], size: float, bound: bool = False) -> float:
    """The line ``a + b * size`` (``a``, ``b`` at least 0) through the measured ``(size, value)`` points: through
    the two when there are two, fitted by least squares when there are more (micro-batches cut by tokens each
    have their own size), then raised by the largest point above it where ``bound`` (memory: a limit holds for
    every micro-batch); in proportion to the largest size's value for one size, or where a noisy point bent
    the line; 0 without points."""
    if not points:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(points) > 2:
        mx, my = fmean(xs), fmean(ys)
        spread = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in points) / spread if spread > 0 else -1.0
    else:
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if xs[-1] > xs[0] else -1.0
        mx, my = xs[0], ys[0]
    intercept = my - slope * mx
    if slope >= 0 and intercept >= 0:
        return intercept + slope * size + (max(y - intercept - slope * x for x, y in points) if bound else 0.0)
    if len(points) > 2 and xs[-1] > 0:  # proportional: the ratio of the sums, or the largest ratio for a bound
        ratio = max(y / x for x, y in points if x > 0) if bound else sum(ys) / max(sum(xs), 1e-30)
        return ratio * size
    return ys[-1] * size / xs[-1] if xs[-1] > 0 else ys[-1]


def layer_bytes(store: HostStore) -> tuple[list[int], list[int]]:
    """Per layer, bytes of the compute copies it uploads and of the gradients it produces on a device."""
    params, grads = [0] * store.num_layers, [0] * store.num_layers
    for group in store.groups:
        nbytes = group.compute.numel() * group.compute.element_size()
        params[group.layer] += nbytes
        if group.trainable:
            grads[group.layer] += nbytes
    return params, grads


def drift(measured: dict[int, list[float]], reference: list[float]) -> float:
    """How far measured stage times (the median over micro-batches) moved from the reference, relative
    to the slowest reference stage (so noise in tiny stages does not count, a stage becoming a
    bottleneck does)."""
    scale = max(reference) if reference else 0.0
    if scale <= 0:
        return 0.0
    return max(
        (abs(median(measured[slot]) - want) / scale for slot, want in enumerate(reference) if measured.get(slot)),
        default=0.0,
    )
