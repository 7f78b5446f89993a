#!/usr/bin/env bash
# Make real test hosts node1..nodeN on this one machine for the multi-host tests (ssh, mpi
# and slurm profiles: tests/clusters/test_hosts.py), idempotently.
#
#   tests/machine/hosts-up.sh          # install if needed, make the hosts, start sshd and slurmd in each
#   tests/machine/hosts-up.sh --check  # verify: ssh (also host to host), mpirun, srun and sbatch across hosts
#   tests/machine/hosts-up.sh --down   # stop what it started, remove the hosts, Slurm back to single-node
#
# A host is a network namespace `nodeI` (eth0 = 10.231.0.(10+I)/24) plus its own hostname and
# mount namespace, held by one `sleep` whose pid is in /run/meshlab-hosts/nodeI.pid; every
# daemon of the host runs in those namespaces (nsenter), so whatever it starts does too. A
# bridge mlbr0 joins the hosts and this machine (10.231.0.1, the "login node"). Nothing else:
# no default route in the hosts, no NAT, no forwarding, so their traffic stays on the bridge.
# The filesystem is shared, as on a cluster with a shared home (and /root/.pyenv).
#
# Test-only files (keys made here, for these hosts only) in /var/lib/meshlab-hosts:
#   ssh_config       ssh -F it: `ssh -F /var/lib/meshlab-hosts/ssh_config node1 hostname`
#   id_ed25519       client key; authorized_keys, known_hosts, nodeI/ (host key, sshd_config)
#   mpi.env          Open MPI settings as OMPI_MCA_* (source it), mpi_args.toml the same as
#                    mpirun arguments (a TOML list)
# Slurm: tests/machine/slurm-up.sh with SLURM_UP_NODES/SLURM_UP_CTLD_ADDR adds the nodes in partition
# `hosts` (the default partition `debug` keeps this machine's node); their slurmd run here.
#
# Env knobs: MESHLAB_HOSTS (how many hosts, default 2), HOSTS_UP_TIMEOUT (s, default 60).
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E "$0" "$@"
fi

HERE=$(cd "$(dirname "$0")" && pwd)
N=${MESHLAB_HOSTS:-2}
TIMEOUT=${HOSTS_UP_TIMEOUT:-60}
BRIDGE=mlbr0
NET=10.231.0
LOGIN_ADDR=$NET.1
STATE=/var/lib/meshlab-hosts
RUN=/run/meshlab-hosts
LOGS=/var/log/meshlab-hosts
SSH_CONFIG=$STATE/ssh_config
SSH=(ssh -F "$SSH_CONFIG")
MPI_OPTS=(  # found with Open MPI 4.1.4: keep it on the bridge (this machine has other networks)
  --mca plm_rsh_agent "ssh -F $SSH_CONFIG"
  --mca oob_tcp_if_include "$NET.0/24"
  --mca btl_tcp_if_include "$NET.0/24"
  --mca plm_rsh_no_tree_spawn 1  # mpirun's own ssh to every host, not daemon to daemon
)

case "$N" in ''|*[!0-9]*) echo "hosts-up: MESHLAB_HOSTS must be a number, got '$N'" >&2; exit 1 ;; esac
if [ "$N" -lt 1 ] || [ "$N" -gt 200 ]; then
  echo "hosts-up: MESHLAB_HOSTS must be 1..200, got $N" >&2; exit 1
fi

# shellcheck source=tests/machine/pidfiles.sh
source "$HERE/pidfiles.sh"

addr() { echo "$NET.$((10 + $1))"; }

holder_ok() {  # is host $1's namespace holder running, in its network namespace?
  local pidf=$RUN/node$1.pid
  alive "$pidf" && [ -e "/run/netns/node$1" ] \
    && [ "$(stat -L -c %i "/proc/$(cat "$pidf")/ns/net" 2>/dev/null)" = "$(stat -L -c %i "/run/netns/node$1")" ]
}

in_host() {  # run a command in host $1's network, hostname and mounts
  local i=$1; shift
  nsenter -t "$(cat "$RUN/node$i.pid")" --net --uts --mount -- "$@"
}

