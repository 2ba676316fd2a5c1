"""Every benchmark script runs end to end on CPU worker threads (a tiny model, a few steps), so one that a
change broke fails here instead of in a scarce GPU session. Numbers are not checked: they mean nothing
on 2 CPU cores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--seq-len", "32"]
SMOKE = {
    # roundpipe's own configuration of baselines.py runs in the split-and-tiled test below and in scaling
    "baselines": ["--device", "cpu", "--model", "debug", "--configs", "plain", "--seqs", "4",
                  "--micro-batch", "2", "--steps", "2", "--warmup", "1", *TINY],
    "bubble_check": ["--device", "cpu", "--model", "debug", "--devices", "2", "--seqs", "4", "--steps", "6",
                     "--microbatches", "2", *TINY],
    "scaling": ["--device", "cpu", "--models", "debug", "--gpus", "2", "--seqs", "4", "--steps", "2",
                "--double-buffer", "first", *TINY],
    "hf_preset": ["--device", "cpu", "--model", "debug", "--configs", "handwritten,preset,preset-padded", "--seqs",
                  "4", "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--in-process", *TINY],
    "lightning_user": ["--device", "cpu", "--model", "debug", "--configs",
                       "plain,newcomer,tuned-2-gm0.6,fused-2-compile", "--seqs", "4", "--micro-batch", "2",
                       "--steps", "2", "--warmup", "3", "--norm", "torch", "--compile-backend", "eager",
                       "--in-process", *TINY],  # dynamo alone: the script's compile path, not AOT's (test_compile)
    "measuring_memory": ["--device", "cpu", "--layers", "3", "--width", "8", "--batch", "64"],
    "moe_lora": ["--device", "cpu", "--shape", "debug", "--seqs", "2", "--micro-batch", "1", "--steps", "1", *TINY],
    "optimizer_zoo": ["--only", "torch AdamW,torch Rprop", "--steps", "3"],
    "optimizer_overlap": ["--device", "cpu", "--model", "debug", "--seqs", "4", "--micro-batch", "2", "--steps",
                          "2", "--warmup", "1", "--in-process", *TINY],
    "schedules": ["--device", "cpu", "--models", "debug", "--micro-batch", "2", *TINY],
    "throughput": ["--device", "cpu", "--model", "debug", "--configs", "plain,roundpipe-priority,roundpipe-none",
                   "--seqs", "4", "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--fused-blocks", "1",
                   "--in-process", *TINY],
    "soak": ["--device", "cpu", "--model", "debug", "--seqs", "4", "--microbatches", "2", "--steps", "20",
             "--settle", "5", *TINY],
}  # fmt: skip


def search_args(split_blocks: bool):
    """What ``baselines.max_seq`` reads of the command line, for a search from 16 tokens in steps of 8."""
    import argparse

    return argparse.Namespace(
        seq_len=16, seq_step=8, seq_cap=1 << 20, workers=1, gpu_gib=24.0, split_blocks=split_blocks, tile_tokens=0,
        model="debug",
    )  # fmt: skip


def failed_configurations(results: object) -> list[object]:
    items = results if isinstance(results, list) else [results]
    return [r for r in items if isinstance(r, dict) and "error" in r]


SPLIT_TILED = "split-and-tiled"  # the commands of the two tests below the smoke test's
VARLEN = "varlen"
OWN_COMMAND = {  # test (not the smoke test): the command it checks
    "test_baselines_roundpipe_with_split_and_tiled_blocks_runs_on_cpu": SPLIT_TILED,
    "test_lightning_user_trains_on_variable_lengths_padded_per_batch_and_packed": VARLEN,
}


def benchmark_command(name: str, out: Path) -> list[str]:
    """The command line of a smoke run (``SMOKE``'s scripts, writing ``out``) or of ``SPLIT_TILED`` or
    ``VARLEN``."""
    if name == SPLIT_TILED:  # 64 tokens per micro-batch: 8 tiles per MLP layer
        args = [*SMOKE["baselines"], "--run", "roundpipe", "--split-blocks", "--tile-tokens", "8"]
        return [sys.executable, str(ROOT / "benchmarks" / "baselines.py"), *args]
    if name == VARLEN:
        args = ["--device", "cpu", "--model", "debug", "--configs",
                "plain,plain-packed,newcomer,newcomer-devopt,newcomer-dbauto",
                "--varlen", "4,40", "--seqs", "8", "--micro-batch", "4", "--steps", "2", "--warmup", "2",
                "--in-process", *TINY]  # fmt: skip
        return [sys.executable, str(ROOT / "benchmarks" / "lightning_user.py"), *args, "--out", str(out)]
    return [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *SMOKE[name], "--out", str(out)]


class BenchmarkRuns:
    """The benchmark commands of this module's selected tests, started when the first of them needs one, two
    at a time, in the tests' order; each a child of a ``prewarmed`` server (``tests/prewarmed.py``: a process
    that starts with torch and Lightning imported, its script run as ``python script.py args`` would run).
    Most of a fresh process's time went to those imports, on one core at a time: the eleven smoke runs and
    the two below took 177 s one after another. Every test still waits for its own command and checks it
    (the same command, the same 220 s limit on it, the same assertions); a driver's configurations in
    processes of their own (``baselines``, ``scaling``) are still fresh processes."""

    def __init__(self, server, commands: dict[str, tuple[list[str], Path]]) -> None:
        self._server = server
        self._lock = threading.Lock()
        self._procs: list = []
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="benchmark-run")
        self._runs: dict[str, Future] = {
            name: self._pool.submit(self._run, cmd, cwd) for name, (cmd, cwd) in commands.items()
        }

    def _run(self, cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
        with self._lock:
            if self._closed:
                raise RuntimeError("the module's tests ended before this command started")
            proc = self._server.popen(cmd[1:], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=cwd,
                                      stdout=cwd / "stdout.txt", stderr=cwd / "stderr.txt")  # fmt: skip
            self._procs.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=220)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

    def result(self, name: str) -> subprocess.CompletedProcess:
        return self._runs[name].result()

    def close(self) -> None:
        """No command outlives the module's tests (a stopped session, ``-x``): not started ones never start,
        running ones are killed."""
        with self._lock:
            self._closed = True
            for run in self._runs.values():
                run.cancel()
            for proc in self._procs:
                proc.kill()
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def benchmark_runs(request, tmp_path_factory, prewarmed):
    """A command and its working folder per selected test of this module that runs one, started at once."""
    commands = {}
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        callspec = getattr(item, "callspec", None)
        if item.originalname == "test_benchmark_runs_on_cpu" and callspec is not None:
            name = callspec.params["script"]
        elif item.originalname in OWN_COMMAND:
            name = OWN_COMMAND[item.originalname]
        else:
            continue
        folder = tmp_path_factory.mktemp(name)
        commands[name] = (benchmark_command(name, folder / "result.json"), folder)
    runs = BenchmarkRuns(prewarmed[0], commands)
    yield runs
    runs.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_on_cpu(script, benchmark_runs):
    proc = benchmark_runs.result(script)
    out = Path(proc.args[proc.args.index("--out") + 1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text())
    assert re.match(rf"(\S+=\S+ )*python benchmarks/{script}\.py ", written["meta"]["command"])
    results = written["results"] if "results" in written else written["result"]
    assert not failed_configurations(results), results
    if script == "bubble_check":  # enough to simulate the measured plan again offline
        assert results["layer_costs"]["forward"] and results["last_timeline"] and results["plan"]


def test_the_recorded_command_carries_the_allocator_setting_it_ran_under(tmp_path, monkeypatch):
    """``expandable_segments`` changes the numbers: a result file must say it ran with it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _driver import write

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    write(str(tmp_path / "r.json"), ["--configs", "newcomer"], "lightning_user.py", [])
    command = json.loads((tmp_path / "r.json").read_text())["meta"]["command"]
    setting = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert command == f"{setting} python benchmarks/lightning_user.py --configs newcomer"


