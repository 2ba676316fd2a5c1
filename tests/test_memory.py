"""Host-memory estimate and preflight: the numbers match what the engine allocates; a run that cannot fit
is refused before anything starts, with the estimate."""

from __future__ import annotations

import threading

import lightning as L
import pytest
import torch
from helpers import BoringPipeline, boring_data
from torch import nn

from lightning_roundpipe import RoundPipeStrategy, estimate_host_memory
from lightning_roundpipe.engine import PipelineEngine
from lightning_roundpipe.runtime import WorkerDevice


@pytest.mark.parametrize(
    "compute_dtype, asynchronous, double_buffer",
    [(torch.bfloat16, True, False), (torch.bfloat16, False, False), (None, True, False), (None, False, False),
     (torch.bfloat16, True, True), (None, True, True)],
)  # fmt: skip
def test_estimate_equals_what_the_engine_allocates(compute_dtype, asynchronous, double_buffer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)  # a frozen parameter is kept once, in the compute dtype
    estimate = estimate_host_memory(
        model, compute_dtype, asynchronous, optimizer_bytes_per_parameter=0, double_buffer=double_buffer
    )
    engine = PipelineEngine(
        list(model.children()), [WorkerDevice("cpu", 0)], compute_dtype=compute_dtype, asynchronous=asynchronous,
        double_buffer=double_buffer,
    )  # fmt: skip
    try:
        assert engine.store.nbytes() == estimate.masters + estimate.gradients + estimate.compute_copies
    finally:
        engine.close()
    adamw = estimate_host_memory(model, torch.bfloat16, True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adamw.optimizer_states == 8 * trainable
    assert adamw.total / trainable == pytest.approx(18, rel=0.1)  # 4 + 4 + 2 + 8, the frozen weight aside
    assert "bytes per parameter" in adamw.table()
    doubled = estimate_host_memory(model, torch.bfloat16, True, double_buffer=True)
    assert doubled.total - adamw.total == 2 * trainable  # a second bf16 copy of the trainable weights


@pytest.mark.timeout(60)
def test_a_run_that_cannot_fit_is_refused_with_the_estimate(monkeypatch):
    import lightning_roundpipe.memory as memory

    monkeypatch.setattr(memory, "available_host_memory", lambda: 1000)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=3), accelerator="cpu", devices=2, max_steps=1, logger=False,
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    with pytest.raises(MemoryError, match=r"(?s)more host memory than is available.*gradients.*optimizer states"):
        trainer.fit(BoringPipeline(), boring_data())
    assert not [t for t in threading.enumerate() if t.name.startswith("roundpipe")]


