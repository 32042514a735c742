"""The decoder layers of each model chunk Megatron builds (one per pipeline rank and virtual stage), from its
arguments, before any model exists: the recompute presets that count layers (``full:block:N``, ``full:uniform:N``)
are checked against every chunk on every rank alike, instead of failing at the model build on some ranks only."""
from __future__ import annotations

import argparse
from types import SimpleNamespace


def _virtual_stages(args: argparse.Namespace, pp: int) -> int | None:
    """Megatron's ``virtual_pipeline_model_parallel_size`` (``validate_args`` derives it; the launcher's arguments
    have not been through it yet). None: no interleaving."""
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp is None:
        vpp = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_virtual = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if vpp is None and per_virtual:
        layers = args.num_layers + bool(getattr(args, "account_for_embedding_in_pipeline_split", False)) \
            + bool(getattr(args, "account_for_loss_in_pipeline_split", False))
        if layers % pp or (layers // pp) % per_virtual:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_virtual}: the {layers} layers (with the "
                             f"embedding/loss when they count) over --pipeline-model-parallel-size {pp} do not split "
                             f"into virtual stages of {per_virtual}")
        vpp = layers // pp // per_virtual
    return None if vpp is None or vpp == 1 or pp == 1 else vpp


def chunk_layers(args: argparse.Namespace) -> dict[tuple[int, int], int]:
    """``{(pipeline rank, virtual stage): decoder layers}`` of the chunks Megatron builds, by megatron-core's own
    count (``get_num_layers_to_build``; ``PipelineParallelLayerLayout`` with --pipeline-model-parallel-layout):
    uneven first/last stages, the embedding and loss counted in the split, interleaved virtual stages."""
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if pp == 1 and layout is None:
        return {(0, 0): args.num_layers}
    if layout is not None:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        if isinstance(layout, str):
            layout = PipelineParallelLayerLayout(layout, pp)
        return {(p, v): stage.count(LayerType.decoder) for p, row in enumerate(layout.layout)
                for v, stage in enumerate(row)}
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    vpp = _virtual_stages(args, pp)
    config = SimpleNamespace(
        pipeline_model_parallel_layout=None, num_layers=args.num_layers, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding_in_pipeline_split=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss_in_pipeline_split=bool(getattr(args, "account_for_loss_in_pipeline_split", False)))
    try:
        return {(p, v): get_num_layers_to_build(config, vp_stage=v if vpp else None, pp_rank=p)
                for p in range(pp) for v in range(vpp or 1)}
    except AssertionError as e:      # Megatron's validate_args asserts the same; say it before any rank starts
        raise ValueError(f"the pipeline split of --num-layers {args.num_layers} over --pipeline-model-parallel-size "
                         f"{pp} is not one megatron-core builds: {' '.join(str(e).split())}") from None