teardown_host() {  # everything of host $1, whether or not it is complete
  local i=$1 pid
  stop_pidfile "/run/slurmd-node$i.pid"
  stop_pidfile "$RUN/sshd-node$i.pid"
  if [ -e "/run/netns/node$i" ]; then
    # What the daemons left in the host (ssh sessions, job steps) and the holder: only
    # processes in this host's network namespace, i.e. the ones started here.
    for pid in $(ip netns pids "node$i" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 25); do [ -z "$(ip netns pids "node$i" 2>/dev/null)" ] && break; sleep 0.2; done
    for pid in $(ip netns pids "node$i" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  fi
  stop_pidfile "$RUN/node$i.pid"
  ip link del "mlveth$i" 2>/dev/null || true  # takes the host's eth0 with it
  ip netns del "node$i" 2>/dev/null || true
  rm -rf "/etc/netns/node$i" "${STATE:?}/node$i"
  rmdir "$RUN/node$i.mnt" 2>/dev/null || true
  rm -f "$RUN"/ssh-*  # control sockets: their masters go with the sshd they talked to
}

existing_hosts() {  # numbers of the hosts some earlier run made (any count)
  { ip -o netns list 2>/dev/null | awk '{print $1}'
    ls /etc/netns "$RUN" 2>/dev/null | sed 's/\.mnt$//'
    ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//'
  } | sed -nE 's/^(node|mlveth)([0-9]+)(\.pid)?$/\2/p' | sort -un
}

slurm_has_hosts() { grep -q '^PartitionName=hosts ' /etc/slurm/slurm.conf 2>/dev/null; }

# --- --down ---------------------------------------------------------------------------------
if [ "${1:-}" = "--down" ]; then
  for i in $(existing_hosts); do teardown_host "$i"; done
  if slurm_has_hosts; then  # Slurm back to the single-node cluster tests/clusters/test_slurm.py wants
    env -u SLURM_UP_NODES -u SLURM_UP_CTLD_ADDR "$HERE/slurm-up.sh" >/dev/null
  fi
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "${STATE:?}" "${RUN:?}" "${LOGS:?}"
  rmdir /etc/netns 2>/dev/null || true  # only if no one else uses it
  echo "hosts down"
  exit 0
fi

# --- --check --------------------------------------------------------------------------------
if [ "${1:-}" = "--check" ]; then
  fails=0
  check() {  # check NAME EXPECTED COMMAND...: run it (60 s at most), compare its sorted output
    local name=$1 want=$2 got; shift 2
    got=$(timeout 60 "$@" 2>&1 | tr -d '\r' | sort | tr '\n' ' ' | sed 's/ $//') || true
    if [ "$got" = "$want" ]; then
      echo "ok    $name: $got"
    else
      echo "FAIL  $name: got '$got', want '$want'"; fails=$((fails + 1))
    fi
  }
  PY=$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null || command -v python3)
  for i in $(seq "$N"); do
    check "ssh node$i" "node$i" "${SSH[@]}" "node$i" hostname
    check "ssh $(addr "$i") (by address)" "node$i" "${SSH[@]}" "$(addr "$i")" hostname
    check "python on node$i" "node$i $(addr "$i")" "${SSH[@]}" "node$i" "$PY" -c \
      "'import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))'"
  done
  check "ssh multiplexing (node1)" "Master running (pid=X)" \
    sh -c "${SSH[*]@Q} -O check node1 2>&1 | sed 's/pid=[0-9]*/pid=X/'"
  if [ "$N" -ge 2 ]; then
    check "ssh node1 -> node2" "node2" "${SSH[@]}" node1 "${SSH[*]@Q}" node2 hostname
    check "ssh node2 -> node1 by address" "node1" "${SSH[@]}" node2 "${SSH[*]@Q}" "$(addr 1)" hostname
    check "mpirun 2 hosts x 2" "node1 node1 node2 node2" \
      env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      mpirun --host node1:2,node2:2 -n 4 "${MPI_OPTS[@]}" hostname
    check "mpirun with mpi.env" "node1 node1 node2 node2" \
      env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 sh -c "set -a && . $STATE/mpi.env && mpirun --host node1:2,node2:2 -n 4 hostname"
    # --ntasks-per-node as the slurm profile does: with 8 CPUs per node Slurm allocates 3+1
    check "srun -p hosts -N 2 -n 4" "node1 node1 node2 node2" \
      srun -p hosts -N 2 -n 4 --ntasks-per-node 2 hostname
    job_dir=$(mktemp -d)
    check "sbatch --wait 2 nodes" "node1 node2" sh -c "cd $job_dir && sbatch --wait -Q -p hosts -N 2 \
      -o out.txt --wrap 'srun -N 2 --ntasks-per-node 1 hostname' >/dev/null && cat out.txt"
    rm -rf "$job_dir"
  fi
  # idle unless a job runs there now
  check "sinfo -p debug" "$(hostname -s) up" \
    sh -c "sinfo -h -p debug -o '%n %T' | sed -E 's/ (idle|mixed|allocated|completing)\$/ up/'"
  check "srun -n 1 (default partition)" "$(hostname -s)" srun -n 1 hostname
  if [ "$fails" -gt 0 ]; then echo "hosts check: $fails failed" >&2; exit 1; fi
  echo "hosts check: all passed"
  exit 0
