"""DeepSpeed integration: a ``"context_parallel"`` section in the DeepSpeed config switches ctx_plugin on.

    engine, optimizer, loader, scheduler = ctx_plugin.deepspeed.initialize(model=model,
        model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")
    for batch in loader:                                   # this rank's shards, labels pre-shifted
        loss, report = ctx_plugin.deepspeed.lm_loss(engine, batch)     # forward + loss (+tile_loss: tiled)
        engine.backward(loss); engine.step()

(``lm_loss`` is ``causal_lm_loss(engine(input_ids=..., position_ids=...).logits, batch["labels"], engine)``, or with
``+tile_loss`` in the section's ``"recompute"`` the LM head and loss over chunks of tokens: ``tiled_causal_lm_loss``.)

The section is ``{"backend", "size", "ulysses_size", "kernel", "recompute", "check_ranks"}`` (``check_ranks``:
``CPConfig.check_ranks``, default true). The world is split into groups of ``size`` consecutive ranks sharing
each sequence; DeepSpeed's data-parallel group (ZeRO partitioning, gradient averaging) is all data × context
ranks, handed to it as ``mpu``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import hf, hf_loss
from .api import shard_sequence
from .config import CPConfig
from .groups import CPGroups, build_cp_groups
from .names import Recompute
from .recompute import RecomputeConfig, apply
from .recompute.apply import refuse_hf_checkpointing
from .rules import SettingNames, check_ulysses_size
from .tiled_loss import lm_loss_sum, upcast

SECTION = "context_parallel"
_KEYS = {"backend": str, "size": int, "ulysses_size": int, "kernel": str, "recompute": str, "check_ranks": bool}


@dataclass(frozen=True)
class ContextParallelSection:
    """The validated ``"context_parallel"`` section."""

    cp_config: CPConfig
    size: int
    recompute: RecomputeConfig


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
    return ContextParallelSection(cp_config=cp_config, size=size, recompute=recompute)


class ContextParallelMPU:
    """The ``mpu`` DeepSpeed gets: no model parallelism; data parallelism over every data × context rank."""

    def __init__(self, alone: dist.ProcessGroup) -> None:
        self._alone = alone

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._alone

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD


def _load_config(config, args) -> dict:
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        raise TypeError("ctx_plugin.deepspeed.initialize needs config= as a dict or a JSON path (or "
                        "args.deepspeed_config)")
    return dict(config)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError("cannot find the model's decoder layers (a ModuleList named '...layers') to apply the "
                     "recompute preset to")


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
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
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
    """Forward pre-hook under ``selective``: DeepSpeed's linear installed after :func:`initialize` is refused too."""
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
    use."""
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
        if micro is None:
            micro = total // per_step
        else:
            accumulation = total // per_step
        accumulation = accumulation or 1
    return {**config, "train_batch_size": micro * accumulation * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation}


def _require_cp_attention(model: torch.nn.Module, groups: CPGroups) -> None:
    """Checks on the model's first forward that its attention went through ``groups`` (they communicate at
    ``size`` > 1); a forward that did not is a RuntimeError instead of training on unsharded attention."""
    before = []

    def pre(module, args):
        before.append(sum(groups.counter.counts.values()))

    def post(module, args, output):
        if sum(groups.counter.counts.values()) == before.pop():
            raise RuntimeError("the model's forward did not call ctx_plugin.cp_attention with the engine's groups, "
                               "but its batches are sharded along the sequence: with attention=fn, fn(groups) must "
                               "make the model's attention call ctx_plugin.cp_attention(q, k, v, "
                               "config=groups.config, groups=groups)")
        handles[0].remove()
        handles[1].remove()

    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]


def _cp_group(size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's context-parallel group of ``size`` consecutive ranks, a group of this rank alone)."""
    cp, _ = dist.new_subgroups(group_size=size)
    alone, _ = dist.new_subgroups(group_size=1)
    return cp, alone


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None, *, attention=None):
    """``deepspeed.initialize`` with the ``"context_parallel"`` section applied; same arguments and returns.

    ``attention``: how the model's attention becomes ctx_plugin's. ``None`` (default): a Hugging Face model (one
    with ``set_attn_implementation``) is switched to it; any other model is an error, since its data would be
    sharded while its own attention sees only the local tokens. A callable: ctx_plugin calls ``attention(groups)``
    with this rank's :class:`CPGroups` before applying the recompute preset and handing the model to DeepSpeed; it
    must make the model's attention call ``ctx_plugin.cp_attention(q, k, v, config=groups.config,
    groups=groups)`` (it replaces the Hugging Face switch). Either way the first forward checks that the attention
    ran through these groups."""
    import deepspeed

    config = _load_config(config if config is not None else config_params, args)
    if SECTION not in config:
        if attention is not None:
            raise ValueError(f'attention= wires the model to context parallelism: it needs a "{SECTION}" section in '
                             "the config (or leave attention= out)")
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                    dist_init_required=dist_init_required, collate_fn=collate_fn, config=config)
    section = parse_section(config.pop(SECTION))
    if mpu is not None:
        raise ValueError(f'"{SECTION}" builds the process groups itself; do not pass mpu=')
    own_sp = config.get("sequence_parallel_size", 1)
    if own_sp not in (1, section.size):
        raise ValueError(f'"sequence_parallel_size" ({own_sp}) disagrees with "{SECTION}.size" ({section.size}); '
                         f'drop "sequence_parallel_size": the "{SECTION}" section is the one switch')
    config.pop("sequence_parallel_size", None)
    if attention is None and not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} is not a Hugging Face model (no set_attn_implementation), so "
                         f'ctx_plugin cannot switch its attention, yet "{SECTION}" shards its sequences: pass '
                         "attention=fn to ctx_plugin.deepspeed.initialize; fn(groups) must make the model's "
                         "attention call ctx_plugin.cp_attention(q, k, v, config=groups.config, groups=groups)")
    if attention is not None and not callable(attention):
        raise TypeError(f"attention= must be a callable taking the CPGroups, got {type(attention).__name__}")
    layer_preset = section.recompute.for_layers          # +tile_loss is the loss's (lm_loss / tiled_causal_lm_loss)
    layers = None if layer_preset == RecomputeConfig() else _decoder_layers(model)
    if layers is not None:
        refuse_hf_checkpointing(layers, layer_preset)
    if section.recompute.tile_loss and attention is None:
        hf_loss.check_model(model)            # a Hugging Face model whose logits the tiled loss reproduces
    config = _zero_config(config, section.recompute)
    deepspeed.init_distributed()        # wraps an already initialised torch.distributed; else starts it
    world = dist.get_world_size()
    if world % section.size:
        raise ValueError(f'"{SECTION}.size" ({section.size}) must divide the number of ranks ({world})')
    config = batch_sizes(config, world=world, size=section.size)
    cp, alone = _cp_group(section.size)
    groups = build_cp_groups(section.cp_config, group=cp)
    if attention is not None:
        attention(groups)
    else:
        hf.enable(model, section.cp_config, groups)
    if section.size > 1:
        _require_cp_attention(model, groups)
    if layers is not None:
        apply(layers, layer_preset, groups=groups)
    if section.recompute.preset == Recompute.SELECTIVE:
        model.register_forward_pre_hook(_refuse_patched_linear)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
        mpu=ContextParallelMPU(alone), dist_init_required=False, config=config)
    engine.ctx_plugin_groups = groups
    engine.ctx_plugin_recompute = section.recompute
    loader = None
    if training_data is not None:
        loader = ShardedLoader(training_data, engine.train_micro_batch_size_per_gpu(), groups,
                               replicas=world // section.size, replica=dist.get_rank() // section.size,
                               collate_fn=collate_fn)
    return engine, optimizer, loader, lr_scheduler


