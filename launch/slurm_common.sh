# shellcheck shell=bash
# Sourced by launch/megatron.sbatch and launch/deepspeed.sbatch; holds no cluster settings (those go in the
# site file) and no framework logic (that is ctx_plugin.slurm, in Python).
#
#   ctx_job FRAMEWORK [job options] -- <framework arguments>
#
# 1. sources the site file: $CTX_SITE, else launch/site.sh when it exists (copy launch/site.example.sh);
# 2. runs `python -m ctx_plugin.slurm.job`, which checks the job (rendezvous host, master port included) and writes
#    <run dir>/attempt-<n>/command.sh and the run records (with --dry-run it prints the check and command.sh and
#    stops here); the batch output continues in <run dir>/attempt-<n>/batch.log;
# 3. runs command.sh (one srun task per node, each starting torchrun) and writes the attempt's status and the run's
#    (<run dir>/status, the latest attempt's plus one line per earlier attempt): running, then completed / failed
#    (with the first failure found in the logs) / timeout / cancelled / requeued / preempted, exit code and times.
# SLURM's time-limit warning (#SBATCH --signal=B:USR1@120) reaches this shell only; it passes USR1 on to every
# rank (an overlapping srun step signals the children of each node's torchrun; torchrun itself ignores USR1), so
# every rank can finish its step, save and exit. Each node records the ranks it signalled in the attempt's
# signals/node-<n>.txt; ranks of ctx_plugin.train_hf, and of Megatron with --exit-signal-handler (through
# ctx_plugin's entry point), record their own handler's in signals/rank-<r>.txt, and the status gets a summary
# (signals=). Then, with --requeue (or CTX_REQUEUE=1), the job requeues itself (same job id, next
# attempt); without, it waits for the time limit, so SLURM records TIMEOUT. A warning sent to the job step instead
# (--signal=USR1@120 without B:) reaches the ranks only: when a rank's handler recorded SIGUSR1, the attempt counts
# as warned all the same (status line warning=). A SIGTERM (scancel, the time limit) is classified by asking
# slurmctld for the job's state; one that reaches this shell only, the job still running (scancel --batch
# --signal=TERM, --signal=B:TERM@<s>), is passed to every rank like the warning (srun would SIGKILL them).
# Preemption with a GraceTime (PreemptMode=REQUEUE or CANCEL): slurmctld sends SIGCONT and SIGTERM to the job steps
# (SLURM 22.05: not to this shell), so every rank gets SIGTERM from SLURM (and again from its torchrun, which waits
# 30 s for it) and saves; the step ends. Seeing PreemptTime set, this shell records "preempted" and waits for SLURM
# to end the job at the GraceTime's end: only a job still running then is requeued (one that ends on its own is
# recorded COMPLETED or FAILED and never resumes). With PreemptParameters=send_user_signal, SLURM sends the warning
# (B:USR1) instead: the ranks save on it, and the job is not requeued by this shell but left to SLURM.

