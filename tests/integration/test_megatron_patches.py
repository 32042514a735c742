"""patches/ apply to the megatron-core wheel CI installs, and the seams they add find ctx_plugin's entry points."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

megatron = pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'ctx-plugin[megatron]'")

PATCHES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))
INSTALLED = Path(megatron.__file__).resolve().parents[1]          # .../site-packages/megatron


def test_there_are_patches():
    assert len(PATCHES) == 2


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_the_installed_wheel(patch, tmp_path):
    shutil.copytree(INSTALLED, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(["git", "apply", "--check", "-v", str(patch)], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_patched_megatron_uses_ctx_plugin_through_entry_points(tmp_path):
    shutil.copytree(INSTALLED, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    for patch in PATCHES:
        subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    script = textwrap.dedent("""
        import sys, torch, warnings
        warnings.filterwarnings("ignore")
        import megatron.core
        assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__
        from megatron.training.arguments import parse_args
        from megatron.training.global_vars import set_args
        from megatron.core import utils
        from megatron.core.models.common.embeddings import rope_utils
        sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
                    "--cp-backend", "striped", "--context-parallel-size", "2", "--transformer-impl", "local",
                    "--no-create-attention-mask-in-dataloader", "--attention-dropout", "0",
                    "--spec", "ctx_plugin.megatron.spec", "layer_spec"]
        args = parse_args()                                   # no extra_args_provider: the entry point adds --cp-*
        assert args.cp_backend == "striped", args.cp_backend
        set_args(args)
        class Group:                                          # rank 1 of 2
            def size(self): return 2
            def rank(self): return 1
        emb = torch.arange(16.0).view(16, 1, 1, 1)
        torch.distributed.get_world_size = lambda group=None: 2
        torch.distributed.get_rank = lambda group=None: 1
        try:          # no model with ctx_plugin's attention built yet: Megatron's own would get striped data
            rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, Group())
            raise AssertionError("the hook sharded for an attention that is not ctx_plugin's")
        except ValueError as e:
            assert str(e).startswith("--cp-backend striped: this Megatron's layout hook"), e
            assert "built with Megatron's own core attention" in str(e) and "--spec ctx_plugin.megatron.spec" in str(e)
        args.cp_backend = "zigzag"      # every --cp-* flag at its default: a plain Megatron run, its own zigzag
        from ctx_plugin.megatron.hooks import local_positions   # (Megatron's zigzag slicing itself needs CUDA)
        assert local_positions(16, 2, 1) is None
        args.cp_backend = "striped"
        from ctx_plugin.megatron.spec import layer_spec      # --spec: the patched hook gives striped positions
        core = layer_spec().submodules.self_attention.submodules.core_attention
        assert core.params["cp_config"].backend == "striped", core
        rope = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, Group()).flatten().tolist()
        batch = utils.get_batch_on_this_cp_rank({"tokens": torch.arange(16).view(1, 16)}, False, cp_group=Group())
        print(rope, batch["tokens"].flatten().tolist())
    """)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    striped = [float(i) for i in range(1, 16, 2)]
    assert proc.stdout.strip().splitlines()[-1] == f"{striped} {[int(i) for i in striped]}"
