"""``python -m ctx_plugin.megatron.pretrain_gpt --megatron-lm PATH <Megatron args> <--cp-* args>``

Runs ``PATH/pretrain_gpt.py`` — the user's Megatron-LM checkout, unedited — with ctx_plugin switched on. Before
the script starts, four seams are set up in memory (all in this process, nothing on disk):

1. Megatron's ``parse_args`` gets the ``--cp-*`` flags, chained after the script's own ``extra_args_provider``.
   Once Megatron has validated and completed its arguments (``set_global_variables``: data-parallel size,
   padded vocabulary), the flags are validated against Megatron's and resolved once (``settings_from_args``,
   ``budget:<GiB>`` included); presets Megatron can express are written into its ``--recompute-*`` settings,
   and every seam below reads these settings. A flag error prints once (rank 0), argparse style, exit code 2.
2. ``GPTModel`` becomes a subclass that swaps ctx_plugin's core attention into whatever layer spec the script
   passes (local or Transformer Engine), gives RoPE the positions each rank holds, and applies the recompute
   presets Megatron cannot express (attention pinned).
3. ``get_batch_on_this_cp_rank`` shards batches in the backend's layout instead of Megatron's zigzag; a
   ``--reset-attention-mask`` batch comes back packed (THD: ``cu_seqlens``, :mod:`ctx_plugin.megatron.mask_documents`),
   and the model refuses to run it without the ``packed_seq_params`` Megatron-LM's ``forward_step`` builds from it.
4. Under the job scripts (``$CTX_ATTEMPT_DIR`` set), every signal Megatron's ``--exit-signal-handler`` takes is also
   recorded by the rank that got it, in front of Megatron's own handler (:mod:`ctx_plugin.megatron.stop_signal`).

A script that trains with Megatron-LM's ``pretrain`` (``from megatron.training import pretrain``, in any form)
needs CUDA; without it the entry point says so before Megatron starts.

Loss reduction, gradient reduction over data × context ranks, optimizers and checkpoints stay Megatron's.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import runpy
import sys
import time
from pathlib import Path

from . import require_megatron
from .args import MegatronCPSettings, add_arguments, settings_from_args

PROG = "python -m ctx_plugin.megatron.pretrain_gpt"
PEER_GRACE_S = 20.0
"""How long a rank other than 0 waits before it exits on a flag error (see :func:`fail`)."""


def fail(message: str, rank: int | None = None) -> None:
    """Ends the run as argparse does (``prog: error: message``, exit code 2), printed by rank 0 only, so the
    message appears once. The other ranks first give rank 0 up to :data:`PEER_GRACE_S` seconds: exiting at once
    could make torchrun stop rank 0 before it printed. ``rank`` defaults to torchrun's ``RANK``."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(PEER_GRACE_S)     # torchrun ends this rank as soon as rank 0 has exited with the message
    raise SystemExit(2)


def uses_megatron_pretrain(script: Path) -> bool:
    """Whether ``script`` imports Megatron-LM's ``pretrain`` (which needs CUDA): ``from megatron.training
    import pretrain`` on one line or in a parenthesised block, ``from megatron.training.training import
    pretrain``, a ``*`` import of either, or ``megatron.training.pretrain`` used after ``import megatron...``.
    ValueError when the file is not Python."""
    try:
        tree = ast.parse(Path(script).read_text(), filename=str(script))
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"{script}: not a Python script ({e})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in ("megatron.training",
                                                                                     "megatron.training.training"):
            if any(alias.name in ("pretrain", "*") for alias in node.names):
                return True
        if isinstance(node, ast.Attribute) and node.attr == "pretrain" and ast.unparse(node.value) in (
                "megatron.training", "megatron.training.training"):
            return True
    return False