ctx_seconds() {   # SLURM time ([D-]HH:MM:SS, MM:SS, SS) → seconds; nothing for UNLIMITED/NOT_SET
  local t=$1 d=0 a b c
  case $t in ''|UNLIMITED|NOT_SET|INVALID) return 0 ;; esac
  case $t in *-*) d=${t%%-*}; t=${t#*-} ;; esac
  IFS=: read -r a b c <<<"$t"
  if [ -n "$c" ]; then echo $((10#$d * 86400 + 10#$a * 3600 + 10#$b * 60 + 10#$c))
  elif [ -n "$b" ]; then echo $((10#$d * 86400 + 10#$a * 60 + 10#$b))
  else echo $((10#$d * 86400 + 10#$a)); fi
}

_ctx_common=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/${BASH_SOURCE[0]##*/}   # this file, for the nodes' tasks

ctx_status() {    # ctx_status WORD [EXIT_CODE [KEY=VALUE...]]: the attempt's status, then the run's; each written whole
  local word=$1 code=${2:-} line
  shift; [ $# -eq 0 ] || shift
  {
    echo "$word"
    [ -z "$code" ] || echo "exit_code=$code"
    echo "job_id=${SLURM_JOB_ID:-}"
    echo "started=$_ctx_started"
    [ "$word" = running ] || echo "ended=$(date -u +%FT%TZ)"
    for line in "$@"; do echo "$line"; done
    [ -z "${_ctx_signals:-}" ] || echo "signals=$_ctx_signals"
  } >"$_ctx_attempt/status.tmp"
  mv "$_ctx_attempt/status.tmp" "$_ctx_attempt/status"
  _ctx_run_status
}

_ctx_run_status() {   # the run's status: the attempt's, its number, a line per earlier attempt
  local n
  {
    cat "$_ctx_attempt/status"
    echo "attempt=$_ctx_n"
    for ((n = 1; n < _ctx_n; n++)); do
      [ ! -f "$_ctx_run/attempt-$n/status" ] || echo "attempt_$n=$(paste -sd ' ' "$_ctx_run/attempt-$n/status")"
    done
  } >"$_ctx_run/status.tmp"
  mv "$_ctx_run/status.tmp" "$_ctx_run/status"
}

_ctx_epoch() { date -d "$1" +%s 2>/dev/null || true; }

_ctx_field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $2"; }   # _ctx_field NAME "scontrol show job -o" line

ctx_end_reason() {   # how slurmctld sees the job ending: cancelled, timeout, preempted, requeued, preempting (within a
                     # preemption's GraceTime, still running), or nothing (unknown)
  local info state limit start end restarts preempt
  info=$(scontrol show job -o "${SLURM_JOB_ID:-0}" 2>/dev/null) || return 0
  state=$(_ctx_field JobState "$info")
  restarts=$(_ctx_field Restarts "$info")
  preempt=$(_ctx_field PreemptTime "$info")
  case $state in
    CANCELLED) echo cancelled ;;
    TIMEOUT|DEADLINE) echo timeout ;;
    PREEMPTED) echo preempted ;;
    PENDING|REQUEUED|REQUEUE_FED|REQUEUE_HOLD) echo requeued ;;
    RUNNING|COMPLETING|SIGNALING|STOPPED|SUSPENDED)
      if [[ $restarts =~ ^[0-9]+$ ]] && [ "$restarts" -gt "${SLURM_RESTART_COUNT:-0}" ]; then
        echo requeued    # SLURM is requeueing it (a preemption's GraceTime is over, or scontrol requeue)
      elif [ -n "$preempt" ] && [ "$preempt" != None ] && [ "$preempt" != Unknown ]; then
        echo preempting   # within the preemption's GraceTime
      elif [ "$state" = COMPLETING ]; then
        # the state it ends in is not shown yet: ended at the time limit (timeout) or before (scancel)
        limit=$(ctx_seconds "$(_ctx_field TimeLimit "$info")")
        start=$(_ctx_epoch "$(_ctx_field StartTime "$info")")
        end=$(_ctx_epoch "$(_ctx_field EndTime "$info")")
        if [ -n "$limit" ] && [ -n "$start" ] && [ -n "$end" ] && [ $((end - start)) -ge "$limit" ]; then echo timeout
        elif [ -n "$start" ] && [ -n "$end" ]; then echo cancelled; fi
      fi ;;
  esac
}

_ctx_on_warning() {   # SLURM's time-limit warning: every rank (torchrun's children, on every node) gets SIGUSR1
  _ctx_trapped=1
  [ -z "$_ctx_reason" ] || return 0
  _ctx_reason=warned
  ctx_status timeout "" "stopping=the ranks got the time-limit warning (SIGUSR1) to save and stop"
  echo "ctx_plugin: time-limit warning: SIGUSR1 to every rank" >&2
  _ctx_signal_ranks USR1 || true
}

_ctx_signal_ranks() {   # _ctx_signal_ranks SIGNAL: SIGNAL to every rank (torchrun's children, on every node); fails
  # when a node had none to signal
  local nodes=${SLURM_JOB_NUM_NODES:-1}
  # one task per node, beside the running step; only the ranks (not their compilers or data-loader workers)
  # shellcheck disable=SC2016   # expanded by the task's bash
  srun --overlap --export=ALL --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 \
    bash -c 'source "$1" && ctx_signal_node "$2" "$3"' _ "$_ctx_common" "$_ctx_attempt" "$1" && return 0
  echo "ctx_plugin: signalling the ranks ($1) failed on a node (see $_ctx_attempt/signals/)" >&2
  return 1
}

_ctx_rank_env() {   # _ctx_rank_env PID: the RANK in that process's environment (empty: none, or gone)
  tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | sed -n 's/^RANK=//p' || true
}

_ctx_ranks_below() {   # _ctx_ranks_below PID: the ranks among PID's descendants, torchrun's children: the first
  # process down each branch with RANK in its environment (torchrun, and a container runtime in front of it, as
  # apptainer's starter, have none; a rank's own children, data-loader workers and compilers, are not descended to)
  local queue=("$1") pid child
  while [ "${#queue[@]}" -gt 0 ]; do
    pid=${queue[0]}
    queue=("${queue[@]:1}")
    for child in $(pgrep -P "$pid"); do
      if [ -n "$(_ctx_rank_env "$child")" ]; then echo "$child"; else queue+=("$child"); fi
    done
  done
}

ctx_signal_node() {   # ctx_signal_node ATTEMPT_DIR SIGNAL, on each node (an srun task): SIGNAL to the node's ranks
  # (torchrun's children, below the pid in pids/node-$SLURM_NODEID.pid, also through a container runtime that
  # forks: _ctx_ranks_below), a line per rank appended to signals/node-$SLURM_NODEID.txt (sent, or gone when it had
  # exited; none when no rank ran); fails when none was sent
  local dir=$1 sig=$2 node=${SLURM_NODEID:-0} host torchrun="" pid rank result sent=0 out
  host=${SLURMD_NODENAME:-$(hostname -s)}
  out=$dir/signals/node-$node.txt
  mkdir -p "$dir/signals" || return 1
  [ ! -f "$dir/pids/node-$node.pid" ] || torchrun=$(<"$dir/pids/node-$node.pid")
  for pid in $([ -z "$torchrun" ] || _ctx_ranks_below "$torchrun"); do
    rank=$(_ctx_rank_env "$pid")
    if kill -s "$sig" "$pid" 2>/dev/null; then result=sent; sent=$((sent + 1)); else result=gone; fi
    echo "$(date -u +%FT%T.%3NZ) node=$node host=$host pid=$pid rank=${rank:-?} signal=$sig $result" >>"$out"
  done
  [ "$sent" -gt 0 ] && return 0
  echo "$(date -u +%FT%T.%3NZ) node=$node host=$host torchrun=${torchrun:-?} signal=$sig none" >>"$out"
  return 1
}

_ctx_on_term() {
  local reason now ending
  _ctx_trapped=1
  case $_ctx_reason in   # decided already: stop waiting (not while the ranks save on the SIGTERM passed to them)
    requeued|cancelled|timeout|preempted)
      _ctx_termed=1
      [ -n "$_ctx_ranks_stopping" ] || kill -TERM "$_ctx_pid" 2>/dev/null || true
      return 0 ;;
  esac
  reason=$(ctx_end_reason)
  ending=$reason
  if [ "$reason" = preempting ] && [ "$_ctx_reason" != preempting ]; then
    # within the preemption's GraceTime: SLURM signals the steps too, so the ranks save and the step ends by itself
    _ctx_reason=preempting
    ctx_status preempted "" "stopping=preempted: the ranks got SIGTERM to save and stop within the GraceTime"
    echo "ctx_plugin: preempted: the ranks save and stop within the GraceTime" >&2
    return 0
  fi
  _ctx_termed=1
  [ "$reason" != preempting ] || reason=preempted   # SLURM's second SIGTERM: the GraceTime is over
  if [ -z "$reason" ]; then   # slurmctld did not say: the time left says
    now=$(date +%s)
    if [ -n "$_ctx_deadline" ] && [ "$now" -ge $((_ctx_deadline - 90)) ]; then reason=timeout; else reason=cancelled; fi
  fi
  _ctx_reason=$reason
  ctx_status "$reason"
  if [ -z "$ending" ] && [ -z "$_ctx_wait_pid" ]; then
    # slurmctld does not say the job ends: the signal came to this shell only (scancel --batch, --signal=B:TERM),
    # SLURM is not ending the step, and srun would SIGKILL the ranks: they get SIGTERM to save and stop, as on the
    # warning, and the step ends by itself (stopped as below when no rank could be signalled)
    echo "ctx_plugin: $reason: SIGTERM to every rank" >&2
    if _ctx_signal_ranks TERM; then _ctx_ranks_stopping=1; return 0; fi
  fi
  echo "ctx_plugin: $reason: stopping the job step" >&2
  kill -TERM "$_ctx_pid" 2>/dev/null || true
}

_ctx_wait() {     # waits for $_ctx_pid; its exit code in _ctx_rc. A trapped signal interrupts wait (128+n): wait
  # again, for the process's own code (kept once it has ended, also when it ended while the trap ran)
  local rc
  _ctx_trapped="" _ctx_rc=0
  wait "$_ctx_pid" || _ctx_rc=$?
  while [ -n "$_ctx_trapped" ] && [ "$_ctx_rc" -gt 128 ]; do
    _ctx_trapped="" rc=0
    wait "$_ctx_pid" || rc=$?
    [ "$rc" -ne 127 ] || break   # collected already: $_ctx_rc was its own
    _ctx_rc=$rc
  done
}

_ctx_wait_for_slurm() {   # _ctx_wait_for_slurm SECONDS: sleeps until SLURM ends the job (its SIGTERM stops it)
  [ -z "$_ctx_termed" ] || return 0
  [ "$1" -gt 0 ] || return 0
  echo "ctx_plugin: waiting for SLURM to end the job (${2:-time limit or requeue})" >&2
  sleep "$1" &
  _ctx_pid=$! _ctx_wait_pid=$! _ctx_ranks_stopping=""
  [ -z "$_ctx_termed" ] || kill -TERM "$_ctx_pid"   # SLURM's SIGTERM came while the wait began
  _ctx_wait
}

_ctx_after_preemption() {   # the step ended within a preemption's GraceTime: SLURM ends the job at the GraceTime's end
  local rc=$1 end
  _ctx_reason=preempted
  ctx_status preempted "$rc" "note=preempted (PreemptTime set): the ranks were signalled to save and stop; SLURM ends \
the job at the end of the GraceTime and requeues it (PreemptMode=REQUEUE) or cancels it"
  _ctx_note_signals   # after the status: the GraceTime runs
  end=$(_ctx_epoch "$(_ctx_field EndTime "$(scontrol show job -o "${SLURM_JOB_ID:-0}" 2>/dev/null || true)")")
  # a job that ends before SLURM's end of the GraceTime is not requeued: wait for it (300 s past: SLURM acts
  # on its next scheduling pass)
  _ctx_wait_for_slurm $((${end:-$(date +%s)} - $(date +%s) + 300)) "end of the preemption's GraceTime"
}

_ctx_killed_by_warning_only() {   # every rank torchrun reports failed died of SIGUSR1 (exit code -10): it had stopped
  # and saved (the ranks agree on the step) and was exiting, its handler gone, when the signal reached its node late
  local log found=""
  for log in "$_ctx_attempt"/logs/*.log; do
    [ -f "$log" ] || continue
    if grep -q '^ *exitcode *: ' "$log"; then
      ! grep '^ *exitcode *: ' "$log" | grep -qv '^ *exitcode *: -10 ' || return 1
      found=1
    fi
  done
  [ -n "$found" ]
}

_ctx_after_warning() {   # the ranks stopped after the warning: requeue, or wait for the time limit (TIMEOUT)
  local rc=$1 left
  if [ "$rc" -ne 0 ] && _ctx_killed_by_warning_only; then
    echo "ctx_plugin: a rank got SIGUSR1 only as it exited (after stopping): counted as stopped" >&2
    rc=0
  fi
  if [ "$(ctx_end_reason)" = preempting ]; then   # the warning came at preemption (send_user_signal): SLURM decides
    _ctx_after_preemption "$rc"
    return 0
  fi
  _ctx_note_signals   # before the requeue, which ends this shell
  local direct=()
  [ -z "$_ctx_direct" ] || direct=("$_ctx_direct")
  if [ "$rc" -ne 0 ]; then
    _ctx_reason=timeout
    ctx_status timeout "$rc" "note=the job step failed after the time-limit warning: not requeued" "${direct[@]}"
  elif [ "$_ctx_requeue" = 1 ]; then
    _ctx_reason=requeued
    ctx_status requeued "$rc" "${direct[@]}"
    if scontrol requeue "${SLURM_JOB_ID:-0}"; then
      echo "ctx_plugin: requeued job ${SLURM_JOB_ID:-}: attempt $((_ctx_n + 1)) resumes" >&2
    else
      _ctx_reason=timeout
      ctx_status timeout "$rc" "note=scontrol requeue failed (submitted with --no-requeue, or JobRequeue=0?)" \
        "${direct[@]}"
    fi
  else
    _ctx_reason=timeout
    ctx_status timeout "$rc" "${direct[@]}"
  fi
  [ -n "$_ctx_deadline" ] || return 0
  left=$((_ctx_deadline - $(date +%s) + 60))
  _ctx_wait_for_slurm "$left"
}

_ctx_note_signals() {   # once the step has ended: the summary of signals/ (which ranks got a stop signal, from the
  # nodes' and the ranks' records) joins the status now written, and every later one
  [ -z "$_ctx_signals" ] && [ -d "$_ctx_attempt/signals" ] || return 0
  _ctx_signals=$(_ctx_prefixed "${CTX_PY:-python3}" -m ctx_plugin.slurm.records signals "$_ctx_attempt" \
    2>/dev/null) || _ctx_signals="(no summary: ctx_plugin.slurm.records failed; see $_ctx_attempt/signals/)"
  [ -n "$_ctx_signals" ] && [ -f "$_ctx_attempt/status" ] || return 0
  { grep -v '^signals=' "$_ctx_attempt/status" || true; echo "signals=$_ctx_signals"; } >"$_ctx_attempt/status.tmp"
  mv "$_ctx_attempt/status.tmp" "$_ctx_attempt/status"
  _ctx_run_status
}

ctx_run() {       # ctx_run RUN_DIR ATTEMPT_DIR [REQUEUE]: runs ATTEMPT_DIR/command.sh, records the status
  local left
  _ctx_run=$1 _ctx_attempt=$2 _ctx_requeue=${3:-0}
  _ctx_n=${_ctx_attempt##*/attempt-}
  _ctx_started=$(date -u +%FT%TZ) _ctx_reason="" _ctx_deadline="" _ctx_pid="" _ctx_rc=0 _ctx_termed="" _ctx_signals="" _ctx_trapped="" _ctx_direct=""
  _ctx_ranks_stopping="" _ctx_wait_pid=""
  left=$(ctx_seconds "$(squeue -h -j "${SLURM_JOB_ID:-0}" -o %L 2>/dev/null || true)")
  [ -z "$left" ] || _ctx_deadline=$(($(date +%s) + left))
  trap _ctx_on_warning USR1
  trap _ctx_on_term TERM INT
  ctx_status running
  if [ -n "${_ctx_early_warning:-}" ]; then   # warned before the step started: no time to train
    echo "ctx_plugin: the time-limit warning came before the job step started: not starting it" >&2
    _ctx_reason=warned
  else
    bash "$_ctx_attempt/command.sh" &
    _ctx_pid=$!
    _ctx_wait
  fi
  local rc=$_ctx_rc failure
  if [ -z "$_ctx_reason" ] && [ "$(ctx_end_reason)" = preempting ]; then
    _ctx_reason=preempting   # the ranks got SLURM's SIGTERM within a preemption's GraceTime (this shell did not)
  fi
  if [ -z "$_ctx_reason" ] && grep -qs ' signal=SIGUSR1 ' "$_ctx_attempt"/signals/rank-*.txt; then
    # SLURM's warning went to the job step, not this shell (--signal=USR1@<s> without B:, or scancel --signal=USR1
    # without --batch): the ranks handled it, saved and stopped, so the step ended early; counted as the warning
    _ctx_reason=warned
    _ctx_direct="warning=SIGUSR1 reached the ranks from SLURM directly, not through this script (--signal without \
B:, or scancel --signal without --batch); counted as the time-limit warning: use --signal=B:USR1@<seconds>"
    echo "ctx_plugin: the ranks got SIGUSR1 from SLURM directly (not this script): counted as the time-limit \
warning; submit with --signal=B:USR1@<seconds>" >&2
  fi
  if [ "$_ctx_reason" = warned ]; then _ctx_after_warning "$rc"
  elif [ "$_ctx_reason" = preempting ]; then _ctx_after_preemption "$rc"
  elif [ -n "$_ctx_reason" ]; then ctx_status "$_ctx_reason" "$rc"
  elif [ "$rc" -eq 0 ]; then ctx_status completed 0
  else
    failure=$(_ctx_prefixed "${CTX_PY:-python3}" -m ctx_plugin.slurm.records failure "$_ctx_attempt" 2>/dev/null) \
      || failure="(no failure record: ctx_plugin.slurm.records failed)"
    ctx_status failed "$rc" "first_failure=$failure"
  fi
  _ctx_note_signals
  trap - USR1 TERM INT
  echo "ctx_plugin: $(head -n 1 "$_ctx_attempt/status") (exit code $rc); logs in $_ctx_attempt" >&2
  return "$rc"
}

_ctx_prefixed() {   # runs "$@" behind CTX_EXEC_PREFIX (e.g. "apptainer exec --nv img.sif"), split into words by the
  # shell's quoting rules as command.sh's srun line splits it (Python's shlex): no globbing
  local - prefix=()
  set -f
  eval "prefix=(${CTX_EXEC_PREFIX:-})"
  "${prefix[@]}" "$@"
}

ctx_site() {      # sources the site file ($CTX_SITE, else launch/site.sh) and exports what the job reads from it
  local site=${CTX_SITE:-}
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
  export CTX_PY CTX_EXEC_PREFIX CTX_SRUN_ARGS CTX_RUNS_DIR CTX_REQUEUE
}

ctx_job() {       # ctx_job FRAMEWORK [job options] -- <framework arguments>
  local framework=$1 handoff
  shift
  _ctx_early_warning=""
  trap '_ctx_early_warning=1' USR1   # SLURM's warning while the job is checked must not kill this shell
  ctx_site || return
  { handoff=$(_ctx_prefixed "$CTX_PY" -m ctx_plugin.slurm.job "$framework" --handoff-fd 3 "$@" 3>&1 1>&4); } 4>&1
  [ -n "$handoff" ] || return 0      # --dry-run: printed, nothing to run
  mapfile -t handoff <<<"$handoff"   # run directory, attempt directory, requeue (0/1)
  # the batch output from here on goes to the attempt's batch.log too (tee outlives the signals this shell gets)
  exec > >(trap '' TERM INT USR1 HUP; exec tee -a "${handoff[1]}/batch.log") 2>&1
  ctx_run "${handoff[@]}"
}
