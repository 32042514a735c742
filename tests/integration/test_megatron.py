"""Megatron integration (megatron-core, CPU, gloo): a tiny GPTModel (2 layers, GQA, biases, init std 0.1, float64)
built through ctx_plugin's spec gives, for every backend at CP = 2 and 4 (hybrid: ulysses_size 2), the loss and
every parameter gradient of Megatron's own model (local spec: DotProductAttention, its RoPE/YaRN) on one rank
within 1e-9 — with RoPE, YaRN, learned positions, honoured options (tests/integration/megatron_ranks.py VARIANTS:
per-layer sliding windows, learnable and off-by-one softmax offsets among them, with the offsets' gradients),
mixture-of-experts layers (their auxiliary losses' gradients included) and
the dataloader's causal mask; flags parse with Megatron's real parser and bad combinations give clear
messages."""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

import torch  # noqa: E402

from ctx_plugin.names import Backend  # noqa: E402
from tests.distributed.harness import run_spawned  # noqa: E402
from tests.integration.megatron_ranks import case_key  # noqa: E402
from tests.integration.megatron_thd_ranks import CP4_CASES as THD_CP4_CASES  # noqa: E402

POSITIONS = ("rope", "learned_absolute")
SIZES = {Backend.ULYSSES_RING: [(4, 2)], **{b: [(2, 1), (4, 1)] for b in Backend if b != Backend.ULYSSES_RING}}
# (world, backend, ulysses size, position embedding, recompute preset, variant, dataloader mask)
CASES = [(w, b.value, u, pos, "none", "base", pos == "rope") for b, sizes in SIZES.items() for w, u in sizes
         for pos in POSITIONS]
CASES += [(2, "zigzag", 1, "rope", "full", "base", True), (2, "ulysses", 1, "rope", "selective", "base", False),
          (2, "zigzag", 1, "rope", "full+offload_attn:1", "base", True), (2, "ulysses", 1, "rope", "sqrt+offload:1",
                                                                            "base", False),
          (2, "striped", 1, "rope", "none", "knobs", True), (2, "ulysses", 1, "rope", "none", "knobs", False),
          (2, "zigzag", 1, "yarn", "none", "base", False), (4, "striped", 1, "yarn", "none", "base", True)]
CASES += [(2, "zigzag", 1, "rope", "selective+tile_mlp:5", "base", True),     # +tile_mlp: [s, b, h], (output, bias)
          (2, "ring", 1, "rope", "sqrt+tile_mlp+recompute_attn", "base", False)]
# windows per layer (window_attn_skip_freq) with learnable softmax offsets, windows with the off-by-one softmax
CASES += [(2, "ring", 1, "rope", "none", "window", True), (2, "zigzag", 1, "rope", "selective", "window", True),
          (2, "allgather", 1, "rope", "none", "window", False), (2, "ulysses", 1, "rope", "none", "offbyone", False),
          (4, "striped", 1, "rope", "none", "offbyone", True), (4, "ulysses_ring", 2, "rope", "none", "window", False)]
# mixture of experts (dropless: the per-token routing and the load-balancing and z losses over all tokens do not
# depend on which tokens a rank holds), under the presets ctx_plugin applies too
CASES += [(2, "zigzag", 1, "rope", "none", "moe", True), (2, "striped", 1, "rope", "selective", "moe", True),
          (2, "ring", 1, "rope", "full", "moe", False), (4, "ulysses", 1, "rope", "none", "moe", False),
          (4, "allgather", 1, "rope", "sqrt", "moe", True), (4, "ulysses_ring", 2, "rope", "none", "moe", False)]
ROPE_CLASS = {"rope": "LayoutRotaryEmbedding", "yarn": "LayoutYarnRotaryEmbedding", "learned_absolute": "NoneType"}
_results: dict[int, list] = {}


