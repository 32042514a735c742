"""What makes a Megatron or DeepSpeed job fail late, checked before it is submitted (and again when it starts).

Each check takes the framework's own arguments and the job's shape (nodes × processes per node, device) and
returns a one-line summary of the parallel layout, or raises ``ValueError`` naming the input to change.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from ..core.rules import SettingNames, check_sequence_parallel, check_tp_heads
from ..megatron.args import add_arguments, settings_from_args
from ..megatron.budget import UNDESCRIBED
from ..megatron.options import DATA_OPTIONS, MODEL_OPTIONS
from ..megatron.pretrain_gpt import uses_megatron_pretrain
from ..names import Recompute

_NAMES = SettingNames(seq_len="--seq-length", cp="--context-parallel-size", tp="--tensor-model-parallel-size",
                      heads="--num-attention-heads", kv_heads="--num-query-groups")


def _file(path: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{what} {path}: no such file")
    return p


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):             # a missing parent package of a dotted name
        return False


# The options ctx_plugin refuses (megatron/options.py's tables) that take a value in Megatron-LM's parser; the others
# are switches there (store_true).
_VALUED = {"attention_dropout": float, "experimental_attention_variant": str, "flash_attention_version": int,
           "position_embedding_type": str, "cuda_graph_impl": str}


def _int_tuple(text: str) -> tuple[int, ...]:
    """Megatron-LM's ``tuple_type`` (``--window-size``): ``"(4,0)"`` or ``"4,0"``."""
    return tuple(int(i) for i in text.strip("()").split(","))


def _megatron_parser() -> argparse.ArgumentParser:
    """The Megatron flags the checks read, with Megatron's defaults (everything else passes through): those the
    job's own check (``settings_from_args``) reads, so that the launcher refuses what the job would, among them every
    option ctx_plugin refuses (``MODEL_OPTIONS``/``DATA_OPTIONS``) and ``--window-size``/``--softmax-type``."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for option in MODEL_OPTIONS + DATA_OPTIONS:
        if option.field in _VALUED:
            default = {"attention_dropout": 0.1, "position_embedding_type": "learned_absolute",
                       "cuda_graph_impl": "none"}.get(option.field)
            p.add_argument(option.flag, type=_VALUED[option.field], default=default)
        else:
            p.add_argument(option.flag, action="store_true")
    p.add_argument("--window-size", type=_int_tuple, default=None)
    p.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"), default="vanilla")
    for flag, kind, default in (("--tensor-model-parallel-size", int, 1), ("--pipeline-model-parallel-size", int, 1),
                                ("--context-parallel-size", int, 1), ("--num-layers", int, None),
                                ("--hidden-size", int, None), ("--ffn-hidden-size", int, None),
                                ("--num-attention-heads", int, None), ("--num-query-groups", int, None),
                                ("--seq-length", int, None), ("--micro-batch-size", int, 1),
                                ("--global-batch-size", int, None),
                                ("--vocab-size", int, None), ("--normalization", str, "LayerNorm"),
                                ("--attention-backend", str, "auto"), ("--recompute-granularity", str, None),
                                ("--recompute-method", str, None), ("--recompute-num-layers", int, None),
                                ("--load", str, None), ("--save", str, None), ("--exit-signal", str, None),
                                ("--data-args-path", str, None),
                                ("--tokenizer-model", str, None), ("--vocab-file", str, None),
                                ("--merge-file", str, None), ("--make-vocab-size-divisible-by", int, 128),
                                ("--max-position-embeddings", int, None)):
        p.add_argument(flag, type=kind, default=default)
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--cp-comm-type",
                 "--hierarchical-context-parallel-sizes"):
        p.add_argument(flag, nargs="*", default=None)
    for flag in ("--group-query-attention", "--swiglu", "--bf16", "--fp16", "--sequence-parallel",
                 "--use-distributed-optimizer", "--mock-data", "--exit-signal-handler", "--recompute-activations",
                 "--reset-attention-mask", "--sft", "--dataloader-inter-document-masking",    # options.check_reset_data
                 "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--use-rotary-position-embeddings"):
        p.add_argument(flag, action="store_true")
    for name, kind, _ in UNDESCRIBED:                                         # refused with budget:<GiB>
        p.add_argument("--" + name.replace("_", "-"), **({"action": "store_true"} if kind is bool else {"type": kind}))
    for flag, dest in (("--disable-bias-linear", "add_bias_linear"), ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
                       ("--no-bias-gelu-fusion", "bias_gelu_fusion")):          # budget:<GiB>'s model (model_spec)
        p.add_argument(flag, action="store_false", dest=dest)
    p.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    for flag, kind, default in (("--num-experts", int, None), ("--mtp-num-layers", int, None)):
        p.add_argument(flag, type=kind, default=default)
    p.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss")   # options.check_reset_data
    return add_arguments(p)


def _data_prefixes(values: list[str] | None) -> list[str]:
    """Megatron's ``--data-path [weight] prefix ...``: the prefixes (weights are numbers)."""
    prefixes = []
    for v in values or []:
        try:
            float(v)
        except ValueError:
            prefixes.append(v)
    return prefixes


