"""The package's layers (README "Layout of the repository"): ``ctx_plugin.core``, the algorithm, imports no adapter,
no tool and no training framework, anywhere in its files (lazy imports included), and reads no environment variable;
only the shared list of names and the recompute state (the pinned attention's replay) come from outside it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ctx_plugin

CORE = Path(ctx_plugin.__file__).parent / "core"
ALLOWED_OUTSIDE_CORE = ("ctx_plugin.names", "ctx_plugin.recompute")
FRAMEWORKS = ("megatron", "deepspeed", "transformers")


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    package = ["ctx_plugin", *path.relative_to(CORE.parent).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [module] + [f"{module}.{alias.name}" for alias in node.names if not node.module]
    return found


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_imports_no_adapter_tool_or_framework(path):
    for module in imported_modules(path):
        top = module.split(".")[0]
        assert top not in FRAMEWORKS, f"{path.name} imports {module}: core must not depend on a training framework"
        if top == "ctx_plugin" and module != "ctx_plugin" and not module.startswith("ctx_plugin.core"):
            assert module.startswith(ALLOWED_OUTSIDE_CORE), \
                f"{path.name} imports {module}: core may only import ctx_plugin.core, names and recompute"


def test_the_check_sees_relative_imports():
    """The resolution itself: api.py's relative imports of its siblings and of the recompute package."""
    found = imported_modules(CORE / "api.py")
    assert "ctx_plugin.core.agreement" in found and "ctx_plugin.recompute" in found
    assert "ctx_plugin.core.kernels.flash_attn_support" in imported_modules(CORE / "kernels" / "flash_attn.py")


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_reads_no_environment_variable(path):
    """No env-var dispatch: the algorithm takes everything as arguments (the adapters read the frameworks' state)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            assert node.attr not in ("environ", "getenv", "putenv"), f"{path.name}:{node.lineno} reads os.{node.attr}"