def test_the_allocator_reserve_is_told_by_the_stream_it_was_allocated_on(monkeypatch):
    """Where the 24 GiB card's reserve sits above the plan's limit (issue 39): a freed block serves only its own
    stream, so lightning_user records each stream's segments at every new high of the reserve."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from lightning_user import allocator_by_stream

    device = SimpleNamespace(compute=SimpleNamespace(cuda_stream=11), param_up=SimpleNamespace(cuda_stream=12), index=0)
    engine = SimpleNamespace(devices=[device], resident=SimpleNamespace(stream=SimpleNamespace(cuda_stream=13)))
    gib = 2**30
    segments = [
        {"device": 0, "stream": 11, "total_size": 4 * gib, "allocated_size": 1 * gib},
        {"device": 0, "stream": 11, "total_size": 2 * gib, "allocated_size": 2 * gib},
        {"device": 0, "stream": 12, "total_size": 8 * gib, "allocated_size": 7 * gib},
        {"device": 0, "stream": 13, "total_size": 1 * gib, "allocated_size": 1 * gib},
        {"device": 0, "stream": 0, "total_size": gib // 2, "allocated_size": 0},
        {"device": 0, "stream": 99, "total_size": gib, "allocated_size": 0},
        {"device": 1, "stream": 11, "total_size": 64 * gib, "allocated_size": 0},  # another card: not counted
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    found = allocator_by_stream(engine)
    assert list(found) == ["param_up", "compute", "resident.stream", "99", "default"]  # the largest reserve first
    assert found == {
        "param_up": [8.0, 7.0], "compute": [6.0, 3.0], "resident.stream": [1.0, 1.0], "99": [1.0, 0.0],
        "default": [0.5, 0.0],
    }  # fmt: skip


@pytest.mark.timeout(60)
def test_a_configuration_that_hangs_is_recorded_and_the_next_still_runs(tmp_path):
    """A hanging baseline must not take a whole GPU call: the driver's per-config time limit."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _driver import run_configs

    script = tmp_path / "bench.py"
    script.write_text(
        "import sys, time, json\n"
        "config = sys.argv[sys.argv.index('--run') + 1]\n"
        "print('about to hang', file=sys.stderr, flush=True)\n"
        "if config == 'hangs':\n    time.sleep(60)\n"
        "print('RESULT ' + json.dumps({'tokens_per_s': 1.0}), flush=True)\n"
    )
    seen = []  # what a caller writes after each config: a device call cut short keeps what finished
    hung, fine = run_configs(str(script), ["hangs", "fine"], {}, timeout=3, on_result=lambda r: seen.append(list(r)))
    assert hung["config"] == "hangs" and "timed out after 3 s" in hung["error"]
    assert fine["config"] == "fine" and fine["tokens_per_s"] == 1.0
    assert seen == [[hung], [hung, fine]]


