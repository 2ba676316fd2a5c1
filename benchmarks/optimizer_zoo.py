"""Optimizers users bring, through the asynchronous engine, against the staleness-one reference (CPU).

The engine steps a shadow of the user's optimizer on its own thread, group by group, one step stale. For
torch.optim's optimizers that equals one step of all parameters; for others it need not (values kept in the
parameter groups, steps that couple the parameters: ``lightning_roundpipe/runtime/shadow.py``). This trains a small
MLP four steps on one CPU worker with each optimizer that is installed, with its states in host memory and on the
(CPU stand-in) device, and prints each run's distance from the same optimizer stepped by hand one step stale, and
whether the engine steps it group by group (``apart``) or at once. A correctness check, not a timing: the numbers
are the weights' difference after four steps relative to the weights (rounding is about 1e-8).

    python benchmarks/optimizer_zoo.py --out benchmarks/results/optimizer-zoo.json

Third-party optimizers are tried where their packages are installed (``bitsandbytes``, ``lion-pytorch``,
``prodigyopt``, ``schedulefree``, ``pytorch-optimizer``, ``transformers``); the others are listed as skipped.
SOAP's updates move by tens of percent with a 1e-7 change of its gradients (an eigenbasis from a rank-one
outer product), so its distance says nothing about the engine. Without ``lightning_roundpipe.runtime.shadow`` (before
2026-12-07) the ``apart`` column is absent and every optimizer is stepped group by group.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.metadata
import json
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice
from lightning_roundpipe.runtime.updates import UpdateSpec

try:
    from lightning_roundpipe.runtime.shadow import steps_apart
except ImportError:  # an engine before the shadow module: every optimizer stepped group by group
    steps_apart = None

Make = Callable[[Any], torch.optim.Optimizer]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)) for _ in range(steps)]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def reference(model: nn.Module, data: list[Any], make: Make) -> torch.Tensor:
    """Step t's gradient on the weights before update t-1, one ``step()`` of all parameters per step."""
    current, lagged = copy.deepcopy(model), copy.deepcopy(model)
    optimizer = make(current.parameters())
    for x, y in data:
        lagged.zero_grad()
        F.mse_loss(lagged(x), y).backward()
        for p, q in zip(current.parameters(), lagged.parameters()):
            p.grad = q.grad.clone()
        before = copy.deepcopy(current.state_dict())
        optimizer.step()
        lagged.load_state_dict(before)
    return _flat(current)


def engine_run(model: nn.Module, data: list[Any], make: Make, place: str) -> torch.Tensor:
    engine = PipelineEngine(list(model.children()), [WorkerDevice("cpu")], asynchronous=True, optimizer_on=place)
    optimizer = make(model.parameters())
    try:
        for x, y in data:
            engine.train_batch(x, y, F.mse_loss)
            engine.submit_step(UpdateSpec.capture(optimizer))
        engine.flush()
    finally:
        engine.close()
    return _flat(model)


def _schedule_free(p: Any) -> torch.optim.Optimizer:
    optimizer = importlib.import_module("schedulefree").AdamWScheduleFree(p, lr=1e-2)
    optimizer.train()  # its mode, which the user sets before training
    return optimizer


def zoo() -> dict[str, tuple[str, Make]]:
    """name: (package, factory)."""
    po = "pytorch_optimizer"
    return {
        "torch AdamW": ("torch", lambda p: torch.optim.AdamW(p, lr=1e-2)),
        "torch NAdam": ("torch", lambda p: torch.optim.NAdam(p, lr=1e-2)),
        "torch Adafactor": ("torch", lambda p: torch.optim.Adafactor(p, lr=1e-2)),
        "torch Rprop": ("torch", lambda p: torch.optim.Rprop(p, lr=1e-2)),
        "bitsandbytes AdamW8bit": ("bitsandbytes", lambda p: importlib.import_module(
            "bitsandbytes").optim.AdamW8bit(p, lr=1e-2, min_8bit_size=16)),
        "lion-pytorch Lion": ("lion_pytorch", lambda p: importlib.import_module("lion_pytorch").Lion(p, lr=1e-3)),
        "prodigyopt Prodigy": ("prodigyopt", lambda p: importlib.import_module("prodigyopt").Prodigy(p, lr=1.0)),
        "schedulefree AdamWScheduleFree": ("schedulefree", _schedule_free),
        "transformers Adafactor": ("transformers", lambda p: importlib.import_module(
            "transformers.optimization").Adafactor(p, lr=1e-2, relative_step=False, scale_parameter=False)),
        "pytorch_optimizer Lamb": (po, lambda p: importlib.import_module(po).Lamb(p, lr=1e-2)),
        "pytorch_optimizer Adan": (po, lambda p: importlib.import_module(po).Adan(p, lr=1e-2)),
        "pytorch_optimizer AdEMAMix": (po, lambda p: importlib.import_module(po).AdEMAMix(p, lr=1e-2)),
        "pytorch_optimizer CAME": (po, lambda p: importlib.import_module(po).CAME(p, lr=1e-2)),
        "pytorch_optimizer SOAP": (po, lambda p: importlib.import_module(po).SOAP(p, lr=1e-2)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", default="", help="comma-separated names (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, data = _model(), _data(args.steps)
    results = []
    for name, (package, make) in zoo().items():
        if args.only and name not in args.only.split(","):
            continue
        try:
            importlib.import_module(package)
        except ImportError:
            results.append({"optimizer": name, "skipped": f"{package} is not installed"})
            print(f"{name:34s} skipped ({package} is not installed)")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bitsandbytes' notes about its CPU kernels
            want = reference(model, data, make)
            row: dict[str, Any] = {"optimizer": name}
            if steps_apart is not None:
                row["apart"] = steps_apart(make(copy.deepcopy(model).parameters()))
            for place in ("host", "device"):
                try:
                    got = engine_run(copy.deepcopy(model), data, make, place)
                except Exception as error:  # what a user would have met
                    row[place] = row["error"] = f"{type(error).__name__}: {error}"
                else:
                    row[place] = float((got - want).norm() / want.norm())
        results.append(row)
        shown = {p: f"{row[p]:.2e}" if isinstance(row[p], float) else row[p][:60] for p in ("host", "device")}
        print(f"{name:34s} apart={row.get('apart')!s:5s} host {shown['host']} device {shown['device']}")
    if args.out is not None:
        packages = {}
        for package in sorted({package for package, _ in zoo().values()}):
            try:
                packages[package] = importlib.metadata.version(package.replace("_", "-"))
            except importlib.metadata.PackageNotFoundError:
                packages[package] = None
        command = "python benchmarks/optimizer_zoo.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        meta = {"date": time.strftime("%Y-%m-%d"), "command": command, "steps": args.steps, "packages": packages}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
