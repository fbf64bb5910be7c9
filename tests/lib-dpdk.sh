# shellcheck shell=bash disable=SC2034   # variables set here are read by the sourcing scripts
# Shared helpers for tests/dpdk-interop and bench/net-bench: run dpdk-testpmd
# interactively (its stdin a FIFO we write commands into, its stdout a log we
# poll for the prompt), run vhostd, parse both sides' counters, reserve
# hugepages, and clean everything up on exit.
#
# This file is SOURCED, never executed, and must stay non-executable:
# scripts/test runs every executable file in tests/.
#
# Conventions: every wait is a poll with a bound; every process we start is
# recorded and killed by dpdk_cleanup (installed as the EXIT trap by
# dpdk_init); every testpmd gets its own --file-prefix, whose hugepage files
# and runtime directory are removed afterwards.

DPDK_W=             # work directory (sockets, FIFOs, logs), from dpdk_init
DPDK_TAG=           # short tag used in file prefixes
TP_TIMEOUT=${TP_TIMEOUT:-600}   # hard bound on any one testpmd's lifetime (s)
VHOSTD_TIMEOUT=${VHOSTD_TIMEOUT:-600}
declare -A TP_PID=() TP_FD=() TP_LOG=() TP_PREFIX=()
declare -A VH_PID=() VH_OUT=() VH_ERR=()
DPDK_KEEP=${DPDK_KEEP:-0}       # 1: keep the work directory (logs) after exit

dpdk_die() { echo "$*" >&2; exit 2; }

