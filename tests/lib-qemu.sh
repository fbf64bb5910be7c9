# Shared by the QEMU interop tests and scripts/demo (source it; not a test).
# Starts vhostd (or another vhost-user backend, start_backend) and boots the
# test guest against it under QEMU TCG (a virtio-net device: start_guest; a
# virtio-blk one: start_guest_blk), with bounded waits and cleanup of
# everything on exit (QEMU, the backend, the network namespace of
# make_netns and every process in it), also when the test is interrupted
# (SIGINT, SIGTERM, SIGHUP).

VHOSTD=${VHOSTD:-$PWD/target/release/vhostd}
QEMU=${QEMU:-qemu-system-x86_64}
GUEST_DIR=${GUEST_DIR:-$PWD/build/guest}

# vhost-user (default) or vfio-user: how start_vhostd serves and
# start_guest attaches the net device (vfio-user: QEMU's vfio-user-pci,
# vhostd being the whole PCI device; QEMU 10.1 or later, else the test
# prints SKIP and passes).
TRANSPORT=${TRANSPORT:-vhost-user}

WORK=$(mktemp -d /tmp/vhostd-qemu.XXXXXX)
VHOSTD_PID=
QEMU_PID=

NETNS=
NETNS_PIDS=
# More QEMUs a test starts (each a `timeout` leading its process group).
QEMU_PIDS_MORE=
PEER_NETNS=

