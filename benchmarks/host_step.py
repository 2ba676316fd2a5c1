"""The host optimizer step's parts on this machine's CPU: AdamW's math, the cast into the bf16 compute copy,
and ways to arrange them, for the Qwen3-1.7B shape's groups (one per block, the tied embedding alone).

Asynchronously, one host thread does each update's math and then its casts; at 8 sequences a step of the
issue-39 workload the devices wait for both (docs/perf-notes.md, seventeenth session). This measures what
each part costs and whether they overlap or share the memory bus:

- ``memcpy``: an fp32 copy of every parameter (the bus's read-and-write rate, for scale);
- ``math``: torch's fused AdamW, one group at a time (what ``OptimizerWorker._step_group`` does);
- ``cast``: each group's fp32 master copied into its pinned bf16 compute copy (``HostStore.refresh_group``);
- ``cast-4-threads``: the same cast cut into four slices on four threads;
- ``math-then-cast``: both on one thread, as the optimizer thread does them now;
- ``math-beside-cast``: the math on one thread, each group's cast on a second one as soon as the group's
  math is done;
- ``chunked``: per group, 4 M elements at a time, the math and then the cast of that chunk while it is in
  the last-level cache;
- ``math-then-cast+LOAD`` (CUDA): the same beside what else runs on the host during a training step:
  ``spinners`` (two threads waiting for GPU work through CUDA events, which spin a core each by default),
  ``sleepers`` (the same waits on blocking events, which sleep), ``dma`` (pinned copies up and down the PCIe
  link without pause, each way on its own stream) and ``python`` (a thread running Python, holding the GIL);
- ``device-cast`` (CUDA): the cast done by the GPU instead (fp32 up, cast there, bf16 down into the pinned compute
  copy: the same 6 bytes a parameter through host memory, by the copy engines rather than the cores; the masters
  are page-locked for it, after the measurements above);
  ``math-beside-device-cast``: each group's so, beside the next group's math; ``math-beside-upload``: only the
  fp32 upload beside the math (the GPU keeping the compute copy itself).

In a training step the optimizer thread's math and cast took 0.53 and 0.21 s where this measured 0.34 and
0.12 alone (2026-12-04, seventeenth session): the loads say which neighbour costs what.

Each is the best of ``--repeats`` after one warm-up. On the GPU machine the compute copies and gradients are
page-locked in place, as the engine does (``--pin``).

    python benchmarks/host_step.py --out benchmarks/results/host-step.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pcie import timed  # best wall time after one warm-up

BLOCK = 50_331_648  # one Qwen3-1.7B decoder block's parameters (rounded to a multiple of 2**20)
EMBEDDING = 151_936 * 2048  # the tied embedding and LM head
CHUNK = 4 << 20


class Groups:
    """Flat fp32 masters, gradients, AdamW moments and bf16 compute copies, one per group."""

    def __init__(self, sizes: list[int], pin: str) -> None:
        self.data = [torch.randn(n) * 0.02 for n in sizes]
        self.grad = [torch.randn(n) * 1e-3 for n in sizes]
        self.avg = [torch.zeros(n) for n in sizes]
        self.avg_sq = [torch.zeros(n) for n in sizes]
        self.step = [torch.zeros(()) for _ in sizes]
        self.compute = [torch.empty(n, dtype=torch.bfloat16, pin_memory=pin == "allocated") for n in sizes]
        if pin == "registered":  # as the engine pins them: the compute copies and gradients page-locked in place
            for t in self.compute + self.grad:
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                assert int(err) == 0, f"cudaHostRegister failed with CUDA error {int(err)}"
        params = [torch.nn.Parameter(d) for d in self.data]
        self.optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
        self.params = params

    def math(self, g: int) -> None:
        """One group's step through the optimizer, as the shadow steps it (the other groups have no gradient)."""
        p = self.params[g]
        p.grad = self.grad[g]
        self.optimizer.step()
        p.grad = None

    def cast(self, g: int, lo: int = 0, hi: int | None = None) -> None:
        self.compute[g][lo:hi].copy_(self.data[g][lo:hi])

    def chunked(self, g: int) -> None:
        """The same AdamW arithmetic as the fused kernel, a chunk at a time, each chunk cast at once."""
        self.step[g] += 1
        n = self.data[g].numel()
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            torch._fused_adamw_(
                [self.data[g][lo:hi]], [self.grad[g][lo:hi]], [self.avg[g][lo:hi]], [self.avg_sq[g][lo:hi]], [],
                [self.step[g]], lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                maximize=False,
            )  # fmt: skip
            self.cast(g, lo, hi)


