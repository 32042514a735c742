"""The ``"context_parallel"`` section of a DeepSpeed config and what it changes in the rest of the config (batch
sizes, ZeRO-3's linear under ``selective``); used by :func:`ctx_plugin.deepspeed.initialize` and the launcher."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

from ..core.config import CPConfig
from ..core.rules import SettingNames, check_ulysses_size
from ..names import Recompute
from ..recompute import RecomputeConfig
from ..recompute.mappings import DEEPSPEED_CHECKPOINTING

SECTION = "context_parallel"


_KEYS = {"backend": str, "size": int, "ulysses_size": int, "kernel": str, "recompute": str, "check_ranks": bool,
         "pad_documents": bool}


@dataclass(frozen=True)
class ContextParallelSection:
    """The validated ``"context_parallel"`` section."""

    cp_config: CPConfig
    size: int
    recompute: RecomputeConfig
    pad_documents: bool = False
    """Packed batches: pad every document to the layout's unit in the loader (else documents it cannot split are an
    error; :func:`ctx_plugin.deepspeed.data.shard_batch`)."""


def parse_section(section: dict) -> ContextParallelSection:
    """Validates a ``"context_parallel"`` section (a ValueError/TypeError naming the key otherwise)."""
    if not isinstance(section, dict):
        raise TypeError(f'"{SECTION}" must be a JSON object, got {type(section).__name__}')
    unknown = sorted(set(section) - set(_KEYS))
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in "{SECTION}"; allowed: {sorted(_KEYS)}')
    for key, kind in _KEYS.items():
        if key in section and (not isinstance(section[key], kind)
                               or isinstance(section[key], bool) != (kind is bool)):
            raise TypeError(f'"{SECTION}.{key}" must be a {kind.__name__}, got {section[key]!r}')
    size = section.get("size")
    if size is None or size < 1:
        raise ValueError(f'"{SECTION}.size" (ranks sharing each sequence) must be a positive int, got {size!r}')
    try:
        cp_config = CPConfig(backend=section.get("backend", "zigzag"), kernel=section.get("kernel", "auto"),
                             ulysses_size=section.get("ulysses_size", 1),
                             check_ranks=section.get("check_ranks", True))
        recompute = RecomputeConfig.parse(section.get("recompute", "none"))
    except (TypeError, ValueError) as e:
        raise type(e)(f'"{SECTION}": {e}') from None
    if recompute.budget_gib is not None:     # the memory model needs the sequence length, which no key gives
        raise ValueError(f'"{SECTION}.recompute": "{recompute}" cannot be resolved from a DeepSpeed config (it does '
                         'not say the sequence length the memory model needs); choose the preset with `ctx-plugin '
                         f'memory --model <config.json> --seq-len <tokens> --cp {size} --budget '
                         f'{recompute.budget_gib:g}` (or ctx_plugin.recompute.resolve) and give that preset here')
    check_ulysses_size(cp_config, size, SettingNames(cp=f'"{SECTION}.size"', ulysses_size=f'"{SECTION}.ulysses_size"'))
    return ContextParallelSection(cp_config=cp_config, size=size, recompute=recompute,
                                  pad_documents=section.get("pad_documents", False))


def _args_config(args):
    """The config ``args`` names (``--deepspeed_config``, or the deprecated ``--deepscale_config``), or None."""
    given = {key: getattr(args, key, None) for key in ("deepspeed_config", "deepscale_config")}
    if all(value is not None for value in given.values()):
        raise ValueError("args has both deepspeed_config and deepscale_config: give one (--deepspeed_config)")
    return given["deepspeed_config"] if given["deepspeed_config"] is not None else given["deepscale_config"]


def _no_duplicate_keys(pairs: list) -> dict:
    """The config reader's object hook: a key given twice in one JSON object is an error, as in DeepSpeed (plain
    ``json.loads`` keeps the last silently)."""
    keys = [key for key, _ in pairs]
    duplicated = sorted({key for key in keys if keys.count(key) > 1})
    if duplicated:
        raise ValueError(f"the DeepSpeed config gives key(s) {duplicated} more than once in one object: keep one")
    return dict(pairs)


def _load_config(config, args) -> dict:
    from_args = _args_config(args) if args is not None else None
    if config is not None and from_args is not None:
        raise ValueError(f"a config in both config= and args ({from_args!r}): give one of them, as "
                         "deepspeed.initialize requires")
    if config is None:
        config = from_args
    if isinstance(config, (str, Path)):
        config = read_config(config)
    if not isinstance(config, dict):
        raise TypeError("ctx_plugin.deepspeed.initialize needs config= as a dict or a JSON path (or "
                        "args.deepspeed_config)")
    return dict(config)


def read_config(config: str | Path) -> dict:
    """A config given as a string, read as ``deepspeed.initialize`` reads it: a file (hjson: JSON that may hold
    comments and trailing commas), else base64-encoded JSON; a key given twice in one object is an error."""
    import hjson                  # DeepSpeed's own reader (one of its requirements)

    try:
        is_file = Path(config).is_file()
    except (OSError, ValueError):     # a long base64 string is no path
        is_file = False
    if is_file:
        return hjson.loads(Path(config).read_text(), object_pairs_hook=_no_duplicate_keys)
    if isinstance(config, str):
        try:
            text = base64.urlsafe_b64decode(config).decode("utf-8")
            decoded = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
        except ValueError as e:       # not base64, not UTF-8 or not (h)json; a duplicated key is said as it is
            if "more than once" in str(e):
                raise
            decoded = None
        if isinstance(decoded, dict):
            return decoded
    raise ValueError(f"config={str(config)[:80]!r} is neither a file nor base64-encoded JSON: give the DeepSpeed "
                     "config as a dict, a path to an existing JSON file or base64 (what deepspeed.initialize takes)")


def split_config(config: dict, model=None) -> tuple[ContextParallelSection, dict]:
    """The ``"context_parallel"`` section of a DeepSpeed config that has one, and the rest of the config, after the
    refusals that need no process group: curriculum learning, deepcompile, summed gradients, model parallelism, a
    ``"sequence_parallel_size"`` other than the section's (then dropped). ``model`` None leaves out what needs the
    model (the launcher's check, before the job builds it)."""
    config = dict(config)
    section = parse_section(config.pop(SECTION))
    _refuse_curriculum(config)
    _refuse_deepcompile(config)
    _refuse_summed_gradients(config)
    _refuse_model_parallel(config, model)
    own_sp = config.pop("sequence_parallel_size", 1)
    if type(own_sp) is not int or own_sp not in (1, section.size):
        raise ValueError(f'"sequence_parallel_size" ({own_sp}) disagrees with "{SECTION}.size" ({section.size}); '
                         f'drop "sequence_parallel_size": the "{SECTION}" section is the one switch')
    return section, config


def world_config(config: dict, section: ContextParallelSection, world: int, ranks: str = "the number of ranks") -> dict:
    """The config for ``world`` ranks (``ranks``: what the caller calls them): the section's size dividing them, the
    batch sizes (:func:`batch_sizes`) and ``"data_parallel_size"`` (:func:`check_data_parallel_size`, dropped)."""
    if world % section.size:
        raise ValueError(f'"{SECTION}.size" ({section.size}) must divide {ranks} ({world})')
    config = batch_sizes(config, world=world, size=section.size)
    check_data_parallel_size(config, world // section.size)
    return config


def _zero_config(config: dict, recompute: RecomputeConfig) -> dict:
    """``config`` with ZeRO-3's ``memory_efficient_linear`` off under ``selective``, which it breaks: DeepSpeed's linear
    adds the bias in place to a matmul output that selective checkpointing keeps for backward, so the recomputed
    layer adds the bias twice (wrong gradients on every linear with a bias)."""
    import torch.nn.functional as functional
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    if recompute.preset != Recompute.SELECTIVE:
        return config
    if functional.linear is zero3_linear_wrap:
        raise ValueError(_PATCHED_LINEAR)
    from deepspeed.runtime.zero.config import get_zero_config

    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or get_zero_config(config).stage != 3:     # "3" and 3.0 are stage 3 to DeepSpeed
        return config
    given = zero.get("memory_efficient_linear", False)
    if given is not False:
        raise ValueError(f'"zero_optimization.memory_efficient_linear": {json.dumps(given)} and '
                         f'"{SECTION}.recompute": "selective" cannot be combined (DeepSpeed\'s linear changes a saved '
                         'matmul output in place, so the recomputed layer adds the bias twice); leave the key out '
                         '(ctx_plugin then turns it off) or set it to false, or use recompute "full" or "sqrt"')
    return {**config, "zero_optimization": {**zero, "memory_efficient_linear": False}}


_PATCHED_LINEAR = ('torch.nn.functional.linear is DeepSpeed\'s memory_efficient_linear, which breaks "recompute": '
                   '"selective" (the recomputed layer adds each bias twice); an earlier ZeRO-3 engine or zero.Init in '
                   'this process installed it, and DeepSpeed never puts it back: set "zero_optimization": '
                   '{"memory_efficient_linear": false} there (zero.Init(mem_efficient_linear=False)), or run this '
                   'model in a fresh process')


def _refuse_patched_linear(module, args) -> None:
    """Forward pre-hook under ``selective``: DeepSpeed's linear installed after
    :func:`ctx_plugin.deepspeed.initialize` is refused too."""
    import torch.nn.functional as functional
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    if functional.linear is zero3_linear_wrap:
        raise ValueError(_PATCHED_LINEAR)


def batch_sizes(config: dict, *, world: int, size: int) -> dict:
    """``config`` with ``train_batch_size`` translated for DeepSpeed.

    Users give the natural value, micro batch × gradient accumulation × data-parallel replicas (``world / size``),
    as with DeepSpeed's own ``sequence_parallel_size``. DeepSpeed here counts every rank of a context-parallel group
    as a data-parallel rank, so it gets the three batch keys resolved, with ``train_batch_size`` × ``size``. A value
    that counts the context-parallel ranks, or that no whole micro batch fits, is a ValueError naming the value to
    use; so is one that, with micro batch or accumulation missing, reads both ways (a missing key would differ:
    :func:`_refuse_ambiguous`)."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    total, micro, accumulation = (config.get(key) for key in keys)
    for key, value in zip(keys, (total, micro, accumulation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f'"{key}" must be a positive int, got {value!r}')
    if total is None:
        return config               # DeepSpeed derives it from the micro batch over all its ranks
    replicas = world // size
    how = (f"train_micro_batch_size_per_gpu × gradient_accumulation_steps × {replicas} data-parallel "
           f"replica(s) ({world} ranks / \"{SECTION}.size\" {size}; context-parallel ranks share samples)")
    if micro is not None and accumulation is not None:
        if total != micro * accumulation * replicas:
            inflated = size > 1 and total == micro * accumulation * world
            raise ValueError(f'"train_batch_size" is {total}' + (" (it counts the context-parallel ranks)" if inflated
                             else "") + f"; give {micro * accumulation * replicas} = {how}, or leave it out")
    else:
        per_step = (micro or accumulation or 1) * replicas
        if total % per_step:
            given = f"train_micro_batch_size_per_gpu ({micro})" if micro else \
                f"gradient_accumulation_steps ({accumulation or 1})"
            raise ValueError(f'"train_batch_size" ({total}) must be {how}: a multiple of {given} × {replicas}')
        _refuse_ambiguous(total, micro, accumulation, world=world, size=size)
        if micro is None:
            micro = total // per_step
        else:
            accumulation = total // per_step
        accumulation = accumulation or 1
    return {**config, "train_batch_size": micro * accumulation * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation}


def check_data_parallel_size(config: dict, replicas: int) -> None:
    """DeepSpeed reads ``"data_parallel_size"`` only next to ``"sequence_parallel_size"`` (which the section
    replaces), so it would be accepted and ignored: it must be the section's data-parallel replicas (then dropped)."""
    given = config.pop("data_parallel_size", None)
    if given is not None and (type(given) is not int or given != replicas):
        raise ValueError(f'"data_parallel_size" ({given}) disagrees with the {replicas} data-parallel replica(s) of '
                         f'"{SECTION}" (ranks / "{SECTION}.size"); drop it: the section sets the groups')


def _refuse_ambiguous(total: int, micro, accumulation, *, world: int, size: int) -> None:
    """A ValueError when micro batch or accumulation (or both) are missing and ``total`` also reads as counting the
    context-parallel ranks (what DeepSpeed alone would assume): a missing key would differ between the readings."""
    if size == 1 or (micro is not None and accumulation is not None) or total % ((micro or accumulation or 1) * world):
        return
    replicas = world // size
    if micro is None and accumulation is None:      # DeepSpeed alone: accumulation 1, micro batch = total / ranks
        given, missing, unit = '"gradient_accumulation_steps" (1 when not given)', "train_micro_batch_size_per_gpu", 1
        scope = 'no "train_micro_batch_size_per_gpu"'
    else:
        key, missing = (("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if micro else
                        ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"))
        unit = micro or accumulation
        given, scope = f'"{key}" ({unit})', f'no "{missing}"'
    ours, native = total // (unit * replicas), total // (unit * world)
    raise ValueError(f'"train_batch_size" ({total}) with {given} and {scope} is ambiguous: as micro batch × '
                     f'accumulation × {replicas} data-parallel replica(s) (context-parallel ranks not counted) it '
                     f'means "{missing}": {ours}; counting all {world} ranks, as DeepSpeed does without "{SECTION}", '
                     f'it means "{missing}": {native}. Give "{missing}": {ours} with "train_batch_size" {total}, or '
                     f'{native} with "train_batch_size" {total // size} (or none)')


_DATA_EFFICIENCY = {
    ("data_efficiency", "data_sampling", "curriculum_learning"):
        "DeepSpeed's curriculum sampler would give the ranks sharing a sequence different samples, and ctx_plugin's "
        "loader does not implement curriculum sampling",
    ("data_efficiency", "data_routing", "random_ltd"):
        "random layerwise token dropping keeps a schedule of tokens of the whole sequence but drops them from each "
        "rank's shard, different tokens on each rank (and nothing while the schedule exceeds the shard), so the "
        "ranks sharing a sequence would no longer hold one layout's shards of it"}


def _refuse_curriculum(config: dict) -> None:
    """DeepSpeed's data efficiency features that change which tokens a rank holds: curriculum data sampling
    (``"data_efficiency"``: ``"data_sampling"``: ``"curriculum_learning"``: ``"enabled": true``; DeepSpeed reads
    that flag alone) picks each rank's samples over every rank it counts as data parallel, context-parallel ranks
    included, and random-LTD (``"data_routing"``: ``"random_ltd"``) drops tokens of each rank's shard: a
    ValueError naming the flag."""
    for path, why in _DATA_EFFICIENCY.items():
        found = config
        for key in path:
            found = found.get(key) if isinstance(found, dict) else None
        if isinstance(found, dict) and found.get("enabled", False):
            raise ValueError(f'"{".".join(path)}" cannot be combined with "{SECTION}": {why}; set its "enabled" to '
                             f'false (or drop it), or train without "{SECTION}"')


def _refuse_deepcompile(config: dict) -> None:
    """DeepCompile (``"compile": {"deepcompile": true}``) rewrites the compiled forward and backward graphs: its
    passes gather and release ZeRO's parameters inside them, ``"autosp"`` splits the sequence itself and ``"autotp"``
    the layers. ctx_plugin's attention runs outside the compiled graphs (:mod:`ctx_plugin.core.compiler`) and was not
    checked under those rewrites, and autosp/autotp would split the ranks the section's groups take: a ValueError.
    ``engine.compile()`` without DeepCompile is plain ``torch.compile`` (tested)."""
    compile_config = config.get("compile")
    if isinstance(compile_config, dict) and compile_config.get("deepcompile", False):
        passes = [p for p in compile_config.get("passes") or [] if p in ("autosp", "autotp")]
        why = (f'its {" and ".join(passes)} pass{"es" if len(passes) > 1 else ""} would split the sequence or the '
               f'layers over the ranks the section\'s context-parallel groups take' if passes else
               "it rewrites the compiled graphs (ZeRO's parameter gathers inside them), which ctx_plugin's attention, "
               "run outside them, was not checked under")
        raise ValueError(f'"compile.deepcompile" cannot be combined with "{SECTION}": {why}; set "deepcompile" to '
                         f"false (engine.compile() without DeepCompile compiles the model around ctx_plugin's "
                         f'attention), or train without "{SECTION}"')


def _refuse_summed_gradients(config: dict) -> None:
    """``"gradient_allreduce_op": "sum"`` (DeepSpeed's default is ``"mean"``): ctx_plugin's losses give each rank its
    share of the global token mean for DeepSpeed's average over every data × context rank; summed, the gradient
    would be that many times too large, not the replicas' sum DeepSpeed alone gives. A ValueError."""
    from deepspeed.runtime.config import get_gradient_allreduce_op

    if get_gradient_allreduce_op(config) != "mean":
        raise ValueError(f'"gradient_allreduce_op": "sum" cannot be combined with "{SECTION}": ctx_plugin\'s losses '
                         "normalise by the global token count for DeepSpeed's mean over the data × context ranks, so "
                         'summed gradients would be scaled by the context-parallel ranks too; drop the key (or set '
                         '"mean") and scale the learning rate if you relied on the sum')


def _refuse_model_parallel(config: dict, model) -> None:
    """DeepSpeed's automatic tensor parallelism (``"tensor_parallel": {"autotp_size": N}``, N > 1) and pipeline
    models (``deepspeed.pipe.PipelineModule``) split the ranks in ways the section's groups do not know: it gives
    DeepSpeed an mpu with data × context parallelism only. A ValueError naming what to drop."""
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config

    size = get_tensor_parallel_config(config).autotp_size      # as DeepSpeed reads it: "2" and 2.0 are 2
    if size > 1:
        raise ValueError(f'"tensor_parallel.autotp_size" {size} cannot be combined with "{SECTION}": ctx_plugin\'s '
                         "DeepSpeed integration runs data × context parallelism only (its groups take every rank of "
                         "a context-parallel group as one sequence's); drop it, or run tensor × context parallelism "
                         "through Megatron")
    try:
        from deepspeed.runtime.tensor_parallel import init_utils
    except ImportError:           # a DeepSpeed without tp_model_init
        init_utils = None
    tp_init = getattr(init_utils, "_TP_MODEL_INIT_ARGS", None)
    if isinstance(tp_init, dict) and tp_init.get("tp_size", 1) > 1:
        raise ValueError(f"deepspeed.tp_model_init(tp_size={tp_init['tp_size']}) cannot be combined with "
                         f'"{SECTION}": it sets automatic tensor parallelism, and ctx_plugin\'s DeepSpeed integration '
                         "runs data × context parallelism only; build the model without tp_model_init, or run "
                         "tensor × context parallelism through Megatron")
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:           # the caller imported deepspeed already; a build without pipe has no such models
        return
    if isinstance(model, PipelineModule):
        raise ValueError(f'a DeepSpeed PipelineModule cannot be combined with "{SECTION}": its pipeline stages '
                         "would split the ranks the context-parallel groups take; train the Hugging Face model "
                         "itself, or run pipeline × context parallelism through Megatron")


_DS_CHECKPOINTING = "activation_checkpointing"


def _refuse_ds_checkpointing(config: dict) -> None:
    """DeepSpeed's ``"activation_checkpointing"`` section configures ``deepspeed.checkpointing.checkpoint`` only
    (``deepspeed.checkpointing.configure``); the engine never applies it, and Hugging Face models call
    ``torch.utils.checkpoint``, so for them a setting there (``cpu_checkpointing``, ``partition_activations``, ...)
    would be accepted and do nothing: a ValueError naming the section's recompute that does it."""
    section = config.get(_DS_CHECKPOINTING)
    if section is None:
        return
    if not isinstance(section, dict):
        raise TypeError(f'"{_DS_CHECKPOINTING}" must be a JSON object, got {type(section).__name__}')
    changed = sorted(key for key, value in section.items() if DEEPSPEED_CHECKPOINTING.get(key, object()) != value)
    if changed:
        raise ValueError(f'"{_DS_CHECKPOINTING}" {changed} has no effect on a Hugging Face model: DeepSpeed applies '
                         "that section only where a model calls deepspeed.checkpointing.checkpoint, and Hugging Face "
                         f'models do not; recompute through "{SECTION}": {{"recompute": ...}} instead (e.g. "full", '
                         '"full+offload:<GiB>" for cpu_checkpointing), and drop the section or leave its defaults')
