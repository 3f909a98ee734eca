#!/usr/bin/env bash
# Brings up a real single-node SLURM cluster (munged, slurmctld, slurmd from Debian's packages) for
# tests and CI. Idempotent: a healthy cluster is left running as it is. Stops nothing it did not
# start (see down.sh). Progress goes to stderr; stdout's only line is the client environment:
#   eval "$(.ci/slurm/up.sh)"        or        .ci/slurm/up.sh && . /tmp/gtp-slurm/env.sh
# Settings: GTP_SLURM_DIR (state folder, default /tmp/gtp-slurm), GTP_SLURM_CPUS (default 8).
set -euo pipefail

state=${GTP_SLURM_DIR:-/tmp/gtp-slurm}
cpus=${GTP_SLURM_CPUS:-8}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
conf=$state/slurm.conf
sock=$state/munge/munge.socket.2

log() { echo "up.sh: $*" >&2; }

# alive PIDFILE NAME: the process named in PIDFILE runs (not a zombie) and is NAME; never match by name.
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1 # a daemon removes its PID file as it exits
  [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
  # Without an init that reaps them (PID 1 in a container), exited daemons linger as zombies.
  [[ $(cut -d ' ' -f 3 "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

install_packages() {
  local missing=0 bin
  for bin in slurmctld slurmd sinfo sbatch scontrol munged munge; do
    command -v "$bin" >/dev/null || missing=1
  done
  ((missing)) || return 0
  [[ $(id -u) == 0 ]] || { log "SLURM packages are missing and installing them needs root"; exit 1; }
  log "installing slurmctld slurmd slurm-client munge"
  local apt_log
  apt_log=$(mktemp)
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -q && apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge; } >"$apt_log" 2>&1; then
    tail -n 40 "$apt_log" >&2
    rm -f "$apt_log"
    log "installing the packages failed"
    exit 1
  fi
  rm -f "$apt_log"
}

# The sacct stand-in: real sacct needs slurmdbd + MariaDB. Without any sacct, submitit reads every
# job as UNKNOWN (= not finished), and a job that dies without a result (cancelled, timed out)
# makes result() wait forever. This answers `sacct -o FIELDS --parsable2 -j ID ...` from
# `scontrol show job -o`, which keeps finished jobs for MinJobAge seconds.
write_sacct() {
  cat >"$state/bin/sacct" <<'PY'
#!/usr/bin/env python3
"""sacct stand-in for a test cluster without slurmdbd: answers from `scontrol show job -o`.
Supports -o/--format, -j/--jobs, -P/--parsable2, -p/--parsable, -n/--noheader; no job steps."""
import argparse, re, subprocess, sys

FIELDS = {"jobid": None, "jobidraw": "JobId", "jobname": "JobName", "state": "JobState",
          "nodelist": "NodeList", "partition": "Partition", "exitcode": "ExitCode",
          "start": "StartTime", "end": "EndTime", "submit": "SubmitTime", "elapsed": "RunTime",
          "user": "UserId", "account": "Account", "reason": "Reason", "alloccpus": "NumCPUs",
          "nnodes": "NumNodes", "ntasks": "NumTasks", "timelimit": "TimeLimit",
          "restarts": "Restarts", "workdir": "WorkDir"}

def parse_args(argv):
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-o", "--format", default="JobID,JobName,Partition,State,ExitCode")
    p.add_argument("-j", "--jobs", action="append", default=[])
    p.add_argument("-P", "--parsable2", action="store_true")
    p.add_argument("-p", "--parsable", action="store_true")
    p.add_argument("-n", "--noheader", action="store_true")
    for ignored in (("-S", "--starttime"), ("-E", "--endtime"), ("-u", "--user"), ("-s", "--state"),
                    ("-A", "--accounts"), ("-M", "--clusters"), ("-r", "--partition"), ("--name",)):
        p.add_argument(*ignored)
    return p.parse_known_args(argv)[0]

def records():
    out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"sacct (stand-in): scontrol failed: {out.stderr.strip()}")
    for line in out.stdout.splitlines():
        if line.startswith("JobId="):
            yield dict(re.findall(r"(\S+?)=(.*?)(?= \S+?=|$)", line.strip()))

def job_id(rec):
    task = rec.get("ArrayTaskId")
    if not task:
        return rec["JobId"]
    return f"{rec['ArrayJobId']}_{task if task.isdigit() else '[' + task + ']'}"

def value(rec, field):
    key = FIELDS.get(field.lower())
    if key is None:
        return job_id(rec) if field.lower() == "jobid" else ""
    val = rec.get(key, "")
    if key == "NodeList" and val in ("", "(null)"):
        return "None assigned"
    if key == "UserId":
        return val.split("(")[0]
    return val

def wanted(rec, ids):
    if not ids:
        return True
    return any(i == job_id(rec) if "_" in i else i in (rec["JobId"], rec.get("ArrayJobId")) for i in ids)

def main():
    args = parse_args(sys.argv[1:])
    fields = [f for f in args.format.split(",") if f]
    ids = {i.split(".")[0] for arg in args.jobs for i in arg.split(",") if i}
    end = "|" if args.parsable and not args.parsable2 else ""
    if not args.noheader:
        print("|".join(fields) + end)
    for rec in records():
        if wanted(rec, ids):
            print("|".join(value(rec, f) for f in fields) + end)

main()
PY
  chmod 755 "$state/bin/sacct"
}

write_conf() {
  local node mem
  node=$(hostname -s)
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  [[ -n $mem ]] || { log "slurmd -C reported no RealMemory"; exit 1; }
  getent hosts "$node" >/dev/null || log "warning: $node does not resolve; jobs that use it as MASTER_ADDR will fail"
  cat >"$1" <<EOF
# Generated by .ci/slurm/up.sh: a single-node test cluster. Edit the script, not this file.
ClusterName=gtp
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# cred_expire also delays a requeued job's restart (120 s by default): keep requeue tests short.
AuthInfo=socket=$sock,cred_expire=10
CredType=cred/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
# No cgroups here: plain process tracking, no task binding, no MPI plugin.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
# Schedule every 2 s (default 60 s, backfill 30 s): a requeued job restarts soon after it is eligible.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Reject impossible requests at sbatch time instead of pending forever.
EnforcePartLimits=ALL
# submitit ignores SIGTERM in the job: SIGKILL soon after a cancel.
KillWait=5
# Finished jobs stay visible to scontrol (and so to the sacct stand-in) for a day.
MinJobAge=86400
ReturnToService=2
# Jobs may be requeued (submitit's checkpoint-and-requeue; preemption). A job in partition
# "urgent" preempts "debug" jobs, which SLURM requeues: a way to test preemption on demand.
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MailProg=/bin/true # the default mail program is missing: an error in the log otherwise
# Advertise more CPUs than the machine has, so multi-task jobs fit on a small CI box.
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=$node MaxTime=INFINITE State=UP PriorityTier=2
EOF
}

start_munged() {
  alive "$state/munge/munged.pid" munged && return 0
  [[ -s /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  # munged refuses to run as root, and checks that its folders belong to munge.
  runuser -u munge -- munged --socket="$sock" --pid-file="$state/munge/munged.pid" \
    --log-file="$state/munge/munged.log" --seed-file="$state/munge/munged.seed"
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { log "timed out waiting for $what"; return 1; }
    sleep 0.2
  done
}

# node_ready: idle, or busy with jobs when up.sh runs on a live cluster (sinfo: a line per partition).
# A drain survives restarts (e.g. "Kill task failed" after a stuck job): resume it.
node_ready() {
  local node states
  node=$(hostname -s)
  states=$(sinfo -h -N -n "$node" -o %T 2>/dev/null | sort -u)
  [[ $states =~ ^(idle|mixed|allocated|completing)$ ]] && return 0
  [[ $states =~ drain ]] && scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1
  return 1
}

show_logs() {
  local f
  for f in "$state/munge/munged.log" "$state/log/slurmctld.log" "$state/log/slurmd.log"; do
    [[ -f $f ]] && { echo "===== $f" >&2; tail -n 40 "$f" >&2; }
  done
  sinfo -N -l >&2 || true
}

main() {
  local t0=$SECONDS new_conf
  PATH=$PATH:/usr/sbin:/sbin # the daemons live in sbin, which a non-login shell may lack
  install_packages
  mkdir -p "$state"/{bin,ctld,d,run,log,munge}
  chmod 755 "$state" # munged (as munge) must reach its files; mktemp -d makes 0700
  chown munge:munge "$state/munge"
  chmod 755 "$state/munge"
  write_sacct

  new_conf=$(mktemp "$state/slurm.conf.XXXXXX")
  write_conf "$new_conf"
  chmod 644 "$new_conf"
  if [[ -f $conf ]] && ! cmp -s "$new_conf" "$conf" &&
    { alive "$state/run/slurmctld.pid" slurmctld || alive "$state/run/slurmd.pid" slurmd; }; then
    log "slurm.conf changed: restarting the cluster"
    GTP_SLURM_DIR=$state "$here/down.sh" >&2
  fi
  mv -f "$new_conf" "$conf"
  export SLURM_CONF=$conf

  start_munged
  wait_for 10 "munged" bash -c "munge -n -S '$sock' | unmunge -S '$sock'" || { show_logs; exit 1; }
  alive "$state/run/slurmctld.pid" slurmctld || slurmctld -f "$conf"
  wait_for 15 "slurmctld" scontrol ping || { show_logs; exit 1; }
  alive "$state/run/slurmd.pid" slurmd || slurmd -f "$conf"
  wait_for 30 "node $(hostname -s) to be idle in sinfo" node_ready || { show_logs; exit 1; }
  # Another cluster on the same ports would answer the checks above: insist on our own daemons.
  if ! { alive "$state/munge/munged.pid" munged && alive "$state/run/slurmctld.pid" slurmctld &&
    alive "$state/run/slurmd.pid" slurmd; }; then
    log "a daemon of this cluster is not running (ports 6817/6818 taken by another cluster?)"
    show_logs
    exit 1
  fi

  local env_line="export GTP_SLURM_DIR=$state; export SLURM_CONF=$conf; export PATH=$state/bin:\$PATH"
  echo "$env_line" >"$state/env.sh"
  log "cluster up in $((SECONDS - t0)) s: $(sinfo -h -o '%P %D %c %T' | tr '\n' ' ')"
  echo "$env_line"
}

main "$@"