def results(world: int, *, launch: bool = True):
    """Every rank's results at ``world`` ranks (1: Megatron's own model); None when not launched yet and not
    ``launch``."""
    if world not in _results and not launch:
        return None
    if world not in _results:
        if world == 1:      # Megatron's own model, one result per (position embedding, variant)
            cases = sorted({(c[3], c[5]) for c in CASES})
            _results[1] = run_spawned("tests.integration.megatron_ranks:reference_step", 1, {"cases": cases},
                                      timeout_s=600)
        else:
            _results[world] = run_spawned("tests.integration.megatron_ranks:gpt_step", world,
                                          {"cases": [c[1:] for c in CASES if c[0] == world],
                                           "refused": [fields for fields, _ in REFUSED_MODELS],
                                           "unprepared": UNPREPARED if world == 2 else [],
                                           "thd": THD_CP4_CASES if world == 4 else []},   # test_megatron_thd.py's
                                          timeout_s=600)
    return _results[world]


@pytest.mark.parametrize("world,backend,u,position,preset,variant,mask", CASES,
                         ids=[f"P{c[0]}-" + case_key(*c[1:]) for c in CASES])
def test_gpt_model_matches_megatron(world, backend, u, position, preset, variant, mask):
    want = results(1)[0][f"{position}-{variant}"]
    got = results(world)
    key = case_key(backend, u, position, preset, variant, mask)
    assert got[0][key]["weights"] == want["weights"], "the two models were not initialised alike"
    assert got[0][key]["rope_class"] == ROPE_CLASS[position]
    assert got[0][key]["offsets"] == want["offsets"]                  # softmax offsets checkpointed alike
    assert bool(want["offsets"]) == (variant == "window")
    for rank in range(world):
        assert abs(got[rank][key]["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"])
    grads = got[0][key]["grads"]
    assert set(grads) == set(want["grads"])
    floor = 1e-6 * max(max(abs(x) for x in g) for g in want["grads"].values())    # gradients that are 0 exactly
    for name, w in want["grads"].items():
        w, have = torch.tensor(w, dtype=torch.float64), torch.tensor(grads[name], dtype=torch.float64)
        err = ((have - w).abs().max() / w.abs().max().clamp_min(floor)).item()
        assert err <= 1e-9, f"{name}: relative error {err:.2e}"


UNPREPARED = ["zigzag", "allgather", "ring", "striped", "ulysses"]


@pytest.mark.parametrize("backend", UNPREPARED)
def test_model_without_prepare_model(backend):
    """A GPTModel built with gpt_layer_spec but not prepared keeps megatron-core's own RoPE, which slices positions
    zigzag-wise: right for zigzag and allgather (Megatron's own model's loss and gradients), an error on every rank
    for the layouts that hold other tokens (it silently rotated them by other tokens' positions)."""
    got = [r[f"unprepared-{backend}"] for r in results(2)]
    if backend in ("zigzag", "allgather"):
        want = results(1)[0]["rope-base"]
        for rank in range(2):
            assert abs(got[rank]["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"])
        floor = 1e-6 * max(max(abs(x) for x in g) for g in want["grads"].values())
        for name, w in want["grads"].items():
            w, have = torch.tensor(w, dtype=torch.float64), torch.tensor(got[0]["grads"][name], dtype=torch.float64)
            assert ((have - w).abs().max() / w.abs().max().clamp_min(floor)).item() <= 1e-9, name
    else:
        for message in got:
            assert f"(backend {backend}) runs in a model ctx_plugin.megatron.spec.prepare_model was not called on" \
                in message and "Call prepare_model(model, settings, groups_provider)" in message


REFUSED_MODELS = [({"window_size": (8, 4)}, "window_size=(8, 4) (--window-size) has right=4 under a causal mask"),
                  ({"window_size": (8, -1)}, "window_size=(8, -1) (--window-size) has right=-1 under a causal mask")]


@pytest.mark.parametrize("fields,message", REFUSED_MODELS, ids=[repr(f) for f, _ in REFUSED_MODELS])
def test_gpt_model_refuses_what_it_would_compute_wrong(fields, message):
    """Windows megatron-core's own attentions read differently (its local attention attends the future tokens of a
    window's right side, Transformer Engine drops them) stop at model construction, on every rank."""
    for got in results(2):
        assert message in got[repr(sorted(fields.items()))]


def _parse(monkeypatch, *flags):
    from megatron.training.arguments import parse_args

    from ctx_plugin.megatron.args import add_arguments

    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "4096",
            "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--attention-dropout", "0"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *base, *flags])
    return parse_args(extra_args_provider=add_arguments)


