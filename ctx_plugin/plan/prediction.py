"""One configuration's prediction: its layout, memory on the GPU and the host, step time and MFU."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..memory.model import MemoryEstimate
from ..names import Backend
from ..recompute.presets import RecomputeConfig


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One configuration's predicted memory and step time (one micro-batch, forward and backward)."""

    backend: Backend
    """Context-parallel backend (the CPConfig default when cp = 1: no context parallelism)."""
    cp: int
    """Context-parallel size."""
    ulysses_size: int
    """Ranks of the all-to-all axis (cp for ``ulysses``, 1 for the ring family and ``allgather``)."""
    ring_size: int
    """Ranks of the ring (cp / ulysses_size; 1 for ``ulysses`` and ``allgather``, which have no ring)."""
    tp: int
    """Tensor-parallel size (with Megatron sequence parallelism when > 1)."""
    dp: int
    """Data-parallel size: GPUs / (tp·cp)."""
    zero_stage: int
    """ZeRO stage (1 is Megatron's distributed optimizer)."""
    recompute: RecomputeConfig
    """Recompute preset with its modifiers."""
    offload_optimizer: bool
    """DeepSpeed ZeRO-Offload: optimizer state in host memory, Adam on the CPUs."""
    memory_bytes: int
    """Peak bytes per GPU: ``ctx_plugin.memory.estimate(...).peak``, less the optimizer state when it is
    offloaded."""
    host_bytes: int
    """Host bytes per rank: activation offload (the memory model's ``host``) + optimizer offload."""
    gpu_fits: bool
    """memory_bytes ≤ the cluster's GPU memory."""
    host_fits: bool
    """host_bytes × GPUs per node ≤ the node's host memory less its reserve."""
    compute_ms: float
    """Attention, dense and recompute time of one micro-batch step."""
    recompute_ms: float
    """The part of compute_ms spent recomputing (tiled loss and MLP chunks included)."""
    exposed_ms: float
    """Time not hidden under compute: communication (ring steps, all-to-alls, all-gathers, TP collectives),
    activation copies beyond their layer's compute, and the optimizer offload's copies and CPU Adam step."""
    offload_ms: float
    """The part of exposed_ms from activation offload copies."""
    optimizer_ms: float
    """The part of exposed_ms from optimizer offload (gradient and weight copies, CPU Adam)."""
    model_flops: float
    """Model FLOPs per GPU and step, without any recompute (the MFU numerator)."""
    mfu: float
    """model_flops / (step time × the GPU's peak rate)."""
    ring_exposed_ms: float
    """The part of exposed_ms from ring steps (including the last dK/dV hop, which nothing hides)."""
    tokens_per_gpu: int
    """micro_batch · seq_len / cp (document padding included)."""
    real_share: float
    """The share of a sequence's tokens that are real, not padding of packed documents to the layout's document
    unit (1 without documents or padding)."""
    ring_hidden: bool | None
    """Every overlapped ring step hides its transfer (None: no ring)."""
    min_tokens_to_hide: int | None
    """Tokens per GPU from which every overlapped ring step hides its transfer on this link (None: no ring)."""
    cp_inter_node: bool
    """The context-parallel group spans nodes (its ring or all-gather runs at the inter-node bandwidth)."""
    ulysses_inter_node: bool
    """The Ulysses group spans nodes (its all-to-alls run at the inter-node bandwidth)."""
    reason: str
    """One line: what limits this configuration."""
    estimate: MemoryEstimate = field(repr=False, compare=False)
    """The memory model's estimate behind memory_bytes (its parts say what binds)."""

    def __post_init__(self) -> None:
        for name in ("cp", "ulysses_size", "ring_size", "tp", "dp", "tokens_per_gpu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if min(self.compute_ms, self.recompute_ms, self.exposed_ms, self.ring_exposed_ms, self.offload_ms,
               self.optimizer_ms) < 0:
            raise ValueError("times must be non-negative")
        if not 0 < self.real_share <= 1:
            raise ValueError(f"real_share must be in (0, 1], got {self.real_share!r}")
        if self.cp % (self.ulysses_size * self.ring_size):
            raise ValueError(f"ulysses_size × ring_size must divide cp ({self.cp})")

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.exposed_ms

    @property
    def fits(self) -> bool:
        """Fits in GPU memory and in host memory."""
        return self.gpu_fits and self.host_fits

    @property
    def host_gib(self) -> float:
        return self.host_bytes / 2**30

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Training throughput: the real tokens of a step (b·s·dp, less document padding) over the step time and all
        GPUs (tp·cp·dp)."""
        return self.tokens_per_gpu * self.real_share / self.tp / (self.step_ms / 1e3)

    @property
    def layout(self) -> str:
        """``zigzag cp=8 tp=1 dp=2`` (with ``u×r`` for the hybrid; ``no CP`` when cp = 1)."""
        axes = f" {self.ulysses_size}×{self.ring_size}" if self.backend == Backend.ULYSSES_RING else ""
        name = f"{self.backend.value}{axes} cp={self.cp}" if self.cp > 1 else "no CP"
        return f"{name} tp={self.tp} dp={self.dp}"

    @property
    def setup(self) -> str:
        """``zigzag cp=8 tp=1 dp=1, ZeRO-3, recompute full+tile_loss, optimizer offload``: everything to set."""
        return (f"{self.layout}, ZeRO-{self.zero_stage}, recompute {self.recompute}"
                + (", optimizer offload" if self.offload_optimizer else ""))