@pytest.mark.timeout(60)
def test_a_measurement_that_finished_before_a_slow_teardown_is_kept(tmp_path):
    """Freeing tens of GB of pinned memory can outlast the limit after training ended: the RESULT stands."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _driver import run_configs

    script = tmp_path / "bench.py"
    script.write_text(
        "import time, json\nprint('RESULT ' + json.dumps({'tokens_per_s': 2.0}), flush=True)\ntime.sleep(60)\n"
    )
    (slow,) = run_configs(str(script), ["slow-teardown"], {}, timeout=3)
    assert "error" not in slow and slow["tokens_per_s"] == 2.0 and slow["teardown_timed_out"]


def test_longest_sequence_search_bisects_past_an_infeasible_plan_and_reports_every_probe(monkeypatch):
    """roundpipe's partitioner refusing a plan is the card's memory running out, so the search bisects on;
    each probe's answer is reported at once, so a command stopped from outside keeps it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import baselines

    def probe(args, config, seq):  # the partitioner refuses first, while the search is still doubling
        if seq <= 80:
            return True, "", ""
        return False, "GPU memory (no plan fits)", "Infeasible: layer 1 needs ..."

    monkeypatch.setattr(baselines, "probe", probe)
    args = search_args(split_blocks=True)
    reports = []
    found = baselines.max_seq(args, "roundpipe", reports.append)
    assert found["max_seq_len"] == 80 and found["first_failure"] == 88
    assert found["split_blocks"] is True  # the chart tells it from roundpipe's whole-block search
    assert found["ran_out_of"] == "GPU memory (no plan fits)" and "inconclusive" not in found
    assert [p["seq_len"] for p in found["probes"]] == [16, 32, 64, 128, 96, 80, 88]
    assert len(reports) == 7 and all(r["searching"] for r in reports)
    assert reports[3]["first_failure"] == 128 and reports[3]["max_seq_len"] == 64