def test_flags_with_megatrons_parser(monkeypatch):
    from ctx_plugin.megatron.args import settings_from_args

    args = _parse(monkeypatch, "--context-parallel-size", "4", "--cp-backend", "ulysses_ring", "--cp-ulysses-size",
                  "2", "--cp-kernel", "torch", "--cp-recompute", "mlp", "--group-query-attention",
                  "--num-query-groups", "2")
    s = settings_from_args(args)
    assert (s.cp_config.backend, s.cp_config.ulysses_size, s.cp_config.kernel) == ("ulysses_ring", 2, "torch")
    assert str(s.recompute) == "mlp"
    assert s.megatron_recompute == {"recompute_granularity": "selective", "recompute_method": None,
                                    "recompute_num_layers": None, "recompute_modules": ["mlp"]}
    moe = settings_from_args(_parse(monkeypatch, "--cp-recompute", "mlp", "--num-experts", "4"))
    assert moe.megatron_recompute["recompute_modules"] == ["mlp", "moe"]    # MoE layers: Megatron's "moe" module
    window = _parse(monkeypatch, "--window-size", "(4,0)", "--window-attn-skip-freq", "[1,0,1,0]",
                    "--softmax-type", "learnable")         # honoured (test_gpt_model_matches_megatron)
    assert (window.window_size, window.window_attn_skip_freq, window.softmax_type) == ((4, 0), [1, 0, 1, 0],
                                                                                       "learnable")
    settings_from_args(window)
    default = settings_from_args(_parse(monkeypatch, "--context-parallel-size", "2"))
    assert default.cp_config.backend == "zigzag" and default.megatron_recompute["recompute_granularity"] is None
    assert settings_from_args(_parse(monkeypatch, "--cp-recompute", "sqrt")).megatron_recompute is None
    for flags in (["--cp-backend", "zigzag", "--position-embedding-type", "rope"],    # packed documents (THD)
                  ["--cp-backend", "ring", "--position-embedding-type", "learned_absolute"]):
        settings_from_args(_parse(monkeypatch, "--context-parallel-size", "2", "--dataloader-inter-document-masking",
                                  *flags))
        settings_from_args(_parse(monkeypatch, "--context-parallel-size", "2", "--reset-attention-mask",
                                  "--reset-position-ids", "--eod-mask-loss", *flags))   # packed from the mask (THD)
    padded = settings_from_args(_parse(monkeypatch, "--context-parallel-size", "2", "--reset-attention-mask",
                                       "--cp-pad-documents", "--tensor-model-parallel-size", "4", "--sequence-parallel"))
    assert padded.document_padding == (4, 8)        # zigzag's 2·CP per document; CP·TP tokens with sequence parallel
    assert default.document_padding is None
    for flags in (["--reset-position-ids"],         # causal attention; positions reach learned embeddings sharded
                  ["--reset-attention-mask", "--dataloader-inter-document-masking"]):   # the dataset's cu_seqlens
        settings_from_args(_parse(monkeypatch, "--context-parallel-size", "2", "--cp-backend", "ring",
                                  "--no-create-attention-mask-in-dataloader", "--pipeline-model-parallel-size", "2",
                                  *flags))


