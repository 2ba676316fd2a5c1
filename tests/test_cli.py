"""LightningCLI: the shipped YAML and ``--trainer.strategy roundpipe`` both train through roundpipe."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from lightning_roundpipe import RoundPipeStrategy

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from finetune_lm import main  # noqa: E402

SMALL = ["--model.dim=32", "--model.depth=2", "--data.seq_len=32", "--data.batch_size=8"]


def test_fit_from_the_shipped_yaml(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["finetune_lm.py"])
    monkeypatch.chdir(tmp_path)  # the YAML writes under runs/ in the working directory
    cli = main(
        ["fit", "--config", str(EXAMPLES / "finetune_lm.yaml"), "--trainer.max_steps=6",
         "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
         "--trainer.log_every_n_steps=2",
         *SMALL]
    )  # fmt: skip
    strategy = cli.trainer.strategy
    assert (
        isinstance(strategy, RoundPipeStrategy) and strategy.options.num_microbatches == 4 and strategy.async_optimizer
    )
    assert cli.trainer.global_step == 6
    with open(next((tmp_path / "runs/finetune_lm/csv").glob("version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("val_ppl") for r in rows) and any(r.get("roundpipe/busy_worker1") for r in rows)
    last = torch.load(tmp_path / "runs/finetune_lm/checkpoints/last.ckpt", weights_only=False)
    assert last["global_step"] == 6 and "roundpipe" in last


def test_strategy_by_name_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["finetune_lm.py"])
    cli = main(
        ["fit", "--trainer.strategy=roundpipe", "--trainer.accelerator=cpu", "--trainer.devices=2",
         "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.logger=false",
         "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
         f"--trainer.default_root_dir={tmp_path}", *SMALL]
    )  # fmt: skip
    assert isinstance(cli.trainer.strategy, RoundPipeStrategy) and cli.trainer.global_step == 2


def test_the_cli_lists_the_strategy_users_pick_and_shows_its_options(monkeypatch, capsys):
    """``fit --help`` lists ``RoundPipeStrategy`` among the strategies, not its internal base class, and
    ``--trainer.strategy.help RoundPipeStrategy`` shows the strategy's arguments (the README says so)."""
    import pytest

    monkeypatch.setattr(sys, "argv", ["finetune_lm.py"])
    with pytest.raises(SystemExit) as done:
        main(["fit", "--help"])
    listed = capsys.readouterr().out
    assert done.value.code == 0 and "lightning_roundpipe.RoundPipeStrategy" in listed
    assert "NodeProcesses" not in listed
    with pytest.raises(SystemExit) as done:
        main(["fit", "--trainer.strategy.help", "RoundPipeStrategy"])
    assert done.value.code == 0 and "--trainer.strategy.num_microbatches" in capsys.readouterr().out