fi

# --- 1. packages ----------------------------------------------------------------------------
missing=()
for pkg in openssh-server openmpi-bin; do
  dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

install -d -m 0755 "$STATE" "$RUN" "$LOGS" /run/sshd /etc/netns

# Fewer hosts than last time: remove the extra ones.
for i in $(existing_hosts); do [ "$i" -le "$N" ] || teardown_host "$i"; done

# --- 2. network: the bridge and one namespace per host --------------------------------------
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link add "$BRIDGE" type bridge
fi
# IPv4 only, and quiet: no IPv6 link-local chatter on the test network.
sysctl -qw "net.ipv6.conf.$BRIDGE.disable_ipv6=1" 2>/dev/null || true
ip addr replace "$LOGIN_ADDR/24" dev "$BRIDGE"
ip link set "$BRIDGE" up

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
hosts_file=$TMP/hosts
{
  echo "# Written by tests/machine/hosts-up.sh: names on the test hosts' network. Do not edit by hand."
  echo "127.0.0.1 localhost"
  echo "::1 localhost ip6-localhost ip6-loopback"
  # this machine by its own name too: what the controller and Slurm may call it
  echo "$LOGIN_ADDR login $(hostname -s)"
  for i in $(seq "$N"); do echo "$(addr "$i") node$i"; done
} >"$hosts_file"

