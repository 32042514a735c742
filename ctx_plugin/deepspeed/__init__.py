"""DeepSpeed integration: a ``"context_parallel"`` section in the DeepSpeed config switches ctx_plugin on.

    engine, optimizer, loader, scheduler = ctx_plugin.deepspeed.initialize(model=model,
        model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")
    for batch in loader:                                   # this rank's shards, labels pre-shifted
        loss, report = ctx_plugin.deepspeed.lm_loss(engine, batch)     # forward + loss (+tile_loss: tiled)
        engine.backward(loss); engine.step()

(``lm_loss`` is ``causal_lm_loss(engine(input_ids=..., position_ids=...).logits, batch["labels"], engine)``, or with
``+tile_loss`` in the section's ``"recompute"`` the LM head and loss over chunks of tokens: ``tiled_causal_lm_loss``.
With gradient accumulation, ``step_tokens=ctx_plugin.deepspeed.step_tokens(engine, the step's micro batches)`` makes
the gradient the token mean over the whole step, as ``ctx_plugin.train_hf`` does.)

The section is ``{"backend", "size", "ulysses_size", "kernel", "recompute", "check_ranks", "pad_documents"}``
(``pad_documents``: pad packed documents to the layout's unit; ``check_ranks``:
``CPConfig.check_ranks``, default true). The world is split into groups of ``size`` consecutive ranks sharing
each sequence; DeepSpeed's data-parallel group (ZeRO partitioning, gradient averaging) is all data × context
ranks, handed to it as ``mpu``; the engine's ``deepspeed_io`` gives a :class:`ShardedLoader` too. The section's
parsing lives in :mod:`ctx_plugin.deepspeed.config`, batches and losses in :mod:`ctx_plugin.deepspeed.data`; their
public names are importable from here.
"""
from __future__ import annotations

import copy
import functools
import os

import torch
import torch.distributed as dist

from .. import hf
from ..core import comm
from ..core.groups import CPGroups, build_cp_groups
from ..hf import loss as hf_loss
from ..names import Recompute
from ..recompute import RecomputeConfig, apply
from ..recompute.apply import refuse_hf_checkpointing
from ..recompute.tiling import layer_norms
from .config import (SECTION, ContextParallelSection, _load_config, _refuse_ds_checkpointing, _refuse_patched_linear,
                     _zero_config, batch_sizes, parse_section, split_config, world_config)
from .data import ShardedLoader, causal_lm_loss, lm_loss, shard_batch, step_tokens, tiled_causal_lm_loss

