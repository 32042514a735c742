# shellcheck shell=bash
# ctx_plugin site file: everything cluster-specific the job scripts need. Copy it to launch/site.sh (or
# anywhere, and point CTX_SITE at it) and edit. It is sourced by the batch script and again by each run's
# command.sh, so keep it idempotent (plain assignments, exports and module loads).

# --- software -----------------------------------------------------------------------------------------
# module purge; module load cuda/12.8 nccl          # what your cluster needs before Python starts
# CTX_PY=/shared/envs/ctx/bin/python                # default: <repo>/.venv/bin/python, else python3
# CTX_RUNS_DIR=/scratch/$USER/ctx-runs              # run directories (default: <submit dir>/runs)

# --- container (optional) -----------------------------------------------------------------------------
# CTX_EXEC_PREFIX="apptainer exec --nv /images/ctx.sif"        # prefix for every python command
# CTX_SRUN_ARGS="--container-image=/images/ctx.sqsh --container-mounts=/scratch:/scratch"   # pyxis/enroot

# --- network ------------------------------------------------------------------------------------------
# export NCCL_SOCKET_IFNAME=ib0                     # interface for NCCL's bootstrap / socket transport
# export GLOO_SOCKET_IFNAME=ib0                     # the same for gloo (CPU jobs, torch.distributed barriers)
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3    # InfiniBand adapters to use
# export NCCL_IB_GID_INDEX=3                        # RoCE: the GID index of the RoCEv2 address
# export NCCL_NET_GDR_LEVEL=PHB                     # GPUDirect RDMA when GPU and NIC share a PCIe host bridge
# export NCCL_DEBUG=WARN                            # INFO while bringing a cluster up

# --- defaults the job scripts set when unset here -----------------------------------------------------
# OMP_NUM_THREADS=<CPU cores of the node / processes per node>
# CUDA_DEVICE_MAX_CONNECTIONS=1   (Megatron on GPUs: its tensor/sequence-parallel communication overlaps the
#                                  GEMMs in issue order only with one work queue)
# DS_ACCELERATOR=cpu              (DeepSpeed on CPU-only nodes)
