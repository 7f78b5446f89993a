#!/usr/bin/env bash
# Bring up a real single-node Slurm cluster on this machine (loopback only), idempotently.
#
#   tests/machine/slurm-up.sh          # install if needed, (re)write config, start munged/slurmctld/slurmd
#   tests/machine/slurm-up.sh --down   # stop slurmd (every one), slurmctld and munged
#
# Safe to run twice: when the daemons are already running with the same config it only
# checks `sinfo` and exits. No systemd needed; works in containers without cgroups
# (proctrack/linuxproc, task/none). Debian/Ubuntu packages: slurmctld slurmd slurm-client munge.
#
# Env knobs: SLURM_UP_CPUS (CPUs declared for the node; default max(nproc, 8) so small
# CI machines can run e.g. 4 single-CPU tasks on 2 cores), SLURM_UP_TIMEOUT (s, default 60).
#
# Multi-host (tests/machine/hosts-up.sh sets these; unset, the cluster is exactly the single-node one):
#   SLURM_UP_NODES="node1=10.231.0.11 node2=10.231.0.12"   more nodes, in a non-default
#       partition `hosts` (`debug` with this machine's node stays the default). Their slurmd
#       are not started here: hosts-up.sh starts each inside its host (`slurmd -N node1`).
#   SLURM_UP_CTLD_ADDR=10.231.0.1   where slurmctld is reached (default 127.0.0.1, which
#       the other hosts cannot reach).
# Running this again without them puts the single-node cluster back.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E "$0" "$@"
fi

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
CTLD_SPOOL=/var/spool/slurmctld
SLURMD_SPOOL=/var/spool/slurmd
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
TIMEOUT=${SLURM_UP_TIMEOUT:-60}
NODE=$(hostname -s)
EXTRA_NODES=${SLURM_UP_NODES:-}
CTLD_ADDR=${SLURM_UP_CTLD_ADDR:-127.0.0.1}
SLURMD_LOG=$LOG_DIR/slurmd.log
SPOOL_CONF=$SLURMD_SPOOL PID_CONF=$SLURMD_PID LOG_CONF=$SLURMD_LOG
if [ -n "$EXTRA_NODES" ]; then
  # Several slurmd on one filesystem: each expands %n to its own node name.
  SPOOL_CONF=$SLURMD_SPOOL/%n PID_CONF=/run/slurmd-%n.pid LOG_CONF=$LOG_DIR/slurmd-%n.log
  SLURMD_PID=/run/slurmd-${NODE}.pid
  SLURMD_LOG=$LOG_DIR/slurmd-${NODE}.log
fi

# shellcheck source=tests/machine/pidfiles.sh
source "$(dirname "$0")/pidfiles.sh"

stop_slurmds() {  # this machine's slurmd, and those of the test hosts (tests/machine/hosts-up.sh), if any
  local f
  for f in /run/slurmd.pid /run/slurmd-*.pid; do stop_pidfile "$f"; done
}

if [ "${1:-}" = "--down" ]; then
  stop_slurmds
  stop_pidfile "$CTLD_PID"
  stop_pidfile /run/munge/munged.pid
  echo "slurm down"
  exit 0
fi

# --- 1. packages ----------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 \
   || ! command -v sinfo >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The slurm-wlm metapackage would also pull ~20 plugin/-dev packages we do not need.
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# --- 2. munge -------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null 2>&1; then
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  else
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  rm -f /run/munge/munged.pid
  runuser -u munge -- munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    echo "slurm-up: munged did not come up" >&2
    tail -n 30 /var/log/munge/munged.log >&2 || true
    exit 1
  fi
fi

# --- 3. config ------------------------------------------------------------------------------
NPROC=$(nproc)
CPUS=${SLURM_UP_CPUS:-$(( NPROC > 8 ? NPROC : 8 ))}
MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$CTLD_SPOOL" "$SLURMD_SPOOL"