BAD = [
    (["--cp-backend", "ringg"], None, "invalid choice"),
    (["--context-parallel-size", "4", "--cp-backend", "ulysses_ring", "--cp-ulysses-size", "3"], ValueError,
     "--cp-ulysses-size 3 must divide --context-parallel-size 4"),
    (["--cp-ulysses-size", "2"], ValueError, "applies to backend='ulysses_ring' only"),
    (["--context-parallel-size", "2", "--attention-backend", "local"], ValueError, "--attention-backend local"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], ValueError, "--cp-comm-type a2a conflicts"),
    (["--context-parallel-size", "16", "--cp-backend", "ulysses"], ValueError,
     "Ulysses splits heads over 16 ranks, but there are 8 attention heads per tensor-parallel rank; use a "
     "--context-parallel-size that divides 8"),
    (["--context-parallel-size", "4", "--cp-backend", "ulysses", "--group-query-attention", "--num-query-groups",
      "3"], None, None),
    (["--context-parallel-size", "3", "--seq-length", "4096"], ValueError,
     "--seq-length must be a positive multiple of 6, got 4096"),
    (["--cp-recompute", "full", "--recompute-granularity", "full"], ValueError, "both set what to recompute"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"], ValueError,
     r"--recompute-granularity, --recompute-method, --recompute-num-layers: ctx_plugin sets Megatron's recompute "
     r"fields from --cp-recompute (default none), so Megatron's own flags would be dropped; use --cp-recompute "
     r"full:uniform:2 instead"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"], ValueError,
     "use --cp-recompute full:block:3 instead"),
    (["--recompute-granularity", "full"], ValueError, "use --cp-recompute full instead"),
    (["--cp-recompute", "full:block:5"], ValueError, "full:block:5 counts 5 layers, but the stack has 4"),
    (["--cp-recompute", "full:uniform:3", "--pipeline-model-parallel-size", "2"], ValueError,
     "counts 3 layers, but the stack has 2 (per pipeline stage or virtual-pipeline chunk)"),
    (["--recompute-activations"], ValueError, "use --cp-recompute selective (or core_attn, mlp) instead"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp"], ValueError,
     "use --cp-recompute mlp instead"),
    (["--cp-recompute", "full:sideways:2"], ValueError, "method must be one of"),
    (["--attention-dropout", "0.1"], ValueError, "set --attention-dropout 0 (got 0.1)"),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"], ValueError,
     "--no-create-attention-mask-in-dataloader: Megatron's dataloader then builds no document mask"),
    (["--reset-attention-mask", "--pipeline-model-parallel-size", "2"], ValueError,
     "--pipeline-model-parallel-size 2: Megatron-LM's get_batch gives middle pipeline stages no batch"),
    (["--reset-attention-mask", "--num-experts", "4", "--moe-router-load-balancing-type", "seq_aux_loss"], ValueError,
     "--num-experts with --moe-router-load-balancing-type seq_aux_loss: megatron-core's router sees the packed batch "
     "as one sequence, so its per-sequence load-balancing loss would pool the samples; use aux_loss or "
     "global_aux_loss"),
    (["--reset-attention-mask", "--num-experts", "4", "--cp-pad-documents"], ValueError,
     "--num-experts with --cp-pad-documents: the padding tokens would be routed to experts and counted by the "
     "load-balancing loss"),
    (["--reset-attention-mask", "--mtp-num-layers", "1"], ValueError, "--mtp-num-layers: on a packed batch"),
    (["--cp-pad-documents"], ValueError, "--cp-pad-documents pads the documents ctx_plugin reads from "
     "--reset-attention-mask's dataloader mask: drop it"),
    (["--cp-pad-documents", "--reset-attention-mask", "--dataloader-inter-document-masking"], ValueError,
     "(--dataloader-inter-document-masking give the dataset's own cu_seqlens)"),
    (["--cp-pad-documents", "--reset-attention-mask", "--cuda-graph-impl", "local"], ValueError,
     "cuda_graph_impl='local' (--cuda-graph-impl): a captured CUDA graph replays ctx_plugin's attention"),
    (["--cuda-graph-impl", "transformer_engine"], ValueError, "cuda_graph_impl='transformer_engine'"),
    (["--enable-cuda-graph"], ValueError, "enable_cuda_graph=True (--enable-cuda-graph)"),
    (["--external-cuda-graph"], ValueError, "external_cuda_graph=True (--external-cuda-graph)"),
    (["--context-parallel-size", "2", "--cp-backend", "ring", "--reset-attention-mask", "--position-embedding-type",
      "rope"], ValueError, "--reset-attention-mask (packed documents, THD) with --position-embedding-type rope"),
    (["--hybrid-context-parallel"], ValueError, "hybrid_context_parallel=True (--hybrid-context-parallel)"),
    (["--context-parallel-size", "2", "--cp-backend", "striped", "--dataloader-inter-document-masking",
      "--position-embedding-type", "rope"], ValueError, "--dataloader-inter-document-masking (packed documents, "
     "THD) with --position-embedding-type rope"),
    (["--context-parallel-size", "2", "--cp-backend", "ring", "--sft", "--position-embedding-type", "yarn"],
     ValueError, "which --cp-backend ring does not hold"),
    (["--window-size", "(4,2)"], ValueError, "window_size=(4, 2) (--window-size) has right=2 under a causal mask"),
    (["--window-size", "(4,-2)"], ValueError, "window_size=(4, -2) (--window-size) must be two integers"),
    (["--position-embedding-type", "mrope", "--mrope-section", "2", "2", "4"], ValueError,
     "position_embedding_type='mrope' (--position-embedding-type): multimodal RoPE"),
    (["--qk-clip"], ValueError, "qk_clip=True (--qk-clip)"),
    (["--seq-length", "65536", "--max-position-embeddings", "65536"], ValueError,
     "mask of 4 GiB per micro batch on its GPU, which ctx_plugin's attention does not need (it applies causality "
     "itself); add --no-create-attention-mask-in-dataloader"),
    (["--seq-length", "32768", "--max-position-embeddings", "32768", "--micro-batch-size", "4"], ValueError,
     "mask of 4 GiB per micro batch"),
    (["--seq-length", "65536", "--max-position-embeddings", "65536", "--reset-attention-mask"], ValueError,
     "replace --reset-attention-mask with --dataloader-inter-document-masking (the documents as cu_seqlens) and add "
     "--no-create-attention-mask-in-dataloader"),
]