def test_available_memory_follows_a_cgroup_limit(tmp_path, monkeypatch):
    """Under a container's or a Slurm job's limit, the room left is the limit minus the working set
    (usage less the inactive file cache the kernel reclaims first), when that is below the machine's."""
    import psutil

    from lightning_roundpipe.memory import available_host_memory

    class Machine:
        available = 64 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Machine())
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{16 << 30}\n")
    (v2 / "memory.current").write_text(f"{12 << 30}\n")
    (v2 / "memory.stat").write_text(f"anon {9 << 30}\ninactive_file {3 << 30}\nactive_file {1 << 30}\n")
    none = str(tmp_path / "no-cgroup-file")
    assert available_host_memory(str(v2), none) == 7 << 30  # 16 - (12 - 3)
    (v2 / "memory.max").write_text("max\n")
    assert available_host_memory(str(v2), none) == 64 << 30  # no limit: the machine's figure
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{5 << 30}\n")
    (v1 / "memory.stat").write_text(f"inactive_file 1\ntotal_inactive_file {1 << 30}\n")
    none = str(tmp_path / "no-cgroup-file")
    assert available_host_memory(str(tmp_path / "v1"), none) == 4 << 30  # 8 - (5 - 1)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert available_host_memory(str(tmp_path / "v1"), none) == 64 << 30
    assert available_host_memory(str(tmp_path / "none"), none) == 64 << 30
    (v2 / "memory.max").write_text(f"{100 << 30}\n")
    assert available_host_memory(str(v2), none) == 64 << 30  # a limit above the machine's memory changes nothing
    # without a namespace the limit sits on a group of the process's path: Slurm puts it on the job,
    # above the step's and task's groups (v2), or on the memory controller's path (v1)
    job = v2 / "system.slice" / "job_7"
    (job / "step_0" / "task_0").mkdir(parents=True)
    (job / "memory.max").write_text(f"{6 << 30}\n")
    (job / "memory.current").write_text(f"{2 << 30}\n")
    (job / "step_0" / "memory.max").write_text("max\n")
    (job / "step_0" / "memory.current").write_text(f"{2 << 30}\n")
    (tmp_path / "cgroup-v2").write_text("0::/system.slice/job_7/step_0/task_0\n")
    assert available_host_memory(str(v2), str(tmp_path / "cgroup-v2")) == 4 << 30
    slurm = tmp_path / "v1" / "memory" / "slurm" / "uid_0" / "job_9"
    slurm.mkdir(parents=True)
    (slurm / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    (slurm / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    (tmp_path / "cgroup-v1").write_text("12:pids:/slurm\n9:memory:/slurm/uid_0/job_9\n1:name=systemd:/\n")
    assert available_host_memory(str(tmp_path / "v1"), str(tmp_path / "cgroup-v1")) == 2 << 30
    from lightning_roundpipe.memory import host_memory_limit

    class Big:
        total = 2048 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Big())
    assert host_memory_limit(str(tmp_path / "v1"), str(tmp_path / "cgroup-v1")) == 3 << 30  # the job's cap


def test_the_refusal_names_the_synchronous_optimizer_when_that_would_fit(monkeypatch):
    """In fp32 (as in bf16-true) the asynchronous optimizer's compute copy is the only one: when the run
    fits without it, the message says so, with the number; when nothing fits, it names nothing."""
    import lightning_roundpipe.memory as memory
    from lightning_roundpipe.build import build_engine
    from lightning_roundpipe.options import RoundPipeOptions

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    asynchronous = estimate_host_memory(model, None, True, 8)
    synchronous = estimate_host_memory(model, None, False, 8)
    assert asynchronous.new - synchronous.new == 4 * sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(memory, "available_host_memory", lambda: int((synchronous.new + 64) / 0.95))
    layers, devices = list(model.children()), [torch.device("cpu")]
    with pytest.raises(MemoryError, match=r"async_optimizer=False\) would add 0\.00 GiB, which fits"):
        build_engine(layers, devices, RoundPipeOptions(), None, asynchronous=True, training=True)
    monkeypatch.setattr(memory, "available_host_memory", lambda: 1000)
    with pytest.raises(MemoryError) as refused:
        build_engine(layers, devices, RoundPipeOptions(), None, asynchronous=True, training=True)
    assert "which fits" not in str(refused.value) and "bf16-true" in str(refused.value)


@pytest.mark.timeout(60)
def test_double_buffer_auto_gives_spare_compute_copies_where_the_host_holds_them(monkeypatch, caplog):
    """``double_buffer="auto"``: with the asynchronous optimizer every trainable group gets a spare
    compute copy where the host holds them beside the rest (AdamW's math and cast then run in one pass, compiled
    when the engine is built); where only the rest fits, none, said in the log; synchronous steps have none."""
    import logging

    import lightning_roundpipe.memory as memory
    from lightning_roundpipe.build import build_engine
    from lightning_roundpipe.options import RoundPipeOptions
    from lightning_roundpipe.runtime.one_pass import OnePass

    compiled = []
    monkeypatch.setattr(OnePass, "compile", classmethod(lambda cls, dtypes: compiled.append(set(dtypes))))
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))

    def built(asynchronous: bool = True) -> tuple[str, int]:
        engine = build_engine(
            list(model.children()), [torch.device("cpu")], RoundPipeOptions(double_buffer="auto"), torch.bfloat16,
            asynchronous, True,
        )  # fmt: skip
        try:
            return engine.steps.double_buffer, sum(g.spare is not None for g in engine.store.groups)
        finally:
            engine.close()

    assert built() == ("all", 2) and compiled == [{torch.bfloat16}]
    assert built(asynchronous=False) == ("none", 0) and len(compiled) == 1
    without = estimate_host_memory(model, torch.bfloat16, True, 8)
    monkeypatch.setattr(memory, "available_host_memory", lambda: int((without.new + 64) / 0.95))
    with caplog.at_level(logging.INFO):
        assert built() == ("none", 0) and len(compiled) == 1
    assert any("no spare compute copies (double_buffer='auto')" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="needs async_optimizer=True"):
        RoundPipeOptions(async_optimizer=False, double_buffer="all")
    assert RoundPipeOptions(async_optimizer=False, double_buffer="auto").double_buffer == "auto"  # ("none" built)


@pytest.mark.timeout(60)
def test_no_one_pass_compile_where_the_gpu_holds_every_state(monkeypatch):
    """With every optimizer state on the device no group has a spare (the device's two copies are what double
    buffering gives), so no kernel is compiled for the host (on a full card "auto" compiles nothing for it)."""
    from lightning_roundpipe.runtime.one_pass import OnePass

    compiled = []
    monkeypatch.setattr(OnePass, "compile", classmethod(lambda cls, dtypes: compiled.append(set(dtypes))))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for place, spares in (("device", 0), ("host", 2)):
        engine = PipelineEngine(
            list(model.children()), [WorkerDevice("cpu", 0)], asynchronous=True, double_buffer="all",
            optimizer_on=place,
        )  # fmt: skip
        try:
            assert sum(g.spare is not None for g in engine.store.groups) == spares
        finally:
            engine.close()
        assert len(compiled) == (spares > 0)


@pytest.mark.timeout(60)
def test_a_rebuilt_engine_keeps_the_first_engines_answer_to_double_buffer_auto(monkeypatch):
    """A rebuild (layers unfrozen, the states moved, a checkpoint loaded mid-run) counts states that exist by then
    as still to come: deciding ``"auto"`` again there could drop the spares mid-run (and with them the one pass's
    rounding) on a host that held them. The rebuilt engine takes the first engine's answer."""
    from types import SimpleNamespace

    import lightning_roundpipe.build as build
    from lightning_roundpipe.options import RoundPipeOptions
    from lightning_roundpipe.runtime.one_pass import OnePass

    monkeypatch.setattr(OnePass, "compile", classmethod(lambda cls, dtypes: None))
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    layers, devices = list(model.children()), [torch.device("cpu")]
    options = RoundPipeOptions(double_buffer="auto")
    engine = build.build_engine(layers, devices, options, torch.bfloat16, True, True)
    assert engine.steps.double_buffer == "all"
    monkeypatch.setattr(build, "fits_host", lambda estimate: False)  # what a second decision would now say
    precision = SimpleNamespace(compute_dtype=torch.bfloat16, autocast_dtype=None)
    again = build._rebuilt(engine, build.EngineArguments(layers, devices, options, precision, [], 1))
    try:
        assert again.steps.double_buffer == "all" and sum(g.spare is not None for g in again.store.groups) == 2
    finally:
        again.close()
    fresh = build.build_engine(layers, devices, options, torch.bfloat16, True, True)  # (a first build decides)
    try:
        assert fresh.steps.double_buffer == "none"
    finally:
        fresh.close()
