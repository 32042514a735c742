"""Every ``ctx-plugin`` error is one line on stderr (``ctx-plugin <command>: error: ...``), exit status 2, nothing on
stdout, no traceback, and is raised before any work: bad numbers, fractions that would be rounded, missing files,
folders, JSON that is not an object, output paths in missing folders, options that would be ignored, and shapes
the ranks cannot split."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ctx_plugin.cli import main

MEMORY = ["memory", "--model", "llama3-8b", "--seq-len", "4k"]
PLAN = ["plan", "--model", "llama3-8b", "--seq-len", "32k", "--nodes", "1"]
BENCH = ["bench", "--device", "cpu", "--passes", "fwd", "--backends", "zigzag"]   # would time S = 128k: must not
SMOKE = ["bench", "--smoke", "--passes", "fwd", "--backends", "zigzag"]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "notjson.json").write_text("num_hidden_layers = 2")
    (tmp_path / "adir").mkdir()
    (tmp_path / "bench.json").write_text(json.dumps({"attention_tflops": "fast"}))
    for name, section in (("typo", {"reduce_bucket_sizes": 1e8}), ("stage3", {"stage": 3}), ("ds2", {"stage": 2}),
                          ("offload", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
                          ("buckets", {"reduce_bucket_size": 1e8})):
        (tmp_path / f"{name}.json").write_text(json.dumps({"zero_optimization": section}))
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 256}
    (tmp_path / "mistral.json").write_text(json.dumps({**llama, "model_type": "mistral"}))   # window 4096 by default
    (tmp_path / "tied.json").write_text(json.dumps({**llama, "tie_word_embeddings": "false"}))
    return tmp_path


# (command line with {d} for the fixture folder, a word the one-line message must contain)
CASES = [
    (["memory", "--model", "nosuch", "--seq-len", "4k"], "neither a model preset"),
    (["memory", "--model", "{d}/missing.json", "--seq-len", "4k"], "neither a model preset"),
    (["memory", "--model", "{d}/adir", "--seq-len", "4k"], "is a folder"),
    (["memory", "--model", "{d}/list.json", "--seq-len", "4k"], "JSON list, not an object"),
    (["memory", "--model", "{d}/notjson.json", "--seq-len", "4k"], "is not JSON"),
    ([*MEMORY, "--micro-batch", "0"], "--micro-batch"),
    ([*MEMORY, "--cp", "-2"], "--cp"),
    ([*MEMORY, "--tp", "1.5"], "not a whole number"),
    ([*MEMORY, "--tp", "16"], "K/V heads 8 is not divisible by --tp 16"),      # not one replicated K/V head per rank
    (["memory", "--model", "qwen2-7b", "--seq-len", "4k", "--tp", "7"], "K/V heads 4 is neither divisible by --tp 7"),
    (["memory", "--model", "llama3-8b", "--seq-len", "100004", "--tp", "8", "--sequence-parallel"],
     "--seq-len must be a positive multiple of 8"),
    ([*PLAN, "--tp", "2", "--zero", "3"], "tp=2 with ZeRO-3: no supported framework runs it"),
    ([*MEMORY, "--framework", "megatron", "--zero", "3"], "ZeRO-2/3 are DeepSpeed's"),
    ([*MEMORY, "--tp", "2", "--zero", "3"], "tp=2 with ZeRO-3: no supported framework runs it"),
    ([*PLAN, "--framework", "megatron", "--zero", "1", "3"], "--framework megatron with --zero 1 3"),
    ([*PLAN, "--framework", "deepspeed", "--tp", "1", "2"], "--framework deepspeed with --tp 1 2"),
    ([*PLAN[:3], "--max-seq-len", *PLAN[5:], "--framework", "deepspeed", "--tp", "2"], "no tensor parallelism"),
    ([*PLAN, "--deepspeed-config", "{d}/list.json"], "JSON list, not an object"),
    ([*MEMORY, "--framework", "deepspeed", "--tp", "2"], "no tensor parallelism"),
    ([*MEMORY, "--deepspeed-config", "{d}/ds2.json"], "--deepspeed-config sets ZeRO stage 2, but the estimate is for "
                                                      "--zero 1: give --zero 2"),
    ([*MEMORY, "--zero", "1", "--framework", "megatron", "--deepspeed-config", "{d}/buckets.json"],
     "this estimate counts the model state as Megatron holds it"),
    ([*MEMORY, "--zero", "2", "--deepspeed-config", "{d}/typo.json"], "reduce_bucket_sizes: Extra inputs"),
    ([*MEMORY, "--zero", "2", "--deepspeed-config", "{d}/stage3.json"], "give --zero 3"),
    ([*MEMORY, "--zero", "2", "--deepspeed-config", "{d}/offload.json"], "offloads (offload_optimizer.device 'cpu')"),
    ([*PLAN, "--deepspeed-config", "{d}/typo.json"], "this search counts every configuration's model state as Megatron"),
    ([*PLAN, "--zero", "2", "--deepspeed-config", "{d}/stage3.json"], "give --zero 3"),
    ([*PLAN, "--zero", "2", "3", "--deepspeed-config", "{d}/ds2.json"], "the estimate is for --zero 2 3"),
    ([*PLAN, "--framework", "megatron", "--modifiers", "--deepspeed-config", "{d}/ds2.json"], "as Megatron holds it"),
    ([*PLAN, "--host-bw", "1", "--host-adam", "2"], "--host-bw, --host-adam describe the host for offload"),
    ([*PLAN, "--gpus-per-host-link", "4"], "add --modifiers"),
    (["memory", "--model", "{d}/mistral.json", "--seq-len", "4k"], "sliding window of 4096 tokens"),
    (["plan", "--model", "{d}/mistral.json", "--seq-len", "4k", "--nodes", "1"], "\"sliding_window\": null"),
    (["memory", "--model", "{d}/tied.json", "--seq-len", "4k"], "'tie_word_embeddings' must be true or false"),
    ([*MEMORY, "--framework", "deepspeed", "--grad-dtype", "fp32"], "grad_accum_dtype"),
    (["plan", "--model", "llama3-8b", "--seq-len", "100004", "--nodes", "1", "--tp", "8"],
     "sequence parallelism splits each of the cp 1 ranks' tokens over tp 8"),
    ([*MEMORY, "--budget", "nan"], "not finite"),
    ([*MEMORY, "--budget", "0"], "must be > 0"),
    ([*MEMORY, "--budget", "1"], "no recompute preset fits"),
    (["memory", "--model", "llama3-8b", "--seq-len", "inf"], "not finite"),
    (["memory", "--model", "llama3-8b", "--seq-len", "1e400"], "is more than 1,099,511,627,776 tokens"),
    ([*PLAN[:4], "1e30", *PLAN[5:]], "is more than 1,099,511,627,776 tokens"),
    ([*MEMORY, "--recompute", "full:block:99"], "counts 99 layers, but the stack has 32"),
    (["memory", "--model", "llama3-8b", "--seq-len", "4096.5"], "not a whole number of tokens"),
    (["memory", "--model", "llama3-8b", "--seq-len", "1000", "--cp", "8"],
     "--seq-len must be a positive multiple of 16, got 1000 (zigzag over --cp 8)"),
    ([*MEMORY, "--ulysses-size", "2"], "--ulysses-size applies to --backend ulysses_ring only"),
    ([*MEMORY, "--backend", "ulysses_ring", "--ulysses-size", "3", "--cp", "8"], "--ulysses-size 3 must divide --cp 8"),
    ([*MEMORY, "--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    ([*MEMORY, "--backend", "ulysses", "--cp", "8", "--tp", "8"], "4 query heads per --tp rank; use a --cp that"),
    ([*MEMORY, "--plot", "{d}/nofolder/m.png"], "does not exist"),
    ([*MEMORY, "--plot", "{d}/adir"], "is a folder"),
    ([*MEMORY, "stray"], "unrecognized arguments"),
    ([*PLAN, "--gpus-per-node", "0"], "--gpus-per-node"),
    ([*PLAN, "--gpu-memory", "inf"], "not finite"),
    ([*PLAN, "--inter-bw", "-1"], "must be > 0"),
    ([*PLAN, "--tp", "0"], "--tp"),
    ([*PLAN, "--top", "0"], "--top"),
    ([*PLAN, "--nodes", "1.5"], "--nodes"),
    ([*PLAN, "--bench", "{d}/adir"], "is a folder"),
    ([*PLAN, "--bench", "{d}/notjson.json"], "is not JSON"),
    ([*PLAN, "--bench", "{d}/list.json"], "JSON list"),
    ([*PLAN, "--bench", "{d}/bench.json"], "not a positive number"),
    ([*PLAN, "--plot", "{d}/nofolder/p.png"], "does not exist"),
    ([*BENCH, "--seq-len", "63", "--ranks", "2"], "multiple of 4, got 63"),
    ([*BENCH, "--backends", "ring", "--seq-len", "63", "--ranks", "2"], "multiple of 2, got 63"),
    ([*BENCH, "--seq-len", "nan"], "not finite"),
    ([*BENCH, "--heads", "0"], "--heads"),
    ([*BENCH, "--kv-heads", "0"], "--kv-heads"),
    ([*BENCH, "--heads", "3", "--kv-heads", "2"], "multiple of kv_heads"),
    ([*BENCH, "--reps", "0"], "--reps"),
    ([*BENCH, "--ranks", "2", "0"], "--ranks"),
    ([*SMOKE, "--seq-len", "64"], "--smoke sets --seq-len"),
    ([*SMOKE, "--heads", "8", "--reps", "3"], "--smoke sets --heads, --reps"),
    ([*SMOKE, "--json", "{d}/nofolder/b.json"], "does not exist"),
    ([*SMOKE, "--json", "{d}/adir"], "is a folder"),
    ([*SMOKE, "--plot", "{d}/nofolder/b.png"], "does not exist"),
    ([*SMOKE, "--nproc", "2"], "--nproc applies to --distributed"),
    ([*SMOKE, "--no-rank-check"], "--no-rank-check applies to --distributed"),
    ([*BENCH, "--distributed", "--ranks", "2"], "--ranks does not apply"),
    ([*SMOKE, "--distributed", "--compare-kernels"], "--compare-kernels does not apply"),
    ([*SMOKE, "--distributed", "--nproc", "3"], "multiple of 6, got 256"),
    ([*SMOKE, "--distributed", "--nproc", "0"], "--nproc"),
    ([*SMOKE, "--distributed", "--kernel", "sdpa_cudnn"], "--kernel sdpa_cudnn cannot run on cpu"),
    ([*BENCH, "--kernel", "sdpa_flash", "--seq-len", "64", "--ranks", "2"], "--kernel sdpa_flash cannot run on cpu"),
    ([*SMOKE, "--backends", "ring", "--ulysses-size", "4"], "--ulysses-size sizes the ulysses_ring backend's"),
    (["bench", "--plan-only", "--doc-len", "64", "--seq-len", "1k", "--ranks", "2", "--passes", "fwd"],
     "--passes does not apply to --plan-only"),
    (["bench", "--plan-only", "--doc-len", "64", "--seq-len", "1k", "--ranks", "2", "--reps", "9"],
     "--reps does not apply to --plan-only"),
    ([*SMOKE, "--window", "-1"], "'-1' is not a whole number of tokens ≥ 0 (0: each query sees only itself)"),
    ([*SMOKE, "--window", "0.5"], "'0.5' is not a whole number of tokens ≥ 0"),
    (["demo", "--nproc", "0"], "--nproc"),
    (["demo", "--seed", "99999999999999999999999"], "is not a seed: give a whole number in 0..2^63-1"),
    (["demo", "--seed", "-1"], "is not a seed"),
    (["demo", "--nproc", "3"], "--seq-len must be a positive multiple of 6, got 256 (zigzag over --nproc 3)"),
    (["demo", "--seq-len", "63"], "multiple of 8"),
    (["demo", "--seq-len", "256.5"], "not a whole number of tokens"),
    (["demo", "--backend", "ulysses", "--nproc", "8"], "4 query heads"),
    (["demo", "--backend", "ulysses_ring", "--ulysses-size", "3"], "--ulysses-size 3 must divide --nproc 4"),
    (["demo", "--recompute", "bogus"], "recompute preset"),
    (["demo", "--recompute", "budget:10"], "budget"),
    (["demo", "--recompute", "full:block:5"],
     "--recompute full:block:5: recompute preset full:block:5 counts 5 layers"),
    (["demo", "--recompute", "full:uniform:3"], "counts 3 layers, but the stack has 2"),
    (["demo", "--kernel", "sdpa_cudnn", "--device", "cpu"], "--kernel sdpa_cudnn cannot run on the demo's cpu ranks"),
    (["demo", "--kernel", "sdpa_flash", "--device", "cpu"], "--kernel sdpa_flash cannot run on the demo's cpu ranks"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--lr", "nan"], "not finite"),
    (["demo", "--rtol", "-1"], "must be ≥ 0"),
    (["demo", "--json", "{d}/nofolder/d.json"], "does not exist"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["launch", "--dry-run", "sbatch"], "no job script"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_one_line_error_before_any_work(argv, message, files, capsys, monkeypatch):
    import torch.distributed.run

    def no_processes(_):
        raise AssertionError("torchrun started although the arguments are bad")
    monkeypatch.setattr(torch.distributed.run, "main", no_processes)      # demo/bench --distributed check first
    argv = [a.replace("{d}", str(files)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert out == ""
    command = argv[0]
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"ctx-plugin {command}: error: ") and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["memory", "--model", "{d}/adir", "--seq-len", "4k"],
    ["memory", "--model", "llama3-8b", "--seq-len", "4k", "--plot", "{d}/nofolder/m.png"],
    ["demo", "--nproc", "3"],
])
def test_subprocess_no_traceback(argv, files):
    """The real command: one stderr line, exit 2, no ChildFailedError from torchrun (demo checks first)."""
    argv = [a.replace("{d}", str(files)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "ctx_plugin.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ctx-plugin {argv[0]}: error: "), proc.stderr


def test_whole_token_counts_are_kept():
    """128k and 1e3 are whole token counts (kept exactly); the tokens type rounds nothing."""
    from ctx_plugin.cliargs import tokens
    assert tokens("128k") == 131072 and tokens("1e3") == 1000 and tokens("0.5k") == 512 and tokens("1m") == 2 ** 20


def test_demo_and_bench_pass_their_own_arguments_to_the_ranks(monkeypatch):
    """Checked arguments reach the ranks as given, without the launcher's --nproc/--distributed."""
    import torch.distributed.run
    seen = []
    monkeypatch.setattr(torch.distributed.run, "main", seen.append)
    assert main(["demo", "--nproc", "2", "--steps", "3", "--seq-len=64"]) == 0
    assert seen[-1] == ["--standalone", "--nproc-per-node", "2", "-m", "ctx_plugin.demo", "--steps", "3",
                        "--seq-len=64"]
    assert main(["bench", "--smoke", "--distributed", "--nproc=2", "--backends", "zigzag"]) == 0
    assert seen[-1] == ["--standalone", "--nproc-per-node", "2", "-m", "ctx_plugin.bench.distributed", "--smoke",
                        "--backends", "zigzag"]


def test_bench_window_zero_is_accepted_as_its_message_says(capsys):
    """The window's rule and message agree: 0 (each query sees only itself, window=(0, 0)) runs, in any spelling."""
    from ctx_plugin.cliargs import non_negative_tokens

    assert [non_negative_tokens(t) for t in ("0", " 0 ", "0k", "0.0", "16", "4k")] == [0, 0, 0, 0, 16, 4096]
    assert main([*SMOKE, "--window", "0"]) == 0
    assert "window (0, 0)" in capsys.readouterr().out
