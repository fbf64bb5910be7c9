# shellcheck shell=bash
# Shared by the tests/qemu-blk-* tests (source it after lib-qemu.sh; not a
# test). A virtio-blk backend on an image file in $WORK, the guest's `blk`
# scenario (guest/init) driven through `vhostd.blk=` on its kernel command
# line, and checks of what the guest reported against the image.
#
# Env: TRANSPORT (tests/lib-qemu.sh; vfio-user needs BLK_BACKEND=vhostd),
# BLK_BACKEND=vhostd (default: `$VHOSTD blk`) or qsd
# (qemu-storage-daemon's vhost-user-blk export, the peer the tests are
# checked against); BLK_DIRECT=on (the backend opens the image with
# O_DIRECT); VHOSTD_ARGS (extra `vhostd blk` arguments); QSD (the
# qemu-storage-daemon binary).

BLK_BACKEND=${BLK_BACKEND:-vhostd}
BLK_DIRECT=${BLK_DIRECT:-off}
QSD=${QSD:-qemu-storage-daemon}
BLK_SOCK=$WORK/blk.sock
# The image, and what it must hold when the guest is done (reference).
IMG=$WORK/disk.img
REF=$WORK/ref.img

num() { [[ "$1" =~ ^[0-9]+$ ]]; }

# blk_prereqs: the backend, QEMU and the guest image are there.
blk_prereqs() {
    [ "$TRANSPORT" = vhost-user ] || [ "$BLK_BACKEND" = vhostd ] ||
        fail "TRANSPORT=$TRANSPORT needs BLK_BACKEND=vhostd (qemu-storage-daemon exports vhost-user)"
    case "$BLK_BACKEND" in
    vhostd) [ -x "$VHOSTD" ] || fail "no vhostd binary at $VHOSTD (cargo build --release)" ;;
    qsd) command -v "$QSD" >/dev/null || fail "no $QSD (Debian qemu-system-common)" ;;
    *) fail "BLK_BACKEND is '$BLK_BACKEND', not vhostd or qsd" ;;
    esac
    command -v "$QEMU" >/dev/null || fail "no $QEMU (scripts/setup)"
    scripts/build-guest >/dev/null || fail "cannot build the guest (scripts/build-guest)"
}

# start_blk QUEUES [readonly] [discard]: the backend serving $IMG on
# $BLK_SOCK with QUEUES request queues, read-only and/or passing discards
# on (punching holes in $IMG).
start_blk() {
    local queues=$1 ro="" discard="" w
    shift
    for w in "$@"; do
        case "$w" in
        readonly) ro=1 ;;
        discard) discard=1 ;;
        *) fail "start_blk: unknown option $w" ;;
        esac
    done
    if [ "$BLK_BACKEND" = qsd ]; then
        local bd="driver=file,node-name=f,filename=$IMG" ex="type=vhost-user-blk,id=e,node-name=f"
        [ -n "$ro" ] && bd="$bd,read-only=on"
        [ -n "$discard" ] && bd="$bd,discard=unmap"
        [ "$BLK_DIRECT" = on ] && bd="$bd,cache.direct=on"
        ex="$ex,addr.type=unix,addr.path=$BLK_SOCK,writable=$([ -n "$ro" ] && echo off || echo on),num-queues=$queues"
        start_backend "$BLK_SOCK" 20 "$QSD" --blockdev "$bd" --export "$ex"
    else
        local be="file,path=$IMG"
        [ -n "$ro" ] && be="$be,readonly=on"
        [ -n "$discard" ] && be="$be,discard=on"
        [ "$BLK_DIRECT" = on ] && be="$be,direct=on"
        # shellcheck disable=SC2086 # VHOSTD_ARGS is a list of words
        start_backend "$BLK_SOCK" 20 "$VHOSTD" blk --transport "$TRANSPORT" --socket-path "$BLK_SOCK" \
            --backend "$be" --queues "$queues" ${VHOSTD_ARGS:-}
    fi
}

# img_fill FILE OFF LEN: LEN random bytes at byte offset OFF of FILE.
img_fill() {
    head -c "$3" /dev/urandom |
        dd of="$1" bs=64K seek="$2" oflag=seek_bytes conv=notrunc iflag=fullblock status=none
}

# img_zero FILE OFF LEN: LEN zero bytes at OFF (written, not a hole).
img_zero() {
    head -c "$3" /dev/zero |
        dd of="$1" bs=64K seek="$2" oflag=seek_bytes conv=notrunc iflag=fullblock status=none
}

# img_copy FROM TO OFF LEN: FROM's bytes OFF..OFF+LEN into TO at OFF.
img_copy() {
    dd if="$1" of="$2" bs=64K skip="$3" seek="$3" count="$4" \
        iflag=skip_bytes,count_bytes oflag=seek_bytes conv=notrunc status=none
}

