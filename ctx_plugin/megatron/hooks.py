"""Functions that a Megatron fork patched with ``patches/`` finds through entry points (see setup.py).

``local_positions`` is the ``megatron.context_parallel_layout`` hook: the global positions this rank holds in
the layout of ``--cp-backend`` (Megatron then shards batches and slices RoPE by them instead of zigzag).
"""
from __future__ import annotations

import functools

import torch

from ..core.config import CPConfig
from ..core.layouts import shard_layout
from ..core.rules import SettingNames, check_seq_len


def local_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor | None:
    """Positions of rank ``cp_rank``'s tokens; None (Megatron's own zigzag) when ctx_plugin's flags are absent."""
    from megatron.training.global_vars import get_args

    try:
        args = get_args()
    except AssertionError:          # Megatron's args are not initialised: not a ctx_plugin run
        return None
    if getattr(args, "cp_backend", None) is None:
        return None
    if getattr(args, "ctx_plugin_attention", None) is None:    # set when ctx_plugin's core attention is built
        given = _flags_given(args)
        if not given:               # a plain Megatron run on a patched fork: Megatron's own zigzag
            return None
        raise ValueError(f"{', '.join(given)}: this Megatron's layout hook would shard batches and slice RoPE for "
                         f"ctx_plugin's attention, but the model was built with Megatron's own core attention (which "
                         f"expects its zigzag chunks and ignores the --cp-* flags); add --spec "
                         f"ctx_plugin.megatron.spec layer_spec, or run through python -m "
                         f"ctx_plugin.megatron.pretrain_gpt")
    config = CPConfig(backend=args.cp_backend, ulysses_size=args.cp_ulysses_size)
    check_seq_len(config, seq_len, cp_size, SettingNames(seq_len="--seq-length"))
    return shard_layout(config).local_indices(seq_len, cp_rank, cp_size)


@functools.cache
def _flag_defaults() -> tuple[tuple[str, str, object], ...]:
    """``(flag, dest, default)`` of each of ctx_plugin's Megatron flags (read once: the hook runs every batch)."""
    import argparse

    from .args import add_arguments

    actions = add_arguments(argparse.ArgumentParser(add_help=False))._actions
    return tuple((a.option_strings[0], a.dest, a.default) for a in actions if a.option_strings[0].startswith("--cp-"))


def _flags_given(args) -> list[str]:
    """ctx_plugin's flags whose values differ from their defaults, as ``--flag value``."""
    given = [(flag, getattr(args, dest)) for flag, dest, default in _flag_defaults()
             if getattr(args, dest, default) != default]
    return [flag + ("" if value is True else f" {value}") for flag, value in given]