for i in $(seq "$N"); do
  ns=node$i veth=mlveth$i
  [ -e "/run/netns/$ns" ] || ip netns add "$ns"
  if ip link show "$veth" >/dev/null 2>&1 && ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
    ip link del "$veth"  # its other end is not this host's eth0 (the namespace was remade)
  fi
  if ! ip link show "$veth" >/dev/null 2>&1; then
    ip link add "$veth" type veth peer name eth0 netns "$ns"
  fi
  sysctl -qw "net.ipv6.conf.$veth.disable_ipv6=1" 2>/dev/null || true
  ip link set "$veth" master "$BRIDGE" up
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.eth0.disable_ipv6=1 2>/dev/null || true  # lo keeps ::1
  ip -n "$ns" link set lo up
  ip -n "$ns" addr replace "$(addr "$i")/24" dev eth0
  ip -n "$ns" link set eth0 up

  # `ip netns exec` bind-mounts /etc/netns/nodeI/* over /etc: the host's names. Written in
  # place (same inode), so a running host sees a change.
  install -d -m 0755 "/etc/netns/$ns"
  cmp -s "$hosts_file" "/etc/netns/$ns/hosts" || cat "$hosts_file" >"/etc/netns/$ns/hosts"
  [ "$(cat "/etc/netns/$ns/hostname" 2>/dev/null)" = "$ns" ] || echo "$ns" >"/etc/netns/$ns/hostname"

  # --- 3. the holder: the host's own hostname and mount namespace ---------------------------
  if ! holder_ok "$i"; then
    # a new holder means new namespaces: the host's daemons must start again inside them
    stop_pidfile "/run/slurmd-$ns.pid"
    stop_pidfile "$RUN/sshd-$ns.pid"
    rm -f "$RUN/$ns.pid"
    install -d -m 0700 "$RUN/$ns.mnt"
    # What `ip netns exec` does (this namespace's /sys, /etc/netns/nodeI/* over /etc), but
    # keeping /sys/fs/cgroup: slurmd will not start without it. Mounts stay in the host.
    setsid nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave sh -c "
      set -e
      hostname $ns
      mount --rbind /sys/fs/cgroup $RUN/$ns.mnt
      umount -l /sys
      mount -t sysfs $ns /sys
      mount --move $RUN/$ns.mnt /sys/fs/cgroup
      for f in /etc/netns/$ns/*; do mount --bind \$f /etc/\${f##*/}; done
      echo \$\$ >$RUN/$ns.pid.new
      mv $RUN/$ns.pid.new $RUN/$ns.pid
      exec sleep infinity" </dev/null >>"$LOGS/$ns.log" 2>&1 &
    for _ in $(seq 50); do [ -s "$RUN/$ns.pid" ] && break; sleep 0.1; done
    holder_ok "$i" || { echo "hosts-up: the holder of $ns did not start" >&2; exit 1; }
  fi
done

