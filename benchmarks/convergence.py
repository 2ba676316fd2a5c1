"""Asynchronous vs synchronous optimizer: loss curves on the addition task of ``examples/train_addition.py``.

Same seed, same data order, same model; only ``RoundPipeStrategy(async_optimizer=...)`` differs. With
``--pretrain-steps N`` both runs start from the same weights after N synchronous steps (a
fine-tuning setting: a trained model, a fresh optimizer, a smaller LR); without, both train from
scratch. Prints the mean loss over the last tenth of the compared steps and their relative
difference; writes the curves as JSON and, when matplotlib is installed, as a PNG.

    python benchmarks/convergence.py --pretrain-steps 300 --steps 300 --lr 1e-3 --out benchmarks/results/convergence
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_addition import Addition, AdditionModel

import lightning_roundpipe


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def train(
    async_optimizer: bool,
    steps: int,
    devices: int,
    batch_size: int,
    lr: float,
    start: dict | None = None,
    seed: int = 0,
) -> tuple[list[float], dict]:
    """Train ``steps`` steps (from ``start`` weights if given); returns the losses and the final weights."""
    L.seed_everything(seed, verbose=False)
    data = torch.utils.data.DataLoader(Addition(steps * batch_size, seed=seed), batch_size=batch_size, shuffle=True)
    losses = Losses()
    model = AdditionModel(lr=lr)
    if start is not None:
        model.load_state_dict(start)
    strategy = lightning_roundpipe.RoundPipeStrategy(async_optimizer=async_optimizer)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )  # fmt: skip
    trainer.fit(model, data)
    return losses.values, {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--pretrain-steps", type=int, default=0, help="synchronous steps both runs start from")
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--out", default=None, help="path prefix for .json and .png")
    args = p.parse_args()

    start_weights = None
    if args.pretrain_steps:
        _, start_weights = train(False, args.pretrain_steps, args.devices, args.batch_size, args.pretrain_lr)
    curves = {}
    for mode in (False, True):
        t0 = time.perf_counter()
        curves["async" if mode else "sync"], _ = train(
            mode, args.steps, args.devices, args.batch_size, args.lr, start_weights, seed=1 if start_weights else 0
        )
        print(f"{'async' if mode else 'sync'}: {time.perf_counter() - t0:.1f} s", flush=True)
    k = max(1, args.steps // 10)
    tail = {name: sum(v[-k:]) / k for name, v in curves.items()}
    diff = abs(tail["async"] - tail["sync"]) / tail["sync"]
    print(f"mean loss over the last {k} steps: sync {tail['sync']:.4f}, async {tail['async']:.4f}, "
          f"relative difference {100 * diff:.2f}%")  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/convergence.py " + " ".join(sys.argv[1:]),
        }
        summary = {"tail_steps": k, "tail_mean": tail, "relative_difference": diff}
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "curves": curves}))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, values in curves.items():
            smooth = [
                sum(values[max(0, i - 9) : i + 1]) / len(values[max(0, i - 9) : i + 1]) for i in range(len(values))
            ]
            ax.plot(smooth, label=f"{name} (last {k}: {tail[name]:.3f})")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (10-step mean)")
        setting = f"fine-tuning after {args.pretrain_steps} sync steps" if args.pretrain_steps else "from scratch"
        ax.set_title(f"async vs sync optimizer, {setting}, lr {args.lr:g}\n{100 * diff:.2f}% apart at the end")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
