"""Python processes that start with torch and Lightning already imported: a server that imports them once and
forks a child per command, which then runs its script as ``python script.py args`` would (``sys.argv``,
``sys.path``, environment, working folder, standard streams, exit code).

Most of a fresh process's cost in the tests that launch one (a node of a multi-node run, a benchmark script)
is importing torch and Lightning: about 10 s of a 2-core machine each, some 30 processes a suite. What the
tests check runs in the child as it would in a fresh process. Nothing has run in the server before a fork
(imports only: no thread pool of torch's, no process group, no random numbers drawn), and each child
re-seeds NumPy's global generator from the OS, as a fresh process seeds it. What a fork cannot give each
child is its own hash seed (``PYTHONHASHSEED``, drawn at interpreter start): the nodes of one run therefore
come from different servers (the ``prewarmed`` fixture's ``[rank]``), so they order sets and dicts of
strings differently, as processes on different machines do. Nor do the preloaded modules see the child's
environment when imported (Lightning's ``rank_zero_only`` reads a rank then; the multi-node strategy sets
it itself): the launch recipes (``torchrun``, SLURM's variables) are tested with fresh processes.

Run as a script, this file is the server: it reads one JSON request a line on stdin (a command: ``id``,
``argv``, ``env``, ``cwd``, ``stdout`` and ``stderr`` files; or ``kill``: a pid) and answers one JSON line
each on stdout (``ready``, ``started`` with the child's pid, ``exited`` with its return code as
``subprocess`` gives it). At the end of its stdin it kills its remaining children and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any


def _send(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # unbuffered: nothing left to be copied into a fork


def _run_child(request: dict[str, Any], base_path: list[str]) -> None:
    """In the forked child: become ``python argv[0] argv[1:]`` and exit with its code. Never returns."""
    code = 1
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        out = os.open(request["stdout"], flags, 0o644)
        err = out if request["stderr"] == request["stdout"] else os.open(request["stderr"], flags, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        pythonpath = request["env"].get("PYTHONPATH", "")  # an empty entry is the working folder, as at start-up
        extra = [os.path.abspath(entry) for entry in pythonpath.split(os.pathsep)] if pythonpath else []
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *extra, *base_path]
        sys.argv = list(request["argv"])
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # from the OS, as at a fresh import
        import runpy
        import traceback

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit:
            if exit.code is None or isinstance(exit.code, int):
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
                code = 1
        except BaseException:  # what the interpreter prints of an uncaught exception
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: non-daemon threads end
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    import lightning  # noqa: F401
    import torch  # noqa: F401

    base_path = sys.path[1:]  # this file's folder is the first
    children: dict[int, int] = {}
    _send({"ready": os.getpid()})
    buffer = b""
    try:
        while True:
            readable, _, _ = select.select([0], [], [], 0.05)
            if readable:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)
                    if "kill" in request:
                        if request["kill"] in children:
                            os.kill(request["kill"], signal.SIGKILL)
                        continue
                    pid = os.fork()
                    if pid == 0:
                        _run_child(request, base_path)
                    children[pid] = request["id"]
                    _send({"started": request["id"], "pid": pid})
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.pop(pid, None)
                _send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for pid in children:
            os.waitpid(pid, 0)


class Server:
    """The test side of one server process: ``popen`` starts a child, a ``subprocess.Popen`` look-alike."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=env, cwd=Path(__file__).parent)  # fmt: skip
        self._changed = threading.Condition()
        self._writing = threading.Lock()  # requests come from several threads (tests/test_benchmarks.py)
        self._pids: dict[int, int] = {}
        self._exited: dict[int, int] = {}
        self._ready = False
        self._gone = False
        self._requests = 0
        threading.Thread(target=self._read, name="prewarmed-server", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "ready" in message:
                    self._ready = True
                elif "started" in message:
                    self._pids[message["started"]] = message["pid"]
                elif "exited" in message:
                    self._exited[message["exited"]] = message["returncode"]
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def _wait_for(self, done: Any, timeout: float | None, what: str) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: done() or self._gone, timeout):
                raise TimeoutError(what)
            if not done():
                raise RuntimeError(f"the prewarmed server ended (return code {self._proc.poll()}) before {what}")

    def _request(self, request: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        with self._writing:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()

    def popen(self, argv: list[str], env: dict[str, str], cwd: str | Path, stdout: Path, stderr: Path | None = None):
        """Start ``python argv[0] argv[1:]``; its output goes to ``stdout`` and ``stderr`` (the same file when
        ``stderr`` is None), read back by ``communicate``."""
        self._wait_for(lambda: self._ready, 300, "it imported torch and Lightning")
        with self._changed:
            self._requests += 1
            request_id = self._requests
        self._request({"id": request_id, "argv": [str(a) for a in argv], "env": dict(env), "cwd": str(cwd),
                       "stdout": str(stdout), "stderr": str(stderr or stdout)})  # fmt: skip
        self._wait_for(lambda: request_id in self._pids, 60, "it started a child")
        return Forked(self, self._pids[request_id], argv, Path(stdout), None if stderr is None else Path(stderr))

    def close(self) -> None:
        """The server kills the children still running and exits (not waited for: its own exit takes seconds)."""
        with self._writing:
            if self._proc.stdin is not None and not self._proc.stdin.closed:
                self._proc.stdin.close()


class Forked:
    """A child of a ``Server``, used as a ``subprocess.Popen`` of ``stdout=PIPE`` is (``stderr=STDOUT``, or
    ``stderr=PIPE`` when it has a file of its own)."""

    def __init__(self, server: Server, pid: int, args: list[str], stdout: Path, stderr: Path | None) -> None:
        self._server, self.pid, self.args, self._stdout, self._stderr = server, pid, args, stdout, stderr

    @property
    def returncode(self) -> int | None:
        with self._server._changed:
            return self._server._exited.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            self._server._wait_for(lambda: self.pid in self._server._exited, timeout, f"child {self.pid} exited")
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self._server._exited[self.pid]

    def kill(self) -> None:
        if self.returncode is None:
            self._server._request({"kill": self.pid})

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        read = lambda path: path.read_text(errors="replace")  # noqa: E731
        return read(self._stdout), None if self._stderr is None else read(self._stderr)


if __name__ == "__main__":
    serve()