def beside(groups: Groups, order: list[int], then: Callable[[int], None] | None = None) -> None:
    """Math on this thread, each group's cast (or ``then``) on another as soon as its math is done."""
    ready: list[threading.Event] = [threading.Event() for _ in order]
    follow = then or groups.cast

    def casts() -> None:
        for i, g in enumerate(order):
            ready[i].wait()
            follow(g)

    thread = threading.Thread(target=casts)
    thread.start()
    for i, g in enumerate(order):
        groups.math(g)
        ready[i].set()
    thread.join()


class DeviceCast:
    """A group's master through the GPU in 64 MiB chunks, on two streams: up in fp32, cast there, and (``back``)
    the bf16 copy down into the pinned compute copy; without ``back`` only the upload, as if the GPU kept the
    compute copy itself. The host waits on blocking events (asleep, not spinning)."""

    CHUNK = 16 << 20  # elements
    registered = False

    def __init__(self, groups: Groups, back: bool) -> None:
        self.groups, self.back = groups, back
        self.up, self.down = torch.cuda.Stream(), torch.cuda.Stream()
        self.staged = [torch.empty(self.CHUNK, device="cuda") for _ in range(2)]
        self.cast = [torch.empty(self.CHUNK, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        self.free = [torch.cuda.Event(blocking=True) for _ in range(2)]
        for event in self.free:
            event.record(self.up)

    def __call__(self, g: int) -> None:
        if not DeviceCast.registered:  # the masters page-locked for the copy engines (the measurements before: not)
            DeviceCast.registered = True
            for t in self.groups.data:
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
                assert int(err) == 0, f"cudaHostRegister failed with CUDA error {int(err)}"
        data, compute = self.groups.data[g], self.groups.compute[g]
        last = None
        for i, lo in enumerate(range(0, data.numel(), self.CHUNK)):
            hi, k = min(data.numel(), lo + self.CHUNK), i % 2
            n = hi - lo
            self.up.wait_event(self.free[k])
            with torch.cuda.stream(self.up):
                self.staged[k][:n].copy_(data[lo:hi], non_blocking=True)
                self.cast[k][:n].copy_(self.staged[k][:n])
            last = torch.cuda.Event(blocking=True)
            last.record(self.up)
            if self.back:
                self.down.wait_event(last)
                with torch.cuda.stream(self.down):
                    compute[lo:hi].copy_(self.cast[k][:n], non_blocking=True)
                last = torch.cuda.Event(blocking=True)
                last.record(self.down)
            self.free[k] = last
        if last is not None:
            last.synchronize()


def sliced_cast(groups: Groups, order: list[int], threads: int) -> None:
    def part(k: int) -> None:
        for g in order:
            n = groups.data[g].numel()
            groups.cast(g, n * k // threads, n * (k + 1) // threads)

    workers = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


class Load:
    """A neighbour running beside a measurement: threads started on entry (the measurement begins once each is
    under way: buffers allocated once, before), stopped on exit."""

    buffers: tuple[Any, ...] | None = None

    def __init__(self, kind: str) -> None:
        self.kind, self.stop, self.threads, self.running = kind, threading.Event(), [], []

    def __enter__(self) -> Load:
        targets: list[Callable[..., None]] = []
        if self.kind in ("spinners", "sleepers"):
            targets = [self._wait_on_gpu] * 2
        elif self.kind == "dma":
            if Load.buffers is None:
                n = 1 << 28  # 1 GiB of fp32 each way
                Load.buffers = (
                    torch.empty(n, pin_memory=True), torch.empty(n, pin_memory=True),
                    torch.empty(n, device="cuda"), torch.empty(n, device="cuda"),
                )  # fmt: skip
            targets = [self._copies]
        elif self.kind == "python":
            targets = [self._python]
        for target in targets:
            running = threading.Event()
            self.running.append(running)
            self.threads.append(threading.Thread(target=target, args=(running,)))
        for t in self.threads:
            t.start()
        for running in self.running:
            running.wait()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _wait_on_gpu(self, running: threading.Event) -> None:
        blocking = self.kind == "sleepers"
        with torch.cuda.stream(torch.cuda.Stream()):
            while not self.stop.is_set():
                torch.cuda._sleep(50_000_000)  # tens of milliseconds of one GPU thread
                event = torch.cuda.Event(blocking=blocking)
                event.record()
                running.set()
                event.synchronize()

    def _copies(self, running: threading.Event) -> None:
        assert Load.buffers is not None
        up, down, first, second = Load.buffers
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        while not self.stop.is_set():
            with torch.cuda.stream(streams[0]):
                first.copy_(up, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                down.copy_(second, non_blocking=True)
            running.set()
            for stream in streams:
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
                event.synchronize()

    def _python(self, running: threading.Event) -> None:
        count = 0
        running.set()
        while not self.stop.is_set():
            count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=28)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each group's size (a CPU smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--pin", default="registered", choices=("registered", "allocated", "none"),
        help="CUDA: compute copies and gradients page-locked in place as the engine does, or compute copies"
        " allocated pinned (the first run, 2026-12-04), or nothing pinned",
    )  # fmt: skip
    parser.add_argument(
        "--switch-interval", type=float, default=None,
        help="the interpreter's switch interval in seconds (default 0.005): how long a thread that wants the GIL"
        " back may wait for one running Python",
    )  # fmt: skip
    parser.add_argument("--only", default="", help="comma-separated names of the measurements to run (all: empty)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    sizes = [int(EMBEDDING * args.scale)] + [int(BLOCK * args.scale)] * args.blocks
    pin = args.pin if torch.cuda.is_available() else "none"
    start = time.perf_counter()
    groups = Groups(sizes, pin)
    built_s = time.perf_counter() - start
    order = list(range(len(sizes)))[::-1]  # deep groups first, as the optimizer thread updates them
    seen: dict[str, int] = {}
    threading.Thread(target=lambda: seen.update(threads=torch.get_num_threads())).start()
    time.sleep(0.1)
    total = sum(sizes)
    copy_dst = [torch.empty_like(d) for d in groups.data[:4]]
    scale_copy = total / sum(d.numel() for d in copy_dst)

    def memcpy() -> None:
        for dst, src in zip(copy_dst, groups.data[:4]):
            dst.copy_(src)

    runs: dict[str, Callable[[], None]] = {
        "memcpy": memcpy,
        "math": lambda: [groups.math(g) for g in order] and None,
        "cast": lambda: [groups.cast(g) for g in order] and None,
        "cast-4-threads": lambda: sliced_cast(groups, order, 4),
        "math-then-cast": lambda: [groups.math(g) for g in order] and [groups.cast(g) for g in order] and None,
        "math-beside-cast": lambda: beside(groups, order),
        "chunked": lambda: [groups.chunked(g) for g in order] and None,
    }
    both = runs["math-then-cast"]

    def beside_load(kind: str) -> Callable[[], None]:
        def run() -> None:
            with Load(kind):
                both()

        return run

    if torch.cuda.is_available():
        for kind in ("spinners", "sleepers", "dma", "python"):
            runs[f"math-then-cast+{kind}"] = beside_load(kind)
        through_device, up_only = DeviceCast(groups, back=True), DeviceCast(groups, back=False)
        runs["device-cast"] = lambda: [through_device(g) for g in order] and None
        runs["math-beside-device-cast"] = lambda: beside(groups, order, through_device)
        runs["math-beside-upload"] = lambda: beside(groups, order, up_only)
    if args.only:
        runs = {name: runs[name] for name in args.only.split(",")}
    seconds = {name: timed(fn, args.repeats) for name, fn in runs.items()}
    if "memcpy" in seconds:
        seconds["memcpy"] *= scale_copy
    result: dict[str, Any] = {
        "parameters": total,
        "groups": len(sizes),
        "pinned": pin,
        "torch": torch.__version__,
        "threads_main": torch.get_num_threads(),
        "threads_other": seen.get("threads"),
        "switch_interval_s": sys.getswitchinterval(),
        "built_s": built_s,
        "seconds": seconds,
        "gb_per_s": {  # memcpy: read and write; math: param and both moments read and written, gradient read
            name: total * per / seconds[name] / 1e9
            for name, per in (("memcpy", 8), ("math", 28), ("cast", 6))
            if name in seconds
        },
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
