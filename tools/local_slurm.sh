#!/usr/bin/env bash
# local_slurm.sh - start/stop a real SLURM cluster of two nodes on this machine, with stand-in GPUs.
#
# Used by CI (.ci/run) and by the pytest SLURM tests so that the launch
# scripts under slurm/ can be exercised with genuine sbatch/srun/squeue.
# Targets Debian 12 (slurm-wlm 22.05), run as root, no systemd needed.
#
# Usage:
#   tools/local_slurm.sh start    # install (if needed), configure, start; idempotent
#   tools/local_slurm.sh stop     # cancel all jobs, stop slurmctld + the slurmds (munged stays)
#   tools/local_slurm.sh status   # print sinfo/squeue; exit 0 if up, 1 otherwise
#
# Environment:
#   LOCAL_SLURM_DIR   state/log/pid directory (default /tmp/open_r1_ext_slurm)
#   LOCAL_SLURM_WAIT  seconds to wait for the nodes to become usable (default 60)
#
# The config lives in /etc/slurm/slurm.conf and gres.conf so plain `sbatch` works in any shell. Two nodes,
# `$(hostname -s)` and `$(hostname -s)-2`, each its own slurmd on this machine (Debian's slurm-wlm is built with
# multiple slurmd support), so a job may ask for 2 nodes as a 2-node trainer does. Each node declares the hardware
# of a GPU node (SlurmdParameters=config_overrides: the declared values, not this machine's): GPUS GRES GPUs backed
# by the device files /dev/tty0..GPUS-1 (SLURM schedules --gres=gpu:N and sets CUDA_VISIBLE_DEVICES; nothing behind
# them is a GPU, and TaskPlugin=task/none isolates nothing) and CPUS CPUs. The single partition `debug` uses
# OverSubscribe=FORCE:4, so up to four jobs may share each CPU: a server job and a trainer job that each ask for
# all CPUs run side by side without any extra sbatch flag. A cluster running with another config is restarted.
set -euo pipefail

STATE_DIR="${LOCAL_SLURM_DIR:-/tmp/open_r1_ext_slurm}"
WAIT_S="${LOCAL_SLURM_WAIT:-60}"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
GRES_CONF="$CONF_DIR/gres.conf"
PARTITION=debug
NODE="$(hostname -s)"
NODES=("$NODE" "$NODE-2")
GPUS=48  # per node: room for every shipped recipe's jobs side by side (tests/test_rehearsal.py: 64 GPUs in all)
CPUS=128  # per node: the shipped recipes' trainer asks 88, their servers 32
SLURMD_FIRST_PORT=6818  # node i's slurmd listens on this + i
CTLD_PID="$STATE_DIR/run/slurmctld.pid"
SLURMD_PID="$STATE_DIR/run/slurmd-%n.pid"  # %n: the node's name (one slurmd per node)
CTLD_LOG="$STATE_DIR/log/slurmctld.log"
SLURMD_LOG="$STATE_DIR/log/slurmd-%n.log"

log() { echo "[local_slurm] $*" >&2; }

die() {
    log "ERROR: $*"
    local f
    for f in "$CTLD_LOG" "${SLURMD_LOG//%n/${NODES[0]}}" "${SLURMD_LOG//%n/${NODES[1]}}" /var/log/munge/munged.log; do
        if [[ -s "$f" ]]; then
            echo "----- tail of $f -----" >&2
            tail -n 25 "$f" >&2 || true
        fi
    done
    exit 1
}

need_root() {
    [[ "$(id -u)" -eq 0 ]] || die "must run as root (installs packages, writes /etc/slurm)"
}

pid_alive() {  # pid_alive PIDFILE
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    if command -v sinfo >/dev/null && command -v slurmctld >/dev/null \
        && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    log "installing slurm-wlm and munge via apt-get ..."
    # another apt-get (a second start, the machine's own updates) holds dpkg's lock: wait for it (10 min at most)
    local apt=(apt-get -o DPkg::Lock::Timeout=600)
    "${apt[@]}" update -qq
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq slurm-wlm munge >/dev/null \
        || die "apt-get install slurm-wlm munge failed"
}