class RunSettings:
    """The ``--cp-*`` settings of one run, computed once when Megatron's arguments are complete and shared by
    the seams (the model, the batch sharder, ``--spec ctx_plugin.megatron.spec layer_spec``)."""

    def __init__(self) -> None:
        self._settings: MegatronCPSettings | None = None

    def compute(self, args: argparse.Namespace) -> MegatronCPSettings:
        """Validates and resolves the flags (a flag error ends the run, see :func:`fail`), and writes the
        recompute fields Megatron applies into ``args``."""
        if self._settings is not None:
            raise RuntimeError("ctx_plugin's settings are computed once per run, and already were")
        try:
            settings = settings_from_args(args)
        except ValueError as e:
            fail(str(e), getattr(args, "rank", None))
        for name, value in (settings.megatron_recompute or {}).items():
            setattr(args, name, value)
        self._settings = settings
        return settings

    @property
    def settings(self) -> MegatronCPSettings:
        if self._settings is None:
            raise RuntimeError("ctx_plugin's settings are read before Megatron's set_global_variables completed "
                               "the arguments; the script must parse its arguments through Megatron "
                               "(parse_and_validate_args, or initialize_megatron inside pretrain)")
        return self._settings


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
    import megatron.training.dist_signal_handler as dist_signal_handler
    import megatron.training.global_vars as global_vars
    from megatron.core import parallel_state

    from ..slurm.signals import OwnSignalRecord
    from .core_attention import GroupsProvider
    from .mask_documents import PackedHandoff
    from .spec import batch_documents, gpt_layer_spec, prepare_model, shard_batch
    from .stop_signal import recording

    run = RunSettings()
    handoff = PackedHandoff()         # --reset-attention-mask batches the sharder packs must reach the model packed
    providers: dict = {}              # one GroupsProvider per CP config, shared by model and batches

    def provider_for(settings):
        return providers.setdefault(settings.cp_config, GroupsProvider(settings.cp_config))

    original_parse = arguments.parse_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        return original_parse(_chain(extra_args_provider), ignore_unknown_args)

    original_set_globals = global_vars.set_global_variables

    def set_global_variables(args, *more, **kwargs):
        original_set_globals(args, *more, **kwargs)
        run.compute(args)

    base = gpt_model_mod.GPTModel

    class CPGPTModel(base):
        """Megatron's GPTModel with ctx_plugin's core attention, layout-aware RoPE and recompute preset."""

        def __init__(self, config, transformer_layer_spec, *args, **kwargs):
            settings = run.settings
            provider = provider_for(settings)
            spec = gpt_layer_spec(settings.cp_config, base=transformer_layer_spec, groups_provider=provider)
            super().__init__(config, spec, *args, **kwargs)
            prepare_model(self, settings, provider, kwargs.get("pg_collection"))

        def forward(self, *args, **kwargs):
            handoff.receive(forward_signature.bind(self, *args, **kwargs).arguments.get("packed_seq_params"))
            return super().forward(*args, **kwargs)

    forward_signature = inspect.signature(base.forward)

    def get_batch_on_this_cp_rank(batch, *args, cp_group=None, **kwargs):
        settings = run.settings
        group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        sharded = shard_batch(batch, config=settings.cp_config, groups=provider_for(settings).get(group),
                              pad_documents=settings.document_padding)
        if batch.get("cu_seqlens") is None and sharded.get("cu_seqlens") is not None:    # packed from the mask
            handoff.expect(batch_documents(sharded))
        return sharded

    def iteration():
        try:
            return getattr(global_vars.get_args(), "curr_iteration", None)    # set by Megatron's training loop
        except AssertionError:
            return None

    signal_handler = dist_signal_handler.DistributedSignalHandler

    get_batch_on_this_cp_rank.ctx_plugin_seam = True  # spec.layer_spec: batches and RoPE follow the backend's layout
    get_batch_on_this_cp_rank.ctx_plugin_run = run    # spec.layer_spec: this run's settings

    for name in ("megatron.training.utils", "megatron.training.initialize"):
        try:   # Megatron-LM's scripts import these names from here; load them so the rebinding reaches them
            __import__(name)
        except ImportError:
            pass
    for name, old, new in (("parse_args", original_parse, parse_args),
                           ("set_global_variables", original_set_globals, set_global_variables),
                           ("GPTModel", base, CPGPTModel),
                           ("get_batch_on_this_cp_rank", core_utils.get_batch_on_this_cp_rank,
                            get_batch_on_this_cp_rank),
                           ("DistributedSignalHandler", signal_handler,
                            recording(signal_handler, OwnSignalRecord(step=iteration)))):
        _rebind(name, old, new)


def _rebind(name: str, old, new) -> None:
    """Points every loaded megatron module's ``name`` that is ``old`` at ``new`` (modules imported later, like
    the script, then import ``new``)."""
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] == "megatron" and getattr(module, name, None) is old:
            setattr(module, name, new)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, description=__doc__.split("\n\n")[1])
    parser.add_argument("--megatron-lm", required=True, help="path of the Megatron-LM checkout (with pretrain_gpt.py)")
    ours, rest = parser.parse_known_args(argv)
    root = Path(ours.megatron_lm).resolve()
    script = root / "pretrain_gpt.py"
    if not script.is_file():
        fail(f"--megatron-lm {root}: no pretrain_gpt.py there; give the root of a Megatron-LM checkout")
    try:
        needs_cuda = uses_megatron_pretrain(script)
    except ValueError as e:
        fail(str(e))
    import torch

    if needs_cuda and not torch.cuda.is_available():
        fail(f"{script} trains with Megatron-LM's pretrain() (megatron.training), whose training loop needs CUDA "
             f"GPUs, and torch sees none here: run it on GPU nodes (ctx-plugin launch with sbatch "
             f"--gpus-per-node N)")
    sys.path.insert(0, str(root))     # the checkout's own megatron package wins over an installed wheel
    _install_seams()
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
