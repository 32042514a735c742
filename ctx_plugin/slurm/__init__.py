"""SLURM jobs: the checks and ``command.sh`` behind ``launch/*.sbatch``, and ``ctx-plugin launch``."""