# img_sha FILE OFF LEN: the SHA-256 of LEN bytes at OFF.
img_sha() {
    dd if="$1" bs=64K skip="$2" count="$3" iflag=skip_bytes,count_bytes status=none |
        sha256sum | cut -d' ' -f1
}

# zero_sha LEN: the SHA-256 of LEN zero bytes.
zero_sha() { head -c "$1" /dev/zero | sha256sum | cut -d' ' -f1; }

# run_blk_guest OPS [SECONDS]: boots the guest on the backend's socket with
# the `blk` scenario doing OPS (see blk_op in guest/init) and waits for it
# to power off; then checks it found a virtio_blk disk and finished.
# GUEST_QUEUES (default 1) request queues.
run_blk_guest() {
    GUEST_ARGS="vhostd.blk=$1 ${GUEST_ARGS:-}"
    start_guest_blk blk "${2:-240}" "$BLK_SOCK" "${GUEST_QUEUES:-1}"
    # Booted (about 5 s unloaded) and found its disk: a backend that never
    # answers QEMU or the driver's set-up fails here, not at QEMU's timeout.
    if ! wait_console 120 "VHOSTD-TEST: (disk=|error)"; then
        grep -q "VHOSTD-TEST: init" "$WORK/console.log" ||
            fail "the guest's Linux did not start in 120 s (the firmware, SeaBIOS, reads the disk's first sector through the backend before Linux boots)"
        fail "the guest did not find its disk in 120 s (virtio_blk's probe reads the partition table)"
    fi
    wait_guest || fail "QEMU failed or timed out (rc $?)"
    grep -q "VHOSTD-TEST: done" "$WORK/console.log" || fail "the guest did not finish its scenario"
    [ -z "$(guest_value error)" ] || fail "guest: $(guest_value error)"
    [ "$(guest_value driver)" = virtio_blk ] || fail "the disk's driver is '$(guest_value driver)', not virtio_blk"
}

# op N KEY: what the guest reported for its Nth operation (opN_KEY).
op() { guest_value "op${1}_$2"; }

# feature BIT: the guest negotiated virtio feature bit BIT.
feature() { local f; f=$(guest_value features); [ "${f:$1:1}" = 1 ]; }

# check_size BYTES: the guest's disk has BYTES (in 512-byte sectors).
check_size() {
    local s; s=$(guest_value size)
    [ "$s" = $(($1 / 512)) ] || fail "the guest's disk has '$s' sectors, want $(($1 / 512)) ($1 bytes)"
}

# check_read N OFF LEN: the guest's operation N read LEN bytes at OFF, and
# they are the image's.
check_read() {
    local want
    [ "$(op "$1" rc)" = 0 ] || fail "op $1 (read of $3 bytes at $2) failed in the guest (rc '$(op "$1" rc)')"
    [ "$(op "$1" bytes)" = "$3" ] || fail "op $1 read $(op "$1" bytes) bytes at $2, want $3"
    want=$(img_sha "$IMG" "$2" "$3")
    [ "$(op "$1" sha)" = "$want" ] ||
        fail "op $1: the guest read $3 bytes at $2 with sha256 $(op "$1" sha), the image holds $want"
}

# check_write N OFF LEN: the guest's operation N wrote LEN bytes at OFF and
# read them back (O_DIRECT) unchanged; the image holds them there. They are
# copied into $REF, which then holds everything the image must.
check_write() {
    local sha
    [ "$(op "$1" rc)" = 0 ] || fail "op $1 (write of $3 bytes at $2) failed in the guest (rc '$(op "$1" rc)')"
    sha=$(op "$1" sha)
    [ -n "$sha" ] || fail "op $1: no sha256 from the guest"
    [ "$(op "$1" back)" = "$sha" ] ||
        fail "op $1: the guest wrote $3 bytes at $2 (sha256 $sha) but read back $(op "$1" back)"
    [ "$(img_sha "$IMG" "$2" "$3")" = "$sha" ] ||
        fail "op $1: the guest wrote $3 bytes at $2 (sha256 $sha), the image holds $(img_sha "$IMG" "$2" "$3") there"
    img_copy "$IMG" "$REF" "$2" "$3"
}

# backend_summary: for the PASS line, vhostd's final `stats total` line
# (printed on SIGTERM; after stop_vhostd), as "; vhostd: ..."; nothing for qsd.
backend_summary() {
    local t
    [ "$BLK_BACKEND" = vhostd ] || return 0
    t=$(sed -n 's/^stats total //p' "$WORK/vhostd.out" 2>/dev/null | tail -1)
    [ -z "$t" ] || echo "; vhostd: $t"
}

# check_unchanged: the image is $REF byte for byte (nothing was written
# where the guest did not write).
check_unchanged() {
    local d
    d=$(cmp "$IMG" "$REF" 2>&1) || fail "the image differs from what it must hold: $d"
}
