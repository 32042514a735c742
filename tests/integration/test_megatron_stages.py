"""The layer-counting recompute presets (``full:block:N``, ``full:uniform:N``) under Megatron's pipeline splits (its
real parser, no processes): every model chunk's decoder layers as megatron-core builds them — uneven first/last
stages, the embedding and loss counted in the split, interleaved virtual stages (derived as Megatron's validate_args
does, or already derived), ``--pipeline-model-parallel-layout`` — against counts written out by hand; a preset that
counts more layers than the smallest chunk is a flag error naming that chunk (it failed at the model build on the
ranks of that chunk only, while the others waited), and ``budget:<GiB>`` is refused with pipeline parallelism (its
memory model is the whole model's, one micro batch in flight)."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("megatron.training", reason="needs megatron-core and Megatron-LM's training package")

BASE = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "4096",
        "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--context-parallel-size", "2"]


def _args(monkeypatch, *flags, layers: int = 8):
    from megatron.training.arguments import parse_args

    from ctx_plugin.megatron.args import add_arguments

    base = [*BASE[:1], str(layers), *BASE[2:]]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *base, *flags])
    args = parse_args(extra_args_provider=add_arguments)
    args.padded_vocab_size, args.data_parallel_size = 1024, 1
    return args


SPLITS = {   # flags → {(pipeline rank, virtual stage): decoder layers}, by hand from megatron-core's rules
    "pp2": (["--pipeline-model-parallel-size", "2"], 8, {(0, 0): 4, (1, 0): 4}),
    "pp2-virtual-1": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 8,
                      {(p, v): 1 for p in range(2) for v in range(4)}),
    "pp2-virtual-stages-2": (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], 8,
                             {(p, v): 2 for p in range(2) for v in range(2)}),
    "pp2-first-2": (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"], 8,
                    {(0, 0): 2, (1, 0): 6}),
    "pp4-last-1": (["--pipeline-model-parallel-size", "4", "--decoder-last-pipeline-num-layers", "2"], 8,
                   {(0, 0): 2, (1, 0): 2, (2, 0): 2, (3, 0): 2}),
    "pp3-first-1-last-1": (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1",
                            "--decoder-last-pipeline-num-layers", "1"], 8, {(0, 0): 1, (1, 0): 6, (2, 0): 1}),
    "pp2-embedding-and-loss": (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
                                "--account-for-loss-in-pipeline-split"], 6, {(0, 0): 3, (1, 0): 3}),
    "pp2-virtual-embedding": (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
                               "--account-for-loss-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "1"],
                              6, {(0, 0): 0, (0, 1): 1, (0, 2): 1, (0, 3): 1, (1, 0): 1, (1, 1): 1, (1, 2): 1,
                                  (1, 3): 0}),
    "layout": (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|ttt|tt|ttL"], 8,
               {(0, 0): 1, (1, 0): 3, (0, 1): 2, (1, 1): 2}),
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_chunk_layers_are_megatrons(monkeypatch, name):
    from ctx_plugin.megatron.stages import chunk_layers

    flags, layers, want = SPLITS[name]
    assert chunk_layers(_args(monkeypatch, *flags, layers=layers)) == want


def test_an_already_derived_virtual_size_counts(monkeypatch):
    """After validate_args (the job's own check), virtual_pipeline_model_parallel_size holds the interleaving."""
    from ctx_plugin.megatron.stages import chunk_layers

    args = _args(monkeypatch, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1")
    args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size = None, 2
    assert chunk_layers(args) == {(p, v): 2 for p in range(2) for v in range(2)}


@pytest.mark.parametrize("flags,layers,preset,smallest,where", [
    (["--num-layers-per-virtual-pipeline-stage", "1"], 8, "full:block:3", 1, "pipeline rank 0, virtual stage 0,"),
    (["--decoder-first-pipeline-num-layers", "2"], 8, "full:block:4", 2, "pipeline rank 0"),
    (["--decoder-first-pipeline-num-layers", "6"], 8, "full:uniform:5", 2, "pipeline rank 1"),
])
def test_a_preset_counting_more_layers_than_a_chunk_is_a_flag_error(monkeypatch, flags, layers, preset, smallest,
                                                                     where):
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--pipeline-model-parallel-size", "2", *flags, "--cp-recompute", preset, layers=layers)
    with pytest.raises(ValueError, match=rf"^--cp-recompute {preset}: recompute preset {preset} counts .* the stack has "
                                         rf"{smallest} .*; {where} builds {smallest} of the --num-layers {layers}"):
        settings_from_args(args)
    fitting = preset.rsplit(":", 1)[0] + f":{smallest}"
    ok = _args(monkeypatch, "--pipeline-model-parallel-size", "2", *flags, "--cp-recompute", fitting, layers=layers)
    assert str(settings_from_args(ok).recompute) == fitting


def test_chunks_without_layers_take_any_preset(monkeypatch):
    """The first and last virtual chunks hold only the embedding and the loss: nothing to recompute there."""
    from ctx_plugin.megatron.args import settings_from_args
    from ctx_plugin.recompute.presets import regions, RecomputeConfig

    flags, layers, _ = SPLITS["pp2-virtual-embedding"]
    for preset in ("full", "full:block:1", "sqrt"):
        settings_from_args(_args(monkeypatch, *flags, "--cp-recompute", preset, layers=layers))
        assert regions(RecomputeConfig.parse(preset), 0) == []


def test_an_uneven_split_megatron_cannot_build_is_a_flag_error(monkeypatch):
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--pipeline-model-parallel-size", "3", "--cp-recompute", "full")
    with pytest.raises(ValueError, match=r"the pipeline split of --num-layers 8 over --pipeline-model-parallel-size "
                                         r"3 is not one megatron-core builds: .*divisible"):
        settings_from_args(args)


@pytest.mark.parametrize("resolve_budget", [True, False])
def test_budget_with_pipeline_parallelism_is_refused(monkeypatch, resolve_budget):
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--pipeline-model-parallel-size", "2", "--cp-recompute", "budget:40")
    with pytest.raises(ValueError, match=r"--cp-recompute budget:40 with --pipeline-model-parallel-size 2: the memory "
                                         r"model .* give a concrete preset instead, e\.g\. --cp-recompute full$"):
        settings_from_args(args, resolve_budget=resolve_budget)


@pytest.mark.parametrize("preset,refused", [
    ("sqrt", True), ("full:uniform:2", True), ("full:uniform:4+offload:1", True),
    ("full", False), ("full:block:3", False), ("selective", False)])
def test_cpu_offloading_is_refused_with_multi_layer_regions(monkeypatch, preset, refused):
    """Megatron's CPU offloading (--cpu-offloading-num-layers) enters saved-tensor hooks around each layer's call; a
    multi-layer region's checkpoint spans several calls (ctx_plugin.recompute.span): the hooks would be left out of
    order. validate_args sets ``cpu_offloading`` from the layer count; either counts."""
    from ctx_plugin.megatron.args import settings_from_args

    args = _args(monkeypatch, "--cp-recompute", preset, "--cpu-offloading-num-layers", "2")
    assert not getattr(args, "cpu_offloading", False)
    if refused:
        with pytest.raises(ValueError, match=rf"^--cp-recompute {preset.replace('+', r'\+')} with --cpu-offloading-"
                                             r"num-layers: .*drop --cpu-offloading-num-layers and offload with "
                                             r"ctx_plugin's \+offload:<GiB>"):
            settings_from_args(args)
        args = _args(monkeypatch, "--cp-recompute", preset)
        args.cpu_offloading = True
        with pytest.raises(ValueError, match="with --cpu-offloading-num-layers"):
            settings_from_args(args)
    else:
        assert str(settings_from_args(args).recompute) == preset