# dpdk_init TAG: checks prerequisites, makes the work directory, installs the trap.
dpdk_init() {
    DPDK_TAG=$1
    [ "$(id -u)" = 0 ] || dpdk_die "$0: run as root (hugepages)"
    command -v dpdk-testpmd >/dev/null || dpdk_die "$0: dpdk-testpmd not found (Debian package dpdk)"
    command -v stdbuf >/dev/null || dpdk_die "$0: stdbuf not found (coreutils)"
    DPDK_W=$(mktemp -d "/tmp/$DPDK_TAG.XXXXXX")
    trap dpdk_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

# hugetlbfs mount points (DPDK uses every one of the default page size).
dpdk_huge_mounts() { awk '$3 == "hugetlbfs" { print $2 }' /proc/mounts; }

# hugepages_ensure PAGES: hugetlbfs mounted, nr_hugepages >= 1024, and at
# least PAGES 2 MiB pages free (other users of this machine may hold some:
# then the pool is grown by the shortfall).
hugepages_ensure() {
    local need=$1 total free
    if [ -z "$(dpdk_huge_mounts)" ]; then
        mkdir -p /dev/hugepages
        mount -t hugetlbfs nodev /dev/hugepages || dpdk_die "cannot mount hugetlbfs on /dev/hugepages"
    fi
    total=$(cat /proc/sys/vm/nr_hugepages)
    if [ "$total" -lt 1024 ]; then
        echo 1024 >/proc/sys/vm/nr_hugepages
        total=$(cat /proc/sys/vm/nr_hugepages)
    fi
    free=$(awk '/^HugePages_Free:/ { print $2 }' /proc/meminfo)
    if [ "$free" -lt "$need" ]; then
        echo $((total + need - free)) >/proc/sys/vm/nr_hugepages
        free=$(awk '/^HugePages_Free:/ { print $2 }' /proc/meminfo)
    fi
    [ "$free" -ge "$need" ] || dpdk_die "need $need free 2 MiB hugepages, have $free (nr_hugepages=$(cat /proc/sys/vm/nr_hugepages))"
}

# poll_until SECONDS CMD...: runs CMD every 50 ms until it succeeds (0) or
# SECONDS pass (1).
poll_until() {
    local limit=$1; shift
    local end_ns=$(($(date +%s%N) + limit * 1000000000))
    while :; do
        "$@" && return 0
        [ "$(date +%s%N)" -ge "$end_ns" ] && return 1
        sleep 0.05
    done
}

alive() { kill -0 "$1" 2>/dev/null; }

# dpdk_version: the DPDK version dpdk-testpmd (the first in PATH) reports,
# e.g. 25.11.4; empty if it names none. 25.11 prints it for --version;
# 22.11 has no --version and prints it for the EAL's -v (then its --help).
dpdk_version() {
    { dpdk-testpmd --version 2>&1; dpdk-testpmd -v --help 2>&1; } |
        sed -n "s/.*RTE Version: 'DPDK \([0-9.]*\)'.*/\1/p" | head -n 1
}

# stop_pid PID SECONDS: SIGTERM, wait up to SECONDS, then SIGKILL; reaps it.
stop_pid() {
    local pid=$1 limit=${2:-10}
    alive "$pid" || { wait "$pid" 2>/dev/null; return 0; }
    kill -TERM "$pid" 2>/dev/null
    if ! poll_until "$limit" eval "! kill -0 $pid 2>/dev/null"; then
        echo "pid $pid did not exit on SIGTERM within ${limit}s: SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null
    fi
    wait "$pid" 2>/dev/null
    return 0
}

# ---------------------------------------------------------------- testpmd

# in_netns_cmd: the command prefix that runs a program in network namespace
# $IN_NETNS (set it for one call: `IN_NETNS=ns tp_start ...`), or nothing.
in_netns_cmd() { if [ -n "${IN_NETNS:-}" ]; then echo "ip netns exec $IN_NETNS"; fi; }

# tp_start NAME EAL-AND-APP-ARGS...: starts `dpdk-testpmd ARGS` (which must
# include `-- -i`) with --file-prefix derived from NAME, stdin a FIFO, stdout
# and stderr a log (line-buffered through stdbuf so command output reaches
# the log before the next prompt), in namespace $IN_NETNS if set. Does not
# wait: see tp_wait_ready.
tp_start() {
    local name=$1; shift
    local fifo="$DPDK_W/$name.fifo" fd ns
    TP_PREFIX[$name]="${DPDK_TAG:0:6}$$$name"
    TP_LOG[$name]="$DPDK_W/$name.log"
    rm -f "$fifo"; mkfifo "$fifo"
    # Opened read-write: never blocks, and testpmd never sees EOF while we live.
    exec {fd}<>"$fifo"
    TP_FD[$name]=$fd
    ns=$(in_netns_cmd)
    # shellcheck disable=SC2086 # ns is a list of words or empty
    timeout -k 5 "$TP_TIMEOUT" $ns stdbuf -oL -eL \
        dpdk-testpmd --file-prefix="${TP_PREFIX[$name]}" "$@" \
        <"$fifo" >"${TP_LOG[$name]}" 2>&1 {fd}>&- &
    TP_PID[$name]=$!
    echo "$name: dpdk-testpmd --file-prefix=${TP_PREFIX[$name]} $*" >>"$DPDK_W/commands"
}

tp_log_size() { stat -c %s "${TP_LOG[$1]}" 2>/dev/null || echo 0; }

# True once the log, from byte OFFSET on, shows a prompt.
tp_prompt_after() { tail -c +$(($2 + 1)) "${TP_LOG[$1]}" 2>/dev/null | grep -q 'testpmd> '; }

# tp_wait_ready NAME [SECONDS]: waits for the first prompt (EAL and ports up).
tp_wait_ready() {
    local name=$1 limit=${2:-30}
    if ! poll_until "$limit" eval "tp_prompt_after $name 0 || ! alive ${TP_PID[$name]}"; then
        echo "$name: testpmd gave no prompt within ${limit}s" >&2; tp_tail "$name" >&2; return 1
    fi
    if ! alive "${TP_PID[$name]}"; then
        echo "$name: testpmd exited during start-up" >&2; tp_tail "$name" >&2; return 1
    fi
}

# tp_cmd NAME COMMAND [SECONDS]: sends one command and waits for the next
# prompt; the command's output is then in $DPDK_W/NAME.out (and TP_OUT).
tp_cmd() {
    local name=$1 cmd=$2 limit=${3:-30} off
    off=$(tp_log_size "$name")
    printf '%s\n' "$cmd" 1>&"${TP_FD[$name]}"
    if ! poll_until "$limit" eval "tp_prompt_after $name $off || ! alive ${TP_PID[$name]}"; then
        echo "$name: no prompt within ${limit}s after '$cmd'" >&2; tp_tail "$name" >&2; return 1
    fi
    tail -c +$((off + 1)) "${TP_LOG[$name]}" >"$DPDK_W/$name.out"
    TP_OUT="$DPDK_W/$name.out"
    alive "${TP_PID[$name]}" || { echo "$name: testpmd died after '$cmd'" >&2; tp_tail "$name" >&2; return 1; }
}

# tp_quit NAME [SECONDS]: `quit`, then waits for the process to end (SIGKILL
# after SECONDS). Returns testpmd's exit status.
tp_quit() {
    local name=$1 limit=${2:-20} pid=${TP_PID[$1]} rc=0
    [ -n "$pid" ] || return 0
    printf 'quit\n' 1>&"${TP_FD[$name]}"
    if ! poll_until "$limit" eval "! alive $pid"; then
        echo "$name: testpmd did not quit within ${limit}s: SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null; rc=1
    fi
    wait "$pid" 2>/dev/null || rc=$?
    TP_PID[$name]=
    local fd=${TP_FD[$name]}
    [ -n "$fd" ] && exec {fd}>&-
    TP_FD[$name]=
    tp_remove_files "$name"
    return "$rc"
}

# Removes the hugepage files and runtime directory of NAME's --file-prefix.
tp_remove_files() {
    local prefix=${TP_PREFIX[$1]} m
    [ -n "$prefix" ] || return 0
    for m in $(dpdk_huge_mounts); do rm -f "$m/${prefix}map_"*; done
    rm -rf "/var/run/dpdk/$prefix"
}

tp_tail() { echo "---- last lines of $1's testpmd log (${TP_LOG[$1]}):"; tail -n "${2:-25}" "${TP_LOG[$1]}" 2>/dev/null; echo "----"; }

# stat_val FILE KEY: the first number after "KEY:" or "KEY=" in FILE (testpmd
# pads with spaces: "RX-packets: 123", "Tx-pps:     4586020").
stat_val() {
    grep -o -- "$2[:=] *[0-9.]*" "$1" | head -n 1 | sed 's/.*[:=] *//'
}

# tp_port_stats NAME: `show port stats all`; sets TP_RX TP_TX (cumulative
# packets since the port started, i.e. rte_eth_stats ipackets/opackets) and
# TP_RX_PPS TP_TX_PPS (testpmd's own rate since the previous `show port stats`).
tp_port_stats() {
    tp_cmd "$1" "show port stats all" || return 1
    TP_RX=$(stat_val "$TP_OUT" RX-packets)
    TP_TX=$(stat_val "$TP_OUT" TX-packets)
    TP_RX_PPS=$(stat_val "$TP_OUT" Rx-pps)
    TP_TX_PPS=$(stat_val "$TP_OUT" Tx-pps)
    [ -n "$TP_RX" ] && [ -n "$TP_TX" ] || { echo "$1: cannot parse port stats:" >&2; cat "$TP_OUT" >&2; return 1; }
}

# tp_wait_rx_settled NAME SECONDS: polls port stats every 200 ms until RX and TX
# stop moving: unchanged for a whole second (5 readings), so a backend that
# was off its CPU for a moment on a loaded machine, holding the last burst,
# does not pass for settled. TP_RX/TP_TX then hold the settled values.
tp_wait_rx_settled() {
    local name=$1 limit=${2:-10} prx=-1 ptx=-1 same=0 end=$((SECONDS + ${2:-10}))
    while [ "$SECONDS" -le "$end" ]; do
        tp_port_stats "$name" || return 1
        if [ "$TP_RX" = "$prx" ] && [ "$TP_TX" = "$ptx" ]; then
            same=$((same + 1))
            [ "$same" -ge 5 ] && return 0
        else
            same=0
        fi
        prx=$TP_RX; ptx=$TP_TX
        sleep 0.2
    done
    echo "$name: counters still moving after ${limit}s" >&2
    return 1
}

# tp_stop NAME: `stop`; sets TP_CPP (CPU cycles/packet, only printed with
# --record-core-cycles) and TP_FWD_RX/TP_FWD_TX (accumulated forward stats).
tp_stop() {
    tp_cmd "$1" "stop" || return 1
    TP_CPP=$(stat_val "$TP_OUT" "CPU cycles/packet")
    local acc
    acc=$(sed -n '/Accumulated forward statistics/,/+++++$/p' "$TP_OUT")
    TP_FWD_RX=$(grep -o 'RX-packets: *[0-9]*' <<<"$acc" | head -n 1 | grep -o '[0-9]*$')
    TP_FWD_TX=$(grep -o 'TX-packets: *[0-9]*' <<<"$acc" | head -n 1 | grep -o '[0-9]*$')
}

# ---------------------------------------------------------------- vhostd

# vhostd_start NAME VHOSTD-ARGS...: starts vhostd (binary $VHOSTD), in
# namespace $IN_NETNS if set, and waits for "vhostd: listening on" on its stderr.
vhostd_start() {
    local name=$1 ns; shift
    VH_OUT[$name]="$DPDK_W/$name.stdout"
    VH_ERR[$name]="$DPDK_W/$name.stderr"
    ns=$(in_netns_cmd)
    # shellcheck disable=SC2086 # ns is a list of words or empty
    timeout -k 5 "$VHOSTD_TIMEOUT" $ns "$VHOSTD" "$@" >"${VH_OUT[$name]}" 2>"${VH_ERR[$name]}" &
    VH_PID[$name]=$!
    echo "$name: $VHOSTD $*" >>"$DPDK_W/commands"
    if ! poll_until 15 eval "grep -q 'vhostd: listening on' '${VH_ERR[$name]}' || ! alive ${VH_PID[$name]}"; then
        echo "$name: vhostd did not report listening within 15s" >&2; vhostd_tail "$name" >&2; return 1
    fi
    alive "${VH_PID[$name]}" || { echo "$name: vhostd exited during start-up" >&2; vhostd_tail "$name" >&2; return 1; }
}

vhostd_tail() {
    echo "---- vhostd $1 stderr:"; tail -n 20 "${VH_ERR[$1]}" 2>/dev/null
    echo "---- vhostd $1 stdout:"; tail -n 20 "${VH_OUT[$1]}" 2>/dev/null; echo "----"
}

# vhostd_stop NAME: SIGTERM, waits (SIGKILL after 10 s), parses the
# `stats total` line into VH_GTX VH_GRX VH_DROPPED VH_BAD VH_CPP VH_BUSY.
vhostd_stop() {
    local name=$1 pid=${VH_PID[$1]} rc=0 total
    [ -n "$pid" ] || return 1
    if alive "$pid"; then
        kill -TERM "$pid"
        if ! poll_until 10 eval "! alive $pid"; then
            echo "$name: vhostd did not exit within 10s of SIGTERM: SIGKILL" >&2
            kill -KILL "$pid"; rc=1
        fi
    else
        echo "$name: vhostd had already exited" >&2; rc=1
    fi
    wait "$pid"; local st=$?
    VH_PID[$name]=
    [ "$st" = 0 ] || { echo "$name: vhostd exit status $st" >&2; rc=1; }
    total=$(grep '^stats total ' "${VH_OUT[$name]}" | tail -n 1)
    VH_GTX=$(stat_val <(echo "$total") guest_tx_packets)
    VH_GRX=$(stat_val <(echo "$total") guest_rx_packets)
    VH_DROPPED=$(stat_val <(echo "$total") dropped)
    VH_BAD=$(stat_val <(echo "$total") bad_chains)
    VH_BUSY=$(stat_val <(echo "$total") busy_cycles)
    VH_CPP=$(stat_val <(echo "$total") cycles_per_packet)
    if [ -z "$VH_GTX" ] || [ -z "$VH_GRX" ]; then
        echo "$name: no parsable 'stats total' line on vhostd's stdout" >&2; vhostd_tail "$name" >&2; rc=1
    fi
    return "$rc"
}

# ---------------------------------------------------------------- cleanup

dpdk_cleanup() {
    local rc=$? n
    trap - EXIT INT TERM
    for n in "${!TP_PID[@]}"; do
        [ -n "${TP_PID[$n]}" ] && stop_pid "${TP_PID[$n]}" 10
        tp_remove_files "$n"
    done
    for n in "${!VH_PID[@]}"; do
        [ -n "${VH_PID[$n]}" ] && stop_pid "${VH_PID[$n]}" 10
    done
    if [ "$DPDK_KEEP" = 1 ] || { [ "$rc" != 0 ] && [ "${DPDK_KEEP_ON_FAIL:-1}" = 1 ]; }; then
        # Keep logs for a post-mortem, but no sockets or FIFOs.
        [ -n "$DPDK_W" ] && find "$DPDK_W" \( -type s -o -type p \) -delete 2>/dev/null
        [ -n "$DPDK_W" ] && echo "logs kept in $DPDK_W" >&2
    else
        [ -n "$DPDK_W" ] && rm -rf "$DPDK_W"
    fi
    exit "$rc"
}

# ---------------------------------------------------------------- benches

# cleanup_run: stops every testpmd and vhostd of a bench run and removes
# their files (and the run's namespace).
cleanup_run() {
    local n
    for n in "${!TP_PID[@]}"; do
        [ -n "${TP_PID[$n]}" ] && { stop_pid "${TP_PID[$n]}" 10; TP_PID[$n]=""; }
        tp_remove_files "$n"
    done
    for n in "${!VH_PID[@]}"; do
        [ -n "${VH_PID[$n]}" ] && { stop_pid "${VH_PID[$n]}" 10; VH_PID[$n]=""; }
    done
    rm -f "$DPDK_W/sock"
    # A bench with a namespace per run defines ns_del.
    if declare -F ns_del >/dev/null; then ns_del; fi
}

# stats_of VALUES...: "median min max" of the numeric values ("- - -" if none).
stats_of() {
    [ $# -gt 0 ] || { echo "- - -"; return; }
    printf '%s\n' "$@" | sort -g | awk '/^[0-9.]+$/ { v[++n] = $1 } END {
        if (n == 0) { print "- - -"; exit }
        m = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
        printf "%.3f %.3f %.3f\n", m, v[1], v[n] }'
}

# ratio A B: A / B to two places, "-" when either is missing or B is 0.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "-" || b == "-" || b == 0) print "-"; else printf "%.2f", a / b }'; }
