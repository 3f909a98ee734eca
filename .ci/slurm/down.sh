#!/usr/bin/env bash
# Tears down the test cluster that up.sh started: cancels all jobs, waits until the queue is empty
# (otherwise slurmstepd processes outlive the daemons), shuts SLURM down and stops munged by its
# PID file, never by name. Keeps the state folder (logs, config). Idempotent.
set -euo pipefail

state=${GTP_SLURM_DIR:-/tmp/gtp-slurm}
export SLURM_CONF=$state/slurm.conf
PATH=$PATH:/usr/sbin:/sbin

log() { echo "down.sh: $*" >&2; }

# alive PIDFILE NAME: the process named in PIDFILE is running (not a zombie) and is NAME.
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1 # a daemon removes its PID file as it exits
  [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
  # Without an init that reaps them (PID 1 in a container), exited daemons linger as zombies.
  [[ $(cut -d ' ' -f 3 "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

# stop PIDFILE NAME: SIGTERM the process if it is still NAME, then wait for it (bounded).
stop() {
  local i pid
  alive "$1" "$2" || return 0
  pid=$(cat "$1" 2>/dev/null) || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    alive "$1" "$2" || return 0
    sleep 0.2
  done
  log "$2 (pid $pid) did not stop within 10 s"
  return 1
}

drain_queue() {
  local jobs i
  jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
  if [[ -n $jobs ]]; then
    log "cancelling $(echo "$jobs" | wc -l) job(s)"
    # shellcheck disable=SC2086  # one job id per word
    timeout 10 scancel $jobs || true
  fi
  # KillWait=5: cancelled jobs leave the queue a few seconds after SIGTERM is ignored.
  for ((i = 0; i < 150; i++)); do
    [[ -z $(timeout 10 squeue -h -o %i 2>/dev/null) ]] && return 0
    sleep 0.2
  done
  log "jobs still in the queue after 30 s:"
  squeue >&2 || true
}

main() {
  local t0=$SECONDS rc=0
  if [[ ! -f $SLURM_CONF ]]; then
    log "no cluster in $state: nothing to stop"
    exit 0
  fi
  if alive "$state/run/slurmctld.pid" slurmctld; then
    drain_queue
    timeout 10 scontrol shutdown >/dev/null || log "scontrol shutdown failed; stopping by PID file"
  fi
  # scontrol shutdown stops slurmd too; these only act on what is still running.
  stop "$state/run/slurmctld.pid" slurmctld || rc=1
  stop "$state/run/slurmd.pid" slurmd || rc=1
  stop "$state/munge/munged.pid" munged || rc=1
  log "cluster down in $((SECONDS - t0)) s"
  return $rc
}

main "$@"
