"""Running benchmark configurations one per process and collecting their JSON results."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_configs(
    script: str,
    configs: list[str],
    shared: dict[str, Any],
    timeout: float | None = None,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``script --run CONFIG --key value ...`` for each config; each prints one ``RESULT {json}`` line.
    ``timeout`` (seconds per config): a config that hangs is recorded as failed with its last output,
    and the others still run. ``on_result`` gets the results so far after each config (a caller writes
    them, so that a device call cut short keeps what finished)."""
    results: list[dict[str, Any]] = []
    for config in configs:
        results.append(_run_config(script, config, shared, timeout))
        if on_result is not None:
            on_result(results)
    return results


def _run_config(script: str, config: str, shared: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    cmd = [sys.executable, script, "--run", config]
    for key, value in shared.items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):  # store_true options
            cmd += [flag] if value else []
        elif value is not None:
            cmd += [flag, str(value)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout
        )
    except subprocess.TimeoutExpired as expired:
        out, tail = (
            t.decode(errors="replace") if isinstance(t, bytes) else t or "" for t in (expired.stdout, expired.stderr)
        )
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        try:  # a line cut short by the kill is no result
            salvaged = json.loads(lines[-1][len("RESULT ") :]) if lines else None
        except json.JSONDecodeError:
            salvaged = None
        if salvaged is not None:  # the measurement finished; only the teardown after it ran out of time
            print(f"{config}: measured, then timed out in teardown after {timeout} s", flush=True)
            return {**salvaged, "config": config, "teardown_timed_out": True, "wall_s": time.perf_counter() - t0}
        why = f"timed out after {timeout} s\n{tail[-3000:]}"
        print(f"{config}: {why}", flush=True)
        return {"config": config, "error": why, "returncode": None, "progress": _progress(tail)}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        progress = _progress(proc.stderr)
        print(f"{config}: FAILED ({proc.returncode})\n" + "\n".join(progress[-12:]), flush=True)
        print(proc.stderr[-3000:], flush=True)
        # the whole chain: a failure raised while handling another (a retry after running out of memory) and
        # the warnings before it say why; the last 3,000 characters held only the outer traceback
        error = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("step "))
        return {"config": config, "error": error[-30000:], "returncode": proc.returncode, "progress": progress}
    result = json.loads(lines[-1][len("RESULT ") :])
    result["config"] = config
    result["wall_s"] = time.perf_counter() - t0
    print(f"{config}: done in {result['wall_s']:.0f} s", flush=True)
    return result


def _progress(stderr: str) -> list[str]:
    """A failed configuration's progress lines (``step N: ...`` and roundpipe's warnings), which the traceback's
    tail would leave out: where it was when it failed."""
    lines = stderr.splitlines()
    return [line[:400] for line in lines if line.startswith("step ") or "roundpipe:" in line][-60:]


def add_in_process_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every configuration in this process, one after another: for CPU smoke tests, which would"
        " otherwise spend most of their time importing torch and Lightning again per configuration; a GPU"
        " measurement wants the fresh process of each (its own allocator, peaks and pinned memory)",
    )


def run_or_drive(
    script: str,
    args: argparse.Namespace,
    run_one: Callable[[argparse.Namespace], dict[str, Any]],
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]] | None:
    """The two ways a benchmark script runs: ``--run CONFIG`` measures one configuration in this process
    and prints its ``RESULT`` line (returns ``None``); otherwise every ``--configs`` entry runs in a fresh
    process of ``script`` with the same options, and their results come back. With ``--in-process`` the
    entries run here instead, their results through the same JSON round trip as a ``RESULT`` line.
    ``on_result``: as :func:`run_configs`'s."""
    if args.run:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return None
    if getattr(args, "in_process", False):
        results = []
        for config in args.configs.split(","):
            t0 = time.perf_counter()
            result = json.loads(json.dumps(run_one(argparse.Namespace(**{**vars(args), "run": config}))))
            results.append({**result, "config": config, "wall_s": time.perf_counter() - t0})
            print(f"{config}: done in {results[-1]['wall_s']:.0f} s (in this process)", flush=True)
            if on_result is not None:
                on_result(results)
        return results
    shared = {k: v for k, v in vars(args).items() if k not in ("run", "configs", "out", "in_process")}
    timeout = getattr(args, "config_timeout", 0) or None
    return run_configs(script, args.configs.split(","), shared, timeout=timeout, on_result=on_result)


def write(out: str | None, argv: list[str], script: str, results: list[dict[str, Any]]) -> None:
    if not out:
        return
    import torch

    settings = " ".join(f"{k}={os.environ[k]}" for k in ("PYTORCH_CUDA_ALLOC_CONF",) if os.environ.get(k))
    meta = {
        "date": time.strftime("%Y-%m-%d"),  # the command as run, with the environment that changes results
        "command": (f"{settings} " if settings else "") + f"python benchmarks/{Path(script).name} " + " ".join(argv),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