__all__ = ["SECTION", "ContextParallelMPU", "ContextParallelSection", "ShardedLoader", "batch_sizes", "causal_lm_loss",
           "initialize", "lm_loss", "parse_section", "shard_batch", "step_tokens", "tiled_causal_lm_loss"]


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


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, torch.nn.Module | None]:
    """The model's decoder layers and its final norm (the one norm next to them, Hugging Face's ``model.norm``;
    None when there is not exactly one)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
            norms = layer_norms(model.get_submodule(name.rpartition(".")[0]))
            return module, norms[0] if len(norms) == 1 else None
    raise ValueError("cannot find the model's decoder layers (a ModuleList named '...layers') to apply the "
                     "recompute preset to")


class _Communicated:
    """A communication observer (:func:`ctx_plugin.core.comm.observing`) that only notes whether anything was sent."""

    def __init__(self) -> None:
        self.seen = False

    def record(self, kind: str) -> None:
        self.seen = True


def _require_cp_attention(model: torch.nn.Module, groups: CPGroups) -> None:
    """Checks on the model's first forward that its attention went through ``groups`` (they communicate at
    ``size`` > 1); a forward that did not is a RuntimeError instead of training on unsharded attention.

    The forward runs wrapped (an instance attribute, removed once a forward passed the check) inside
    :func:`ctx_plugin.core.comm.observing`, which sees every communication ctx_plugin issues in it."""
    had_own = "forward" in vars(model)
    original = model.forward

    def forward(*args, **kwargs):
        with comm.observing(_Communicated()) as sent:
            out = original(*args, **kwargs)
        if not sent.seen:
            raise RuntimeError("the model's forward did not call ctx_plugin.cp_attention with the engine's groups, "
                               "but its batches are sharded along the sequence: with attention=fn, fn(groups) must "
                               "make the model's attention call ctx_plugin.cp_attention(q, k, v, "
                               "config=groups.config, groups=groups)")
        if had_own:
            model.forward = original
        else:
            del model.forward           # the class's forward shows again
        return out

    model.forward = forward


class _SetTrainBatchSize:
    """``engine.set_train_batch_size(n)`` in the section's units: ``n`` = micro batch × gradient accumulation ×
    data-parallel replicas, as the config's ``train_batch_size`` (DeepSpeed's own method counts every rank, the
    context-parallel ones too: it would set ``size`` times fewer accumulation steps)."""

    def __init__(self, set_native, size: int) -> None:
        self.set_native, self.size = set_native, size

    def __call__(self, train_batch_size: int) -> None:
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1:
            raise ValueError(f"set_train_batch_size takes a positive int, got {train_batch_size!r}")
        self.set_native(train_batch_size * self.size)


def _set_device(args) -> None:
    """Makes the device DeepSpeed's engine will take (``args.device_rank``, else ``LOCAL_RANK``, as its
    ``_set_distributed_vars``) current now, before ctx_plugin's own collectives: ``init_distributed`` binds NCCL to
    that device without making it current, so the context-parallel groups' first all-gather would run on cuda:0
    from every rank of a node."""
    from deepspeed.accelerator import get_accelerator

    device_rank = getattr(args, "device_rank", None)
    if device_rank is None:
        device_rank = int(os.environ.get("LOCAL_RANK", -1))
    if device_rank >= 0:
        get_accelerator().set_device(device_rank)


def _cp_group(size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's context-parallel group of ``size`` consecutive ranks, a group of this rank alone)."""
    cp, _ = dist.new_subgroups(group_size=size)
    alone, _ = dist.new_subgroups(group_size=1)
    return cp, alone


def _without_config(args):
    """A copy of ``args`` without its config (``_load_config`` read it): ``deepspeed.initialize`` refuses a config
    in both ``args`` and ``config=``."""
    if args is None:
        return None
    args = copy.copy(args)
    for key in ("deepspeed_config", "deepscale_config"):
        if getattr(args, key, None) is not None:
            setattr(args, key, None)
    return args


