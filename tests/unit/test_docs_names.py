"""Every ``ctx_plugin.x.y`` an error message, docstring or the README tells users to call exists, and every
``:func:`name``` style reference in a docstring names something its module (or ``ctx_plugin``) has."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOTTED = re.compile(r"\bctx_plugin(?:\.[A-Za-z_]\w*)+")
ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|exc):`~?([A-Za-z_][\w.]*)`")
OPTIONAL = ("megatron", "deepspeed", "transformers", "triton", "flash_attn", "matplotlib")


def _strings(path: Path) -> list[str]:
    """String literals of a source file: docstrings, messages, and the literal parts of f-strings."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


SOURCES = sorted((ROOT / "ctx_plugin").rglob("*.py"))
DOTTED_NAMES = sorted({name for path in SOURCES for text in _strings(path) for name in DOTTED.findall(text)}
                      | set(DOTTED.findall((ROOT / "README.md").read_text())))
ROLE_REFS = sorted({(_module_name(path), ref) for path in SOURCES for text in _strings(path)
                    for ref in ROLE.findall(text) if not ref.startswith("ctx_plugin.")})


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{module} needs {e.name}")
        raise


def _lookup(obj, attrs: list[str]):
    for attr in attrs:
        fields = {f.name for f in dataclasses.fields(obj)} if isinstance(obj, type) and \
            dataclasses.is_dataclass(obj) else set()
        if attr in fields and not hasattr(obj, attr):
            return True       # a dataclass field without a default: documented, not a class attribute
        obj = getattr(obj, attr)
    return obj


def resolve(name: str):
    """``ctx_plugin.a.b.c`` → the object: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            return _lookup(_import(module), parts[i:])
    raise AssertionError(f"no module in {name}")


def test_the_scan_finds_names():
    assert "ctx_plugin.recompute.resolve" in DOTTED_NAMES and len(DOTTED_NAMES) > 20
    assert ("ctx_plugin.memory.model", "MemoryEstimate.recompute_fraction") in ROLE_REFS


@pytest.mark.parametrize("name", DOTTED_NAMES)
def test_dotted_name_exists(name):
    try:
        resolve(name)
    except AttributeError as e:
        raise AssertionError(f"{name} is mentioned in ctx_plugin or the README but does not exist: {e}") from None


@pytest.mark.parametrize("module,ref", ROLE_REFS, ids=[f"{m}:{r}" for m, r in ROLE_REFS])
def test_docstring_reference_exists(module, ref):
    """A bare ``:func:`name``` names something of its own module (a class member for ``:meth:``/``:attr:``, a
    sibling module for ``.name``) or of the top-level ``ctx_plugin``."""
    mod = _import(module)
    if ref.startswith("."):
        package = module if (ROOT / module.replace(".", "/")).is_dir() else module.rpartition(".")[0]
        assert importlib.util.find_spec(ref, package) is not None, f"{module} mentions missing module {ref}"
        return
    parts = ref.split(".")
    scopes = [mod, importlib.import_module("ctx_plugin"),
              *(v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == module)]
    for scope in scopes:
        try:
            _lookup(scope, parts)
            return
        except AttributeError:
            continue
    raise AssertionError(f"{module} refers to {ref}, which neither it, its classes nor ctx_plugin have")