ensure_hostname_resolves() {  # every node's name: jobs reach a server or the trainer's rendezvous by it
    local name
    for name in "${NODES[@]}"; do
        if ! getent hosts "$name" >/dev/null; then
            log "hostname '$name' does not resolve; adding it to /etc/hosts"
            echo "127.0.0.1 $name" >>/etc/hosts
        fi
    done
}

start_munge() {
    install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
    install -d -o munge -g munge -m 0711 /var/lib/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return  # already running and working
    fi
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged || die "munged failed to start"
    local i
    for i in $(seq 1 20); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.25
    done
    die "munge credential round-trip failed"
}

# Prints the slurm.conf we want on stdout.
render_conf() {
    local mem i
    mem="$(slurmd -C | sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p')" || die "slurmd -C failed"
    [[ -n "$mem" ]] || die "could not parse 'slurmd -C': $(slurmd -C | head -n 1)"
    # leave a little headroom so slurmd never reports less than configured
    mem=$(( mem * 95 / 100 ))
    cat <<EOF
# Generated by tools/local_slurm.sh - a two-node test cluster on one machine, with stand-in GPUs. Do not edit.
ClusterName=local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=300
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldLogFile=$CTLD_LOG
SlurmdLogFile=$SLURMD_LOG
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
EOF
    for i in "${!NODES[@]}"; do
        echo "NodeName=${NODES[$i]} NodeHostname=$NODE NodeAddr=127.0.0.1 Port=$(( SLURMD_FIRST_PORT + i ))" \
             "Gres=gpu:$GPUS CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1" \
             "RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP"
}

# Prints the gres.conf we want: each node's GPUs are the device files /dev/tty0..GPUS-1 (there on any Linux).
render_gres_conf() {
    [[ -e "/dev/tty$(( GPUS - 1 ))" ]] || die "no /dev/tty$(( GPUS - 1 )): the stand-in GPUs need /dev/tty0..$(( GPUS - 1 ))"
    echo "# Generated by tools/local_slurm.sh - stand-in GPUs: character devices, no GPU behind them. Do not edit."
    echo "NodeName=$(IFS=,; echo "${NODES[*]}") Name=gpu File=/dev/tty[0-$(( GPUS - 1 ))]"
}

# Value of KEY in the installed slurm.conf, else DEFAULT.
conf_value() {  # conf_value KEY DEFAULT
    local v=""
    [[ -f "$CONF" ]] && v="$(sed -n "s/^$1=//p" "$CONF" | head -n 1)"
    echo "${v:-$2}"
}

# Installs slurm.conf and gres.conf; if either changed, stops the daemons first so they restart with them.
write_conf() {
    local new new_gres
    new="$(render_conf)"
    new_gres="$(render_gres_conf)"
    [[ "$new" == "$(cat "$CONF" 2>/dev/null)" && "$new_gres" == "$(cat "$GRES_CONF" 2>/dev/null)" ]] && return 0
    stop_daemons
    log "writing $CONF and $GRES_CONF"
    printf '%s\n' "$new" >"$CONF"
    printf '%s\n' "$new_gres" >"$GRES_CONF"
}

# The pid file of each node's slurmd that the installed slurm.conf names (%n expanded; a config from before the
# second node names one file).
slurmd_pidfiles() {
    local file name
    [[ -f "$CONF" ]] || return 0
    file="$(conf_value SlurmdPidFile "$SLURMD_PID")"
    for name in $(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF"); do
        echo "${file//%n/$name}"
    done | sort -u
}

# Stops every slurmd and slurmctld via the pid files named in the installed
# slurm.conf (it may point at another LOCAL_SLURM_DIR than the current one).
stop_daemons() {
    local f pid i
    for f in $(slurmd_pidfiles) "$(conf_value SlurmctldPidFile "$CTLD_PID")"; do
        pid_alive "$f" || { rm -f "$f"; continue; }
        pid="$(cat "$f")"
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 40); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$f"
    done
}

# wait_pidfile NAME PIDFILE: the daemon forks, so its pid file shows up a bit later.
wait_pidfile() {
    local i
    for i in $(seq 1 40); do
        pid_alive "$2" && return 0
        sleep 0.25
    done
    die "$1 did not start (no live pid in $2)"
}

