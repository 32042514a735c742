"""The kernel registry: auto picks an available kernel, explicit unavailable kernels say how to get them."""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.kernels import SPECS, auto_order, kernel_unavailable, select_kernel
from ctx_plugin.kernels.sdpa import CpuFlashKernel
from ctx_plugin.kernels.torch_math import TorchKernel
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
