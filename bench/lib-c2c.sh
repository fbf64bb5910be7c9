# shellcheck shell=bash
# The cache-line round trip between the benchmark's two CPUs, measured
# around each run: the host moves these vCPUs, and for minutes at a time
# the round trip is ~6x longer (bench/tools/c2c.rs, plain rustc, no
# crates), which changes every rate. Sourced by bench/net-bench and
# bench/pool-bench, after ROOT, DPDK_W (lib-dpdk.sh), BE_CPU, FE_CPU,
# MAX_RT (ns; 0: off) and FAR_WAIT (s) are set.
# Without rustc the round trip reads "-", unless --max-round-trip needs it.
C2C="$ROOT/target/bench-tools/c2c"
if [ ! -x "$C2C" ] || [ "$ROOT/bench/tools/c2c.rs" -nt "$C2C" ]; then
    RUSTC=$(command -v rustc || echo "$HOME/.cargo/bin/rustc")
    mkdir -p "$(dirname "$C2C")"
    "$RUSTC" -O --edition 2021 -o "$C2C" "$ROOT/bench/tools/c2c.rs" 2>"$DPDK_W/c2c-build.err" || {
        echo "$(basename "$0"): cannot build bench/tools/c2c.rs with $RUSTC:" >&2; sed 's/^/    /' "$DPDK_W/c2c-build.err" >&2
        rm -f "$C2C"
    }
fi
c2c_ns() { { [ -x "$C2C" ] && "$C2C" "$BE_CPU" "$FE_CPU" 20000 2>/dev/null; } || echo "-"; }
if [ "$MAX_RT" -gt 0 ] && ! [[ $(c2c_ns) =~ ^[0-9]+$ ]]; then
    echo "--max-round-trip needs bench/tools/c2c.rs built and able to pin threads to CPUs $BE_CPU and $FE_CPU" >&2
    exit 1
fi
# far NS...: whether --max-round-trip is set and any NS exceeds it ("-", a
# failed measurement, does not count as far).
far() {
    [ "$MAX_RT" -gt 0 ] || return 1
    local v
    for v in "$@"; do [[ $v =~ ^[0-9]+$ ]] && [ "$v" -gt "$MAX_RT" ] && return 0; done
    return 1
}
# wait_near: before a run, up to FAR_WAIT seconds for the round trip to come back.
wait_near() {
    local waited=0 rt
    rt=$(c2c_ns)
    while far "$rt" && [ "$waited" -lt "$FAR_WAIT" ]; do
        sleep 5; waited=$((waited + 5)); rt=$(c2c_ns)
    done
    [ "$waited" = 0 ] || echo "(waited ${waited}s for the CPUs to come near: $rt ns) " >&2
    echo "$rt"
}
