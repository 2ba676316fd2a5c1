"""The package's shape: data flows glue -> engine -> runtime -> schedule, and no module, class or
function outgrows one job (docs/architecture.md). These fail on a change that reaches back up a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_roundpipe"

MAY_IMPORT = {
    "schedule": {"schedule"},
    "runtime": {"runtime", "schedule"},
    "engine": {"engine", "runtime", "schedule"},
    "models": {"models"},
}
"""Per layer (a subpackage), the layers its modules may import; the top-level glue modules may import any."""

MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 400, 300, 80


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def package_imports(path: Path) -> set[str]:
    """``lightning_roundpipe.*`` modules ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith("lightning_roundpipe.")}
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    layer = path.relative_to(PACKAGE).parts[0]
    if layer not in MAY_IMPORT:
        return  # glue
    reached = set()
    for name in package_imports(path):
        parts = name.split(".")
        target = parts[1]
        if target in MAY_IMPORT or (PACKAGE / target).is_dir():
            reached.add(target)
        elif (PACKAGE / f"{target}.py").exists():
            reached.add(f"{target}.py (glue)")
    assert reached <= MAY_IMPORT[layer], f"{path.name} in {layer}/ reaches {sorted(reached - MAY_IMPORT[layer])}"


def test_no_module_class_or_function_outgrows_one_job():
    too_big = []
    for path in modules():
        source = path.read_text()
        where = path.relative_to(PACKAGE)
        if len(source.splitlines()) > MODULE_LINES:
            too_big.append(f"{where}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                size = (node.end_lineno or first) - first + 1
                limit = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
                if size > limit:
                    too_big.append(f"{where}: {node.name} {size} lines (limit {limit})")
    assert not too_big, "split these by job: " + "; ".join(too_big)


def test_the_check_sees_a_layer_reaching_back_up(tmp_path):
    """The import check reads imports inside functions too (a lazy import is still a dependency)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from lightning_roundpipe.engine import PipelineEngine\n")
    assert package_imports(module) == {"lightning_roundpipe.engine", "lightning_roundpipe.engine.PipelineEngine"}
