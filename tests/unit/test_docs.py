"""The README documents every backend and kernel name (names come from ctx_plugin.names only)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ctx_plugin.names import Backend, Kernel, Recompute

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("name", [m.value for m in (*Backend, *Kernel)])
def test_readme_has_a_row_for_every_name(name):
    assert f"| `{name}`" in README


@pytest.mark.parametrize("name", [m.value for m in Recompute])
def test_readme_has_a_row_for_every_recompute_preset(name):
    assert f"| `{name}" in README


def test_quick_start_has_the_two_commands_ci_uses():
    assert "bash launch/demo.sh" in README and "bash launch/test.sh" in README
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert "bash launch/test.sh" in ci
