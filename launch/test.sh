#!/usr/bin/env bash
# Quick start, tests: creates the venv if needed and runs the test suite (arguments go to pytest).
set -euo pipefail
# shellcheck source=launch/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test,megatron,hf,deepspeed
cd "$CTX_ROOT"
exec "$CTX_PY" -m pytest -q "$@" tests
