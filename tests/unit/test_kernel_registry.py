"""The kernel registry: auto picks an available kernel, explicit unavailable kernels say how to get them."""
from __future__ import annotations

import sys

import pytest
import torch

from ctx_plugin.core.kernels import SPECS, auto_order, flash_attn, kernel_unavailable, select_kernel
from ctx_plugin.core.kernels.sdpa import CpuFlashKernel
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.names import Kernel

CPU = torch.device("cpu")


def test_every_named_kernel_is_registered():
    assert set(SPECS) | {Kernel.AUTO} == set(Kernel)
    assert set(auto_order(CPU)) == set(SPECS)
    assert auto_order(CPU)[-1] == Kernel.TORCH, "the always-available kernel must come last"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_auto_on_cpu_is_torchs_cpu_flash_kernel(dtype):
    assert isinstance(select_kernel(Kernel.AUTO, CPU, dtype, 64), CpuFlashKernel)


def test_explicit_torch_kernel():
    assert isinstance(select_kernel(Kernel.TORCH, CPU, torch.float64, 64), TorchKernel)
    assert "CPU only" in kernel_unavailable(Kernel.SDPA_CPU, torch.device("cuda", 0), torch.float32, 64)


def test_cuda_kernels_explain_themselves_on_cpu():
    for name in (Kernel.SDPA_CUDNN, Kernel.SDPA_FLASH):
        assert "CUDA device" in kernel_unavailable(name, CPU, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="kernel 'sdpa_flash' cannot run here"):
        select_kernel(Kernel.SDPA_FLASH, CPU, torch.bfloat16, 64)


def test_half_precision_only_kernels_name_the_dtype():
    cuda = torch.device("cuda", 0)
    assert "float16 and bfloat16 only" in kernel_unavailable(Kernel.SDPA_CUDNN, cuda, torch.float32, 64)
    assert "multiple of 8" in kernel_unavailable(Kernel.SDPA_FLASH, cuda, torch.bfloat16, 60)


def test_non_float_inputs_are_refused_even_by_auto():
    assert "floating-point" in kernel_unavailable(Kernel.AUTO, CPU, torch.int64, 64)


# ---------------------------------------------------------------- GPU guards, checked against monkeypatched devices
CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of a chosen compute capability (no flash-attn installed, torch's cuDNN 9 present)."""
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_interface", "flash_attn_3",
                 "flash_attn_3.flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    flash_attn.forget_probe()   # the adapter memoises its import probe: let it see the hidden modules

    def use(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    yield use
    flash_attn.forget_probe()


@pytest.mark.parametrize("capability,cudnn,flash", [
    ((7, 0), False, False), ((7, 5), False, False),             # V100, T4: torch accepts neither
    ((8, 0), True, True), ((8, 6), True, True), ((8, 9), True, True), ((9, 0), True, True),
    ((10, 0), True, True), ((12, 0), True, True), ((12, 1), True, True),
    ((13, 0), False, False)])                                    # beyond torch 2.13's [sm80, sm121]
def test_sdpa_kernels_follow_torchs_compute_capability_range(gpu, capability, cudnn, flash):
    gpu(capability)
    for kernel, ok in ((Kernel.SDPA_CUDNN, cudnn), (Kernel.SDPA_FLASH, flash)):
        reason = kernel_unavailable(kernel, CUDA, torch.bfloat16, 128)
        assert (reason is None) == ok, reason
        if not ok:
            assert "sm80 to sm121" in reason and f"sm{capability[0]}{capability[1]}" in reason


@pytest.mark.parametrize("capability,picked", [((7, 5), Kernel.TORCH), ((7, 0), Kernel.TORCH),
                                               ((8, 0), Kernel.SDPA_CUDNN), ((9, 0), Kernel.SDPA_CUDNN)])
def test_auto_falls_back_on_old_gpus_instead_of_crashing(gpu, capability, picked):
    gpu(capability)
    assert select_kernel(Kernel.AUTO, CUDA, torch.float16, 128).name == picked.value


def test_auto_takes_torchs_flash_kernel_where_cudnn_cannot(gpu, monkeypatch):
    gpu((8, 0))
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 256).name == Kernel.SDPA_FLASH.value   # cuDNN <= 128
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8906)
    assert "cuDNN 9.0 or newer" in kernel_unavailable(Kernel.SDPA_CUDNN, CUDA, torch.bfloat16, 128)
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128).name == Kernel.SDPA_FLASH.value


