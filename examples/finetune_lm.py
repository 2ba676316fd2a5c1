"""Fine-tune a causal language model on real text with ``Trainer(strategy="roundpipe")``, from LightningCLI.

The default: a small byte-level transformer (an ``nn.Sequential`` trained through ``pipeline_loss``)
on the Python docstrings shipped in ``examples/data/``, 2 CPU workers, validation perplexity through
torchmetrics, a CSV log with the ``RoundPipeMonitor`` numbers, and a checkpoint. Every setting is in
``examples/finetune_lm.yaml``; override any of them on the command line::

    python examples/finetune_lm.py fit --config examples/finetune_lm.yaml
    python examples/finetune_lm.py fit --config examples/finetune_lm.yaml --trainer.max_steps 50

A Hugging Face model (a local directory, or a hub name already in the local cache) takes its own
tokenizer; pass GPUs for real use::

    python examples/finetune_lm.py fit --config examples/finetune_lm.yaml \\
        --model.hf_model /path/to/Qwen3-1.7B --data.tokenizer /path/to/Qwen3-1.7B \\
        --trainer.accelerator gpu --trainer.devices 1 --trainer.precision bf16-mixed --data.seq_len 2048

Resume from the last checkpoint with ``--ckpt_path last``. Needs ``pip install -e ".[examples]"``
(LightningCLI's argument parser; add ``[hf]`` for Hugging Face models).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_roundpipe

CORPUS = Path(__file__).resolve().parent / "data" / "python_docstrings.txt"
IGNORE = -100


class Chunks(Dataset):
    """Consecutive windows of ``seq_len + 1`` token ids: inputs and next-token labels."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


class TextData(L.LightningDataModule):
    """A text file cut into fixed-length windows; the last ``val_fraction`` is held out for validation.

    Args:
        path: the text; the default is the corpus shipped with the project.
        tokenizer: ``"bytes"`` (UTF-8 bytes are the tokens, vocabulary 256) or a Hugging Face tokenizer
            name or directory.
    """

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str = "bytes",
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
    ) -> None:
        super().__init__()
        self.path = Path(path) if path else CORPUS
        self.tokenizer, self.seq_len, self.batch_size, self.val_fraction = tokenizer, seq_len, batch_size, val_fraction

    def setup(self, stage: str) -> None:
        text = self.path.read_text(encoding="utf-8")
        if self.tokenizer == "bytes":
            ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        else:
            from transformers import AutoTokenizer

            ids = torch.tensor(AutoTokenizer.from_pretrained(self.tokenizer)(text)["input_ids"], dtype=torch.long)
        split = int(len(ids) * (1 - self.val_fraction))
        self.train, self.val = Chunks(ids[:split], self.seq_len), Chunks(ids[split:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=g, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, drop_last=True)


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(seq_len, dim) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.out(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


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


class CausalLM(L.LightningModule):
    """A byte-level transformer, or a Hugging Face causal LM when ``hf_model`` is given.

    Args:
        hf_model: a Hugging Face model name or directory (``from_pretrained``); ``None`` builds the
            small byte-level model from ``dim``, ``depth``, ``heads`` and ``max_seq_len``.
        lr, warmup_steps, weight_decay: AdamW with linear warm-up and cosine decay to 10%.
    """

    def __init__(
        self,
        hf_model: str | None = None,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        max_seq_len: int = 1024,
        dropout: float = 0.0,
        lr: float = 2e-3,
        warmup_steps: int = 20,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if hf_model:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(hf_model, torch_dtype=torch.float32)
        else:
            self.model = nn.Sequential(
                Embed(256, dim, max_seq_len), *(Block(dim, heads, dropout) for _ in range(depth)), Head(dim, 256)
            )
        self.val_nll = torchmetrics.MeanMetric()

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, labels = batch
        if self.hparams.hf_model:  # Hugging Face shifts labels itself
            return self.model(input_ids=tokens, labels=tokens).loss
        return lightning_roundpipe.pipeline_loss(self.model, tokens, labels, token_loss, reduction=counted_tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_nll.update(self._loss(batch), weight=batch[1].numel())
        self.log("val_loss", self.val_nll, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.log("val_ppl", math.exp(min(self.val_nll.compute().item(), 50.0)), prog_bar=True)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in self.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr)
        total, warmup = max(1, self.trainer.estimated_stepping_batches), self.hparams.warmup_steps

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(CausalLM, TextData, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