def _check_stop_and_resume(args: argparse.Namespace) -> None:
    """Megatron saves and stops on the time-limit warning through its own flags: ``--exit-signal-handler`` with
    ``--exit-signal SIGUSR1`` (the signal the job script passes to every rank) and ``--save``; a requeued attempt
    resumes with ``--load`` (the same directory, absent before the first save)."""
    if args.exit_signal_handler:
        if args.exit_signal != "SIGUSR1":
            raise ValueError(f"--exit-signal-handler listens for {args.exit_signal or 'SIGTERM (the default)'}, but "
                             f"the job script passes SLURM's time-limit warning to the ranks as SIGUSR1: add "
                             f"--exit-signal SIGUSR1")
        if not args.save:
            raise ValueError("--exit-signal-handler without --save stops on the warning without saving: add --save DIR "
                             "(and --load DIR to resume from it)")
    if args.load and not Path(args.load).expanduser().is_dir() and not _same_path(args.load, args.save):
        raise ValueError(f"--load {args.load}: no such checkpoint directory")


def _same_path(a: str | None, b: str | None) -> bool:
    return bool(a and b) and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def check_megatron(argv: list[str], *, world: int, device: str, megatron_lm: str) -> str:
    """Checks a ``pretrain_gpt.py`` command line for ``world`` ranks; returns the parallel layout."""
    script = Path(megatron_lm).expanduser() / "pretrain_gpt.py"
    if not script.is_file():
        raise ValueError(f"--megatron-lm {megatron_lm}: no pretrain_gpt.py there; give the root of a Megatron-LM "
                         f"checkout")
    if device == "cpu" and uses_megatron_pretrain(script):      # the entry point's own CUDA check
        raise ValueError(f"{script} trains with Megatron-LM's pretrain(), which needs CUDA, and this job has no GPU: "
                         f"request GPUs (sbatch --gpus-per-node N) or use a CPU-capable training script")
    try:
        args, _ = _megatron_parser().parse_known_args(argv)      # Megatron's other flags pass through
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world % (tp * pp * cp):
        raise ValueError(f"{world} ranks (nodes × processes per node) are not a multiple of TP × PP × CP = "
                         f"{tp} × {pp} × {cp} = {tp * pp * cp}: change the node count, the processes per node or "
                         f"--tensor-model-parallel-size/--pipeline-model-parallel-size/--context-parallel-size")
    dp = world // (tp * pp * cp)
    kv_heads = args.num_query_groups if args.group_query_attention and args.num_query_groups else \
        args.num_attention_heads                  # as settings_from_args reads them
    check_tp_heads(args.num_attention_heads, kv_heads, tp, _NAMES)
    gbs = args.global_batch_size
    if gbs is not None and gbs % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size × DP = "
                         f"{args.micro_batch_size} × {dp}")
    args.data_parallel_size = dp                  # as Megatron's validate_args and tokenizer set them
    multiple = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple if args.vocab_size else None
    # the --cp-* checks the job itself makes at start; budget:<GiB> needs the vocabulary, which only a given
    # --vocab-size tells before the job builds its tokenizer
    settings = settings_from_args(args, resolve_budget=args.padded_vocab_size is not None)
    if args.sequence_parallel:                    # each CP rank's tokens split over its TP ranks
        check_sequence_parallel(settings.cp_config, args.seq_length, cp, tp, _NAMES)
    for prefix in _data_prefixes(args.data_path) + _data_prefixes(args.train_data_path) + \
            _data_prefixes(args.valid_data_path) + _data_prefixes(args.test_data_path):
        for suffix in (".bin", ".idx"):
            _file(prefix + suffix, "--data-path prefix: indexed dataset file")
    for flag in ("data_args_path", "tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, flag):
            _file(getattr(args, flag), f"--{flag.replace('_', '-')}")
    _check_stop_and_resume(args)
    return (f"Megatron: {world} ranks = TP {tp} × PP {pp} × CP {cp} ({settings.cp_config.backend}) × DP {dp}, "
            f"sequence {args.seq_length}, recompute {settings.recompute}"
            + ("" if args.padded_vocab_size or settings.recompute.preset != Recompute.BUDGET else
               " (chosen when the job starts: the tokenizer gives the vocabulary size)"))


def check_deepspeed(program: list[str], *, world: int, device: str, ds_config: str) -> str:
    """Checks a DeepSpeed job: the config file and its ``"context_parallel"`` section for ``world`` ranks, and
    the program (``script.py ...`` or ``-m module ...``) that ``torchrun`` starts; returns the layout."""
    from ..deepspeed.config import SECTION, _refuse_ds_checkpointing, read_config, split_config, world_config

    path = _file(ds_config, "--ds-config")
    try:         # as ctx_plugin.deepspeed.initialize (and DeepSpeed) read it: hjson, no key twice
        config = read_config(path)
    except ValueError as e:
        raise ValueError(f"--ds-config {ds_config}: not a valid DeepSpeed config file ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--ds-config {ds_config}: a DeepSpeed config is a JSON object, got {type(config).__name__}")
    if SECTION not in config:
        raise ValueError(f'--ds-config {ds_config} has no "{SECTION}" section: add one to switch context '
                         f'parallelism on (see README, DeepSpeed)')
    section, config = split_config(config)        # the refusals initialize makes before it builds any group
    if config.get("train_batch_size") is None and config.get("train_micro_batch_size_per_gpu") is None:
        raise ValueError("the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu")
    config = world_config(config, section, world, ranks="the ranks (nodes × processes per node)")
    if not program:
        raise ValueError("give the training program after '--': a script (train.py ...) or a module (-m name ...)")
    given = next((a for a in program if _names_deepspeed_config(a.split("=", 1)[0])), None)
    if given is not None:
        raise ValueError(f"the launcher passes --deepspeed_config from --ds-config; drop {given} from the program's "
                         f"arguments")
    if program[0] == "-m":
        if len(program) < 2 or not _module_exists(program[1]):
            raise ValueError(f"-m {program[1] if len(program) > 1 else ''}: no such module in this Python")
        if program[1] == "ctx_plugin.train_hf":
            from ..train_hf import check_job, parse_args
            _refuse_ds_checkpointing(config)                # train_hf trains a Hugging Face model
            check_job(parse_args(program[2:]), section.cp_config, section.size)
    else:
        _file(program[0], "training script")
    return (f"DeepSpeed: {world} ranks = CP {section.size} ({section.cp_config.backend}) × DP {world // section.size}, "
            f"ZeRO {config.get('zero_optimization', {}).get('stage', 0)}, recompute {section.recompute}, "
            f"{device}")


def _names_deepspeed_config(name: str) -> bool:
    """``name`` is DeepSpeed's ``--deepspeed_config`` (also as argparse's abbreviation of it, or its deprecated
    ``--deepscale_config``), which argparse would let override the one the launcher appends or be overridden by it."""
    return name in ("--deepspeed-config", "--deepscale_config") or \
        (len(name) > len("--deepspeed_") and "--deepspeed_config".startswith(name))


def check_requeue(framework: str, program: list[str]) -> None:
    """A job that requeues itself must resume in each attempt, else every attempt trains again from the start (and
    overwrites the checkpoints with earlier steps): Megatron's ``--load`` must be its ``--save`` (with
    ``--exit-signal-handler``, which saves on the warning); ``ctx_plugin.train_hf`` needs ``--resume``. A script of
    your own must resume itself (not checkable here). ``ValueError`` naming the flag."""
    if framework == "megatron":
        args, _ = _megatron_parser().parse_known_args(program)
        if not args.exit_signal_handler or not args.save:
            raise ValueError("--requeue: the ranks must save when the time-limit warning comes, or the requeued "
                             "attempt has nothing to resume: add --exit-signal-handler --exit-signal SIGUSR1 --save DIR "
                             "--load DIR")
        if not args.load or not _same_path(args.load, args.save):
            raise ValueError(f"--requeue: each attempt must resume from what the previous one saved: give --load "
                             f"{args.save} (the --save directory; it may not exist before the first save), not "
                             f"{'no --load' if not args.load else '--load ' + args.load}")
    elif program[:2] == ["-m", "ctx_plugin.train_hf"] and "--resume" not in program:
        raise ValueError("--requeue: ctx_plugin.train_hf starts from step 0 without --resume (and a later stop would "
                         "overwrite the checkpoints with earlier steps): add --resume, which starts afresh when "
                         "there is no checkpoint yet")


CHECKS = {"megatron": check_megatron, "deepspeed": check_deepspeed}
"""The frameworks the job scripts launch, with their checks (one source of truth for the names)."""