@pytest.mark.parametrize("capability,head_dim,ok", [
    ((8, 6), 200, False), ((8, 9), 224, False), ((12, 0), 208, False),   # no backward for 193..224 there
    ((8, 6), 192, True), ((8, 6), 232, True), ((8, 6), 256, True), ((8, 0), 200, True), ((9, 0), 224, True)])
def test_torch_flash_kernel_head_dims_without_a_backward(gpu, capability, head_dim, ok):
    gpu(capability)
    reason = kernel_unavailable(Kernel.SDPA_FLASH, CUDA, torch.float16, head_dim)
    assert (reason is None) == ok, reason
    if not ok:
        assert "no backward" in reason and str(head_dim) in reason


def test_sdpa_head_dim_limits_and_rocm(gpu, monkeypatch):
    gpu((9, 0))
    assert "at most 128" in kernel_unavailable(Kernel.SDPA_CUDNN, CUDA, torch.float16, 256)
    assert "at most 256" in kernel_unavailable(Kernel.SDPA_FLASH, CUDA, torch.float16, 264)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "ROCm" in kernel_unavailable(Kernel.SDPA_CUDNN, CUDA, torch.float16, 128)


def test_sdpa_kernels_need_a_visible_gpu(gpu, monkeypatch):
    gpu((9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for kernel in (Kernel.SDPA_CUDNN, Kernel.SDPA_FLASH):
        assert "is_available() is False" in kernel_unavailable(kernel, CUDA, torch.float16, 128)
    assert select_kernel(Kernel.AUTO, CUDA, torch.float16, 128).name == Kernel.TORCH.value


# ---------------------------------------------------------------- cost: cp_attention selects a kernel on every call
def _refuse_probing(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("flash-attn import probe repeated")
    monkeypatch.setattr(flash_attn, "_import_first", boom)
    monkeypatch.setattr(flash_attn.support, "ops_clash", boom)


def _best_us_per_call(*args, calls=200, repeats=5) -> float:
    import time
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            select_kernel(*args)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def test_selection_on_cpu_never_probes_flash_attn(monkeypatch):
    flash_attn.forget_probe()
    _refuse_probing(monkeypatch)
    assert isinstance(select_kernel(Kernel.AUTO, CPU, torch.float32, 64), CpuFlashKernel)
    assert "CUDA device" in kernel_unavailable(Kernel.FLASH_ATTN, CPU, torch.bfloat16, 64)
    assert _best_us_per_call(Kernel.AUTO, CPU, torch.float32, 64) < 50   # ~8 us measured; ~240 us when probing


def test_selection_on_a_gpu_probes_flash_attn_once(gpu, monkeypatch):
    gpu((9, 0))
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128).name == Kernel.SDPA_CUDNN.value
    _refuse_probing(monkeypatch)
    assert "not installed" in kernel_unavailable(Kernel.FLASH_ATTN, CUDA, torch.bfloat16, 128)
    assert _best_us_per_call(Kernel.AUTO, CUDA, torch.bfloat16, 128) < 50   # ~6 us measured
    flash_attn.forget_probe()
    with pytest.raises(AssertionError, match="probe repeated"):
        select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128)


# ---------------------------------------------------------------- mask features: windows and softcap
WINDOW, SOFTCAP = frozenset({"window"}), frozenset({"softcap"})


@pytest.mark.parametrize("features", [WINDOW, SOFTCAP, WINDOW | SOFTCAP], ids=sorted)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_on_cpu_takes_the_torch_kernel_for_windows_and_softcap(features, dtype):
    assert isinstance(select_kernel(Kernel.AUTO, CPU, dtype, 64, features), TorchKernel)
    assert isinstance(select_kernel(Kernel.AUTO, CPU, dtype, 64), CpuFlashKernel)
    assert kernel_unavailable(Kernel.TORCH, CPU, dtype, 64, features) is None


def test_explicit_kernel_without_the_feature_names_it_and_the_kernels_that_can():
    with pytest.raises(ValueError, match="cannot apply sliding windows here") as info:
        select_kernel(Kernel.SDPA_CPU, CPU, torch.float32, 64, WINDOW)
    assert "kernels that can: torch" in str(info.value)
    with pytest.raises(ValueError, match="cannot apply softcap here"):
        select_kernel(Kernel.SDPA_CPU, CPU, torch.float32, 64, SOFTCAP)
    with pytest.raises(ValueError, match="unknown kernel features"):
        select_kernel(Kernel.AUTO, CPU, torch.float32, 64, frozenset({"alibi"}))


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_auto_on_a_gpu_without_flash_attn_takes_torchs_flash_kernel_for_windows(gpu, capability):
    """cuDNN (first for plain masks) applies no window; torch's flash kernel does, before the torch kernel."""
    gpu(capability)
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128).name == Kernel.SDPA_CUDNN.value
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128, WINDOW).name == Kernel.SDPA_FLASH.value
    assert kernel_unavailable(Kernel.SDPA_FLASH, CUDA, torch.bfloat16, 128, WINDOW) is None
    assert select_kernel(Kernel.SDPA_FLASH, CUDA, torch.bfloat16, 128, WINDOW).name == Kernel.SDPA_FLASH.value
    with pytest.raises(ValueError, match="kernels that can: sdpa_flash, torch"):
        select_kernel(Kernel.SDPA_CUDNN, CUDA, torch.bfloat16, 128, WINDOW)
    # where torch's flash kernel cannot run (fp32, head size 264), windows fall back to the torch kernel
    assert select_kernel(Kernel.AUTO, CUDA, torch.float32, 128, WINDOW).name == Kernel.TORCH.value
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 264, WINDOW).name == Kernel.TORCH.value