HEADER="single-node test cluster on loopback"
EXTRA_NODE_LINES="" EXTRA_PARTITION=""
if [ -n "$EXTRA_NODES" ]; then
  HEADER="this machine's node plus the test hosts' (tests/machine/hosts-up.sh)"
  names=""
  for entry in $EXTRA_NODES; do
    name=${entry%%=*} addr=${entry#*=}
    if [ -z "$name" ] || [ -z "$addr" ] || [ "$name" = "$entry" ]; then
      echo "slurm-up: SLURM_UP_NODES wants name=address entries, got '$entry'" >&2; exit 1
    fi
    install -d -m 0755 "$SLURMD_SPOOL/$name"
    EXTRA_NODE_LINES+="NodeName=${name} NodeAddr=${addr} NodeHostname=${name} CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN"$'\n'
    names+=${names:+,}$name
  done
  install -d -m 0755 "$SLURMD_SPOOL/$NODE"
  EXTRA_PARTITION="PartitionName=hosts Nodes=${names} MaxTime=INFINITE State=UP"$'\n'
fi

NEW_CONF=$(mktemp)
trap 'rm -f "$NEW_CONF"' EXIT
cat >"$NEW_CONF" <<EOF
# Written by tests/machine/slurm-up.sh: ${HEADER}. Do not edit by hand.
ClusterName=meshlab
SlurmctldHost=${NODE}(${CTLD_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=${CTLD_SPOOL}
SlurmdSpoolDir=${SPOOL_CONF}
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${PID_CONF}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_CONF}
# No cgroups in containers: track processes via /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPU count below even though the machine has fewer cores (oversubscription).
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=60
NodeName=${NODE} NodeAddr=127.0.0.1 NodeHostname=${NODE} CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
${EXTRA_NODE_LINES}PartitionName=debug Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
EOF
printf '%s' "$EXTRA_PARTITION" >>"$NEW_CONF"

CHANGED=0
if ! cmp -s "$NEW_CONF" "$CONF"; then
  install -m 0644 "$NEW_CONF" "$CONF"
  CHANGED=1
fi

# --- 4. daemons -----------------------------------------------------------------------------
if [ "$CHANGED" = 1 ]; then  # config changed: restart whatever runs with the old one
  stop_slurmds  # the test hosts' too: hosts-up.sh starts them again
  stop_pidfile "$CTLD_PID"
fi
alive "$CTLD_PID" || slurmctld
alive "$SLURMD_PID" || slurmd

# --- 5. wait for the node -------------------------------------------------------------------
fail() {
  echo "slurm-up: $*" >&2
  for f in "$LOG_DIR/slurmctld.log" "$SLURMD_LOG"; do
    echo "--- tail $f" >&2; tail -n 40 "$f" >&2 || true
  done
  exit 1
}
started=$SECONDS deadline=$(( SECONDS + TIMEOUT ))
state=""
while :; do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1 || true)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    drained|draining|drain*)  # e.g. left over from an earlier run: put it back
      scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
  esac
  if [ "$SECONDS" -ge $(( started + 5 )) ]; then  # a daemon just started writes its pid file a moment later
    alive "$CTLD_PID" || fail "slurmctld is not running"
    alive "$SLURMD_PID" || fail "slurmd is not running"
  fi
  [ "$SECONDS" -lt "$deadline" ] || fail "node $NODE not up after ${TIMEOUT}s (state: '${state:-no answer}')"
  sleep 0.5
done

if [ -n "$EXTRA_NODES" ]; then
  echo "slurm up: node ${NODE}, ${CPUS} cpus (${NPROC} real), partition debug, state ${state}; partition hosts: ${names} (their slurmd: tests/machine/hosts-up.sh); slurmctld at ${CTLD_ADDR}"
else
  echo "slurm up: node ${NODE}, ${CPUS} cpus (${NPROC} real), partition debug, state ${state}"
fi