def test_long_sequences_without_the_dataloader_mask(monkeypatch):
    """Below 4 GiB of mask per micro batch, or without the mask, long sequences pass (the limit is the mask's)."""
    from ctx_plugin.megatron.args import settings_from_args

    for flags in (["--seq-length", "32768"], ["--seq-length", "1048576", "--no-create-attention-mask-in-dataloader"],
                  ["--seq-length", "1048576", "--dataloader-inter-document-masking",
                   "--no-create-attention-mask-in-dataloader"]):
        settings_from_args(_parse(monkeypatch, *flags, "--max-position-embeddings", flags[1]))


@pytest.mark.parametrize("flags,error,message", BAD, ids=[" ".join(f) for f, _, _ in BAD])
def test_bad_flag_combinations(monkeypatch, flags, error, message):
    from ctx_plugin.megatron.args import settings_from_args

    if error is None and message == "invalid choice":
        with pytest.raises(SystemExit):
            _parse(monkeypatch, *flags)
        return
    try:
        args = _parse(monkeypatch, *flags)
    except SystemExit:
        pytest.fail(f"Megatron's parser rejected {flags}")
    if error is None:      # num_query_groups 3 is rejected by Megatron's own validation, not by the parser
        with pytest.raises(ValueError, match=r"needs --num-query-groups per tensor-parallel rank \(3\) to divide 4"):
            settings_from_args(args)
        return
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_from_args(args)


SPEC_BASE = ("--transformer-impl", "local", "--context-parallel-size", "2")


def _layer_spec(monkeypatch, *flags):
    from megatron.training import global_vars

    from ctx_plugin.megatron.spec import layer_spec

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", _parse(monkeypatch, *SPEC_BASE, *flags))
    return layer_spec(None)


@pytest.mark.parametrize("backend", ["zigzag", "allgather"])
def test_spec_alone_with_megatrons_zigzag_layout(monkeypatch, backend):
    """``--spec ctx_plugin.megatron.spec layer_spec`` on an unpatched Megatron: Megatron calls it; the core
    attention is ctx_plugin's, whose layout for these backends is Megatron's zigzag."""
    from ctx_plugin.megatron.core_attention import CPCoreAttention

    spec = _layer_spec(monkeypatch, "--cp-backend", backend, "--no-create-attention-mask-in-dataloader")
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is CPCoreAttention and core.params["cp_config"].backend == backend


@pytest.mark.parametrize("own", [["--recompute-granularity", "selective"],
                                 ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "1"]])
