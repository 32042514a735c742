#!/usr/bin/env bash
# Creates (once) and checks the project's virtual environment: .venv with Python 3.12, ctx_plugin installed
# in editable mode with the extras given as arguments (default: test), torch pinned by constraints.txt.
# With the deepspeed extra it also builds DeepSpeed's CPU comm op (launch/deepspeed_ops.py; CTX_DS_BUILD_TIMEOUT
# seconds, default 900). Usage: source launch/env.sh [extra,...]   → sets CTX_PY to the venv's python. The work runs
# in a subshell with its own strict options: a sourcing shell keeps its options, and a failure returns its status
# to it (a script with set -e stops there, an interactive shell stays open).
CTX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CTX_VENV="${CTX_VENV:-$CTX_ROOT/.venv}"
(
set -euo pipefail
CTX_EXTRAS="${1:-test}"

find_python312() {
  if python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    command -v python3.12; return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python3.12"; return; fi
  fi
  for p in /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$p" ]; then echo "$p"; return; fi
  done
  return 1
}

# A venv without torch yet takes ~5.1 GB (torch's CUDA build and its nvidia-* wheels: pip installs these on CPU-only
# machines too), with the wheels unpacked beside it while pip works: refuse at once, with the numbers, instead of pip
# failing half way with "No space left on device" and leaving a venv that is neither usable nor removed.
check_disk_space() {
  local need_gib=7 dir avail_kib
  dir=$(dirname "$CTX_VENV")
  avail_kib=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ -n "$avail_kib" ] && [ "$avail_kib" -lt $((need_gib * 1024 * 1024)) ]; then
    echo "ctx_plugin's venv needs about $need_gib GiB free to install (it takes ~5.1 GB) and $dir has" \
      "$((avail_kib / 1024)) MiB:" >&2
    echo "  free some space there, or set CTX_VENV to a path on a larger disk, and run this again." >&2
    return 1
  fi
}

torch_installed() {
  compgen -G "$CTX_VENV/lib/python3.*/site-packages/torch-*.dist-info" >/dev/null
}

if ! torch_installed; then
  check_disk_space || exit 1
fi
if [ ! -x "$CTX_VENV/bin/python" ]; then
  py=$(find_python312) || {
    echo "ctx_plugin needs Python 3.12 (megatron-core >= 0.17 requires it) and none was found:" >&2
    echo "  install it (e.g. 'pyenv install 3.12' or your distribution's python3.12) and run this again." >&2
    exit 1
  }
  echo "[ctx_plugin] creating $CTX_VENV with $py" >&2
  "$py" -m venv "$CTX_VENV"
  "$CTX_VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$CTX_VENV/.ctx_plugin-installed-$(echo "$CTX_EXTRAS" | tr ',' '-')"
if [ ! -f "$stamp" ] || [ "$CTX_ROOT/setup.py" -nt "$stamp" ] || [ "$CTX_ROOT/constraints.txt" -nt "$stamp" ]; then
  echo "[ctx_plugin] installing ctx_plugin[$CTX_EXTRAS] (torch pinned by constraints.txt)" >&2
  "$CTX_VENV/bin/python" -m pip install -q -c "$CTX_ROOT/constraints.txt" -e "${CTX_ROOT}[$CTX_EXTRAS]"
  touch "$stamp"
fi
if [[ ",$CTX_EXTRAS," == *",deepspeed,"* ]]; then
  # DeepSpeed on CPU compiles a comm op at its first start (1-5 min on 2 cores) under a lock file that a killed build
  # leaves behind, hanging every later start: build it here, once, visibly and in bounded time (a stale lock removed).
  "$CTX_VENV/bin/python" "$CTX_ROOT/launch/deepspeed_ops.py" --timeout "${CTX_DS_BUILD_TIMEOUT:-900}"
fi
)
_ctx_env_status=$?
if [ "$_ctx_env_status" -ne 0 ]; then
  # shellcheck disable=SC2317   # exit: when run rather than sourced, where return fails
  return "$_ctx_env_status" 2>/dev/null || exit "$_ctx_env_status"
fi
unset _ctx_env_status
CTX_PY="$CTX_VENV/bin/python"
export CTX_PY CTX_ROOT