def test_a_time_limit_while_bisecting_leaves_the_search_inconclusive(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import baselines

    answers = {16: (True, "", ""), 32: (True, "", ""), 64: (False, "GPU memory", "oom"), 48: (False, "time limit", "")}
    monkeypatch.setattr(baselines, "probe", lambda args, config, seq: answers[seq])
    args = search_args(split_blocks=False)
    found = baselines.max_seq(args, "fsdp-offload")
    assert found["inconclusive"] and found["max_seq_len"] == 32 and found["first_failure"] == 64


def test_probe_reads_what_ran_out_from_the_error(monkeypatch):
    """The partitioner's ``Infeasible`` is the card's memory running out (no plan fits); a CUDA
    out-of-memory is the allocator's; a finished run that only timed out in teardown fits."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import argparse

    import baselines

    stderr = {
        "infeasible": "Traceback ...\nlightning_roundpipe.schedule.partition.Infeasible: layer 1 needs 19.33 GiB",
        "oom": "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    }

    def run(cmd, **kwargs):
        case = os.environ["CASE"]
        if case == "teardown":
            raise subprocess.TimeoutExpired(cmd, 1, output=b"RESULT {}\n")
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr[case])

    monkeypatch.setattr(baselines.subprocess, "run", run)
    args = argparse.Namespace(model="debug", device="cpu", workers=1, double_buffer="none", gpu_memory=0.8,
                              gpu_gib=24.0, probe_timeout=1, split_blocks=False, tile_tokens=0)  # fmt: skip
    monkeypatch.setenv("CASE", "infeasible")
    fits, why, detail = baselines.probe(args, "roundpipe", 131072)
    assert not fits and why == "GPU memory (no plan fits)" and "19.33 GiB" in detail
    monkeypatch.setenv("CASE", "oom")
    assert baselines.probe(args, "fsdp-offload", 98304)[:2] == (False, "GPU memory")
    monkeypatch.setenv("CASE", "teardown")
    assert baselines.probe(args, "roundpipe", 65536)[0]


def test_baselines_chart_collects_what_the_files_hold_and_draws_it(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import baselines_chart

    run = {"results": [{"config": "plain", "tokens_per_s": 10.0}, {"config": "fsdp-offload", "error": "oom"},
                       {"config": "roundpipe", "tokens_per_s": 9.0, "gpu_cap_gib": 24.0}]}  # fmt: skip
    older_4b = {"meta": {"command": "python benchmarks/baselines.py --model qwen3-4b --configs plain"},
                "results": [{"config": "plain", "tokens_per_s": 4.0}]}  # fmt: skip
    newer_4b = {"results": [{"config": "roundpipe", "tokens_per_s": 3.0, "model": "qwen3-4b", "gpu_cap_gib": 24.0}]}
    found = {"config": "roundpipe", "max_seq_len": 64, "first_failure": 96, "gpu_cap_gib": 24.0}
    partial = {"config": "fsdp-offload", "max_seq_len": 32, "first_failure": 64, "searching": True}
    search = {"results": [found, partial]}
    split = {"meta": {"command": "python benchmarks/baselines.py --max-seq roundpipe --split-blocks"},
             "results": [{**found, "max_seq_len": 128, "first_failure": 160}]}  # fmt: skip
    tiled = {"results": [{**found, "max_seq_len": 256, "first_failure": None, "split_blocks": True,
                          "tile_tokens": 16, "single_probe": True}]}  # fmt: skip
    paths = []
    files = (("run", run), ("older_4b", older_4b), ("newer_4b", newer_4b), ("search", search), ("split", split),
             ("tiled", tiled))  # fmt: skip
    for name, content in files:
        paths.append(str(tmp_path / f"{name}.json"))
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    speed, longest = baselines_chart.collect(paths)
    assert speed == {  # no bar for a failure; each model shape in its own groups
        "qwen3-1.7b, full card": {"plain": 10.0},
        "qwen3-1.7b, 24 GiB card": {"roundpipe": 9.0},
        "qwen3-4b, full card": {"plain": 4.0},
        "qwen3-4b, 24 GiB card": {"roundpipe": 3.0},
    }
    assert longest == {
        "roundpipe": (64, 96, True, "qwen3-1.7b, 24 GiB card"),
        "fsdp-offload": (32, 64, False, "qwen3-1.7b, full card"),
        "roundpipe-split": (128, 160, True, "qwen3-1.7b, 24 GiB card"),  # its command split the blocks
        "roundpipe-split-tiled": (256, None, False, "qwen3-1.7b, 24 GiB card"),  # one probe is not a search
    }
    pytest.importorskip("matplotlib")
    baselines_chart.draw(speed, longest, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").stat().st_size > 1000


@pytest.mark.timeout(240)
def test_baselines_roundpipe_with_split_and_tiled_blocks_runs_on_cpu(benchmark_runs):
    """One configuration as the driver runs it (``--run``: the driver's own process is tested above)."""
    proc = benchmark_runs.result(SPLIT_TILED)  # --split-blocks --tile-tokens 8
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result.get("split_blocks") is True and result.get("tile_tokens") == 8 and "error" not in result
    assert result["tokens_per_s"] > 0


def test_split_blocks_is_the_same_model_with_twice_the_layers():
    """The benchmark model's blocks as attention and MLP layers (``baselines.py --split-blocks``): the same
    parameters, the same loss and the same gradients."""
    import copy

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from qwen3_shape import SHAPES, build, init, split_blocks

    shape = SHAPES["debug"]
    whole = init(build(shape))
    halves = split_blocks(copy.deepcopy(whole))
    tiled = split_blocks(copy.deepcopy(whole), tile_tokens=5)  # 32 tokens: 7 tiles per MLP layer
    assert len(halves) == 2 + 2 * shape.layers
    assert sum(p.numel() for p in halves.parameters()) == sum(p.numel() for p in whole.parameters())
    tokens = torch.randint(0, shape.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = [model((tokens, tokens)) for model in (whole, halves, tiled)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(whole.parameters(), halves.parameters()):  # same registration order
        assert torch.equal(a.grad, b.grad)
    assert torch.allclose(losses[2], losses[0], rtol=1e-6)  # tiles sum the weight gradients in another order
    for a, b in zip(whole.parameters(), tiled.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_lightning_user_trains_on_variable_lengths_padded_per_batch_and_packed(benchmark_runs):
    """``--varlen`` (issue 39): instruction-like sequences padded per batch, or packed for plain; tokens/s
    counts the real tokens, the same number of them in every configuration's timed steps."""
    proc = benchmark_runs.result(VARLEN)  # plain,plain-packed,newcomer,newcomer-devopt,newcomer-dbauto
    out = Path(proc.args[proc.args.index("--out") + 1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert not failed_configurations(results), results
    real = {round(r["tokens_per_s"] * r["timed_seconds"]) for r in results}
    assert len(real) == 1 and real.pop() < 8 * 40 * 2  # the same real tokens, fewer than the padded ones
    # the device optimizer keeps the engine's order: on the CPU the same math, up to the summation order of a plan
    # adopted a batch earlier or later (a measured plan is taken up once its records are in, which timing decides)
    losses = {r["config"]: r["losses"] for r in results}
    assert losses["newcomer-devopt"] == pytest.approx(losses["newcomer"], rel=1e-5) and len(losses["newcomer"]) == 4
    assert {r["config"]: r["optimizer_states"] for r in results if r["config"].startswith("newcomer")} == {
        "newcomer": "host", "newcomer-devopt": "device", "newcomer-dbauto": "host"
    }  # fmt: skip
    # double_buffer="auto" (auto-db-24gib's candidate default): spares on this host, the one pass on, same losses
    auto = next(r for r in results if r["config"] == "newcomer-dbauto")
    assert (auto["double_buffer"], auto["one_pass"]["off_because"]) == ("all", None) and auto["spares"] > 0
    assert auto["one_pass"]["groups_updated"] > 0 and auto["losses"] == pytest.approx(losses["newcomer"], rel=1e-5)
    assert next(r for r in results if r["config"] == "newcomer")["one_pass"]["groups_updated"] == 0
    assert next(r for r in results if r["config"] == "newcomer")["spares"] == 0