def _sharded_io(engine, sharded, default_collate_fn):
    """What replaces ``engine.deepspeed_io``: DeepSpeed's would split samples over every rank it counts as data
    parallel, the ranks of a context-parallel group included (each would get a different, unsharded sample). This
    gives a :class:`ShardedLoader` instead, shuffled on DeepSpeed's training route as DeepSpeed's is; what it cannot
    honour is a ValueError. ``sharded(dataset, batch_size, **loader_options)``: this rank's :class:`ShardedLoader`."""
    from deepspeed.runtime.constants import ROUTE_EVAL, ROUTE_PREDICT, ROUTE_TRAIN

    def deepspeed_io(dataset, batch_size=None, route=ROUTE_TRAIN, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        if data_sampler is not None:
            raise ValueError(f'engine.deepspeed_io(data_sampler=...) under "{SECTION}": its loader samples per '
                             "data-parallel replica itself (the ranks sharing a sequence get the same samples); leave "
                             "data_sampler out, or batch with your own sampler and shard each batch with "
                             "ctx_plugin.deepspeed.shard_batch(batch, engine.ctx_plugin_groups)")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not (hasattr(dataset, "__getitem__")
                                                                        and hasattr(dataset, "__len__")):
            raise ValueError(f'engine.deepspeed_io under "{SECTION}" needs a map-style dataset (__getitem__ and '
                             f"__len__), got {type(dataset).__name__}: its samples are split per data-parallel "
                             "replica by index; shard an iterable's batches with ctx_plugin.deepspeed.shard_batch")
        return sharded(dataset, batch_size or engine.train_micro_batch_size_per_gpu(),
                       collate_fn=collate_fn if collate_fn is not None else default_collate_fn,
                       shuffle=route not in (ROUTE_EVAL, ROUTE_PREDICT), pin_memory=pin_memory,
                       num_workers=num_local_io_workers or 0)

    return deepspeed_io


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

    if config is not None and config_params is not None:
        raise ValueError("config= and config_params= both given: give the DeepSpeed config once (config_params is "
                         "DeepSpeed's older name for config)")
    config = _load_config(config if config is not None else config_params, args)
    if SECTION not in config:
        if attention is not None:
            raise ValueError(f'attention= wires the model to context parallelism: it needs a "{SECTION}" section in '
                             "the config (or leave attention= out)")
        return deepspeed.initialize(args=_without_config(args), model=model, optimizer=optimizer,
                                    model_parameters=model_parameters, training_data=training_data,
                                    lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required,
                                    collate_fn=collate_fn, config=config)
    section, config = split_config(config, model)
    if mpu is not None:
        raise ValueError(f'"{SECTION}" builds the process groups itself; do not pass mpu=')
    if attention is None and not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} is not a Hugging Face model (no set_attn_implementation), so "
                         f'ctx_plugin cannot switch its attention, yet "{SECTION}" shards its sequences: pass '
                         "attention=fn to ctx_plugin.deepspeed.initialize; fn(groups) must make the model's "
                         "attention call ctx_plugin.cp_attention(q, k, v, config=groups.config, groups=groups)")
    if attention is not None and not callable(attention):
        raise TypeError(f"attention= must be a callable taking the CPGroups, got {type(attention).__name__}")
    if attention is None:
        _refuse_ds_checkpointing(config)
    layer_preset = section.recompute.for_layers          # +tile_loss is the loss's (lm_loss / tiled_causal_lm_loss)
    layers, final_norm = (None, None) if layer_preset == RecomputeConfig() else _decoder_layers(model)
    if layers is not None:
        refuse_hf_checkpointing(layers, layer_preset)
    if section.recompute.tile_loss and attention is None:
        hf_loss.check_model(model)            # a Hugging Face model whose logits the tiled loss reproduces
    config = _zero_config(config, section.recompute)
    # wraps an already initialised torch.distributed; else starts it (dist_init_required=False: DeepSpeed's error)
    deepspeed.init_distributed(dist_init_required=dist_init_required)
    _set_device(args)
    world = dist.get_world_size()
    config = world_config(config, section, world)
    cp, alone = _cp_group(section.size)
    groups = build_cp_groups(section.cp_config, group=cp)
    if attention is not None:
        attention(groups)
    else:
        hf.enable(model, section.cp_config, groups)
    if section.size > 1:
        _require_cp_attention(model, groups)
    if layers is not None:
        apply(layers, layer_preset, final_norm=final_norm)
    if section.recompute.preset == Recompute.SELECTIVE:
        model.register_forward_pre_hook(_refuse_patched_linear)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=_without_config(args), model=model, optimizer=optimizer, model_parameters=model_parameters,
        lr_scheduler=lr_scheduler, mpu=ContextParallelMPU(alone), dist_init_required=False, config=config)
    engine.ctx_plugin_groups = groups
    engine.set_train_batch_size = _SetTrainBatchSize(engine.set_train_batch_size, section.size)
    engine.ctx_plugin_recompute = section.recompute
    replicas = world // section.size
    shared = None if replicas == 1 else dist.group.WORLD if dist.get_backend() == "gloo" else \
        dist.new_group(backend="gloo")          # refusals of one replica's batch, on every rank (on the host)
    sharded = functools.partial(ShardedLoader, groups=groups, replicas=replicas,
                                replica=dist.get_rank() // section.size, pad_documents=section.pad_documents,
                                drop_last=engine.dataloader_drop_last(), replica_group=shared)
    engine.deepspeed_io = _sharded_io(engine, sharded, collate_fn)
    loader = None
    if training_data is not None:
        loader = sharded(training_data, engine.train_micro_batch_size_per_gpu(), collate_fn=collate_fn)
    return engine, optimizer, loader, lr_scheduler
