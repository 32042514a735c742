# shellcheck shell=bash
# ctx_plugin site file: everything cluster-specific the job scripts need. Copy it to launch/site.sh (or
# anywhere, and point CTX_SITE at it) and edit. It is sourced by the batch script and again by each run's
# command.sh, so keep it idempotent (plain assignments, exports and module loads).

# --- software -----------------------------------------------------------------------------------------
# module purge; module load cuda/12.8 nccl          # what your cluster needs before Python starts
# CTX_PY=/shared/envs/ctx/bin/python                # default: <repo>/.venv/bin/python, else python3
# CTX_RUNS_DIR=/scratch/$USER/ctx-runs              # run directories (default: <submit dir>/runs)

# --- container (optional) -----------------------------------------------------------------------------
# CTX_EXEC_PREFIX="apptainer exec --nv /images/ctx.sif"        # prefix for every python command (shell quoting)
# CTX_SRUN_ARGS="--container-image=/images/ctx.sqsh --container-mounts=/scratch:/scratch"   # pyxis/enroot

# --- network ------------------------------------------------------------------------------------------
# export NCCL_SOCKET_IFNAME=ib0                     # interface for NCCL's bootstrap / socket transport
# export GLOO_SOCKET_IFNAME=ib0                     # the same for gloo (CPU jobs, torch.distributed barriers)
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3    # InfiniBand adapters to use
# export NCCL_IB_GID_INDEX=3                        # RoCE: the GID index of the RoCEv2 address
# export NCCL_NET_GDR_LEVEL=PHB                     # GPUDirect RDMA when GPU and NIC share a PCIe host bridge
# export NCCL_DEBUG=WARN                            # INFO while bringing a cluster up

# --- hangs and failures -------------------------------------------------------------------------------
# A rank that dies or stalls should end the job (srun --kill-on-bad-exit) instead of leaving the others
# blocked in a collective until the time limit:
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1          # a failed/timed-out NCCL collective aborts the process
# export TORCH_NCCL_BLOCKING_WAIT=0                 # (1: wait() raises on timeout instead; slower)
#   (how long a stuck collective waits is the program's init_process_group(timeout=...): Megatron's
#   --distributed-timeout-minutes, DeepSpeed's deepspeed.init_distributed(timeout=...))
# export TORCH_NCCL_DUMP_ON_TIMEOUT=1               # flight recorder: what each rank was doing at the timeout
# export TORCH_NCCL_TRACE_BUFFER_SIZE=2000          # entries kept for that dump
# export NCCL_IB_TIMEOUT=22                         # InfiniBand retry timeout (4.096 µs × 2^N); raise on big fabrics
# export NCCL_IB_RETRY_CNT=7
# export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=60          # torchrun: seconds its ranks get after a SIGTERM before SIGKILL

# --- time limits --------------------------------------------------------------------------------------
# CTX_REQUEUE=1                                     # on SLURM's time-limit warning the ranks save, then the job
#                                                   # requeues itself (same as the job option --requeue)

# --- compiled extensions (DeepSpeed ops, Triton, torch.compile) on node-local disk ---------------------
# JIT builds on a shared file system are slow and their lock files can be left behind by a killed job (every
# later start then waits on the lock): build on each node's local disk, once per node.
# export TORCH_EXTENSIONS_DIR=/tmp/$USER/torch_extensions
# export TRITON_CACHE_DIR=/tmp/$USER/triton
# export TORCHINDUCTOR_CACHE_DIR=/tmp/$USER/inductor

# --- defaults the job scripts set when unset here -----------------------------------------------------
# OMP_NUM_THREADS=<CPU cores of the node / processes per node>
# CUDA_DEVICE_MAX_CONNECTIONS=1   (Megatron on GPUs: its tensor/sequence-parallel communication overlaps the
#                                  GEMMs in issue order only with one work queue)
# DS_ACCELERATOR=cpu              (DeepSpeed on CPU-only nodes)
