"""Test configuration: the ``gpu`` marker skips cleanly where there is no CUDA device; ``prewarmed`` processes
(``tests/prewarmed.py``) and the ``alongside`` marker (``tests/alongside.py``) that runs tests in one."""

from __future__ import annotations

import pytest
import torch

_servers: list = []
_alongside: dict = {}  # module path: alongside.Module of its selected alongside tests


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "alongside: may run in a second, prewarmed process alongside its module's other tests "
        "(tests/alongside.py): no fixtures but its parameters",
    )  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def prewarmed_servers() -> list:
    """The two servers, started (importing in the background) at the first call."""
    if not _servers:
        from prewarmed import Server

        _servers.extend([Server(), Server()])
    return _servers


@pytest.fixture(scope="session")
def prewarmed():
    """Two servers of Python processes that start with torch and Lightning imported (``tests/prewarmed.py``):
    node ``r`` of a multi-node run comes from server ``r``, so the nodes differ in hash seed as processes of
    their own do."""
    return prewarmed_servers()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    from alongside import Module

    by_module: dict = {}
    for item in session.items:
        if item.get_closest_marker("alongside") and not any(item.iter_markers("skip")) and not any(
            mark.args and mark.args[0] for mark in item.iter_markers("skipif")
        ):  # fmt: skip
            by_module.setdefault(item.path, []).append(item)
    for path, items in by_module.items():
        if len(items) >= 2:  # one test has no one to share with
            _alongside[path] = Module(items, prewarmed_servers()[1])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    module = _alongside.get(item.path)
    if module is not None and not getattr(module, "begun", False):
        module.begun = True
        module.start()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    module = _alongside.get(pyfuncitem.path)
    if module is None or pyfuncitem.nodeid not in module.keys:
        return None
    outcome = module.take(pyfuncitem.nodeid)
    if outcome is None:
        return None  # this process runs it
    if outcome["outcome"] == "passed":
        return True
    if outcome["outcome"] == "skipped":
        pytest.skip(outcome["reason"])
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    pyfuncitem.obj(**args)  # failed in the child: here again, for pytest's report of the failure
    pytest.fail(f"failed in the alongside process (pid {outcome['pid']}), passed when run again here:\n"
                f"{outcome['traceback']}\n{module.log_tail()}")  # fmt: skip


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    module = _alongside.get(item.path)
    if module is not None and (nextitem is None or nextitem.path != item.path):
        module.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module in _alongside.values():
        module.stop()
    for server in _servers:
        server.close()