def test_spec_alone_leaves_megatrons_own_recompute_flags_to_megatron(monkeypatch, own):
    """Without the entry point nothing writes Megatron's recompute fields, so its own --recompute-* flags apply as
    given (the entry point refuses them for --cp-recompute, which writes those fields; --spec alone refuses that)."""
    from megatron.training import global_vars

    spec = _layer_spec(monkeypatch, "--cp-backend", "zigzag", "--no-create-attention-mask-in-dataloader", *own)
    assert spec.submodules.self_attention.submodules.core_attention.params["cp_config"].backend == "zigzag"
    assert global_vars.get_args().recompute_granularity == own[1]


@pytest.mark.parametrize("flags,message", [
    (["--cp-backend", "striped", "--no-create-attention-mask-in-dataloader"],
     "--cp-backend striped holds other tokens on each rank than the zigzag chunks"),
    (["--cp-backend", "ulysses", "--no-create-attention-mask-in-dataloader"], "--cp-backend ulysses holds other"),
    (["--cp-backend", "zigzag"], "pass --no-create-attention-mask-in-dataloader"),
    (["--cp-backend", "zigzag", "--no-create-attention-mask-in-dataloader", "--cp-recompute", "selective"],
     "--cp-recompute selective is applied by ctx_plugin's entry point"),
    # packed batches: Megatron's get_batch shards them its own way, whatever the layout hook says
    (["--cp-backend", "zigzag", "--dataloader-inter-document-masking"],
     "--dataloader-inter-document-masking without --sft: Megatron-LM's get_batch shards its batches zigzag over the "
     "whole sequence"),
    (["--cp-backend", "allgather", "--dataloader-inter-document-masking", "--position-embedding-type",
      "learned_absolute"], "--dataloader-inter-document-masking without --sft"),
])
def test_spec_alone_refuses_what_megatron_would_get_wrong(monkeypatch, flags, message):
    with pytest.raises(ValueError, match="without ctx_plugin's entry point") as e:
        _layer_spec(monkeypatch, *flags)
    assert message in str(e.value) and "python -m ctx_plugin.megatron.pretrain_gpt" in str(e.value)
    if "striped" in flags:
        assert "patches/megatron-core-0.19-cp-layout-hook.patch" in str(e.value)
        assert "--cp-backend zigzag" in str(e.value)


def test_spec_without_ctx_plugins_flags_names_the_ways_to_add_them(monkeypatch):
    """An unpatched Megatron parsing without ctx_plugin's extra_args_provider: no --cp-* flags on its args."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    from ctx_plugin.megatron.spec import layer_spec

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                                      "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
                                      "64", "--micro-batch-size", "1", *SPEC_BASE])
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", parse_args())
    with pytest.raises(ValueError, match=r"Megatron's arguments have no --cp-\* flags .*python -m "
                                         r"ctx_plugin.megatron.pretrain_gpt.*extra-args-entry-points.patch"):
        layer_spec(None)


@pytest.mark.parametrize("backend", ["ring", "striped", "ulysses"])
def test_spec_with_the_layout_hook_refuses_sft_batches_off_megatrons_zigzag(monkeypatch, backend):
    """--sft batches go through Megatron's per-document sharder (Transformer Engine's zigzag per document), which the
    layout-hook patch does not reach: with the hook installed, only Megatron's zigzag layouts take them."""
    import ctx_plugin.megatron.spec as spec_module

    monkeypatch.setattr(spec_module, "_layout_hook_installed", lambda: True)
    flags = ["--no-create-attention-mask-in-dataloader", "--sft", "--position-embedding-type", "learned_absolute"]
    with pytest.raises(ValueError, match=f"--sft: Megatron shards packed batches zigzag per document .* --cp-backend "
                                         f"{backend} holds other tokens"):
        _layer_spec(monkeypatch, "--cp-backend", backend, *flags)
    _layer_spec(monkeypatch, "--cp-backend", backend, "--no-create-attention-mask-in-dataloader")   # unpacked: fine
    _layer_spec(monkeypatch, "--cp-backend", "zigzag", *flags)


@pytest.mark.parametrize("backend,hook_backend,packed,fits", [
    ("striped", "striped", False, True), ("ulysses_ring", "ulysses_ring", False, True),
    ("ring", "striped", False, False), ("ring", None, False, False),       # the hook's layout, or Megatron's zigzag
    ("striped", "striped", True, False), ("zigzag", None, True, True), ("allgather", None, False, True)])