def shard_batch(batch: dict, groups: CPGroups) -> dict:
    """This rank's part of a causal-LM batch: ``input_ids``, ``position_ids`` (made when absent), ``labels``
    shifted one token left (the last target ignored) *before* sharding, every other per-token tensor (e.g. a
    loss mask, ``[batch, seq, ...]``) sharded as it is, and an all-ones ``attention_mask`` dropped (padding is
    refused). Per-sample values pass through."""
    cfg = groups.config
    input_ids = batch["input_ids"]
    seq = input_ids.shape[1]
    out = {}
    for key, value in batch.items():
        if key in ("input_ids", "labels", "position_ids", "attention_mask"):
            continue
        per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq
        out[key] = shard_sequence(value, config=cfg, groups=groups, dim=1) if per_token else value
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError("padded batches are not supported under context parallelism: pack or trim sequences and "
                         "give padding labels -100 instead of an attention_mask")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    out["input_ids"] = shard_sequence(input_ids, config=cfg, groups=groups, dim=1)
    out["position_ids"] = shard_sequence(positions, config=cfg, groups=groups, dim=1)
    if "labels" in batch:
        labels = batch["labels"]
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        out["labels"] = shard_sequence(shifted, config=cfg, groups=groups, dim=1)
    return out


class ShardedLoader:
    """Batches of ``dataset`` for this data-parallel replica (every rank of a context-parallel group gets the
    same samples), sharded with :func:`shard_batch`."""

    def __init__(self, dataset, batch_size: int, groups: CPGroups, *, replicas: int, replica: int,
                 collate_fn=None) -> None:
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=False)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                                  collate_fn=collate_fn)
        self.groups = groups

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield shard_batch(batch, self.groups)


