#!/usr/bin/env bash
# Quick start, main job: trains a tiny attention model with 4-way context parallelism on local processes
# (GPUs when there are 4, else CPU processes with gloo) and checks its loss against the single-process run.
# Extra arguments go to `ctx-plugin demo` (see `ctx-plugin demo --help`).
set -euo pipefail
# shellcheck source=launch/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
exec "$CTX_PY" -m ctx_plugin.cli demo "$@"