start_daemons() {
    local i name
    if ! pid_alive "$CTLD_PID"; then
        log "starting slurmctld"
        slurmctld || die "slurmctld failed to start"
        wait_pidfile slurmctld "$CTLD_PID"
    fi
    for i in $(seq 1 40); do
        scontrol ping 2>/dev/null | grep -q UP && break
        sleep 0.25
    done
    for name in "${NODES[@]}"; do
        if ! pid_alive "${SLURMD_PID//%n/$name}"; then
            log "starting slurmd of node $name"
            slurmd -N "$name" || die "slurmd -N $name failed to start"
            wait_pidfile "slurmd of node $name" "${SLURMD_PID//%n/$name}"
        fi
    done
}

node_state() {  # node_state NAME
    sinfo -h -n "$1" -o %T 2>/dev/null | head -n 1
}

usable() {  # usable STATE
    case "$1" in idle*|mixed*|alloc*|completing*) return 0 ;; esac
    return 1
}

wait_for_node() {  # wait_for_node NAME
    local deadline=$(( SECONDS + WAIT_S )) state="" last=""
    while (( SECONDS < deadline )); do
        pid_alive "$CTLD_PID" || die "slurmctld is not running"
        pid_alive "${SLURMD_PID//%n/$1}" || die "the slurmd of node $1 is not running"
        state="$(node_state "$1")"
        [[ "$state" != "$last" ]] && log "node $1 state: ${state:-<no answer>}"
        last="$state"
        usable "$state" && return 0
        case "$state" in
            down*|drain*|fail*) scontrol update nodename="$1" state=resume 2>/dev/null || true ;;
        esac
        sleep 1
    done
    die "node $1 not usable after ${WAIT_S}s (state: ${state:-unknown}; reason: $(sinfo -h -R -n "$1" -o %E 2>/dev/null))"
}

cmd_start() {
    local name
    need_root
    install_packages
    ensure_hostname_resolves
    start_munge
    mkdir -p "$CONF_DIR" "$STATE_DIR"/{state,log,run}
    for name in "${NODES[@]}"; do mkdir -p "$STATE_DIR/spool/$name"; done
    write_conf
    start_daemons
    for name in "${NODES[@]}"; do wait_for_node "$name"; done
    echo "local SLURM up: nodes=$(IFS=,; echo "${NODES[*]}") each cpus=$CPUS gres=gpu:$GPUS" \
         "mem=$(sinfo -h -n "$NODE" -o %m)MB partition=$PARTITION conf=$CONF dir=$STATE_DIR"
}

cmd_stop() {
    if command -v squeue >/dev/null && pid_alive "$(conf_value SlurmctldPidFile "$CTLD_PID")"; then
        local jobs i
        jobs="$(squeue -h -o %i 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            log "cancelling jobs: $(echo $jobs)"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for i in $(seq 1 30); do
                [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
                sleep 0.5
            done
        fi
    fi
    stop_daemons
    echo "local SLURM stopped (munged left running)"
}

cmd_status() {
    local f name
    for f in $(slurmd_pidfiles); do
        pid_alive "$f" || { echo "local SLURM is not running (no slurmd behind $f)"; return 1; }
    done
    if [[ -f "$CONF" ]] && pid_alive "$(conf_value SlurmctldPidFile "$CTLD_PID")" \
        && scontrol ping 2>/dev/null | grep -q UP; then
        sinfo -N -o "%N %T %c %G"
        squeue
        for name in $(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$CONF"); do
            usable "$(node_state "$name")" || { echo "node $name not usable: $(node_state "$name")"; return 1; }
        done
        return 0
    fi
    echo "local SLURM is not running"
    return 1
}

# One start or stop at a time (`make test` has two pytest-xdist workers with SLURM tests, each starting the cluster):
# the script runs again under flock, which holds the lock itself (-o), so the daemons started do not inherit it.
if [[ "${1:-}" =~ ^(start|stop)$ && -z "${LOCAL_SLURM_LOCKED:-}" ]]; then
    mkdir -p "$STATE_DIR"
    LOCAL_SLURM_LOCKED=1 exec flock -o "$STATE_DIR/start-stop.lock" "$0" "$@"
fi

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
esac