def test_unprepared_model_with_the_layout_hook(monkeypatch, backend, hook_backend, packed, fits):
    """Without prepare_model, megatron-core's RoPE slices by the layout-hook patch's hook when one is installed
    (unpacked sequences only; packed ones zigzag per document): the core attention runs only where that is its
    layout on every rank."""
    import megatron.core.utils as core_utils

    import ctx_plugin
    import ctx_plugin.megatron.rope as rope_module
    from ctx_plugin.core.layouts import shard_layout

    def hook(seq_len, cp, rank):
        if hook_backend is None:
            return None
        layout = shard_layout(ctx_plugin.CPConfig(backend=hook_backend, ulysses_size=2 if "ulysses" in hook_backend
                                                  else 1))
        return layout.local_indices(seq_len, rank, cp)

    monkeypatch.setattr(rope_module, "_layout_hook_installed", lambda: True)
    monkeypatch.setattr(core_utils, "get_cp_layout_hook", lambda: hook, raising=False)
    config = ctx_plugin.CPConfig(backend=backend, ulysses_size=2 if "ulysses" in backend else 1)
    assert rope_module.megatron_rope_fits(config, 64, 4, packed) is fits


@pytest.mark.parametrize("flags,dropped", [(["--qk-l2-norm"], "--qk-l2-norm"), (["--num-experts", "2"], "--num-experts"),
                                          (["--multi-latent-attention"], "--multi-latent-attention")])
def test_spec_without_megatrons_model_config_refuses_what_the_plain_layer_drops(monkeypatch, flags, dropped):
    """Called without Megatron's GPTModelConfig, layer_spec builds the plain GPT layer: flags whose modules that layer
    lacks (L2-normalised q/k, MoE) would be silently dropped."""
    with pytest.raises(ValueError, match=f"which would drop {dropped}; run through ctx_plugin's entry point"):
        _layer_spec(monkeypatch, "--cp-backend", "zigzag", "--no-create-attention-mask-in-dataloader", *flags)


def test_spec_with_megatrons_model_config_is_megatrons_own_spec(monkeypatch):
    """Called by megatron-core's GPTModelBuilder (with its GPTModelConfig), layer_spec is Megatron's own
    default_layer_spec with only the core attention replaced (here: its q/k layernorm kept), and flags the plain layer
    would drop (--qk-l2-norm) are Megatron's spec's to honour, not refused."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import global_vars
    from megatron.training.models.gpt import GPTModelConfig, default_layer_spec

    from ctx_plugin.megatron.core_attention import CPCoreAttention
    from ctx_plugin.megatron.spec import layer_spec

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", _parse(monkeypatch, *SPEC_BASE, "--cp-backend", "zigzag",
                                                            "--no-create-attention-mask-in-dataloader", "--qk-l2-norm"))
    transformer = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, qk_layernorm=True,
                                    use_cpu_initialization=True)
    transformer.transformer_impl = "local"
    model_config = GPTModelConfig(transformer=transformer, vocab_size=128)
    spec, own = layer_spec(model_config), default_layer_spec(model_config, None)
    attention, own_attention = spec.submodules.self_attention.submodules, own.submodules.self_attention.submodules
    assert attention.core_attention.module is CPCoreAttention and own_attention.core_attention is not CPCoreAttention
    assert attention.q_layernorm == own_attention.q_layernorm and attention.linear_qkv == own_attention.linear_qkv
    assert repr(spec.submodules.mlp) == repr(own.submodules.mlp)     # partials: equal by what they hold


def test_spec_under_the_entry_point(monkeypatch):
    """The entry point shards batches in the backend's layout (and drops the checked causal mask): every
    backend and preset goes."""
    import megatron.core.utils as core_utils

    def sharder(batch, *args, **kwargs):
        return batch

    sharder.ctx_plugin_seam = True          # what python -m ctx_plugin.megatron.pretrain_gpt marks its sharder with
    monkeypatch.setattr(core_utils, "get_batch_on_this_cp_rank", sharder)
    spec = _layer_spec(monkeypatch, "--cp-backend", "striped", "--cp-recompute", "selective")
    assert spec.submodules.self_attention.submodules.core_attention.params["cp_config"].backend == "striped"