# --- 4. ssh: keys, client config, one sshd per host -----------------------------------------
[ -s "$STATE/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C meshlab-test-hosts -f "$STATE/id_ed25519"
new=$TMP/new known=$TMP/known_hosts
cp "$STATE/id_ed25519.pub" "$new"
cmp -s "$new" "$STATE/authorized_keys" || install -m 0600 "$new" "$STATE/authorized_keys"

{
  echo "# Written by tests/machine/hosts-up.sh: the test hosts' ssh client settings. Do not edit by hand."
  for i in $(seq "$N"); do printf 'Host node%s\n    HostName %s\n' "$i" "$(addr "$i")"; done
  cat <<EOF
Host node* $NET.*
    User root
    IdentityFile $STATE/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 10
    # a host that went away is noticed in 30 s, not hung on
    ServerAliveInterval 10
    ServerAliveCountMax 3
    # one connection per host and caller, reused: launchers run many ssh commands per engine
    ControlMaster auto
    ControlPath $RUN/ssh-%C
    ControlPersist 60
    LogLevel ERROR
EOF
} >"$new"
cmp -s "$new" "$SSH_CONFIG" || install -m 0644 "$new" "$SSH_CONFIG"

: >"$known"
for i in $(seq "$N"); do
  ns=node$i dir=$STATE/node$i
  install -d -m 0755 "$dir"
  [ -s "$dir/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N '' -C "$ns" -f "$dir/ssh_host_ed25519_key"
  echo "$ns,$(addr "$i") $(cut -d' ' -f1,2 "$dir/ssh_host_ed25519_key.pub")" >>"$known"
  cat >"$new" <<EOF
# Written by tests/machine/hosts-up.sh: sshd of test host $ns. Do not edit by hand.
ListenAddress $(addr "$i")
Port 22
HostKey $dir/ssh_host_ed25519_key
PidFile $RUN/sshd-$ns.pid
AuthorizedKeysFile $STATE/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
PrintMotd no
PrintLastLog no
# multiplexed connections carry many sessions; launchers start many at once
MaxSessions 100
MaxStartups 100:30:200
# scp speaks sftp since OpenSSH 9
Subsystem sftp internal-sftp
EOF
  if ! cmp -s "$new" "$dir/sshd_config"; then
    install -m 0644 "$new" "$dir/sshd_config"
    stop_pidfile "$RUN/sshd-$ns.pid"
  fi
  alive "$RUN/sshd-$ns.pid" || in_host "$i" /usr/sbin/sshd -f "$dir/sshd_config" -E "$LOGS/sshd-$ns.log"
done
cmp -s "$known" "$STATE/known_hosts" || install -m 0644 "$known" "$STATE/known_hosts"

deadline=$(( SECONDS + TIMEOUT ))
for i in $(seq "$N"); do
  until [ "$("${SSH[@]}" -o ControlMaster=no "node$i" hostname 2>/dev/null)" = "node$i" ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "hosts-up: ssh node$i does not answer after ${TIMEOUT}s" >&2
      "${SSH[@]}" -o ControlMaster=no -o LogLevel=INFO "node$i" hostname >&2 || true
      tail -n 20 "$LOGS/sshd-node$i.log" >&2 || true
      exit 1
    fi
    sleep 0.2
  done
done

# --- 5. MPI: the options, for callers -------------------------------------------------------
{
  echo "# Written by tests/machine/hosts-up.sh: Open MPI on the test hosts (source it, export OMPI_*)."
  echo "OMPI_MCA_plm_rsh_agent='ssh -F $SSH_CONFIG'"
  echo "OMPI_MCA_oob_tcp_if_include=$NET.0/24"
  echo "OMPI_MCA_btl_tcp_if_include=$NET.0/24"
  echo "OMPI_MCA_plm_rsh_no_tree_spawn=1"
} >"$STATE/mpi.env.new"
mv "$STATE/mpi.env.new" "$STATE/mpi.env"
args=""
for a in "${MPI_OPTS[@]}"; do args+="${args:+, }\"$a\""; done  # none has a quote or backslash
echo "[$args]" >"$STATE/mpi_args.toml.new"  # a TOML array: mpi_args = <this file>
mv "$STATE/mpi_args.toml.new" "$STATE/mpi_args.toml"

# --- 6. Slurm: the hosts as nodes of partition `hosts` --------------------------------------
nodes=""
for i in $(seq "$N"); do nodes+="${nodes:+ }node$i=$(addr "$i")"; done
SLURM_UP_NODES=$nodes SLURM_UP_CTLD_ADDR=$LOGIN_ADDR "$HERE/slurm-up.sh" >/dev/null
for i in $(seq "$N"); do
  alive "/run/slurmd-node$i.pid" || in_host "$i" slurmd -N "node$i"
done
started=$SECONDS deadline=$(( SECONDS + TIMEOUT ))
state=""
while :; do
  state=$(sinfo -h -p hosts -o '%n %T' 2>/dev/null | sort | tr '\n' ' ' || true)
  ready=1
  for i in $(seq "$N"); do
    case " $state" in
      *" node$i idle "*|*" node$i mixed "*|*" node$i allocated "*|*" node$i completing "*) ;;
      *" node$i drain"*)  # e.g. left over from an earlier run: put it back
        scontrol update NodeName="node$i" State=RESUME >/dev/null 2>&1 || true; ready=0 ;;
      *) ready=0 ;;
    esac
  done
  [ "$ready" = 1 ] && break
  for i in $(seq "$N"); do  # (a slurmd just started writes its pid file a moment later)
    [ "$SECONDS" -lt $(( started + 5 )) ] || alive "/run/slurmd-node$i.pid" || { tail -n 30 "/var/log/slurm/slurmd-node$i.log" >&2 || true
                                        echo "hosts-up: slurmd of node$i is not running" >&2; exit 1; }
  done
  if [ "$SECONDS" -ge "$deadline" ]; then
    tail -n 30 /var/log/slurm/slurmctld.log >&2 || true
    echo "hosts-up: partition hosts not up after ${TIMEOUT}s (${state:-no answer})" >&2; exit 1
  fi
  sleep 0.5
done

echo "hosts up: node1..node$N on $BRIDGE ($NET.0/24, this machine $LOGIN_ADDR), ssh -F $SSH_CONFIG, mpirun options in $STATE/mpi_args.toml, Slurm partition hosts ${state% }"
