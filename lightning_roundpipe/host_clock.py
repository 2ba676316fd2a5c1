"""The host optimizer's step against the GPUs': said once where the host is the slower of the two, or, under
``optimizer_on="auto"`` on one GPU whose memory cannot hold every state, a share of them moved there.

With the states on the host the asynchronous optimizer hides the host's step only behind the next step's
compute. Where the batches are short (8 sequences of 256-4096 tokens a step, the 1.7B shape, one H100 capped at
24 GiB, 2026-12-07) AdamW's math takes longer than the devices' step and they wait for it: 18,447 real tokens/s.
Skipping the math of the deepest 35% of the parameters (as if their states were on the GPU) and planning for what
their states would leave ran 21,664. :class:`ShareSwitch` does that for real where the host bounds the step:
the deepest share that brings the host's step under the devices' (at most half of ``gpu_memory``) goes to the GPU,
and is kept only where it runs faster. It is off (:attr:`ShareSwitch.automatic`) until a judgement that holds on a
GPU: the one run so far kept a share that was slower. Where every state fits beside a plan about as fast as the
host's (an 80 GB card), it moves them all instead (:attr:`ShareSwitch.whole`, on).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from statistics import median
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_roundpipe.build import EngineArguments, back_after_edit, build_placed, could_share
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.engine.cache import CacheWatch
from lightning_roundpipe.engine.planner import unchanged
from lightning_roundpipe.runtime.callers import outside_package
from lightning_roundpipe.runtime.placement import AUTO_SHARE, STATES_MOST, deepest_share, resident_bytes, share_for


class HostStepClock:
    """The host optimizer's step time, against the devices' time for one optimizer step of compute.

    When the host's step is the longer one the GPUs wait for it, even with the asynchronous optimizer
    (which hides it only behind the next step's compute): say so once, with both times and what to do.
    Judged on settled steps only: the first allocates the optimizer's states, and the first batches
    compile and measure. Judged on any step, this warned on the H200 of runs whose host step settled at a
    fifth to a half of the devices' (2.39 against 2.26 s, settling at 0.51 for the 1.7B shape; 12.35
    against 6.24, settling at 2.64 for the 8B); then the median of :attr:`window` steps, so that one slow
    step (a compile, the page cache) does not warn either.
    """

    settle = 2
    """Steps not judged at the start."""
    window = 3
    """Steps whose median is judged."""

    def __init__(self) -> None:
        self.host_step_s: float | None = None
        """Seconds of the last measured host optimizer step (its math; casts into compute copies excluded)."""
        self._warned = False
        self._steps = 0
        self._last_step: int | None = None
        self._recent: deque[float] = deque(maxlen=self.window)
        self.on_bound: Callable[[float, float], bool] | None = None
        """Asked first when the host's step is judged the longer, with both times: ``True`` when it acts instead
        of the warning (:meth:`ShareSwitch.offer`)."""

    def restart(self) -> None:
        """A new fit: judged afresh (settling again), warning again; :attr:`on_bound` kept."""
        self._warned, self._steps, self._last_step = False, 0, None
        self._recent.clear()

    @contextlib.contextmanager
    def timing(self, device_step_s: float | None, optimizer: Any) -> Iterator[Callable[[Callable[[], Any]], Any]]:
        """Synchronous mode: time an optimizer step, less the closure it runs (the pipeline's batch)::

        with clock.timing(device_s, optimizer) as timed:
            super().optimizer_step(optimizer, timed(closure), ...)
        """
        inside = [0.0]

        def timed(closure: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                start = time.perf_counter()
                try:
                    return closure()
                finally:
                    inside[0] += time.perf_counter() - start

            return run

        start = time.perf_counter()
        yield timed
        self.record(None, time.perf_counter() - start - inside[0], device_step_s, optimizer)

    def update(self, last: tuple[int, float] | None, device_step_s: float | None, optimizer: Any = None) -> None:
        """Asynchronous mode: the optimizer thread's last update, ``(step, seconds)``, once it has one."""
        if last is not None:
            self.record(*last, device_step_s, optimizer)

    def record(
        self, step: int | None, host_step_s: float | None, device_step_s: float | None, optimizer: Any = None
    ) -> None:
        """A host step's seconds (``step``: its number, so that an update seen again is not counted twice;
        ``None``: a new one each call) against the devices' seconds per optimizer step."""
        if host_step_s is None or (step is not None and step == self._last_step):
            return
        self._last_step, self.host_step_s, self._steps = step, host_step_s, self._steps + 1
        if self._steps <= self.settle:
            return
        self._recent.append(host_step_s)
        if self._warned or device_step_s is None or device_step_s <= 0 or len(self._recent) < self.window:
            return
        host_step_s = median(self._recent)
        if host_step_s <= 1.05 * device_step_s:
            return
        if self.on_bound is not None and self.on_bound(host_step_s, device_step_s):
            self._recent.clear()  # handled (a share of the states to the GPU): judged afresh on the steps after
            return
        self._warned = True
        name = type(getattr(optimizer, "_optimizer", optimizer)).__name__ if optimizer is not None else "the optimizer"
        warnings.warn(
            f"roundpipe: the host optimizer step ({name}) takes {host_step_s:.2f} s, longer than the"
            f" {device_step_s:.2f} s the devices compute per optimizer step, so the GPUs wait for the host"
            " even with the asynchronous optimizer. Use a fused optimizer kernel (torch's Adam, AdamW, SGD or"
            " Adagrad with `fused` and `foreach` unset or fused=True), train fewer parameters (LoRA), or put"
            " more tokens into each optimizer step (a larger batch or accumulate_grad_batches). On one GPU,"
            " RoundPipeStrategy(optimizer_on='device') steps it there where its states fit (the default 'auto'"
            " does so for torch.optim's within half of gpu_memory).",
            stacklevel=outside_package(),
        )


class ShareSwitch:
    """``optimizer_on="auto"``'s states moved, a share of them, to the one GPU where the host's step bounds the step.

    Offered by the clock's judgement (:meth:`offer`, the share from :func:`~lightning_roundpipe.runtime.placement.
    share_for`); before a later training batch, once the running plan's pace is measured (seconds per input
    element, :meth:`CacheWatch.pace`), the engine is built again with that share on the GPU
    (:func:`~lightning_roundpipe.build.build_placed`: no layer measured again, the plan chosen for what the states
    leave). That is a trial: kept where its own pace is :attr:`CacheWatch.gain` faster, else the host again
    (and the clock's warning). Logged either way. An engine built again for another reason (parameters unfrozen,
    a checkpoint loaded mid-run) is the default's again, judged afresh.
    """

    automatic = False
    """Whether ``"auto"`` moves a share by itself. Off: in its one GPU run (one H100 capped at 24 GiB, 8 sequences
    of 256-4096 tokens a step, 2026-12-07) it moved 30% at step 12 and kept it on one window of four batches that ran
    15% faster per token, but steps 13-32 then took 5-19% longer than the host's in another call (16,157 real
    tokens/s against 19,135-19,185; NVML 23.9 GiB, 12 cache releases): the share's smaller plan slowed the long
    batches more than it sped up the short ones, and the one-sided window did not see it (docs/benchmarks.md). Set
    by hand the same day, shares of 0.25-0.35 ran 1.12-1.13x the host in one call at 8 a step, and 0.3 ran 0.65x the
    host at 32 a step (not host-bound)."""

    def __init__(self) -> None:
        self.eligible = False
        self.share: float | None = None
        """The share offered, moved, or kept."""
        self.outcome: dict[str, Any] | None = None
        """Once judged: the share, both paces (seconds per million input elements) and whether it was kept."""
        self.weighed: dict[str, Any] | None = None
        """What it last weighed: the workers' waits for the host against the devices' compute, and where they
        offered a share, the host and device seconds, the share or ``None`` and its states against what may hold
        them (GiB); or every state against the limit and the plan beside them. Why a run moved nothing, which its
        result does not say otherwise."""
        self._times: tuple[float, float] = (0.0, 0.0)
        self._before: float | None = None  # the host's pace, once the share runs
        self._engine: PipelineEngine | None = None  # the engine this switch built (or judged)
        self._done = False
        self._whole: str | None = None  # when every state may move: "first" plan, once its "waits" are measured
        self._clock: HostStepClock | None = None  # the fit's, judged afresh once every state moved
        self._moved: PipelineEngine | None = None  # the engine built with every state on the GPU, while it runs

    def watch(self, eligible: bool, clock: HostStepClock | None = None) -> None:
        """At setup, or on an engine built again elsewhere: whether it may move a share
        (:func:`~lightning_roundpipe.build.could_share`); ``clock``: a new fit's, judged afresh."""
        self.eligible = eligible and self.automatic
        self.share, self._before, self._engine, self._done = None, None, None, False
        self._whole, self._moved = "first" if eligible and self.whole else None, None
        if clock is not None:
            self.outcome, self._clock = None, clock
            clock.restart()

    def offer(self, engine: PipelineEngine, host_s: float, device_s: float) -> bool:
        """The host's step (``host_s``) judged longer than the devices' (``device_s``): whether a share moves."""
        if not self.eligible or self._done or self.share is not None:
            return self.share is not None and not self._done
        ceiling = engine.caches.ceiling
        share = share_for(engine.store, ceiling, host_s, device_s)
        held = 0
        if share is not None and ceiling is not None:  # (whole groups: at least the deepest one)
            held = resident_bytes(engine.store, groups=deepest_share(engine.store, share))
            share = share if held <= AUTO_SHARE * ceiling else None
        self.share, self._times = share, (host_s, device_s)
        self.weighed = {
            "host_s": host_s, "device_s": device_s, "share": share, "held_gib": held / 2**30,
            "may_hold_gib": None if ceiling is None else AUTO_SHARE * ceiling / 2**30,
        }  # fmt: skip
        return share is not None

    def _offer_on_waits(self, engine: PipelineEngine) -> None:
        """The host's step bounds the step where the workers wait for its updates (their reads and casts) more
        than :attr:`waited` of the devices' compute per batch, though its math alone may be the shorter: on one H100
        capped at 24 GiB (8 sequences a step, 2026-12-07) AdamW's math took 0.51 s, under the GPU's compute, and the
        worker still waited 0.34 s a batch for the casts and the updated weights. The clock never judged it."""
        waits, device = engine.worker_waits, engine.stats.compute_s
        waited = waits.get("update reads", 0.0) + waits.get("casts", 0.0)
        weighed = {"waited_s": waited, "compute_s": device, "share": None}
        if device and waited > self.waited * device:
            self.offer(engine, device + waited, device)
            weighed.update(self.weighed or {})
        self.weighed = weighed

    waited = 0.15
    """The workers' waits for the host's updates, of the devices' compute per batch (for the whole move, of a
    batch's wall time less those waits), that say the host bounds."""
    stretch_most = 3.0
    """The most a batch's wall time is taken to exceed what it would take without the host's waits: the waits are
    summed over a batch's stages, and batches in flight overlap, so they can pass the wall time without the host
    taking all of it; a plan beside every state simulated more than this times the running one's is never moved to
    on the waits."""

    whole = True
    """Whether ``"auto"`` moves every state to the GPU where a plan fits beside them that is about as fast at the first
    plan (:meth:`_fits_whole`), or than the host's plan as it runs once that plan settled (:meth:`_fits_waited`),
    not only where they take at most half of ``gpu_memory``. On one H100 80GB (8 sequences of 256-4096 tokens a
    step, 2026-12-07) the 32 GiB of states were just over half of its 63.3 GiB and the host bounded the step: 22,203
    real tokens/s, every state on the GPU by hand 33,349. The plan beside them simulated 1.2x the running one's
    seconds, so the first weighing declined; the workers waited 0.45 s a batch for the host, so the second moved
    them at step 12, in an 11 s step, and steps 17-24 ran 33,477 against 20,827 with the switch off, in one call
    (that run's second weighing stretched the devices' busy seconds, since a batch's wall time: not yet measured on
    a GPU). Fixed 32 x 2048 on the same card: no waits, nothing moved (48,113 and 47,913)."""
    intervals = 2
    """Intervals between dispatches on the settled first plan that the second weighing takes a batch's wall time
    over: fewer than the pace's window (:attr:`CacheWatch.window`), so that the move comes two batches sooner (step
    12 with the window on one H100 80GB, 2026-12-07); a stretch that passes the bar by far (about 2.3 expected
    there, 1.15 needed) does not need a longer mean."""
    as_fast = 1.05
    """The simulated seconds per batch, of the running plan's, within which the plan beside every state is as fast."""

    def _fits_whole(self, engine: PipelineEngine, stretch: float = 1.0) -> bool:
        """Whether a plan about as fast as the running one (the same plan and count, or simulated seconds per batch
        within :attr:`as_fast` of the running plan's times ``stretch``, both simulated now) fits in what every state
        leaves of the planner's limit, the states within :data:`STATES_MOST` of it: then the host's step, its casts
        and the uploads of the weights leave the step and nothing is slower. ``stretch``: how much longer the
        running plan's batches take than its compute, measured (the workers' waits for the host). The planner is
        left as it was; recorded in :attr:`weighed`."""
        planner, store = engine.planner, engine.store
        limit, states = planner.memory_limit, resident_bytes(engine.store)
        self.weighed = {
            "whole_gib": states / 2**30,
            "limit_gib": limit and limit / 2**30,
            "beside": None,
            "as_fast": False,
        }
        if limit is None or states >= STATES_MOST * limit:
            return False
        with unchanged(planner):
            here = planner.plan_for_memory(store, limit)
            running = (here, planner.microbatches_per_round, min(planner.candidate_periods.values(), default=None))
            beside = planner.plan_for_memory(store, limit - states)
            period = min(planner.candidate_periods.values(), default=None)
            same = beside is not None and (beside, planner.microbatches_per_round) == running[:2]
            fast = beside is not None and planner.chooses_microbatches and None not in (period, running[2])
            fast = fast and period <= self.as_fast * stretch * running[2]  # (a count given: no periods simulated)
        self.weighed.update(beside=None if beside is None else str(beside), as_fast=same or fast)
        if beside is not None and period is not None and running[2]:
            self.weighed["simulated"] = period / running[2]  # the plan beside them, of the running plan's period
        return same or fast

    def _fits_waited(self, engine: PipelineEngine) -> bool:
        """Once the first plan settled with every state on the host: whether the plan beside them is about as fast
        (within :attr:`as_fast`) as the running one as it runs, its batches stretched by the workers' waits for the
        host's updates (their reads and casts): a batch's wall time (:meth:`CacheWatch.interval`) against that time
        less those waits (at most :attr:`stretch_most`), where they are over :attr:`waited` of the rest. On one H100
        80GB (8 sequences of 256-4096 tokens a step, 2026-12-07) the plan beside every state simulated 1.2x the
        running one's seconds, the workers waited about 0.45 s of 0.8 s a batch for the host, and every state on the
        GPU ran 33,477 real tokens/s against the host's 20,827. Those runs stretched the devices' busy seconds by the
        waits instead (2.5 s a batch, the kernels' events spanning the weights' uploads; the move passed by 1.18
        against 1.20 / 1.05); this stretch (about 2.3 there) is not yet measured on a GPU. With gradient accumulation
        the median batch does not wait for the host (only a step's first does): it errs toward the host."""
        waited = sum(engine.worker_waits.get(reason, 0.0) for reason in ("update reads", "casts"))
        period = engine.caches.interval(self.intervals)
        self.weighed = {**(self.weighed or {}), "waited_s": waited, "period_s": period, "as_fast": False}
        if not period or waited <= self.waited * max(0.0, period - waited):
            return False
        stretch = self.stretch_most if waited >= period else min(self.stretch_most, period / (period - waited))
        weighed = self.weighed
        fits = self._fits_whole(engine, stretch=stretch)
        self.weighed = {**weighed, **self.weighed, "stretch": stretch}
        return fits

    def _move_whole(
        self, strategy: Any, engine: PipelineEngine, engine_arguments: Callable[[], EngineArguments]
    ) -> bool:
        """Every state to the GPU before the first step on the first plan, where they fit beside a plan about as
        fast, or else once that plan settled, where the plan beside them is about as fast as it runs with the host's
        waits (:meth:`_fits_waited`); back to the host, once, where a batch then ran out of device memory beside them
        (the plan was made for the lengths seen so far). Whether the engine was built again."""
        if not engine.steps.between_steps():
            return False
        if self._whole == "first" and engine.planner.fitted is not None and engine.planner.profile is None:
            fits, self._engine = self._fits_whole(engine), engine  # before the first step on the first plan
            beside = self.weighed is not None and self.weighed["beside"] is not None  # (then periods compared)
            self._whole = "waits" if not fits and beside and engine.planner.chooses_microbatches else None
        elif self._whole == "waits" and engine.caches.interval(self.intervals) is not None:
            self._whole, fits = None, self._fits_waited(engine)  # settled on its plan: the host's waits measured
        else:
            fits = False
        seconds: dict[str, float] = {}
        if fits and (again := build_placed(engine, engine_arguments(), "device", seconds)) is not None:
            self._done, self._engine = True, _install(strategy, again)
            self._moved, self.outcome = again, {"share": 1.0, "kept": True, "judged": False, "seconds": seconds}
            if self._clock is not None:
                self._clock.restart()  # (its window held the host's steps)
            rank_zero_info(
                "roundpipe: every optimizer state moved to the GPU (optimizer_on='auto'): a plan"
                + (" faster than the host's" if "stretch" in (self.weighed or {}) else " about as fast as the first")
                + " fits beside them"
            )
            return True
        if engine is self._moved and engine.recovery.recovered:
            self._moved = None
            if (back := build_placed(engine, engine_arguments(), "host")) is not None:
                self._engine, self.outcome = _install(strategy, back), {"share": 1.0, "kept": False, "judged": False}
                if self._clock is not None:
                    self._clock.restart()
                warnings.warn(
                    "roundpipe: a batch ran out of device memory beside every optimizer state, which optimizer_on="
                    "'auto' had moved to the GPU for the lengths seen by its first plan: they are back on the host",
                    stacklevel=outside_package(),
                )
                return True
        return False

    def apply(self, strategy: Any, engine_arguments: Callable[[], EngineArguments]) -> None:
        """Before a training batch: the offered share moved, or the moved one judged, where it is time
        (``engine_arguments``: asked for only then)."""
        engine = strategy.engine
        if self._engine is not None and engine is not self._engine:  # built again elsewhere: the default's again
            self.watch(could_share(engine, engine_arguments()))
        if (back := back_after_edit(engine, engine_arguments)) is not None:  # "auto"'s states to the host, for good:
            strategy.options = replace(strategy.options, optimizer_on="host")  # (engines built later too)
            self._engine, self._done, self._whole, self._moved = _install(strategy, back), True, None, None
            self.outcome = {"share": 0.0, "kept": True, "judged": False, "edited": True}
            return
        if self._move_whole(strategy, engine, engine_arguments):
            return
        if not self.eligible or self._done or not engine.steps.between_steps():
            return
        if strategy.lightning_module.trainer.accumulate_grad_batches > CacheWatch.window:
            self._done = True  # the pace's window of batches would miss the step's wait for the host
            return
        pace = engine.caches.pace()
        if pace is None:  # measured first: the plan settled, a window of batches on it, no trial running
            return
        if self.share is None:
            self._offer_on_waits(engine)
            if self.share is None:
                return
        arguments = engine_arguments()
        if self._before is None:
            again = build_placed(engine, arguments, self.share)
            host, device = self._times
            if again is None:
                self._done = True
                rank_zero_info(f"roundpipe: no plan fits beside {self.share:.0%} of the optimizer's states on the GPU")
                return
            self._before, self._engine = pace, _install(strategy, again)
            rank_zero_info(
                f"roundpipe: the host optimizer step ({host:.2f} s) is longer than the {device:.2f} s the GPU computes"
                f" per step: the optimizer's states of the deepest {self.share:.0%} of the parameters moved to the"
                " GPU (optimizer_on='auto'), kept if the steps run faster"
            )
            return
        self._done, kept = True, pace <= (1 - CacheWatch.gain) * self._before
        self.outcome = {"share": self.share, "host_s": self._before * 1e6, "share_s": pace * 1e6, "kept": kept}
        if not kept and (again := build_placed(engine, arguments, "host")) is not None:
            self._engine = _install(strategy, again)
        rank_zero_info(
            f"roundpipe: with {self.share:.0%} of the optimizer's states on the GPU the steps took"
            f" {pace * 1e6:.3g} s per million tokens against the host's {self._before * 1e6:.3g}:"
            + (" kept" if kept else " the host again")
        )


def _install(strategy: Any, engine: PipelineEngine) -> PipelineEngine:
    strategy.engine = strategy._calls.engine = engine
    strategy._nodes.join(engine, engine.asynchronous)
    return engine
