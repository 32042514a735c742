"""The machines a plan runs on: GPUs, links, host memory and the rates the planner's cost model uses."""
from __future__ import annotations

import math
from dataclasses import dataclass


def _positive_number(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines a plan runs on. Rates are per GPU, bandwidths per direction per GPU (unless said otherwise)."""

    nodes: int
    """Number of nodes."""
    gpus_per_node: int = 8
    """GPUs per node (the NVLink domain; also the ranks that share a node's host memory and CPUs)."""
    gpu_memory_gib: float = 80.0
    """Memory per GPU in GiB, the card's size (an "80 GB" H100: 80). The memory model's peak must fit under it
    less :attr:`gpu_reserve_gib`."""
    gpu_reserve_gib: float = 5.0
    """GPU memory per GPU in GiB that the memory model does not count and a plan must leave free: what the driver
    keeps of the card (CUDA sees about 79 GiB of an 80 GB H100), the CUDA context (~0.5), NCCL's communicator buffers
    (~1 at CP and DP), cuBLAS/cuDNN workspaces and the caching allocator's fragmentation (a few % of the peak).
    Measure it on your GPUs: the card's size less the largest ``torch.cuda.max_memory_allocated()`` a run reached
    without running out of memory."""
    intra_bw_gbs: float = 450.0
    """Intra-node bandwidth per GPU and direction in GB/s (NVLink 4 on H100/H200: 450)."""
    inter_bw_gbs: float = 50.0
    """Inter-node bandwidth per GPU and direction in GB/s (one 400 Gb/s InfiniBand NIC per GPU: 50)."""
    attention_tflops: float = 480.0
    """Attention kernel rate per GPU in TFLOP/s, counting only the FLOPs of unmasked scores (a causal block counts
    half a full one): bf16 flash attention on H200. Measure it with ``ctx-plugin bench``."""
    matmul_tflops: float = 600.0
    """Dense matmul rate per GPU in TFLOP/s (bf16 GEMMs of a transformer layer on H200)."""
    peak_tflops: float = 989.0
    """The GPU's peak dense bf16 rate in TFLOP/s, the denominator of MFU (H100/H200 SXM: 989)."""
    host_memory_gib: float = 1024.0
    """Host (CPU) memory per node in GiB, shared by the node's ranks: activation offload and optimizer offload
    must fit in it, less :attr:`host_reserve_gib`."""
    host_reserve_gib: float = 64.0
    """Host memory per node in GiB kept free for everything else: the OS, the framework and CUDA context of every
    rank, data loaders, the page cache of the dataset and DeepSpeed's pinned staging buffers."""
    host_bw_gbs: float = 50.0
    """Host↔device bandwidth of one PCIe link per direction in GB/s (PCIe 5 × 16: 64 GB/s raw, ~50 achieved)."""
    gpus_per_host_link: int = 2
    """GPUs behind one PCIe uplink to the CPUs. On HGX/DGX H100 and H200 boards two GPUs share a PCIe switch
    (with their NICs) whose ×16 uplink carries their host traffic; every GPU of a node offloads at the same moment
    (they run the same layer), so each gets ``host_bw_gbs / min(gpus_per_host_link, gpus_per_node)``. Give 1 where
    every GPU has its own ×16 link to a CPU (e.g. GH200)."""
    host_adam_gparams_s: float = 2.0
    """Parameters per second, in billions, that a node's CPUs update with DeepSpeed's CPU Adam (all its ranks
    together). The update is memory-bound: ~32 bytes per parameter (fp32 weight, moments and gradient read and
    written, bf16 weight out) at ~64 GB/s of a two-socket server's effective bandwidth is 2 G parameters/s.
    Measure it on your nodes (DeepSpeed logs the optimizer step time)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "gpus_per_host_link"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _positive_number(self, "gpu_memory_gib", "intra_bw_gbs", "inter_bw_gbs", "attention_tflops", "matmul_tflops",
                         "peak_tflops", "host_memory_gib", "host_bw_gbs", "host_adam_gparams_s")
        for where in ("gpu", "host"):
            reserve, memory = getattr(self, f"{where}_reserve_gib"), getattr(self, f"{where}_memory_gib")
            if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not math.isfinite(reserve) \
                    or not 0 <= reserve < memory:
                raise ValueError(f"{where}_reserve_gib must be ≥ 0 and below {where}_memory_gib ({memory:g}), "
                                 f"got {reserve!r}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def crosses_nodes(self, group: int) -> bool:
        """Whether some group of ``group`` consecutive ranks (groups start at multiples of ``group``) spans two
        nodes; such a group communicates at the inter-node bandwidth."""
        g = self.gpus_per_node
        return any(start // g != (start + group - 1) // g for start in range(0, self.gpus, group))

    def bandwidth(self, inter: bool) -> float:
        """Bytes per second of the link a group uses."""
        return (self.inter_bw_gbs if inter else self.intra_bw_gbs) * 1e9

    @property
    def host_bandwidth(self) -> float:
        """Host↔device bytes per second per GPU and direction while every GPU of the node copies."""
        return self.host_bw_gbs * 1e9 / min(self.gpus_per_host_link, self.gpus_per_node)

    @property
    def gpu_bytes(self) -> int:
        """GPU memory a plan's peak may use: memory − reserve, in bytes."""
        return int((self.gpu_memory_gib - self.gpu_reserve_gib) * 2**30)

    @property
    def gpu_room_gib(self) -> float:
        """:attr:`gpu_bytes` in GiB."""
        return self.gpu_memory_gib - self.gpu_reserve_gib

    @property
    def host_bytes_per_rank(self) -> int:
        """Host memory one rank may use: (host memory − reserve) / GPUs per node, in bytes."""
        return int((self.host_memory_gib - self.host_reserve_gib) * 2**30) // self.gpus_per_node