@pytest.mark.parametrize("features", [SOFTCAP, WINDOW | SOFTCAP], ids=sorted)
def test_auto_on_a_gpu_without_flash_attn_falls_back_to_torch_for_softcap(gpu, features):
    gpu((9, 0))
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128, features).name == Kernel.TORCH.value
    for name in (Kernel.SDPA_CUDNN, Kernel.SDPA_FLASH):
        assert "applies no" in kernel_unavailable(name, CUDA, torch.bfloat16, 128, features)
        with pytest.raises(ValueError, match="kernels that can: torch"):
            select_kernel(name, CUDA, torch.bfloat16, 128, features)
    assert "softcap" in kernel_unavailable(Kernel.SDPA_FLASH, CUDA, torch.bfloat16, 128, features)


def test_auto_on_a_gpu_prefers_flash_attn_when_it_applies_the_feature(gpu, monkeypatch):
    """flash-attn 2.5 (window, no softcap) stand-in: auto takes it for windows, falls back to torch for softcap."""
    from tests.unit.test_flash_attn_adapter import VERSIONS, _install

    gpu((8, 0))
    _install(monkeypatch, next(v for v in VERSIONS if v.label == "2.5"))
    flash_attn.forget_probe()
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128, WINDOW).name == Kernel.FLASH_ATTN.value
    assert select_kernel(Kernel.AUTO, CUDA, torch.bfloat16, 128, SOFTCAP).name == Kernel.TORCH.value
    with pytest.raises(ValueError, match="kernels that can: torch") as info:
        select_kernel(Kernel.FLASH_ATTN, CUDA, torch.bfloat16, 128, SOFTCAP)
    assert "2.5.9.post1" in str(info.value) and "softcap" in str(info.value)