def _recompute(engine) -> RecomputeConfig:
    recompute = getattr(engine, "ctx_plugin_recompute", None)
    if recompute is None:
        raise ValueError("this engine was not made by ctx_plugin.deepspeed.initialize with a \"context_parallel\" "
                         "section")
    return recompute


def _global_mean(local: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """DeepSpeed averages gradients over all data × context ranks, so each rank backpropagates its token sum over
    the global token count times that rank count; the result is the gradient of the global token mean."""
    stats = torch.stack([local.detach(), (labels != -100).sum().to(local.dtype)])
    dist.all_reduce(stats)
    world = dist.get_world_size()
    return local * world / stats[1], (stats[0] / stats[1]).item()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, engine) -> tuple[torch.Tensor, float]:
    """(loss to backpropagate, global token-mean loss to report) for pre-shifted, sharded ``labels`` (-100:
    ignored), from the whole logits (at least fp32). A section with ``+tile_loss`` is refused here: use
    :func:`lm_loss` (Hugging Face models) or :func:`tiled_causal_lm_loss`."""
    recompute = getattr(engine, "ctx_plugin_recompute", None)      # None: an engine without the section
    if recompute is not None and recompute.tile_loss:
        raise ValueError(f'"{SECTION}.recompute" is "{recompute}": +tile_loss computes the loss from the hidden '
                         "states without whole logits; call ctx_plugin.deepspeed.lm_loss(engine, batch) (Hugging Face "
                         "models) or tiled_causal_lm_loss(hidden, labels, engine, head=...) instead of "
                         "causal_lm_loss(logits, ...)")
    local = F.cross_entropy(upcast(logits).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return _global_mean(local, labels)


def tiled_causal_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, engine, *, head) -> tuple[torch.Tensor, float]:
    """:func:`causal_lm_loss` from the final hidden states ``[batch, seq, hidden]`` and the LM head module, over
    chunks of tokens (the section's ``+tile_loss[:<tokens>]``; :mod:`ctx_plugin.tiled_loss`). ``hidden`` must come
    out of the engine's forward (DeepSpeed prepares backward from hooks on its outputs); call ``head`` as a module
    so ZeRO-3 fetches its parameters."""
    recompute = _recompute(engine)
    if not recompute.tile_loss:
        raise ValueError(f'"{SECTION}.recompute" is "{recompute}", without +tile_loss: use causal_lm_loss(logits, '
                         f'...) or lm_loss(engine, batch), or add +tile_loss to the preset')
    local = lm_loss_sum(hidden, labels, head, tokens=recompute.loss_tokens)
    return _global_mean(local, labels)


def lm_loss(engine, batch: dict) -> tuple[torch.Tensor, float]:
    """Forward and loss of a Hugging Face causal LM on this rank's ``batch`` (``input_ids``, ``position_ids``,
    pre-shifted ``labels``, as :class:`ShardedLoader` gives them): (loss to backpropagate, global token-mean loss).
    With ``+tile_loss`` in the section the model's ``lm_head`` runs over chunks of tokens
    (:func:`ctx_plugin.hf_loss.hidden_states`, :func:`tiled_causal_lm_loss`), else on the whole logits."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    recompute = getattr(engine, "ctx_plugin_recompute", None)      # None: an engine without the section
    if recompute is None or not recompute.tile_loss:
        return causal_lm_loss(engine(**inputs).logits, batch["labels"], engine)
    hidden, head = hf_loss.hidden_states(engine, engine.module, **inputs)
    return tiled_causal_lm_loss(hidden, batch["labels"], engine, head=head)
