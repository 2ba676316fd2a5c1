"""Test helpers: a boring pipelined LightningModule, its data, and comparisons."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe


class BackwardHook(nn.Module):
    """The identity, whose backward first calls ``hook(grad)``: a failure injected into a layer's backward."""

    def __init__(self, hook: Any) -> None:
        super().__init__()
        self.hook = lambda grad: hook(grad)  # (a function: the engine's copies of the layer call the same hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Hooked.apply(x, self.hook)


class _Hooked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Any) -> torch.Tensor:
        ctx.hook = hook
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.hook(grad)
        return grad, None


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class BoringPipeline(L.LightningModule):
    """An MLP as an ``nn.Sequential`` trained through ``pipeline_loss``; runs under any strategy."""

    def __init__(self, width: int = 16, depth: int = 3, lr: float = 1e-2, fused: bool = False, scheduler: bool = False):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        layers.append(nn.Linear(width, 4))
        self.model = nn.Sequential(*layers)
        self.lr, self.fused, self.scheduler = lr, fused, scheduler
        self.seen_grad_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = lightning_roundpipe.pipeline_loss(self.model, x, y, F.mse_loss)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", lightning_roundpipe.pipeline_loss(self.model, x, y, F.mse_loss))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.seen_grad_norms.append(torch.stack(norms).norm().item() if norms else 0.0)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused or None)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def boring_data(samples: int = 96, batch_size: int = 12, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g)
    y = torch.randn(samples, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fit(module_factory: Any, trainer_kwargs: dict[str, Any], data: Any = None, seed: int = 1) -> L.LightningModule:
    L.seed_everything(seed, verbose=False)
    module = module_factory()
    kwargs = dict(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    kwargs.update(trainer_kwargs)
    L.Trainer(**kwargs).fit(module, data if data is not None else boring_data())
    return module


def flat_weights(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def next_batch_and_plain_gradients(engine: Any, reference: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """Flat gradients of one more MSE batch through ``engine`` and, in plain PyTorch, through
    ``reference``: after a failed batch the next one must be exact."""
    import torch.nn.functional as F

    engine.train_batch(x, y, F.mse_loss)
    engine.store.install_grads()
    reference.zero_grad()
    F.mse_loss(reference(x), y).backward()
    got = torch.cat([p.grad.flatten() for p in engine.store.parameters])
    want = torch.cat([p.grad.flatten() for p in reference.parameters()])
    return got, want