qemu_cleanup() {
    # Best effort: a step that fails (a process already gone) must not end
    # the cleanup under the caller's `set -e` or ERR trap.
    set +e; trap - ERR
    # QEMU_PID is `timeout`, which leads its own process group (QEMU's too).
    local p
    for p in $QEMU_PID $QEMU_PIDS_MORE; do
        kill -9 -- "-$p" 2>/dev/null; kill -9 "$p" 2>/dev/null
    done
    [ -n "$VHOSTD_PID" ] && kill -9 "$VHOSTD_PID" 2>/dev/null
    # shellcheck disable=SC2086 # a list of pids
    [ -n "$NETNS_PIDS" ] && kill -9 $NETNS_PIDS 2>/dev/null
    wait 2>/dev/null
    local ns
    for ns in $NETNS $PEER_NETNS; do
        # Processes still in the namespace (e.g. a daemonised httpd) go first.
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
        ip netns del "$ns" 2>/dev/null
    done
    if [ -n "${KEEP_LOGS:-}" ]; then
        echo "logs kept in $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap qemu_cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

# fail MESSAGE: prints `FAIL $name: MESSAGE` with the ends of the guest's
# console, QEMU's and vhostd's logs, and exits 1 (cleanup runs on exit).
# shellcheck disable=SC2154 # name: set by the test that sources this
fail() {
    # Report everything, even when a log is missing or empty (set -e, pipefail).
    set +e; trap - ERR
    echo "FAIL $name: $*"
    echo "--- guest console"; tr -d '\r' 2>/dev/null < "$WORK/console.log" | grep -v '^\s*$' | tail -30
    echo "--- qemu"; tail -10 "$WORK/qemu.err" 2>/dev/null
    echo "--- vhostd"; tail -20 "$WORK/vhostd.err" 2>/dev/null; cat "$WORK/vhostd.out" 2>/dev/null
    exit 1
}

# wait_for SECONDS COMMAND...: polls a condition, bounded.
wait_for() {
    local deadline=$((SECONDS + $1)); shift
    until "$@"; do
        [ $SECONDS -ge $deadline ] && return 1
        sleep 0.05
    done
}

# make_netns: a fresh network namespace of this test ($NETNS), removed on exit
# with every process in it.
make_netns() {
    NETNS=vhd-$(basename "$WORK" | tr -cd 'a-zA-Z0-9')
    ip netns add "$NETNS" || return 1
    ip -n "$NETNS" link set lo up
}

# make_peer_netns: a second namespace ($PEER_NETNS), the far end of a
# test's wire, removed on exit like $NETNS.
make_peer_netns() {
    PEER_NETNS=$NETNS-peer
    ip netns add "$PEER_NETNS" || return 1
    ip -n "$PEER_NETNS" link set lo up
}

# in_ns COMMAND...: runs a command in $NETNS.
in_ns() { ip netns exec "$NETNS" "$@"; }

# start_vhostd ARGS...: vhostd net on $WORK/net.sock (in $NETNS if set);
# output in $WORK/vhostd.{out,err}.
start_vhostd() {
    local ns=()
    [ -n "$NETNS" ] && ns=(ip netns exec "$NETNS")
    "${ns[@]}" "$VHOSTD" net --transport "$TRANSPORT" --socket-path "$WORK/net.sock" "$@" \
        > "$WORK/vhostd.out" 2> "$WORK/vhostd.err" &
    VHOSTD_PID=$!
    wait_for 10 grep -qs "vhostd: listening" "$WORK/vhostd.err" || {
        echo "vhostd did not start:"; cat "$WORK/vhostd.err"; return 1; }
}

# socket_listening PATH: a Unix socket is listening at PATH (asks the
# kernel, without connecting to it).
socket_listening() {
    [ -S "$1" ] && ss -Hxl 2>/dev/null | awk -v p="$1" '$5 == p { f = 1 } END { exit !f }'
}

# start_backend SOCKET SECONDS COMMAND...: starts a vhost-user backend
# (any program: vhostd, qemu-storage-daemon) in the background as
# VHOSTD_PID, output in $WORK/vhostd.{out,err} (stopped by stop_vhostd and
# on exit like vhostd), and waits up to SECONDS for it to listen on SOCKET.
# Fails, showing its stderr, if it exits or does not listen in time.
start_backend() {
    local sock=$1 secs=$2; shift 2
    "$@" > "$WORK/vhostd.out" 2> "$WORK/vhostd.err" &
    VHOSTD_PID=$!
    # shellcheck disable=SC2317 # called through wait_for
    backend_up() { socket_listening "$sock" || ! kill -0 "$VHOSTD_PID" 2>/dev/null; }
    if ! wait_for "$secs" backend_up || ! kill -0 "$VHOSTD_PID" 2>/dev/null; then
        echo "$1 did not start (no listener on $sock):"; cat "$WORK/vhostd.err"; return 1
    fi
}

# stop_vhostd: SIGTERM, bounded wait; its counters are then in $WORK/vhostd.out.
stop_vhostd() {
    kill -TERM "$VHOSTD_PID"
    local i
    for i in $(seq 100); do kill -0 "$VHOSTD_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$VHOSTD_PID" 2>/dev/null; then
        echo "vhostd still running 10 s after SIGTERM" >&2
        kill -9 "$VHOSTD_PID"
        wait "$VHOSTD_PID" 2>/dev/null
        VHOSTD_PID=
        return 1
    fi
    wait "$VHOSTD_PID"
    local rc=$?
    VHOSTD_PID=
    return $rc
}

# vhostd_queue INDEX KEY: a value from vhostd's final `stats queue=INDEX` line.
vhostd_queue() {
    sed -n "s/^stats queue=$1 .*\b$2=\([0-9.]*\).*/\1/p" "$WORK/vhostd.out"
}

# vhostd_total KEY: a value from vhostd's final `stats total` line.
vhostd_total() {
    sed -n "s/^stats total .*\b$1=\([0-9.]*\).*/\1/p" "$WORK/vhostd.out"
}

# start_qemu SCENARIO TIMEOUT DEVICE_ARGS...: boots the test guest in the
# background (QEMU_PID) with the given device arguments (-chardev, -netdev,
# -device...), console in $WORK/console.log. GUEST_SMP (default 1) CPUs;
# GUEST_ARGS is appended to the kernel command line. With QEMU_NETNS set,
# QEMU runs in that network namespace (its own -netdev then sees the
# namespace's interfaces); QEMU_CONSOLE names another console file, and
# QEMU_ERR another stderr file. With QEMU_REBOOT=1 a guest's reboot
# resets the machine (otherwise QEMU exits on it).
start_qemu() {
    local scenario=$1 timeout=$2; shift 2
    local ns=() console=${QEMU_CONSOLE:-$WORK/console.log} reboot=-no-reboot
    [ "${QEMU_REBOOT:-0}" = 1 ] && reboot=
    [ -n "${QEMU_NETNS:-}" ] && ns=(ip netns exec "$QEMU_NETNS")
    : > "$console"
    timeout "$timeout" "${ns[@]}" "$QEMU" -name vhostd-test,debug-threads=on -accel tcg -m 256M -smp "${GUEST_SMP:-1}" \
        -object memory-backend-memfd,id=mem0,size=256M,share=on -numa node,memdev=mem0 \
        "$@" \
        -kernel "$GUEST_DIR/vmlinuz" -initrd "$GUEST_DIR/initramfs.cpio.gz" \
        -append "console=ttyS0 panic=-1 quiet vhostd.test=$scenario ${GUEST_ARGS:-}" \
        -display none -serial "file:$console" ${reboot:+"$reboot"} -monitor none \
        2> "${QEMU_ERR:-$WORK/qemu.err}" &
    QEMU_PID=$!
}

# qemu_at_least MAJOR MINOR: $QEMU is version MAJOR.MINOR or later.
qemu_at_least() {
    local v
    v=$("$QEMU" -version | sed -n '1s/.*version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
    # shellcheck disable=SC2086 # major and minor
    set -- $v "$@"
    [ $(( ${1:-0} * 1000 + ${2:-0} )) -ge $(( $3 * 1000 + $4 )) ]
}

# qemu_vectors: ",vectors=0" for a QEMU older than 11: under TCG, QEMU 7.2
# segfaults in msix_set_vector_notifiers when a vhost-user device with
# MSI-X starts. QEMU 11.1 does not, so its guests use MSI-X (a vector per
# queue), as guests on KVM do.
qemu_vectors() {
    qemu_at_least 11 0 || echo ",vectors=0"
}

# qemu_reconnect: the -chardev socket option that makes $QEMU reconnect to a
# backend that went away, after a second: `reconnect=1` up to QEMU 9.1
# (removed in 10.0), `reconnect-ms=1000` from 9.2.
qemu_reconnect() {
    if qemu_at_least 9 2; then echo reconnect-ms=1000; else echo reconnect=1; fi
}

# start_guest SCENARIO TIMEOUT [NETDEV_EXTRA] [DEVICE_EXTRA]: boots the guest
# (start_qemu) with a virtio-net-pci device on vhostd's $WORK/net.sock
# (TRANSPORT=vfio-user: a vfio-user-pci device there; the extras, options
# of QEMU's virtio-net, do not apply: the device is vhostd's).
start_guest() {
    local scenario=$1 timeout=$2 netdev_extra=${3:-} device_extra=${4:-}
    if [ "$TRANSPORT" = vfio-user ]; then
        start_qemu "$scenario" "$timeout" -nic none \
            -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$WORK/net.sock\"}}"
        return
    fi
    start_qemu "$scenario" "$timeout" \
        -chardev socket,id=c0,path="$WORK/net.sock" \
        -netdev "vhost-user,id=n0,chardev=c0$netdev_extra" \
        -device "virtio-net-pci,netdev=n0,romfile=$(qemu_vectors)$device_extra"
}

# start_guest_blk SCENARIO TIMEOUT SOCKET QUEUES [DEVICE_EXTRA]: boots the
# guest (start_qemu) with a vhost-user-blk-pci device of QUEUES request
# queues on SOCKET (the backend must be listening: QEMU reads the disk's
# config from it at start-up) and no network device (TRANSPORT=vfio-user:
# a vfio-user-pci device on SOCKET).
start_guest_blk() {
    local scenario=$1 timeout=$2 sock=$3 queues=$4 device_extra=${5:-}
    if [ "$TRANSPORT" = vfio-user ]; then
        # The queues are the backend's (vhostd --queues); QEMU's options do not apply.
        start_qemu "$scenario" "$timeout" -nic none \
            -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$sock\"}}"
        return
    fi
    start_qemu "$scenario" "$timeout" -nic none \
        -chardev socket,id=c0,path="$sock" \
        -device "vhost-user-blk-pci,chardev=c0,num-queues=$queues$(qemu_vectors)$device_extra"
}

# wait_guest [SECONDS]: waits for the guest started by start_guest to power
# off (or for start_guest's timeout); returns QEMU's status, or 124 when
# SECONDS are given and pass first (QEMU is then still running).
wait_guest() {
    if [ -n "${1:-}" ]; then
        qemu_gone() { ! kill -0 "$QEMU_PID" 2>/dev/null; }
        wait_for "$1" qemu_gone || return 124
    fi
    wait "$QEMU_PID"
    local rc=$?
    QEMU_PID=
    return $rc
}

# boot_guest SCENARIO TIMEOUT [NETDEV_EXTRA] [DEVICE_EXTRA]: boots the guest
# and returns when it powers off (or times out).
boot_guest() {
    start_guest "$@"
    wait_guest
}

# wait_console SECONDS PATTERN: waits until the console shows PATTERN (an
# extended regex) or the guest stops; false if it did not show.
wait_console() {
    local deadline=$((SECONDS + $1))
    until tr -d '\r' < "$WORK/console.log" | grep -qE "$2"; do
        if [ $SECONDS -ge $deadline ] || ! kill -0 "$QEMU_PID" 2>/dev/null; then
            tr -d '\r' < "$WORK/console.log" | grep -qE "$2"
            return
        fi
        sleep 0.1
    done
}

# guest_value KEY: a `VHOSTD-TEST: KEY=value` value from the console.
guest_value() {
    tr -d '\r' < "$WORK/console.log" | sed -n "s/.*VHOSTD-TEST: .*\b$1=\([^ ]*\).*/\1/p" | tail -1
}

# tell_guest NETNS: sends `done` to the guest's port 7777 (10.99.1.2) from
# NETNS. The guest prints what the host waits for and only then starts
# listening, so a refused connection is retried (30 s at most) until one
# goes through or a console ($WORK/console*.log) says the guest heard it.
tell_guest() {
    local ns=$1 deadline=$((SECONDS + 30))
    until echo done | timeout 10 ip netns exec "$ns" "$BUSYBOX" nc 10.99.1.2 7777 >/dev/null 2>&1; do
        grep -qs "VHOSTD-TEST: host_said=" "$WORK"/console*.log && return 0
        [ $SECONDS -lt $deadline ] || return 1
        sleep 0.2
    done
}

if [ "$TRANSPORT" = vfio-user ] && ! qemu_at_least 10 1; then
    echo "SKIP ${TEST_NAME:-$0}: $("$QEMU" -version | head -1) has no vfio-user-pci (10.1 or later)"
    exit 0
fi
