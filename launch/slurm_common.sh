# shellcheck shell=bash
# Sourced by launch/megatron.sbatch and launch/deepspeed.sbatch; holds no cluster settings (those go in the
# site file) and no framework logic (that is ctx_plugin.slurm, in Python).
#
#   ctx_job FRAMEWORK [job options] -- <framework arguments>
#
# 1. sources the site file: $CTX_SITE, else launch/site.sh when it exists (copy launch/site.example.sh);
# 2. runs `python -m ctx_plugin.slurm.job`, which checks the job and writes <run dir>/command.sh (with
#    --dry-run it prints the check and command.sh and stops here);
# 3. runs command.sh (one srun task per node, each starting torchrun) and writes <run dir>/status:
#    running, then completed / failed / timeout / cancelled, with the exit code and times.
# A timeout is the warning signal SLURM sends before the time limit (#SBATCH --signal=B:USR1@120), or a
# SIGTERM within 90 s of it; any other SIGTERM (scancel) is "cancelled".

ctx_seconds() {   # SLURM time ([D-]HH:MM:SS, MM:SS, SS) → seconds; nothing for UNLIMITED/NOT_SET
  local t=$1 d=0 a b c
  case $t in ''|UNLIMITED|NOT_SET|INVALID) return 0 ;; esac
  case $t in *-*) d=${t%%-*}; t=${t#*-} ;; esac
  IFS=: read -r a b c <<<"$t"
  if [ -n "$c" ]; then echo $((10#$d * 86400 + 10#$a * 3600 + 10#$b * 60 + 10#$c))
  elif [ -n "$b" ]; then echo $((10#$d * 86400 + 10#$a * 60 + 10#$b))
  else echo $((10#$d * 86400 + 10#$a)); fi
}

ctx_status() {    # ctx_status RUN_DIR WORD [EXIT_CODE]: written whole, then renamed
  local run=$1
  {
    echo "$2"
    [ -z "${3:-}" ] || echo "exit_code=$3"
    echo "job_id=${SLURM_JOB_ID:-}"
    echo "started=$_ctx_started"
    [ "$2" = running ] || echo "ended=$(date -u +%FT%TZ)"
  } >"$run/status.tmp"
  mv "$run/status.tmp" "$run/status"
}

_ctx_on_signal() {
  local reason=$1 now
  if [ "$reason" = term ]; then
    now=$(date +%s)
    if [ -n "$_ctx_deadline" ] && [ "$now" -ge $((_ctx_deadline - 90)) ]; then reason=timeout; else reason=cancelled; fi
  fi
  _ctx_reason=$reason
  echo "ctx_plugin: $reason: stopping the job step" >&2
  kill -TERM "$_ctx_pid" 2>/dev/null || true
}

ctx_run() {       # ctx_run RUN_DIR: runs RUN_DIR/command.sh, records the status
  local run=$1 rc=0 left
  _ctx_started=$(date -u +%FT%TZ) _ctx_reason="" _ctx_deadline=""
  left=$(ctx_seconds "$(squeue -h -j "${SLURM_JOB_ID:-0}" -o %L 2>/dev/null || true)")
  [ -z "$left" ] || _ctx_deadline=$(($(date +%s) + left))
  _ctx_pid=""
  trap '_ctx_on_signal timeout' USR1
  trap '_ctx_on_signal term' TERM INT
  ctx_status "$run" running
  bash "$run/command.sh" &
  _ctx_pid=$!
  while :; do
    rc=0; wait "$_ctx_pid" || rc=$?
    kill -0 "$_ctx_pid" 2>/dev/null || break     # a trapped signal interrupted wait: wait again
  done
  trap - USR1 TERM INT
  if [ -n "$_ctx_reason" ]; then ctx_status "$run" "$_ctx_reason" "$rc"
  elif [ "$rc" -eq 0 ]; then ctx_status "$run" completed 0
  else ctx_status "$run" failed "$rc"; fi
  echo "ctx_plugin: $(head -n 1 "$run/status") (exit code $rc); logs in $run/logs" >&2
  return "$rc"
}

ctx_job() {       # ctx_job FRAMEWORK [job options] -- <framework arguments>
  local framework=$1 run_dir site=${CTX_SITE:-}
  shift
  [ -n "$site" ] || [ ! -f "$CTX_LAUNCH_DIR/site.sh" ] || site=$CTX_LAUNCH_DIR/site.sh
  if [ -n "$site" ]; then
    [ -f "$site" ] || { echo "ctx_plugin: site file $site (CTX_SITE) does not exist" >&2; return 2; }
    site=$(cd "$(dirname "$site")" && pwd)/$(basename "$site")
    # shellcheck source=/dev/null
    source "$site"
  fi
  export CTX_SITE=$site
  if [ -z "${CTX_PY:-}" ]; then
    if [ -x "$CTX_LAUNCH_DIR/../.venv/bin/python" ]; then CTX_PY=$(cd "$CTX_LAUNCH_DIR/.." && pwd)/.venv/bin/python
    else CTX_PY=python3; fi
  fi
  export CTX_PY CTX_EXEC_PREFIX CTX_SRUN_ARGS CTX_RUNS_DIR
  # shellcheck disable=SC2086   # CTX_EXEC_PREFIX is a command prefix (e.g. "apptainer exec --nv img.sif")
  { run_dir=$(${CTX_EXEC_PREFIX:-} "$CTX_PY" -m ctx_plugin.slurm.job "$framework" --handoff-fd 3 "$@" 3>&1 1>&4); } 4>&1
  [ -n "$run_dir" ] || return 0      # --dry-run: printed, nothing to run
  ctx_run "$run_dir"
}
