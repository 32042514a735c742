"""``python -m ctx_plugin.megatron.pretrain_gpt --megatron-lm PATH <Megatron args> <--cp-* args>``

Runs ``PATH/pretrain_gpt.py`` — the user's Megatron-LM checkout, unedited — with ctx_plugin switched on. Before
the script starts, three seams are set up in memory (all in this process, nothing on disk):

1. Megatron's ``parse_args`` gets the ``--cp-*`` flags, chained after the script's own ``extra_args_provider``;
   right after parsing, the flags are validated against Megatron's (``settings_from_args``) and recompute
   presets Megatron can express are written into its ``--recompute-*`` settings.
2. ``GPTModel`` becomes a subclass that swaps ctx_plugin's core attention into whatever layer spec the script
   passes (local or Transformer Engine), gives RoPE the positions each rank holds, and applies the recompute
   presets Megatron cannot express (attention pinned).
3. ``get_batch_on_this_cp_rank`` shards batches in the backend's layout instead of Megatron's zigzag.

Loss reduction, gradient reduction over data × context ranks, optimizers and checkpoints stay Megatron's.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from . import require_megatron
from .args import add_arguments, settings_from_args


def _chain(provider):
    def both(parser):
        parser = provider(parser) if provider is not None else parser
        return add_arguments(parser)
    return both


def _install_seams() -> None:
    require_megatron()
    import megatron.core.models.gpt.gpt_model as gpt_model_mod
    import megatron.core.utils as core_utils
    import megatron.training.arguments as arguments
    from megatron.core import parallel_state
    from megatron.training import get_args

    from .core_attention import GroupsProvider
    from .spec import gpt_layer_spec, prepare_model, shard_batch

    providers: dict = {}              # one GroupsProvider per CP config, shared by model and batches

    def provider_for(settings):
        return providers.setdefault(settings.cp_config, GroupsProvider(settings.cp_config))

    original_parse = arguments.parse_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original_parse(_chain(extra_args_provider), ignore_unknown_args)
        settings = settings_from_args(args)
        for name, value in (settings.megatron_recompute or {}).items():
            setattr(args, name, value)
        return args

    base = gpt_model_mod.GPTModel

    class CPGPTModel(base):
        """Megatron's GPTModel with ctx_plugin's core attention, layout-aware RoPE and recompute preset."""

        def __init__(self, config, transformer_layer_spec, *args, **kwargs):
            settings = settings_from_args(get_args())
            provider = provider_for(settings)
            spec = gpt_layer_spec(settings.cp_config, base=transformer_layer_spec, groups_provider=provider)
            super().__init__(config, spec, *args, **kwargs)
            prepare_model(self, settings, provider, kwargs.get("pg_collection"))

    def get_batch_on_this_cp_rank(batch, *args, cp_group=None, **kwargs):
        settings = settings_from_args(get_args())
        group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        return shard_batch(batch, config=settings.cp_config, groups=provider_for(settings).get(group))

    get_batch_on_this_cp_rank.ctx_plugin_seam = True  # spec.layer_spec: batches and RoPE follow the backend's layout

    try:   # Megatron-LM's pretrain_gpt.py imports the sharder from here; load it so the rebinding reaches it
        import megatron.training.utils  # noqa: F401
    except ImportError:
        pass
    for name, old, new in (("parse_args", original_parse, parse_args), ("GPTModel", base, CPGPTModel),
                           ("get_batch_on_this_cp_rank", core_utils.get_batch_on_this_cp_rank,
                            get_batch_on_this_cp_rank)):
        _rebind(name, old, new)


def _rebind(name: str, old, new) -> None:
    """Points every loaded megatron module's ``name`` that is ``old`` at ``new`` (modules imported later, like
    the script, then import ``new``)."""
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] == "megatron" and getattr(module, name, None) is old:
            setattr(module, name, new)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ctx_plugin.megatron.pretrain_gpt", add_help=False,
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--megatron-lm", required=True, help="path of the Megatron-LM checkout (with pretrain_gpt.py)")
    ours, rest = parser.parse_known_args(argv)
    root = Path(ours.megatron_lm).resolve()
    script = root / "pretrain_gpt.py"
    if not script.is_file():
        raise SystemExit(f"--megatron-lm {root}: no pretrain_gpt.py there; give the root of a Megatron-LM checkout")
    sys.path.insert(0, str(root))     # the checkout's own megatron package wins over an installed wheel
    _install_seams()
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
