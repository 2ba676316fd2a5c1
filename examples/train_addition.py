"""Train a tiny causal transformer to add numbers, with ``Trainer(strategy="roundpipe")``.

The data is generated (``"417+85=502"``, the loss counts only the answer's characters), the model is
an ``nn.Sequential`` of embedding, transformer blocks and head, and ``training_step`` returns
``lightning_roundpipe.pipeline_loss``. The same module trains unchanged with ``--strategy auto``.

    python examples/train_addition.py                       # 2 CPU workers, about a minute
    python examples/train_addition.py --devices 3 --steps 100
"""

from __future__ import annotations

import argparse
import math
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_roundpipe

VOCAB = "0123456789+=."  # '.' ends the answer and pads
PAD = VOCAB.index(".")
IGNORE = -100


class Addition(Dataset):
    """``a+b=c.`` with a, b below 10**digits; the label is the next character, answer positions only."""

    def __init__(self, size: int, digits: int = 2, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pairs = torch.randint(0, 10**digits, (size, 2), generator=g)
        self.length = 2 * digits + 2 + digits + 2

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.pairs[i].tolist()
        prompt, answer = f"{a}+{b}=", f"{a + b}."
        ids = [VOCAB.index(c) for c in prompt + answer]
        ids += [PAD] * (self.length - len(ids))
        tokens = torch.tensor(ids)
        labels = torch.full_like(tokens, IGNORE)
        start = len(prompt) - 1  # predicting the first answer character from '='
        labels[start : start + len(answer)] = tokens[start + 1 : start + 1 + len(answer)]
        return tokens, labels


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, length: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)


def counted_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE).sum()


class AdditionModel(L.LightningModule):
    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, length: int = 10, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            Embed(len(VOCAB), dim, length), *(Block(dim, heads) for _ in range(depth)), Head(dim, len(VOCAB))
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        loss = lightning_roundpipe.pipeline_loss(self.model, tokens, labels, token_loss, reduction=counted_tokens)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        steps = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LossReport(L.Callback):
    """Prints the mean loss of the first and last tenth of training."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        k = max(1, len(self.losses) // 10)
        first, last = sum(self.losses[:k]) / k, sum(self.losses[-k:]) / k
        print(f"loss fell from {first:.3f} (first {k} steps) to {last:.3f} (last {k} steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="roundpipe")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--num-microbatches", type=int, default=None, help="micro-batches per round")
    parser.add_argument("--plan", default=None, help="stage plan, e.g. '2,2|1,1,1,1,2' for 6 layers")
    args = parser.parse_args()

    L.seed_everything(0)
    strategy = args.strategy
    if strategy == "roundpipe":
        strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=args.num_microbatches, plan=args.plan)
    data = DataLoader(Addition(args.steps * args.batch_size), batch_size=args.batch_size, shuffle=True)
    report = LossReport()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices if args.strategy == "roundpipe" else 1,
        precision=args.precision,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        callbacks=[report],
        log_every_n_steps=10,
    )
    start = time.perf_counter()
    trainer.fit(AdditionModel(), data)
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s with strategy={args.strategy!r}")


if __name__ == "__main__":
    main()
