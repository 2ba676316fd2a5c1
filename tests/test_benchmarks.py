"""Every benchmark script runs end to end on CPU worker threads (a tiny model, a few steps), so one that a
change broke fails here instead of in a scarce GPU session. Numbers are not checked: they mean nothing
on 2 CPU cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--seq-len", "32"]
SMOKE = {
    "baselines": ["--device", "cpu", "--model", "debug", "--configs", "plain,roundpipe", "--seqs", "4",
                  "--micro-batch", "2", "--steps", "2", "--warmup", "1", *TINY],
    "bubble_check": ["--device", "cpu", "--model", "debug", "--devices", "2", "--seqs", "4", "--steps", "6",
                     "--microbatches", "2", *TINY],
    "scaling": ["--device", "cpu", "--models", "debug", "--gpus", "1,2", "--seqs", "4", "--steps", "2",
                "--double-buffer", "first", *TINY],
    "hf_preset": ["--device", "cpu", "--model", "debug", "--seqs", "4", "--micro-batch", "2", "--steps", "2",
                  "--warmup", "1", *TINY],
    "moe_lora": ["--device", "cpu", "--shape", "debug"],
    "optimizer_overlap": ["--device", "cpu", "--model", "debug", "--seqs", "4", "--micro-batch", "2", "--steps",
                          "2", "--warmup", "1", *TINY],
    "schedules": ["--device", "cpu", "--model", "debug"],
    "throughput": ["--device", "cpu", "--model", "debug", "--configs", "plain,roundpipe-priority,roundpipe-none",
                   "--seqs", "4", "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--fused-blocks", "1",
                   *TINY],
    "soak": ["--device", "cpu", "--model", "debug", "--seqs", "4", "--microbatches", "2", "--steps", "20",
             "--settle", "5", *TINY],
}  # fmt: skip


def failed_configurations(results: object) -> list[object]:
    items = results if isinstance(results, list) else [results]
    return [r for r in items if isinstance(r, dict) and "error" in r]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_on_cpu(script, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *SMOKE[script], "--out", str(out)],
        capture_output=True, text=True, timeout=220, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text())
    assert written["meta"]["command"].startswith(f"python benchmarks/{script}.py")
    results = written["results"] if "results" in written else written["result"]
    assert not failed_configurations(results), results


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
    hung, fine = run_configs(str(script), ["hangs", "fine"], {}, timeout=3)
    assert hung["config"] == "hangs" and "timed out after 3 s" in hung["error"]
    assert fine["config"] == "fine" and fine["tokens_per_s"] == 1.0
