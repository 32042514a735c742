"""Exact-size page-locked host buffers for activation offload (ctx_plugin.recompute.pinned), with stand-ins for
cudaHostRegister/cudaHostUnregister (the real ones run in tests/gpu/test_offload_gpu.py)."""
from __future__ import annotations

import gc

import pytest
import torch

from ctx_plugin.recompute.pinned import REGISTER_MIN, PinnedPool, host_block


def test_host_block_rounds_only_torch_pinned_blocks():
    assert host_block(3 * 2**20 + 1, "cuda") == 4 * 2**20           # torch's caching host allocator: a power of two
    assert host_block(REGISTER_MIN - 1, "cuda") == REGISTER_MIN
    assert host_block(REGISTER_MIN + 1, "cuda") == REGISTER_MIN + 1  # a registered buffer of its own size
    assert host_block(3_500_000_123, "cuda") == 3_500_000_123
    assert host_block(3 * 2**20 + 1, "cpu") == 3 * 2**20 + 1


class _Runtime:
    def __init__(self, error: int = 0):
        self.registered: dict[int, int] = {}
        self.error = error

    def register(self, ptr: int, nbytes: int) -> int:
        if not self.error:
            assert ptr not in self.registered
            self.registered[ptr] = nbytes
        return self.error

    def unregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0


def test_buffers_are_exact_reused_by_size_and_unregistered_with_the_pool():
    runtime = _Runtime()
    pool = PinnedPool(runtime.register, runtime.unregister)
    shape = (REGISTER_MIN // 2 + 512,)                          # bf16: REGISTER_MIN + 1 KiB
    a = pool.empty(shape, torch.bfloat16)
    assert a.shape == shape and a.dtype == torch.bfloat16
    assert list(runtime.registered.values()) == [a.numel() * 2]   # exactly its bytes
    ptr = a.untyped_storage().data_ptr()
    b = pool.empty(shape, torch.bfloat16)                        # a is still held: a second buffer
    assert len(runtime.registered) == 2 and b.untyped_storage().data_ptr() != ptr
    pool.give_back(ptr)
    pool.give_back(12345)                                        # not the pool's (torch's pinned blocks): ignored
    c = pool.empty((REGISTER_MIN // 4 + 256,), torch.float32)    # the same bytes, another dtype and shape
    assert c.untyped_storage().data_ptr() == ptr and len(runtime.registered) == 2
    assert pool.registered_bytes == 2 * (REGISTER_MIN + 1024)
    del pool, a, b, c
    gc.collect()
    assert runtime.registered == {}


def test_new_sizes_release_the_free_buffers_first():
    """Shapes that change (another sequence length or micro batch) must not grow the registered memory without end:
    a size no free buffer has unregisters the free ones first (after the device's queued copies), so the registered
    bytes are the copies alive plus the new one; a size seen again reuses its buffer."""
    runtime, syncs = _Runtime(), []
    pool = PinnedPool(runtime.register, runtime.unregister, lambda: syncs.append(1))
    live = None
    for step in range(8):
        nbytes = REGISTER_MIN + step * 2**20                      # one copy alive at a time, each a little larger
        new = pool.empty((nbytes,), torch.uint8)
        if live is not None:
            pool.give_back(live.untyped_storage().data_ptr())
        live = new
        assert pool.registered_bytes <= 2 * (REGISTER_MIN + 8 * 2**20), step
    assert pool.registered_bytes == sum(runtime.registered.values()) == 2 * REGISTER_MIN + 13 * 2**20   # steps 6, 7
    assert len(syncs) == 6
    same = pool.empty((REGISTER_MIN + 6 * 2**20,), torch.uint8)  # step 6's size, given back: reused, nothing released
    assert len(runtime.registered) == 2 and len(syncs) == 6 and same.untyped_storage().data_ptr() in runtime.registered


def test_a_failed_registration_is_a_clear_error():
    pool = PinnedPool(_Runtime(error=2).register, lambda ptr: 0)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of \d+ bytes of host memory for activation offload "
                                           r"failed \(2\).*ulimit -l"):
        pool.empty((REGISTER_MIN,), torch.uint8)
