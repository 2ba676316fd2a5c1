"""Tests marked ``alongside`` may run in a second process while this one runs the rest of their module.

Each module with two or more selected ``alongside`` tests gets, when its first test starts, a child of a
``prewarmed`` server (``tests/prewarmed.py``: a process that starts with torch and Lightning imported). The
two processes share the module's ``alongside`` tests by claiming them: the suite from the first onwards as
it reaches them, the child from the last backwards, until they meet. A test the child claimed is waited for
here (its own run's time at most: the child finished every later one first) and reported as the child's
outcome; one the child failed runs again here, so its failure is reported with pytest's details, and fails
with the child's traceback if it passed here. A child that died or hung leaves its tests to this process.
On a 2-core machine the compile-heavy tests (mostly dynamo tracing, on one core) take about half the time.

An ``alongside`` test takes no fixtures but its parameters, which JSON must carry; the child calls the test
function itself (no pytest hooks, no warning filters of the configuration, which ignore only).

Run as a script, this file is the child: ``alongside.py PLAN FOLDER``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _key(nodeid: str) -> str:
    return hashlib.sha1(nodeid.encode()).hexdigest()[:20]


def _claim(folder: Path, key: str, who: str) -> bool:
    """Whether this process now owns the test (the other has not claimed it first)."""
    try:
        fd = os.open(folder / "claims" / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, who.encode())
    os.close(fd)
    return True


def entries(items: list) -> list[dict[str, Any]]:
    """What the child needs to call each test: module, function and parameters; a test that does not fit
    (fixtures beyond its parameters, parameters JSON cannot carry) is a usage error."""
    found = []
    for item in items:
        params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
        extra = set(item.fixturenames) - set(params)
        try:
            carried = json.loads(json.dumps(params)) == params
        except TypeError:
            carried = False
        if extra or not carried:
            raise ValueError(f"{item.nodeid} is marked alongside but takes fixtures {sorted(extra)} or parameters "
                             "that JSON cannot carry")  # fmt: skip
        found.append({"key": _key(item.nodeid), "module": item.module.__name__, "function": item.originalname,
                      "params": params})  # fmt: skip
    return found


class Module:
    """The suite's side for one module: ``start`` the child, ``take`` a test, ``stop``."""

    def __init__(self, items: list, server: Any) -> None:
        self.keys = {item.nodeid: _key(item.nodeid) for item in items}
        self._plan = list(reversed(entries(items)))  # the child starts from the last
        self._server = server
        self._folder: Path | None = None
        self._proc: Any = None
        self._started = threading.Event()
        self._abandoned = False

    def start(self) -> None:
        """Starts the child once the server is ready (in the background: this process goes on meanwhile)."""
        self._folder = Path(tempfile.mkdtemp(prefix="alongside-"))
        (self._folder / "claims").mkdir()
        (self._folder / "results").mkdir()
        (self._folder / "plan.json").write_text(json.dumps(self._plan))

        def spawn() -> None:
            try:
                if self._abandoned:
                    return
                path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
                env = {**os.environ, "PYTHONPATH": path}
                self._proc = self._server.popen([__file__, self._folder / "plan.json", self._folder], env=env,
                                                cwd=os.getcwd(), stdout=self._folder / "log.txt")  # fmt: skip
            except Exception:  # no child: this process runs them all
                traceback.print_exc()
            finally:
                self._started.set()

        threading.Thread(target=spawn, name="alongside-start", daemon=True).start()

    def take(self, nodeid: str) -> dict[str, Any] | None:
        """The child's outcome of the test, or None when this process is to run it."""
        assert self._folder is not None
        key = self.keys[nodeid]
        if self._abandoned or _claim(self._folder, key, "suite"):
            return None
        result = self._folder / "results" / f"{key}.json"
        got = False
        try:
            self._started.wait()
            while not result.exists():
                if self._proc is None or self._proc.poll() is not None:  # the child died on this test
                    return None if not result.exists() else json.loads(result.read_text())
                time.sleep(0.02)
            got = True
            return json.loads(result.read_text())
        finally:
            if not got and not result.exists():  # stopped while waiting (a timeout): nothing more from it
                self._abandon()

    def _abandon(self) -> None:
        self._abandoned = True
        if self._proc is not None:
            self._proc.kill()

    def log_tail(self) -> str:
        path = None if self._folder is None else self._folder / "log.txt"
        return path.read_text(errors="replace")[-3000:] if path is not None and path.exists() else ""

    def stop(self) -> None:
        self._abandoned = True
        if self._folder is None:  # never started
            return
        self._started.wait(timeout=1)
        if self._proc is not None:
            self._proc.kill()
        shutil.rmtree(self._folder, ignore_errors=True)


def _run(entry: dict[str, Any]) -> dict[str, Any]:
    import importlib

    from _pytest.outcomes import Skipped

    started = time.perf_counter()
    try:
        function = getattr(importlib.import_module(entry["module"]), entry["function"])
        function(**entry["params"])
        outcome = {"outcome": "passed"}
    except Skipped as skipped:
        outcome = {"outcome": "skipped", "reason": skipped.msg}
    except BaseException:
        outcome = {"outcome": "failed", "traceback": traceback.format_exc()}
    return {**outcome, "seconds": time.perf_counter() - started, "pid": os.getpid()}


def child(plan_path: str, folder: str) -> None:
    """Claim and run tests from the last backwards until the suite's process has claimed the next one."""
    root = Path(folder)
    for entry in json.loads(Path(plan_path).read_text()):
        if not _claim(root, entry["key"], "child"):
            return  # the suite got here first: the rest before it are the suite's too
        print(f"alongside: {entry['module']}.{entry['function']}{entry['params'] or ''}", flush=True)
        result = _run(entry)
        print(f"alongside: {result['outcome']} in {result['seconds']:.1f} s", flush=True)
        partial = root / "results" / f"{entry['key']}.part"
        partial.write_text(json.dumps(result))
        os.replace(partial, root / "results" / f"{entry['key']}.json")  # whole, or not there


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
