"""The split rules (ctx_plugin.core.rules): one function per rule, each surface naming its own settings."""
from __future__ import annotations

import pytest

from ctx_plugin import CPConfig
from ctx_plugin.core.rules import (SettingNames, check_heads, check_seq_len, check_split, check_ulysses_size,
                                   sequence_unit)

MEGATRON = SettingNames(seq_len="--seq-length", cp="--context-parallel-size", ulysses_size="--cp-ulysses-size")


@pytest.mark.parametrize("backend,u,cp,unit", [
    ("ring", 1, 4, 4), ("striped", 1, 4, 4), ("ulysses", 1, 4, 4), ("zigzag", 1, 4, 8), ("allgather", 1, 4, 8),
    ("zigzag", 1, 1, 2), ("ulysses_ring", 2, 4, 4), ("ulysses_ring", 2, 8, 8), ("ulysses_ring", 4, 8, 8),
    ("ulysses_ring", 3, 6, 12)])
def test_sequence_unit(backend, u, cp, unit):
    config = CPConfig(backend=backend, ulysses_size=u)
    assert sequence_unit(config, cp) == unit
    check_seq_len(config, 3 * unit, cp)
    for bad in (unit + unit // 2 if unit > 1 else 0, 0, -unit):
        with pytest.raises(ValueError, match=f"positive multiple of {unit}, got {bad}"):
            check_seq_len(config, bad, cp)


@pytest.mark.parametrize("bad", [True, 8.0, "8"])
def test_seq_len_type(bad):
    with pytest.raises(ValueError, match="positive multiple of 8"):
        check_seq_len(CPConfig(backend="zigzag"), bad, 4)


def test_messages_name_the_surface_settings():
    config = CPConfig(backend="ulysses_ring", ulysses_size=3)
    with pytest.raises(ValueError, match=r"^--cp-ulysses-size 3 must divide --context-parallel-size 4; valid "
                                         r"--cp-ulysses-size values: \[1, 2, 4\]$"):
        check_ulysses_size(config, 4, MEGATRON)
    with pytest.raises(ValueError, match=r"^--seq-length must be a positive multiple of 16, got 100 \(zigzag over --context-parallel-size 8\)"):
        check_seq_len(CPConfig(), 100, 8, MEGATRON)


def test_heads():
    ulysses = CPConfig(backend="ulysses")
    check_heads(ulysses, 8, 2, 4)             # K/V heads divide the axis: each rank gets a replicated K/V head
    check_heads(ulysses, 8, 8, 4)
    with pytest.raises(ValueError, match=r"over 4 ranks, but there are 6 query heads; use a context-parallel size "
                                         r"that divides 6: \[1, 2, 3, 6\]"):
        check_heads(ulysses, 6, 6, 4)
    with pytest.raises(ValueError, match=r"needs kv_heads \(3\) to divide 2 or be divisible by it"):
        check_heads(ulysses, 6, 3, 2)
    hybrid = CPConfig(backend="ulysses_ring", ulysses_size=2)
    check_heads(hybrid, 2, 1, 8)              # the axis is ulysses_size, not cp
    with pytest.raises(ValueError, match="use a ulysses_size that divides 3"):
        check_heads(hybrid, 3, 3, 8)
    check_heads(CPConfig(backend="zigzag"), 3, 3, 8)     # no all-to-all axis: anything splits


def test_check_split_order():
    config = CPConfig(backend="ulysses_ring", ulysses_size=3)
    with pytest.raises(ValueError, match="must divide"):        # the Ulysses size first, then the others
        check_split(config, 4, seq_len=7, heads=5)
    with pytest.raises(ValueError, match="multiple of 12"):
        check_split(config, 6, seq_len=7, heads=5)
    with pytest.raises(ValueError, match="5 query heads"):
        check_split(config, 6, seq_len=24, heads=5)
    check_split(config, 6, seq_len=24, heads=6, kv_heads=1)


def test_one_rank_names_the_layout_that_takes_any_length():
    """Zigzag's unit of 2 holds at one rank too (its layout splits every sequence in two chunks); the message then
    names ring, whose unit over one rank is 1, and only then."""
    with pytest.raises(ValueError, match="multiple of 2, got 31 .*, or use backend ring, which splits nothing"):
        check_seq_len(CPConfig(), 31, 1)
    with pytest.raises(ValueError) as e:
        check_seq_len(CPConfig(), 31, 2)
    assert "backend ring" not in str(e.value)
    check_seq_len(CPConfig(backend="ring"), 31, 1)
