"""Which Lightning package the glue modules build on.

``lightning.pytorch`` and ``pytorch_lightning`` hold separate class trees and registries, and a
Trainer of one accepts only strategies derived from its own base classes. The glue modules are
therefore written once and loaded a second time as twins built on ``pytorch_lightning`` when that
package is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

DEFAULT_PACKAGE = "lightning.pytorch"


def lightning_package(module_globals: dict[str, Any]) -> ModuleType:
    """The Lightning package a glue module (or its twin) builds on."""
    return importlib.import_module(module_globals.get("_LIGHTNING_PACKAGE", DEFAULT_PACKAGE))


def sibling(name: str, module_globals: dict[str, Any]) -> ModuleType:
    """Another glue module of the same flavour as the calling one."""
    package = module_globals.get("_LIGHTNING_PACKAGE", DEFAULT_PACKAGE)
    module = importlib.import_module(f"lightning_roundpipe.{name}")
    return module if package == DEFAULT_PACKAGE else twin(module, package)


def twin(module: ModuleType, package: str) -> ModuleType:
    """``module`` loaded again on ``package`` (cached in ``sys.modules``)."""
    name = f"lightning_roundpipe._twin_{package}.{module.__name__.rsplit('.', 1)[-1]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, module.__file__)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    loaded._LIGHTNING_PACKAGE = package  # type: ignore[attr-defined]
    sys.modules[name] = loaded
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[name]
        raise
    return loaded


def is_installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
