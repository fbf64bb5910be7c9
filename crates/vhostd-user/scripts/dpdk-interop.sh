#!/usr/bin/env bash
# Interop and speed check of vhostd-user (our vhost-user frontend) against
# DPDK testpmd's vhost-user backend (net_vhost PMD), three scenarios:
#   1. vhostd-user txonly -> testpmd rxonly
#   2. testpmd txonly     -> vhostd-user rxonly
#   3. testpmd io (or mac) forwarding <-> vhostd-user echo, seeded by `start tx_first`
# Each prints both sides' counters and whether they agree exactly.
#
# Needs root (hugepages for testpmd only; vhostd-user uses a plain memfd),
# dpdk-testpmd (Debian `dpdk`), and a built binary:
#   CARGO_TARGET_DIR=... cargo build --release -p vhostd-user
# Usage: dpdk-interop.sh [BIN] ; env: SECS=3 PKT=64 RUNS=1 FWD=io FE_CPU=0 BE_CPU=1 QS=256 BURST=32
set -euo pipefail

BIN=${1:-${CARGO_TARGET_DIR:-target}/release/vhostd-user}
SECS=${SECS:-3}
PKT=${PKT:-64}
RUNS=${RUNS:-1}
FWD=${FWD:-io}
FE_CPU=${FE_CPU:-0}
BE_CPU=${BE_CPU:-1}
QS=${QS:-256}
BURST=${BURST:-32}
EXTRA=${EXTRA:-}

[ -x "$BIN" ] || { echo "no binary at $BIN" >&2; exit 2; }
command -v dpdk-testpmd >/dev/null || { echo "dpdk-testpmd not installed" >&2; exit 2; }
free=$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)
if [ "${free:-0}" -lt 128 ]; then
    echo "need >= 128 free 2 MiB hugepages for testpmd (echo 1024 > /proc/sys/vm/nr_hugepages)" >&2
    exit 2
fi

W=$(mktemp -d /tmp/vhostd-user-interop.XXXXXX)
TP_PID=
cleanup() {
    [ -n "$TP_PID" ] && kill "$TP_PID" 2>/dev/null || true
    exec 3>&- 2>/dev/null || true
    rm -rf "$W"
    # testpmd leaves its runtime dir (and, if killed, its hugepage file) behind.
    rm -rf "/var/run/dpdk/vhu$$" /dev/hugepages/vhu$$map_* 2>/dev/null || true
}
trap cleanup EXIT

# Starts testpmd as the vhost-user server in interactive mode, its stdin a FIFO on fd 3.
start_testpmd() { # mode
    rm -f "$W/sock" "$W/fifo"
    mkfifo "$W/fifo"
    dpdk-testpmd --lcores "0@$BE_CPU,1@$BE_CPU" --no-pci --file-prefix="vhu$$" -m 256 \
        --single-file-segments --vdev "net_vhost0,iface=$W/sock,queues=1" -- \
        -i --forward-mode="$1" --nb-cores=1 --txpkts="$PKT" --burst="$BURST" \
        <"$W/fifo" >"$W/tp.log" 2>&1 &
    TP_PID=$!
    exec 3>"$W/fifo"
    for _ in $(seq 100); do [ -S "$W/sock" ] && return 0; sleep 0.1; done
    echo "testpmd did not create its socket:" >&2; cat "$W/tp.log" >&2; exit 1
}

# Waits until testpmd's log shows the vhost device is up (all vrings ready).
wait_link() {
    for _ in $(seq 100); do
        grep -q "virtio is now ready for processing\|Port 0: link state change event\|LSC event" "$W/tp.log" 2>/dev/null && return 0
        sleep 0.05
    done
}

stop_testpmd() {
    echo "quit" >&3
    exec 3>&-
    wait "$TP_PID" || true
    TP_PID=
}

# Final forward-stats numbers from testpmd's log: "RX-packets" or "TX-packets".
tp_stat() {
    tr -d '\033' <"$W/tp.log" | sed -n '/Accumulated forward statistics/,$p' | grep -o "$1: *[0-9]*" | head -1 | grep -o '[0-9]*$'
}
tp_drop() {
    tr -d '\033' <"$W/tp.log" | sed -n '/Accumulated forward statistics/,$p' | grep -o "TX-dropped: *[0-9]*" | head -1 | grep -o '[0-9]*$'
}
fe_val() { # key file
    grep -o "$1=[0-9.]*" "$2" | head -1 | cut -d= -f2
}
verdict() { [ "$1" = "$2" ] && echo match || echo MISMATCH; }

for run in $(seq "$RUNS"); do
    # 1. our txonly -> testpmd rxonly (we stop first; testpmd counts all we sent).
    start_testpmd rxonly
    echo "start" >&3
    "$BIN" net --socket-path "$W/sock" --mode txonly --duration "$SECS" --pkt-size "$PKT" \
        --queue-size "$QS" --burst "$BURST" --cpu "$FE_CPU" $EXTRA >"$W/fe.out" 2>"$W/fe.err"
    sleep 0.3
    echo "stop" >&3
    sleep 0.3
    stop_testpmd
    ours=$(fe_val packets "$W/fe.out"); theirs=$(tp_stat RX-packets)
    echo "run $run txonly->rxonly: vhostd-user sent $ours ($(fe_val mpps "$W/fe.out") Mpps), testpmd received $theirs: $(verdict "$ours" "$theirs")"

    # 2. testpmd txonly -> our rxonly (testpmd stops first; we drain, then stop).
    start_testpmd txonly
    "$BIN" net --socket-path "$W/sock" --mode rxonly --queue-size "$QS" --burst "$BURST" \
        --cpu "$FE_CPU" $EXTRA >"$W/fe.out" 2>"$W/fe.err" &
    FE=$!
    wait_link
    echo "start" >&3
    sleep "$SECS"
    echo "stop" >&3
    sleep 0.3
    kill -INT "$FE"; wait "$FE" || true
    stop_testpmd
    ours=$(fe_val packets "$W/fe.out"); theirs=$(tp_stat TX-packets)
    echo "run $run txonly->rxonly: testpmd sent $theirs (dropped for want of RX buffers: $(tp_drop)), vhostd-user received $ours ($(fe_val mpps "$W/fe.out") Mpps): $(verdict "$ours" "$theirs")"

    # 3. testpmd $FWD forwarding <-> our echo, seeded by 4 bursts from testpmd.
    start_testpmd "$FWD"
    "$BIN" net --socket-path "$W/sock" --mode echo --queue-size "$QS" --burst "$BURST" \
        --cpu "$FE_CPU" $EXTRA >"$W/fe.out" 2>"$W/fe.err" &
    FE=$!
    wait_link
    echo "start tx_first 4" >&3
    sleep "$SECS"
    echo "stop" >&3
    sleep 0.3
    kill -INT "$FE"; wait "$FE" || true
    stop_testpmd
    rx=$(fe_val rx_packets "$W/fe.out"); tx=$(fe_val tx_packets "$W/fe.out")
    trx=$(tp_stat RX-packets); ttx=$(tp_stat TX-packets)
    echo "run $run $FWD<->echo: testpmd tx $ttx / vhostd-user rx $rx: $(verdict "$ttx" "$rx"); vhostd-user tx $tx / testpmd rx $trx: $(verdict "$tx" "$trx"); echo rate $(fe_val rx_mpps "$W/fe.out") Mpps each way"
done
