#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/<target>/: small, well-formed
inputs in each target's input format (described at the top of each
fuzz_targets/*.rs), from which libFuzzer mutates. Rerun after changing a
target's input format:  python3 fuzz/make-seeds.py
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

NEXT, WRITE, INDIRECT = 1, 2, 4
P_AVAIL, P_USED = 1 << 7, 1 << 15
VERSION_1 = 1 << 32
PROTOCOL_FEATURES = 1 << 30
EVENT_IDX = 1 << 29
INDIRECT_DESC = 1 << 28
RING_PACKED = 1 << 34
UADDR = 0x7F00_0000_0000


def u16(v): return struct.pack('<H', v & 0xFFFF)
def u32(v): return struct.pack('<I', v & 0xFFFFFFFF)
def u64(v): return struct.pack('<Q', v & 0xFFFFFFFFFFFFFFFF)


def align(v, a): return (v + a - 1) & ~(a - 1)


class Image:
    """Guest memory image from gpa 0 (sparse writes, zero elsewhere)."""

    def __init__(self):
        self.b = bytearray()

    def put(self, at, data):
        if len(self.b) < at + len(data):
            self.b.extend(b'\0' * (at + len(data) - len(self.b)))
        self.b[at:at + len(data)] = data

    def bytes(self):
        return bytes(self.b)


def split_desc(img, table, i, addr, ln, flags, nxt=0):
    img.put(table + 16 * i, u64(addr) + u32(ln) + u16(flags) + u16(nxt))


def packed_desc(img, ring, i, addr, ln, id_, flags, wrap=True):
    bits = P_AVAIL if wrap else P_USED
    img.put(ring + 16 * i, u64(addr) + u32(ln) + u16(id_) + u16(flags | bits))


def split_layout(base, size):
    desc = align(base, 16)
    avail = desc + 16 * size
    used = align(avail + 6 + 2 * size, 4)
    return desc, avail, used, used + 6 + 8 * size


def packed_layout(base, size):
    desc = align(base, 16)
    return desc, desc + 16 * size, desc + 16 * size + 4, desc + 16 * size + 8


def split_avail(img, avail, heads, flags=0, used_event=None, size=None):
    img.put(avail, u16(flags) + u16(len(heads)) + b''.join(u16(h) for h in heads))
    if used_event is not None:
        img.put(avail + 4 + 2 * size, u16(used_event))


def write(target, name, data):
    d = os.path.join(HERE, 'corpus', target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), 'wb') as f:
        f.write(data)


# ---------------------------------------------------------------- split_chain
# size byte (1 << b % 9), flags, next_avail, nops, ops, image.
# ops: 0 pop (a = access 0 RO, 1 WO, 2 RW; then max-1), 1 complete oldest
# (then count|mode<<6), 3 read-only completion, 4 unpop, 5 avail.idx += a,
# 8 enable, 9 disable, 10 needs_notify, 11 flush (a even) / publish (odd),
# 13 repop (then head u16), 14 remap to table a.
def op(code, a=0): return bytes([code | (a << 4)])


def split_seeds():
    POP = lambda access, mx: op(0, access) + bytes([mx - 1])
    DONE = op(1) + b'\0'
    PUB = op(11, 1)

    # A well-formed read-then-write chain: 16-byte header, 512 bytes, status.
    size = 4
    img = Image()
    desc, avail, used, end = split_layout(0, size)
    split_desc(img, desc, 0, 0x400, 16, NEXT, 1)
    split_desc(img, desc, 1, 0x800, 512, NEXT | WRITE, 2)
    split_desc(img, desc, 2, 0xA00, 1, WRITE)
    split_avail(img, avail, [0])
    ops = POP(2, 4) + DONE + PUB + op(10)
    write('split_chain', 'chain-rw', bytes([2, 0]) + u16(0) + bytes([len(ops)]) + ops + img.bytes())

    # An indirect chain (INDIRECT_DESC): three entries in a table at 0x600.
    img = Image()
    split_desc(img, desc, 0, 0x600, 48, INDIRECT)
    split_desc(img, 0x600, 0, 0x400, 16, NEXT, 1)
    split_desc(img, 0x600, 1, 0x800, 512, NEXT | WRITE, 2)
    split_desc(img, 0x600, 2, 0xA00, 1, WRITE)
    split_avail(img, avail, [0])
    write('split_chain', 'chain-indirect', bytes([2, 1]) + u16(0) + bytes([len(ops)]) + ops + img.bytes())

    # EVENT_IDX + IN_ORDER: four one-descriptor TX chains, one batch, one
    # used element for all, notification decisions.
    img = Image()
    for i in range(4):
        split_desc(img, desc, i, 0x1000 + 0x100 * i, 64, 0)
    split_avail(img, avail, [0, 1, 2, 3], used_event=2, size=size)
    ops = op(9) + POP(0, 4) + op(3) + PUB + op(10) + op(8) + op(12, 1)
    write('split_chain', 'batch-event-idx-in-order', bytes([2, 2 | 4]) + u16(0) + bytes([len(ops)]) + ops + img.bytes())

    # Buffers crossing from R0 into R1 (memory table 1: adjacent regions),
    # avail index wrapping from 0xfffe.
    img = Image()
    split_desc(img, desc, 0, 0x7F00, 0x200, 0)
    split_desc(img, desc, 1, 0x7FF0, 0x20, WRITE)
    img.put(avail, u16(0) + u16(0x0000) + u16(1) + u16(0) + u16(0) + u16(0))
    # next_avail 0xfffe, avail.idx 0 -> two chains: slots 2 and 3.
    img.put(avail + 4 + 2 * 2, u16(0) + u16(1))
    ops = POP(2, 2) + DONE + PUB + op(14, 2) + POP(2, 4)
    write('split_chain', 'cross-region-wrap', bytes([2, 1 << 3]) + u16(0xFFFE) + bytes([len(ops)]) + ops + img.bytes())

    # Hostile: a loop, a head past the queue, a bad address; unpop, repop.
    img = Image()
    split_desc(img, desc, 0, 0x400, 16, NEXT, 1)
    split_desc(img, desc, 1, 0x400, 16, NEXT, 0)
    split_desc(img, desc, 2, 0xFFFF_0000, 16, 0)
    split_desc(img, desc, 3, 0x500, 32, 0)
    split_avail(img, avail, [3, 0, 2, 3, 9])
    ops = POP(0, 8) + op(4, 1) + DONE + POP(0, 8) + DONE + op(13, 0) + u16(3) + DONE + PUB
    write('split_chain', 'hostile', bytes([2, 0]) + u16(0) + bytes([len(ops)]) + ops + img.bytes())


# ---------------------------------------------------------------- packed_chain
# size byte (1 + b), flags, base u32, nops, ops, image.
# ops: 0 pop, 1 complete oldest (a: count-1 | len mode << 3), 2 complete by id
# (then index), 3 read-only, 4 unpop, 5 make available (slot, addr u16, len
# u16, id, flags; a&1 = lap), 6 poke, 7 driver area u32, 8 enable, 9 disable,
# 10 needs_notify, 11 flush/publish, 14 complete all + publish.
def packed_seeds():
    POP = lambda access, mx: op(0, access) + bytes([mx - 1])
    size = 4
    desc, driver, device, end = packed_layout(0, size)
    base = struct.pack('<I', 0x8000_8000)

    # A well-formed three-descriptor chain and a one-descriptor chain.
    img = Image()
    packed_desc(img, desc, 0, 0x400, 16, 0, NEXT)
    packed_desc(img, desc, 1, 0x800, 512, 0, NEXT | WRITE)
    packed_desc(img, desc, 2, 0xA00, 1, 7, WRITE)
    packed_desc(img, desc, 3, 0xB00, 64, 8, WRITE)
    ops = POP(2, 4) + op(1, 1) + op(11, 1) + op(10)
    write('packed_chain', 'chain-rw', bytes([size - 1, 0]) + base + bytes([len(ops)]) + ops + img.bytes())

    # Indirect chain.
    img = Image()
    packed_desc(img, desc, 0, 0x600, 48, 5, INDIRECT)
    split_desc(img, 0x600, 0, 0x400, 16, 0)
    split_desc(img, 0x600, 1, 0x800, 512, WRITE)
    split_desc(img, 0x600, 2, 0xA00, 1, WRITE)
    ops = POP(2, 4) + op(14)
    write('packed_chain', 'chain-indirect', bytes([size - 1, 1]) + base + bytes([len(ops)]) + ops + img.bytes())

    # Four single descriptors (batch of four), completed out of order by id,
    # then the driver makes slots available in the next lap (wrap counter 0).
    img = Image()
    for i in range(4):
        packed_desc(img, desc, i, 0x1000 + 0x100 * i, 128, 10 + i, WRITE)
    # driver area: EVENT_IDX descriptor event at slot 2, wrap 1
    img.put(driver, u16(2 | 0x8000) + u16(2))
    ops = (POP(1, 4) + op(2, 0) + bytes([2]) + op(2, 0) + bytes([0]) + op(11, 1) + op(10)
           + op(1, 1) + op(11, 1) + op(10)
           + op(5, 0) + bytes([0]) + u16(0x2000) + u16(64) + bytes([20, WRITE])
           + op(5, 0) + bytes([1]) + u16(0x2100) + u16(64) + bytes([21, WRITE])
           + POP(1, 4) + op(14) + op(8) + op(9))
    write('packed_chain', 'out-of-order-wrap', bytes([size - 1, 2]) + base + bytes([len(ops)]) + ops + img.bytes())

    # IN_ORDER read-only batch and unpop.
    img = Image()
    for i in range(4):
        packed_desc(img, desc, i, 0x1000 + 0x100 * i, 60, i, 0)
    ops = POP(0, 2) + op(4, 1) + POP(0, 4) + op(3) + op(11, 1)
    write('packed_chain', 'in-order-read-only', bytes([size - 1, 4]) + base + bytes([len(ops)]) + ops + img.bytes())

    # Hostile: a chain whose second descriptor is not available (breaks the ring).
    img = Image()
    packed_desc(img, desc, 0, 0x400, 16, 0, NEXT)
    img.put(desc + 16, u64(0x500) + u32(16) + u16(0) + u16(0))
    ops = POP(2, 4) + op(14)
    write('packed_chain', 'hostile-cut-chain', bytes([size - 1, 0]) + base + bytes([len(ops)]) + ops + img.bytes())


# ---------------------------------------------------------------- net_tx_header
# tx byte (bit 7 packed; split 1 << b % 6), rx byte, features, table, nops,
# ops, image. ops: 0 tx, 1 rx, 2 ctrl, 3 poke, 4 post (a%3 ring), 5 notify,
# 6 header, 7 available.
MRG, V1, CSUM, GCSUM, INORDER, INDIR, EVIDX, SINK = 1, 2, 4, 8, 16, 32, 64, 128


def net_hdr(flags=0, gso_type=0, hdr_len=0, gso_size=0, csum_start=0, csum_offset=0, num_buffers=0):
    return bytes([flags, gso_type]) + u16(hdr_len) + u16(gso_size) + u16(csum_start) + u16(csum_offset) + u16(num_buffers)


def eth_frame(n=60):
    f = bytes([2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x00])
    return f + bytes((i * 7) & 0xFF for i in range(n - len(f)))


def net_seeds():
    # TX ring at 0, RX ring after it, a control ring of 4 after that.
    def rings(packed, tsz, rsz):
        if packed:
            t = packed_layout(0, tsz)
            r = packed_layout(align(t[3], 64), rsz)
            c = packed_layout(align(r[3], 64), 4)
        else:
            t = split_layout(0, tsz)
            r = split_layout(align(t[3], 64), rsz)
            c = split_layout(align(r[3], 64), 4)
        return t, r, c

    # Split, VERSION_1, loopback: one TX frame (one buffer), one RX buffer.
    t, r, c = rings(False, 4, 4)
    img = Image()
    frame = net_hdr() + eth_frame(60)
    img.put(0x2000, frame)
    split_desc(img, t[0], 0, 0x2000, len(frame), 0)
    split_avail(img, t[1], [0])
    split_desc(img, r[0], 0, 0x3000, 1526, WRITE)
    split_avail(img, r[1], [0])
    ops = op(0) + op(1) + op(5, 0) + op(5, 1)
    write('net_tx_header', 'tx-rx-loopback', bytes([2, 2, V1, 0, len(ops)]) + ops + img.bytes())

    # Mergeable RX with offloads: a GSO TCPv4 header (NEEDS_CSUM, TSO4) split
    # over two TX descriptors; RX buffers of 64 bytes, so the frame spans several.
    img = Image()
    hdr = net_hdr(1, 1, 54, 1448, 34, 16)
    img.put(0x2000, hdr)
    img.put(0x2100, eth_frame(200))
    split_desc(img, t[0], 0, 0x2000, 12, NEXT, 1)
    split_desc(img, t[0], 1, 0x2100, 200, 0)
    split_avail(img, t[1], [0])
    for i in range(4):
        split_desc(img, r[0], i, 0x3000 + 0x100 * i, 64, WRITE)
    split_avail(img, r[1], [0, 1, 2, 3])
    ops = op(0) + op(1) + op(7)
    write('net_tx_header', 'gso-mergeable', bytes([2, 2, MRG | V1 | CSUM | GCSUM, 0, len(ops)]) + ops + img.bytes())

    # Short header, legacy 10-byte header, a zero-length descriptor, sink.
    img = Image()
    split_desc(img, t[0], 0, 0x2000, 6, 0)
    split_desc(img, t[0], 1, 0x2000, 0, NEXT, 2)
    split_desc(img, t[0], 2, 0x2100, 70, 0)
    split_avail(img, t[1], [0, 1])
    ops = op(0) + op(4, 0) + bytes([2]) + op(0)
    write('net_tx_header', 'short-header-sink', bytes([2, 2, SINK, 0, len(ops)]) + ops + img.bytes())

    # The control queue: MQ_VQ_PAIRS_SET 1, MAC_ADDR_SET, GUEST_OFFLOADS_SET.
    img = Image()
    cmds = [bytes([4, 0]) + u16(1), bytes([1, 1]) + bytes([2, 0, 0, 0, 0, 9]), bytes([5, 0]) + u64(2)]
    for i, cmd in enumerate(cmds):
        img.put(0x2000 + 0x40 * i, cmd)
    # A ring of 4 descriptors: 0-1 carry MQ_VQ_PAIRS_SET, 2-3 MAC_ADDR_SET
    # (each a command and a one-byte ack).
    split_desc(img, c[0], 0, 0x2000, 4, NEXT, 1)
    split_desc(img, c[0], 1, 0x2800, 1, WRITE)
    split_desc(img, c[0], 2, 0x2040, 8, NEXT, 3)
    split_desc(img, c[0], 3, 0x2801, 1, WRITE)
    split_avail(img, c[1], [0, 2])
    ops = op(2)
    write('net_tx_header', 'ctrl', bytes([2, 2, V1 | GCSUM, 0, len(ops)]) + ops + img.bytes())

    # Packed rings, IN_ORDER, four TX frames in a row (batch of four).
    t, r, c = rings(True, 4, 4)
    img = Image()
    for i in range(4):
        img.put(0x2000 + 0x100 * i, net_hdr() + eth_frame(64))
        packed_desc(img, t[0], i, 0x2000 + 0x100 * i, 76, i, 0)
        packed_desc(img, r[0], i, 0x3000 + 0x100 * i, 128, i, WRITE)
    ops = op(0) + op(1) + op(5, 0)
    write('net_tx_header', 'packed-in-order', bytes([0x80 | 3, 0x80 | 3, V1 | INORDER | EVIDX, 0, len(ops)]) + ops + img.bytes())


# ---------------------------------------------------------------- blk_request
# ring byte (bit 7 packed; split 1 << b % 8), disk byte, qdepth-1,
# bdepth-1, capacity u64, inflight byte (+ u16 len + bytes), nops, ops, image.
# ops: 0 process, 1 poke, 2 post, 3 config, 4 header, 5 range, 6 notify, 7 drain.
T_IN, T_OUT, T_FLUSH, T_GET_ID, T_DISCARD, T_WZ = 0, 1, 4, 8, 11, 13


def blk_hdr(t, sector=0):
    return u32(t) + u32(0) + u64(sector)


def blk_seeds():
    size = 8
    desc, avail, used, end = split_layout(0, size)
    cap = u64(2048)  # sectors -> 1 MiB

    def req(img, table, first, hdr_at, t, sector, data, status_at, data_write):
        img.put(hdr_at, blk_hdr(t, sector))
        n = first
        split_desc(img, table, n, hdr_at, 16, NEXT, n + 1); n += 1
        for (a, ln) in data:
            split_desc(img, table, n, a, ln, NEXT | (WRITE if data_write else 0), n + 1); n += 1
        split_desc(img, table, n, status_at, 1, WRITE); n += 1
        return n

    # Read, write, flush, get_id, each its own chain.
    img = Image()
    n = req(img, desc, 0, 0x1000, T_IN, 0, [(0x2000, 512)], 0x1F00, True)
    n2 = req(img, desc, n, 0x1010, T_OUT, 8, [(0x2200, 1024)], 0x1F01, False)
    n3 = req(img, desc, n2, 0x1020, T_FLUSH, 0, [], 0x1F02, False)
    n4 = req(img, desc, n3, 0x1030, T_GET_ID, 0, [(0x2600, 20)], 0x1F03, True)
    split_avail(img, avail, [0, n, n2, n3])
    ops = op(0) + op(0) + op(7)
    write('blk_request', 'rw-flush-getid', bytes([3, 0, 255, 255]) + cap + b'\0' + bytes([len(ops)]) + ops + img.bytes())

    # Discard and write-zeroes (one range each), write-through cache mode.
    img = Image()
    img.put(0x1100, u64(16) + u32(8) + u32(0))
    img.put(0x1110, u64(32) + u32(8) + u32(1))
    n = req(img, desc, 0, 0x1000, T_DISCARD, 0, [(0x1100, 16)], 0x1F00, False)
    n2 = req(img, desc, n, 0x1010, T_WZ, 0, [(0x1110, 16)], 0x1F01, False)
    n3 = req(img, desc, n2, 0x1020, T_OUT, 4, [(0x2000, 512)], 0x1F02, False)
    split_avail(img, avail, [0, n, n2])
    ops = op(3, 0) + op(0) + op(0) + op(7)
    write('blk_request', 'discard-write-zeroes', bytes([3, 0, 255, 255]) + cap + b'\0' + bytes([len(ops)]) + ops + img.bytes())

    # Bad requests: past the capacity, not whole sectors, no status byte,
    # unknown type, header split over two descriptors; read-only disk.
    img = Image()
    n = req(img, desc, 0, 0x1000, T_IN, 4096, [(0x2000, 512)], 0x1F00, True)
    n2 = req(img, desc, n, 0x1010, T_OUT, 0, [(0x2200, 100)], 0x1F01, False)
    split_desc(img, desc, n2, 0x1020, 16, 0)
    img.put(0x1020, blk_hdr(T_IN))
    img.put(0x1030, blk_hdr(77))
    split_desc(img, desc, n2 + 1, 0x1030, 8, NEXT, n2 + 2)
    split_desc(img, desc, n2 + 2, 0x1038, 8, NEXT, n2 + 3)
    split_desc(img, desc, n2 + 3, 0x1F03, 1, WRITE)
    split_avail(img, avail, [0, n, n2, n2 + 1])
    ops = op(0) + op(7)
    write('blk_request', 'bad-requests', bytes([3, 4, 255, 255]) + cap + b'\0' + bytes([len(ops)]) + ops + img.bytes())

    # Indirect read of 4 KiB in 8 segments, depth 1 (requests wait for room).
    img = Image()
    img.put(0x1000, blk_hdr(T_IN, 0))
    tbl = 0x600
    split_desc(img, tbl, 0, 0x1000, 16, NEXT, 1)
    for i in range(8):
        split_desc(img, tbl, 1 + i, 0x2000 + 0x200 * i, 512, NEXT | WRITE, 2 + i)
    split_desc(img, tbl, 9, 0x1F00, 1, WRITE)
    split_desc(img, desc, 0, tbl, 160, INDIRECT)
    split_desc(img, desc, 1, tbl, 160, INDIRECT)
    split_avail(img, avail, [0, 1])
    ops = op(0) + op(0) + op(0) + op(7)
    write('blk_request', 'indirect-depth1', bytes([3, 1, 0, 0]) + cap + b'\0' + bytes([len(ops)]) + ops + img.bytes())

    # Packed ring: a read and a write.
    psize = 8
    pd, pdrv, pdev, pend = packed_layout(0, psize)
    img = Image()
    img.put(0x1000, blk_hdr(T_IN, 1))
    img.put(0x1010, blk_hdr(T_OUT, 2))
    packed_desc(img, pd, 0, 0x1000, 16, 0, NEXT)
    packed_desc(img, pd, 1, 0x2000, 512, 0, NEXT | WRITE)
    packed_desc(img, pd, 2, 0x1F00, 1, 3, WRITE)
    packed_desc(img, pd, 3, 0x1010, 16, 0, NEXT)
    packed_desc(img, pd, 4, 0x2200, 512, 0, NEXT)
    packed_desc(img, pd, 5, 0x1F01, 1, 4, WRITE)
    ops = op(0) + op(0) + op(7)
    write('blk_request', 'packed-rw', bytes([0x80 | (psize - 1), 0, 255, 255]) + cap + b'\0' + bytes([len(ops)]) + ops + img.bytes())

    # Inflight recovery: head 0 left in flight by a previous backend (split
    # ring of 8, used.idx 0, avail.idx 1; the log says head 0, counter 5).
    img = Image()
    n = req(img, desc, 0, 0x1000, T_OUT, 0, [(0x2000, 512)], 0x1F00, False)
    split_avail(img, avail, [0])
    log = bytearray(16 + 16 * size)
    log[8:10] = u16(1)      # version
    log[10:12] = u16(size)  # desc_num
    log[12:14] = u16(0xFFFF)
    log[14:16] = u16(0)     # used_idx
    log[16] = 1             # head 0 in flight
    log[16 + 8:16 + 16] = u64(5)
    ops = op(0) + op(7)
    write('blk_request', 'inflight-recovery', bytes([3, 0, 255, 255]) + cap + b'\1' + u16(len(log)) + bytes(log) + bytes([len(ops)]) + ops + img.bytes())


# ---------------------------------------------------------------- vhost_user_msg
# selector (bit 0: net), then records (see fuzz_targets/vhost_user_msg.rs).
GET_FEATURES, SET_FEATURES, SET_OWNER, RESET_OWNER, SET_MEM_TABLE = 1, 2, 3, 4, 5
SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE = 8, 9, 10, 11
SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR = 12, 13, 14
GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES, GET_QUEUE_NUM, SET_VRING_ENABLE = 15, 16, 17, 18
GET_CONFIG, SET_CONFIG, GET_INFLIGHT_FD, SET_INFLIGHT_FD, RESET_DEVICE = 24, 25, 31, 32, 34
GET_MAX_MEM_SLOTS, ADD_MEM_REG, REM_MEM_REG, SET_STATUS, GET_STATUS = 36, 37, 38, 39, 40
PROTO = 0x1 | 0x8 | 0x200 | 0x2000 | 0x8000 | 0x10000  # MQ REPLY_ACK CONFIG RESET_DEVICE MEM_SLOTS STATUS


def msg(req, body=b'', fds='', reply=False):
    """An auto-header record; fds: string of 'm' (memfd) / 'e' (eventfd)."""
    kinds = sum(1 << i for i, k in enumerate(fds) if k == 'e')
    tag = 0xC0 | (0x20 if reply else 0) | (kinds << 2) | len(fds)
    return bytes([tag, req]) + u16(len(body)) + body


def raw(data, fds=''):
    kinds = sum(1 << i for i, k in enumerate(fds) if k == 'e')
    return bytes([(kinds << 2) | len(fds)]) + u16(len(data)) + data


def template(data):
    return bytes([0x40]) + u16(len(data)) + data


KICK = bytes([0x81])


def region(gpa, size, uaddr, off=0):
    return u64(gpa) + u64(size) + u64(uaddr) + u64(off)


def handshake(features):
    return (msg(GET_FEATURES) + msg(SET_OWNER) + msg(GET_PROTOCOL_FEATURES)
            + msg(SET_FEATURES, u64(features)) + msg(SET_PROTOCOL_FEATURES, u64(PROTO)))


def ring_setup(index, size, desc, avail, used, base=0):
    return (msg(SET_VRING_NUM, u32(index) + u32(size))
            + msg(SET_VRING_ADDR, u32(index) + u32(0) + u64(UADDR + desc) + u64(UADDR + used) + u64(UADDR + avail) + u64(0))
            + msg(SET_VRING_BASE, u32(index) + u32(base))
            + msg(SET_VRING_CALL, u64(index), 'e')
            + msg(SET_VRING_KICK, u64(index), 'e')
            + msg(SET_VRING_ENABLE, u32(index) + u32(1)))


def vu_seeds():
    # blk: the whole handshake, a memory table holding a split ring with a
    # read request, the ring started and kicked, then stopped.
    size = 8
    desc, avail, used, end = split_layout(0, size)
    img = Image()
    img.put(0x1000, blk_hdr(T_IN, 0))
    split_desc(img, desc, 0, 0x1000, 16, NEXT, 1)
    split_desc(img, desc, 1, 0x2000, 512, NEXT | WRITE, 2)
    split_desc(img, desc, 2, 0x1F00, 1, WRITE)
    split_avail(img, avail, [0])
    feats = VERSION_1 | PROTOCOL_FEATURES | EVENT_IDX | INDIRECT_DESC
    s = (handshake(feats) + template(img.bytes())
         + msg(SET_MEM_TABLE, u32(1) + u32(0) + region(0, 0x100000, UADDR), 'm')
         + msg(GET_CONFIG, u32(0) + u32(60) + u32(0) + bytes(60))
         + ring_setup(0, size, desc, avail, used) + KICK
         + msg(GET_VRING_BASE, u32(0) + u32(0)) + msg(GET_STATUS) + msg(SET_STATUS, u64(0xF)))
    write('vhost_user_msg', 'blk-session', b'\0' + s)

    # blk on a packed ring, REPLY_ACK on every message, ADD/REM_MEM_REG.
    pd, pdrv, pdev, pend = packed_layout(0, size)
    img = Image()
    img.put(0x1000, blk_hdr(T_OUT, 0))
    packed_desc(img, pd, 0, 0x1000, 16, 0, NEXT)
    packed_desc(img, pd, 1, 0x2000, 512, 0, NEXT)
    packed_desc(img, pd, 2, 0x1F00, 1, 1, WRITE)
    feats = VERSION_1 | PROTOCOL_FEATURES | RING_PACKED | EVENT_IDX
    s = (handshake(feats) + template(img.bytes())
         + msg(GET_MAX_MEM_SLOTS)
         + msg(ADD_MEM_REG, u64(0) + region(0, 0x100000, UADDR), 'm', reply=True)
         + msg(SET_VRING_NUM, u32(0) + u32(size), reply=True)
         + msg(SET_VRING_ADDR, u32(0) + u32(0) + u64(UADDR + pd) + u64(UADDR + pdev) + u64(UADDR + pdrv) + u64(0), reply=True)
         + msg(SET_VRING_BASE, u32(0) + u32(0x8000), reply=True)
         + msg(SET_VRING_CALL, u64(0), 'e') + msg(SET_VRING_KICK, u64(0), 'e')
         + msg(SET_VRING_ENABLE, u32(0) + u32(1), reply=True) + KICK
         + msg(GET_VRING_BASE, u32(0) + u32(0))
         + msg(REM_MEM_REG, u64(0) + region(0, 0x100000, UADDR), reply=True)
         + msg(RESET_DEVICE))
    write('vhost_user_msg', 'blk-packed-memreg', b'\0' + s)

    # blk inflight: GET_INFLIGHT_FD, then SET_INFLIGHT_FD with a memfd.
    s = (handshake(VERSION_1 | PROTOCOL_FEATURES)
         + msg(SET_PROTOCOL_FEATURES, u64(PROTO | 0x1000))
         + msg(GET_INFLIGHT_FD, u64(0) + u64(0) + u16(1) + u16(8) + u32(0))
         + msg(SET_INFLIGHT_FD, u64(4096) + u64(0) + u16(1) + u16(8) + u32(0), 'm')
         + msg(SET_CONFIG, u32(32) + u32(1) + u32(0) + b'\0'))
    write('vhost_user_msg', 'blk-inflight-config', b'\0' + s)

    # net: mergeable RX, control queue, two queue pairs (MQ), a TX frame
    # and RX buffers in memory, rings started and kicked.
    size = 4
    t = split_layout(0, size)
    r = split_layout(align(t[3], 64), size)
    img = Image()
    frame = net_hdr() + eth_frame(60)
    img.put(0x2000, frame)
    split_desc(img, t[0], 0, 0x2000, len(frame), 0)
    split_avail(img, t[1], [0])
    split_desc(img, r[0], 0, 0x3000, 2048, WRITE)
    split_avail(img, r[1], [0])
    feats = VERSION_1 | PROTOCOL_FEATURES | (1 << 15) | (1 << 17) | (1 << 22) | (1 << 5) | (1 << 16)
    s = (handshake(feats) + template(img.bytes())
         + msg(GET_QUEUE_NUM)
         + msg(SET_MEM_TABLE, u32(1) + u32(0) + region(0, 0x100000, UADDR), 'm')
         + ring_setup(0, size, *r[:3]) + ring_setup(1, size, *t[:3]) + KICK
         + msg(GET_CONFIG, u32(0) + u32(12) + u32(0) + bytes(12))
         + msg(GET_VRING_BASE, u32(1) + u32(0)) + msg(GET_VRING_BASE, u32(0) + u32(0)) + msg(RESET_OWNER))
    write('vhost_user_msg', 'net-session', b'\1' + s)

    # Raw bytes: a message split in two sends, a short one, a bad size.
    s = (raw(u32(GET_FEATURES) + u32(1)) + raw(u32(0))
         + raw(u32(SET_FEATURES) + u32(1) + u32(4) + u32(0))
         + raw(u32(SET_MEM_TABLE) + u32(1) + u32(8) + u32(2) + u32(0), 'me'))
    write('vhost_user_msg', 'raw-malformed', b'\0' + s)


if __name__ == '__main__':
    split_seeds()
    packed_seeds()
    net_seeds()
    blk_seeds()
    vu_seeds()
    for t in sorted(os.listdir(os.path.join(HERE, 'corpus'))):
        files = os.listdir(os.path.join(HERE, 'corpus', t))
        print(f'{t}: {len(files)} seeds')
