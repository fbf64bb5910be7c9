//! The SCSI target behind vhostd's virtio-scsi device: a command's CDB
//! decoded and answered as Linux's scsi and sd layers expect (SPC-4 for
//! the primary commands, SBC-3 for a direct-access block device), with
//! exact sense data for what it refuses.
//!
//! Commands that move or change data (READ, WRITE, SYNCHRONIZE CACHE,
//! UNMAP, WRITE SAME) come back as an [`Action`] for the caller to run on
//! its block backend, range-checked; the rest are answered here with
//! their data-in bytes. Knows nothing of virtqueues, guest memory or
//! backends: every input is a byte slice, and any byte pattern in it
//! gets an answer (never a panic).

#![forbid(unsafe_code)]

pub mod device;
pub mod queue;
pub mod sense;
pub mod wire;

pub use device::{build, CtrlGroup, Lun, ReqGroup, ScsiDevice};
pub use sense::Sense;

/// Operation codes answered (SPC-4, SBC-3).
pub mod op {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0a;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SENSE_6: u8 = 0x1a;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2a;
    pub const VERIFY_10: u8 = 0x2f;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const MODE_SENSE_10: u8 = 0x5a;
    pub const READ_16: u8 = 0x88;
    pub const WRITE_16: u8 = 0x8a;
    pub const VERIFY_16: u8 = 0x8f;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    /// SERVICE ACTION IN(16): READ CAPACITY(16) is its action 0x10.
    pub const SERVICE_ACTION_IN_16: u8 = 0x9e;
    pub const REPORT_LUNS: u8 = 0xa0;
    /// MAINTENANCE IN: REPORT SUPPORTED OPERATION CODES is its action 0x0c.
    pub const MAINTENANCE_IN: u8 = 0xa3;
    pub const READ_12: u8 = 0xa8;
    pub const WRITE_12: u8 = 0xaa;

    pub const SA_READ_CAPACITY_16: u16 = 0x10;
    pub const SA_REPORT_SUPPORTED_OPCODES: u16 = 0x0c;
}

/// SCSI status codes (SAM-5).
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
}

/// A logical unit: a direct-access block device, as the initiator sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    /// Logical blocks.
    pub blocks: u64,
    /// Bytes per logical block.
    pub block_size: u32,
    pub read_only: bool,
    /// UNMAP and WRITE SAME with UNMAP are offered (LBPME, VPD 0xb2), and
    /// unmapped blocks read as zeros (LBPRZ).
    pub discard: bool,
    /// The volatile write cache is on (WCE): a write is durable only
    /// after SYNCHRONIZE CACHE (or with FUA).
    pub write_cache: bool,
    /// Unit serial number (VPD 0x80): printable ASCII, at most 32 bytes
    /// are reported.
    pub serial: String,
    /// The 60 vendor bits of the unit's locally assigned NAA identifier
    /// (VPD 0x83): see [`naa_bits`].
    pub naa: u64,
    /// Sense data in descriptor format (the control mode page's D_SENSE).
    pub descriptor_sense: bool,
    /// The most blocks one READ or WRITE may move (VPD 0xb0).
    pub max_transfer_blocks: u32,
}

/// Most block descriptors in one UNMAP parameter list (VPD 0xb0).
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
/// Most blocks one UNMAP descriptor, or one WRITE SAME, may cover (VPD 0xb0).
pub const MAX_UNMAP_BLOCKS: u32 = 0x40_0000;

/// Vendor identification (INQUIRY, 8 bytes) and product (16 bytes).
const VENDOR: &[u8; 8] = b"VHOSTD  ";
const PRODUCT: &[u8; 16] = b"vhostd disk     ";
const REVISION: &[u8; 4] = b"0001";

/// The 60 vendor bits of a NAA identifier for `name` (a device's name and
/// the unit's number): FNV-1a, so the identifier stays the same across
/// restarts for the same name, which `/dev/disk/by-id` and multipath rely on.
pub fn naa_bits(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h & ((1 << 60) - 1)
}

/// What a command asks of the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Status GOOD with these data-in bytes (already cut to the CDB's
    /// allocation length; may be empty).
    Data(Vec<u8>),
    /// Read `blocks` blocks from `lba` into the data-in buffers.
    Read { lba: u64, blocks: u32 },
    /// Write `blocks` blocks at `lba` from the data-out buffers; `fua`:
    /// durable before the command completes.
    Write { lba: u64, blocks: u32, fua: bool },
    /// Make every completed write durable (SYNCHRONIZE CACHE).
    Flush,
    /// Deallocate these (lba, blocks) ranges (UNMAP, WRITE SAME with UNMAP).
    Unmap(Vec<(u64, u32)>),
    /// Write zeros over a range (WRITE SAME of a zero block, no UNMAP).
    WriteZeroes { lba: u64, blocks: u32 },
    /// CHECK CONDITION with this sense.
    Check(Sense),
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// The CDB length an operation code's group implies (SPC-4 4.2.5.1);
/// None for variable-length and vendor groups.
pub fn cdb_len(opcode: u8) -> Option<usize> {
    match opcode >> 5 {
        0 => Some(6),
        1 | 2 => Some(10),
        4 => Some(16),
        5 => Some(12),
        _ => None,
    }
}

/// Data-in of `v`, cut to `alloc` bytes.
fn data(mut v: Vec<u8>, alloc: usize) -> Action {
    v.truncate(alloc);
    Action::Data(v)
}

/// Answers `cdb` for `disk`; `data_out` is the command's data-out (read
/// only for UNMAP's and WRITE SAME's parameter data; a WRITE's data is
/// the caller's to move).
pub fn execute(disk: &Disk, cdb: &[u8], data_out: &[u8]) -> Action {
    let cdb = match whole_cdb(cdb) {
        Ok(cdb) => cdb,
        Err(s) => return Action::Check(s),
    };
    let opcode = cdb[0];
    match opcode {
        op::TEST_UNIT_READY => Action::Data(Vec::new()),
        op::REQUEST_SENSE => request_sense(cdb, None),
        op::INQUIRY => inquiry(disk, cdb),
        op::MODE_SENSE_6 | op::MODE_SENSE_10 => mode_sense(disk, cdb),
        op::READ_CAPACITY_10 => read_capacity_10(disk, cdb),
        op::SERVICE_ACTION_IN_16 if (cdb[1] & 0x1f) as u16 == op::SA_READ_CAPACITY_16 => read_capacity_16(disk, cdb),
        op::READ_6 | op::READ_10 | op::READ_12 | op::READ_16 => read_write(disk, cdb, false).into(),
        op::WRITE_6 | op::WRITE_10 | op::WRITE_12 | op::WRITE_16 => read_write(disk, cdb, true).into(),
        op::VERIFY_10 | op::VERIFY_16 => verify(disk, cdb),
        op::SYNCHRONIZE_CACHE_10 | op::SYNCHRONIZE_CACHE_16 => synchronize_cache(disk, cdb),
        op::UNMAP if disk.discard => unmap(disk, cdb, data_out),
        op::WRITE_SAME_10 | op::WRITE_SAME_16 => write_same(disk, cdb, data_out),
        op::MAINTENANCE_IN if (cdb[1] & 0x1f) as u16 == op::SA_REPORT_SUPPORTED_OPCODES => {
            report_supported_opcodes(disk, cdb)
        }
        // REPORT LUNS needs the target's units: `report_luns`.
        _ => Action::Check(Sense::INVALID_OPCODE),
    }
}

/// The CDB cut to its opcode's length, or the sense that refuses it: an
/// unknown group, too few bytes, or NACA set in the CONTROL byte (ACA
/// handling, which this target does not do; SAM-5 5.9.1.3).
#[inline(always)]
fn whole_cdb(cdb: &[u8]) -> Result<&[u8], Sense> {
    let Some(&opcode) = cdb.first() else { return Err(Sense::INVALID_OPCODE) };
    let Some(len) = cdb_len(opcode) else { return Err(Sense::INVALID_OPCODE) };
    if cdb.len() < len {
        return Err(Sense::INVALID_FIELD_IN_CDB);
    }
    if cdb[len - 1] & 0x04 != 0 {
        return Err(Sense::INVALID_FIELD_IN_CDB);
    }
    Ok(&cdb[..len])
}

/// A READ or WRITE as the data path runs it: [`execute`]'s answer for those
/// opcodes, in a small value with no allocation the caller keeps in
/// registers (an [`Action`] returned from a call comes back through
/// memory, and reading it back stalled a null-backend command).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    Read {
        lba: u64,
        blocks: u32,
    },
    Write {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    /// A transfer of 0 blocks: GOOD, nothing moved.
    Nothing,
    Check(Sense),
}

impl From<Transfer> for Action {
    fn from(t: Transfer) -> Action {
        match t {
            Transfer::Read { lba, blocks } => Action::Read { lba, blocks },
            Transfer::Write { lba, blocks, fua } => Action::Write { lba, blocks, fua },
            Transfer::Nothing => Action::Data(Vec::new()),
            Transfer::Check(s) => Action::Check(s),
        }
    }
}

/// READ and WRITE (6/10/12/16) checked against `disk`, as [`execute`]
/// answers them; None for every other opcode. The CDB is a request
/// header's whole field, longer than any of these opcodes' CDBs, so it is
/// read uncut: no index into it needs a bounds check.
#[inline(always)]
pub fn transfer(disk: &Disk, cdb: &[u8; wire::CDB_SIZE]) -> Option<Transfer> {
    let be32 = |i: usize| u32::from_be_bytes([cdb[i], cdb[i + 1], cdb[i + 2], cdb[i + 3]]);
    let be16 = |i: usize| u16::from_be_bytes([cdb[i], cdb[i + 1]]);
    // One match decodes what `whole_cdb`, `read_write` and `lba_len` take
    // from the CDB: direction, LBA, length, the byte with the protection
    // and FUA bits, and the CONTROL byte (at `cdb_len`'s length minus
    // one). Callgrind, instructions a command: the lengths from
    // `cdb_len` cost 13 more; a second dispatch, on the group code, 5.
    let (write, lba, blocks, flags, control) = match cdb[0] {
        op::READ_10 | op::WRITE_10 => (cdb[0] == op::WRITE_10, be32(2) as u64, be16(7) as u32, cdb[1], cdb[9]),
        op::READ_16 | op::WRITE_16 => {
            let lba = u64::from_be_bytes([cdb[2], cdb[3], cdb[4], cdb[5], cdb[6], cdb[7], cdb[8], cdb[9]]);
            (cdb[0] == op::WRITE_16, lba, be32(10), cdb[1], cdb[15])
        }
        op::READ_12 | op::WRITE_12 => (cdb[0] == op::WRITE_12, be32(2) as u64, be32(6), cdb[1], cdb[11]),
        op::READ_6 | op::WRITE_6 => {
            let lba = (((cdb[1] & 0x1f) as u64) << 16) | ((cdb[2] as u64) << 8) | cdb[3] as u64;
            // A length of 0 means 256 blocks; byte 1 holds LBA bits here,
            // no protection or FUA bits.
            let n = if cdb[4] == 0 { 256 } else { cdb[4] as u32 };
            (cdb[0] == op::WRITE_6, lba, n, 0, cdb[5])
        }
        _ => return None,
    };
    // NACA in the CONTROL byte (`whole_cdb`'s one check that can fail
    // here), or RDPROTECT/WRPROTECT: no protection information here.
    if control & 0x04 != 0 || flags & 0xe0 != 0 {
        return Some(Transfer::Check(Sense::INVALID_FIELD_IN_CDB));
    }
    if write && disk.read_only {
        return Some(Transfer::Check(Sense::WRITE_PROTECTED));
    }
    if blocks > disk.max_transfer_blocks {
        return Some(Transfer::Check(Sense::INVALID_FIELD_IN_CDB));
    }
    if let Err(s) = in_range(disk, lba, blocks as u64) {
        return Some(Transfer::Check(s));
    }
    Some(match (blocks, write) {
        (0, _) => Transfer::Nothing,
        (_, true) => Transfer::Write { lba, blocks, fua: flags & 0x08 != 0 },
        (_, false) => Transfer::Read { lba, blocks },
    })
}

/// REQUEST SENSE: the sense pending for the initiator (`pending`; None:
/// NO SENSE, as this target returns sense with each CHECK CONDITION), in
/// the format the DESC bit asks for.
pub fn request_sense(cdb: &[u8], pending: Option<Sense>) -> Action {
    if cdb.len() < 6 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let desc = cdb[1] & 0x01 != 0;
    let mut out = vec![0u8; 18];
    let n = pending.unwrap_or(Sense::NO_SENSE).write(desc, &mut out);
    out.truncate(n);
    data(out, cdb[4] as usize)
}

/// The answer for a logical unit the target does not have (SPC-4 3.1.68):
/// INQUIRY reports "no unit here" (peripheral qualifier 3), REQUEST SENSE
/// says LOGICAL UNIT NOT SUPPORTED, and every other command is refused
/// with it.
pub fn no_such_unit(cdb: &[u8]) -> Action {
    match cdb.first() {
        Some(&op::INQUIRY) if cdb.len() >= 6 => {
            let alloc = be16(&cdb[3..5]) as usize;
            if cdb[1] & 0x01 != 0 {
                // No vital product data for a unit that is not there.
                return Action::Check(Sense::LUN_NOT_SUPPORTED);
            }
            let mut v = standard_inquiry();
            v[0] = 0x7f; // qualifier 3, type 0x1f: no device
            data(v, alloc)
        }
        Some(&op::REQUEST_SENSE) => request_sense(cdb, Some(Sense::LUN_NOT_SUPPORTED)),
        _ => Action::Check(Sense::LUN_NOT_SUPPORTED),
    }
}

/// REPORT LUNS (SPC-4 6.33) for a target whose units are `luns`, in
/// single-level flat addressing (SAM-5 4.7.7.1: peripheral device
/// addressing below 256, flat space from 256 to 16383).
pub fn report_luns(luns: &[u16], cdb: &[u8]) -> Action {
    if cdb.len() < 12 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let alloc = be32(&cdb[6..10]) as usize;
    if alloc < 16 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let listed: Vec<u16> = match cdb[2] {
        // All units, or all that are not well-known (none are).
        0x00 | 0x02 => luns.iter().copied().filter(|&l| l < 0x4000).collect(),
        // Well-known units only: none.
        0x01 => Vec::new(),
        _ => return Action::Check(Sense::INVALID_FIELD_IN_CDB),
    };
    let mut v = Vec::with_capacity(8 + 8 * listed.len());
    v.extend_from_slice(&((8 * listed.len()) as u32).to_be_bytes());
    v.extend_from_slice(&[0; 4]);
    for l in listed {
        let mut e = [0u8; 8];
        if l < 256 {
            e[1] = l as u8;
        } else {
            e[0] = 0x40 | (l >> 8) as u8;
            e[1] = l as u8;
        }
        v.extend_from_slice(&e);
    }
    data(v, alloc)
}

/// The unit a virtio-scsi LUN field (8 bytes: 1, target, then a
/// single-level LUN) addresses, with its target; None for a field that is
/// not in that form. The REPORT LUNS well-known unit (0xc101) is `0xc101`.
pub fn parse_virtio_lun(lun: &[u8; 8]) -> Option<(u8, u16)> {
    if lun[0] != 1 || u32::from_ne_bytes([lun[4], lun[5], lun[6], lun[7]]) != 0 {
        return None;
    }
    let (hi, lo) = (lun[2], lun[3]);
    let unit = match hi >> 6 {
        // Peripheral device addressing: bus 0 only.
        0 if hi == 0 => lo as u16,
        // Flat space addressing.
        1 => (((hi & 0x3f) as u16) << 8) | lo as u16,
        // Extended: the REPORT LUNS well-known unit.
        3 if hi == 0xc1 && lo == 0x01 => 0xc101,
        _ => return None,
    };
    Some((lun[1], unit))
}

fn standard_inquiry() -> Vec<u8> {
    let mut v = vec![0u8; 36];
    v[0] = 0x00; // connected, direct-access block device
    v[1] = 0x00; // not removable
    v[2] = 0x06; // SPC-4
    v[3] = 0x12; // HISUP, response data format 2
    v[4] = 31; // additional length: bytes 5..36
    v[7] = 0x02; // CMDQUE
    v[8..16].copy_from_slice(VENDOR);
    v[16..32].copy_from_slice(PRODUCT);
    v[32..36].copy_from_slice(REVISION);
    v
}

/// Vital product data pages offered, in ascending order.
const VPD_PAGES: [u8; 6] = [0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2];

fn inquiry(disk: &Disk, cdb: &[u8]) -> Action {
    let alloc = be16(&cdb[3..5]) as usize;
    let evpd = cdb[1] & 0x01 != 0;
    // CMDDT (obsolete) or any other reserved bit.
    if cdb[1] & 0xfe != 0 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    if !evpd {
        if cdb[2] != 0 {
            return Action::Check(Sense::INVALID_FIELD_IN_CDB);
        }
        return data(standard_inquiry(), alloc);
    }
    let page = cdb[2];
    let body: Vec<u8> = match page {
        0x00 => VPD_PAGES.to_vec(),
        0x80 => serial_bytes(disk),
        0x83 => device_identification(disk),
        0xb0 => block_limits(disk),
        0xb1 => {
            // Block device characteristics: non-rotating medium.
            let mut b = vec![0u8; 0x3c];
            b[0..2].copy_from_slice(&1u16.to_be_bytes());
            b
        }
        0xb2 => {
            // Logical block provisioning: UNMAP and WRITE SAME(16/10)
            // with UNMAP, unmapped blocks read zeros, thin.
            let mut b = vec![0u8; 4];
            if disk.discard {
                b[1] = 0x80 | 0x40 | 0x20 | 0x04;
                b[2] = 0x02;
            }
            b
        }
        _ => return Action::Check(Sense::INVALID_FIELD_IN_CDB),
    };
    let mut v = Vec::with_capacity(4 + body.len());
    v.extend_from_slice(&[0x00, page]);
    v.extend_from_slice(&(body.len() as u16).to_be_bytes());
    v.extend_from_slice(&body);
    data(v, alloc)
}

/// The serial as reported: printable ASCII (anything else as '_'), at
/// most 32 bytes.
fn serial_bytes(disk: &Disk) -> Vec<u8> {
    disk.serial.bytes().take(32).map(|b| if (0x20..0x7f).contains(&b) { b } else { b'_' }).collect()
}

/// VPD 0x83: a locally assigned NAA identifier (NAA 3) and a T10 vendor
/// identifier (vendor + serial), both for the logical unit.
fn device_identification(disk: &Disk) -> Vec<u8> {
    let mut v = Vec::with_capacity(64);
    // Binary code set; association: the logical unit; type 3, NAA.
    v.extend_from_slice(&[0x01, 0x03, 0x00, 8]);
    v.extend_from_slice(&((3u64 << 60) | (disk.naa & ((1 << 60) - 1))).to_be_bytes());
    // ASCII; the logical unit; type 1, T10 vendor ID.
    let serial = serial_bytes(disk);
    v.extend_from_slice(&[0x02, 0x01, 0x00, (8 + serial.len()) as u8]);
    v.extend_from_slice(VENDOR);
    v.extend_from_slice(&serial);
    v
}

/// VPD 0xb0, block limits (SBC-3 6.5.3), bytes 4 onwards.
fn block_limits(disk: &Disk) -> Vec<u8> {
    let mut b = vec![0u8; 0x3c];
    // WSNZ: a WRITE SAME of zero blocks is refused, not "to the end".
    b[0] = 0x01;
    // Optimal transfer length granularity: one block.
    b[2..4].copy_from_slice(&1u16.to_be_bytes());
    b[4..8].copy_from_slice(&disk.max_transfer_blocks.to_be_bytes());
    if disk.discard {
        b[16..20].copy_from_slice(&MAX_UNMAP_BLOCKS.to_be_bytes());
        b[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
        b[24..28].copy_from_slice(&1u32.to_be_bytes()); // optimal unmap granularity
    }
    b[32..40].copy_from_slice(&(MAX_UNMAP_BLOCKS as u64).to_be_bytes()); // maximum WRITE SAME length
    b
}

fn read_capacity_10(disk: &Disk, cdb: &[u8]) -> Action {
    // PMI (obsolete) clear: the LBA field must be zero (SBC-3 5.16.1).
    if cdb[8] & 0x01 == 0 && be32(&cdb[2..6]) != 0 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let last = disk.blocks.saturating_sub(1).min(u32::MAX as u64) as u32;
    let mut v = Vec::with_capacity(8);
    v.extend_from_slice(&last.to_be_bytes());
    v.extend_from_slice(&disk.block_size.to_be_bytes());
    Action::Data(v)
}

fn read_capacity_16(disk: &Disk, cdb: &[u8]) -> Action {
    let alloc = be32(&cdb[10..14]) as usize;
    if cdb[14] & 0x01 == 0 && be64(&cdb[2..10]) != 0 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let mut v = vec![0u8; 32];
    v[0..8].copy_from_slice(&disk.blocks.saturating_sub(1).to_be_bytes());
    v[8..12].copy_from_slice(&disk.block_size.to_be_bytes());
    if disk.discard {
        v[14] = 0x80 | 0x40; // LBPME, LBPRZ
    }
    data(v, alloc)
}

fn mode_sense(disk: &Disk, cdb: &[u8]) -> Action {
    let ten = cdb[0] == op::MODE_SENSE_10;
    let dbd = cdb[1] & 0x08 != 0;
    let pc = cdb[2] >> 6;
    let page = cdb[2] & 0x3f;
    let subpage = cdb[3];
    let alloc = if ten { be16(&cdb[7..9]) as usize } else { cdb[4] as usize };
    if pc == 3 {
        return Action::Check(Sense::SAVING_PARAMETERS_NOT_SUPPORTED);
    }
    // Nothing is changeable (no MODE SELECT): the changeable values are zeros.
    let changeable = pc == 1;
    let caching = || {
        let mut p = vec![0u8; 20];
        p[0] = 0x08;
        p[1] = 0x12;
        if disk.write_cache && !changeable {
            p[2] = 0x04; // WCE
        }
        p
    };
    let control = || {
        let mut p = vec![0u8; 12];
        p[0] = 0x0a;
        p[1] = 0x0a;
        if !changeable {
            if disk.descriptor_sense {
                p[2] = 0x04; // D_SENSE
            }
            p[3] = 0x10; // queue algorithm modifier 1: unrestricted reordering
        }
        p
    };
    let pages = match (page, subpage) {
        (0x08, 0) => caching(),
        (0x0a, 0) => control(),
        (0x3f, 0) | (0x3f, 0xff) => {
            let mut p = caching();
            p.extend(control());
            p
        }
        _ => return Action::Check(Sense::INVALID_FIELD_IN_CDB),
    };
    // WP, and DPOFUA: FUA is honoured.
    let device_specific = if disk.read_only { 0x80 } else { 0x00 } | 0x10;
    let mut blockdesc = Vec::new();
    if !dbd {
        blockdesc.extend_from_slice(&(disk.blocks.min(u32::MAX as u64) as u32).to_be_bytes());
        blockdesc.push(0); // density code
        blockdesc.extend_from_slice(&disk.block_size.to_be_bytes()[1..]);
    }
    let mut v = Vec::with_capacity(8 + blockdesc.len() + pages.len());
    if ten {
        let total = 8 + blockdesc.len() + pages.len();
        v.extend_from_slice(&((total - 2) as u16).to_be_bytes());
        v.extend_from_slice(&[0, device_specific, 0, 0]);
        v.extend_from_slice(&(blockdesc.len() as u16).to_be_bytes());
    } else {
        let total = 4 + blockdesc.len() + pages.len();
        v.extend_from_slice(&[(total - 1) as u8, 0, device_specific, blockdesc.len() as u8]);
    }
    v.extend_from_slice(&blockdesc);
    v.extend_from_slice(&pages);
    data(v, alloc)
}

/// LBA and transfer length of a READ, WRITE or VERIFY CDB; FUA.
#[inline(always)]
fn lba_len(cdb: &[u8]) -> (u64, u32, bool) {
    match cdb[0] >> 5 {
        0 => {
            let lba = (((cdb[1] & 0x1f) as u64) << 16) | ((cdb[2] as u64) << 8) | cdb[3] as u64;
            // READ(6)/WRITE(6): a length of 0 means 256 blocks.
            let n = if cdb[4] == 0 { 256 } else { cdb[4] as u32 };
            (lba, n, false)
        }
        1 => (be32(&cdb[2..6]) as u64, be16(&cdb[7..9]) as u32, cdb[1] & 0x08 != 0),
        5 => (be32(&cdb[2..6]) as u64, be32(&cdb[6..10]), cdb[1] & 0x08 != 0),
        _ => (be64(&cdb[2..10]), be32(&cdb[10..14]), cdb[1] & 0x08 != 0),
    }
}

/// LBA OUT OF RANGE unless `blocks` blocks from `lba` are on the disk.
fn in_range(disk: &Disk, lba: u64, blocks: u64) -> Result<(), Sense> {
    match lba.checked_add(blocks) {
        Some(end) if end <= disk.blocks => Ok(()),
        _ => Err(Sense::LBA_OUT_OF_RANGE),
    }
}

#[inline(always)]
fn read_write(disk: &Disk, cdb: &[u8], write: bool) -> Transfer {
    // RDPROTECT/WRPROTECT: no protection information here.
    if cdb[0] >> 5 != 0 && cdb[1] & 0xe0 != 0 {
        return Transfer::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    if write && disk.read_only {
        return Transfer::Check(Sense::WRITE_PROTECTED);
    }
    let (lba, blocks, fua) = lba_len(cdb);
    if blocks > disk.max_transfer_blocks {
        return Transfer::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    if let Err(s) = in_range(disk, lba, blocks as u64) {
        return Transfer::Check(s);
    }
    if blocks == 0 {
        return Transfer::Nothing;
    }
    if write {
        Transfer::Write { lba, blocks, fua }
    } else {
        Transfer::Read { lba, blocks }
    }
}

fn verify(disk: &Disk, cdb: &[u8]) -> Action {
    // VRPROTECT, or BYTCHK: comparing data against the medium is not done.
    if cdb[1] & 0xe6 != 0 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let (lba, blocks, _) = lba_len(cdb);
    match in_range(disk, lba, blocks as u64) {
        // BYTCHK 0: the medium is checked, which a file always passes.
        Ok(()) => Action::Data(Vec::new()),
        Err(s) => Action::Check(s),
    }
}

fn synchronize_cache(disk: &Disk, cdb: &[u8]) -> Action {
    let (lba, blocks) = if cdb[0] == op::SYNCHRONIZE_CACHE_10 {
        (be32(&cdb[2..6]) as u64, be16(&cdb[7..9]) as u64)
    } else {
        (be64(&cdb[2..10]), be32(&cdb[10..14]) as u64)
    };
    // 0 blocks: from lba to the end.
    let blocks = if blocks == 0 { disk.blocks.saturating_sub(lba) } else { blocks };
    if lba > disk.blocks {
        return Action::Check(Sense::LBA_OUT_OF_RANGE);
    }
    match in_range(disk, lba, blocks) {
        Ok(()) => Action::Flush,
        Err(s) => Action::Check(s),
    }
}

fn unmap(disk: &Disk, cdb: &[u8], data_out: &[u8]) -> Action {
    if disk.read_only {
        return Action::Check(Sense::WRITE_PROTECTED);
    }
    if cdb[1] & 0x01 != 0 {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB); // ANCHOR
    }
    let list_len = be16(&cdb[7..9]) as usize;
    if list_len == 0 {
        return Action::Unmap(Vec::new());
    }
    if list_len < 8 {
        return Action::Check(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    let list = &data_out[..list_len.min(data_out.len())];
    if list.len() < 8 {
        return Action::Check(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    let desc_len = be16(&list[2..4]) as usize;
    let descs = &list[8..];
    let n = desc_len.min(descs.len()) / 16;
    if n as u32 > MAX_UNMAP_DESCRIPTORS {
        return Action::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
    }
    let mut ranges = Vec::with_capacity(n);
    for d in descs.chunks_exact(16).take(n) {
        let (lba, blocks) = (be64(&d[0..8]), be32(&d[8..12]));
        if blocks > MAX_UNMAP_BLOCKS {
            return Action::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        if let Err(s) = in_range(disk, lba, blocks as u64) {
            return Action::Check(s);
        }
        if blocks > 0 {
            ranges.push((lba, blocks));
        }
    }
    Action::Unmap(ranges)
}

fn write_same(disk: &Disk, cdb: &[u8], data_out: &[u8]) -> Action {
    let sixteen = cdb[0] == op::WRITE_SAME_16;
    // WRPROTECT, ANCHOR; NDOB only in the 16-byte form.
    if cdb[1] & 0xe4 != 0 || (!sixteen && cdb[1] & 0x01 != 0) {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    if disk.read_only {
        return Action::Check(Sense::WRITE_PROTECTED);
    }
    let unmap = cdb[1] & 0x08 != 0;
    let ndob = sixteen && cdb[1] & 0x01 != 0;
    let (lba, blocks) = if sixteen {
        (be64(&cdb[2..10]), be32(&cdb[10..14]))
    } else {
        (be32(&cdb[2..6]) as u64, be16(&cdb[7..9]) as u32)
    };
    // WSNZ is set: zero blocks is refused, as is more than the limit.
    if blocks == 0 || blocks > MAX_UNMAP_BLOCKS {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    if let Err(s) = in_range(disk, lba, blocks as u64) {
        return Action::Check(s);
    }
    if !ndob {
        let bs = disk.block_size as usize;
        if data_out.len() < bs {
            return Action::Check(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        // Only a block of zeros is replicated (what sd sends: zeroing and
        // discard); any other pattern is refused.
        if data_out[..bs].iter().any(|&b| b != 0) {
            return Action::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
    }
    if unmap && disk.discard {
        Action::Unmap(vec![(lba, blocks)])
    } else {
        Action::WriteZeroes { lba, blocks }
    }
}

/// A supported command for REPORT SUPPORTED OPERATION CODES: its opcode,
/// service action (None: has none), and CDB usage map (SPC-4 6.35.3: the
/// bits of each CDB byte the target looks at; byte 0 is the opcode).
struct Supported {
    opcode: u8,
    service_action: Option<u16>,
    usage: &'static [u8],
    /// Offered only with discard on.
    discard_only: bool,
}

const fn cmd(opcode: u8, usage: &'static [u8]) -> Supported {
    Supported { opcode, service_action: None, usage, discard_only: false }
}

const SUPPORTED: &[Supported] = &[
    cmd(op::TEST_UNIT_READY, &[0x00, 0x00, 0x00, 0x00, 0x00, 0x04]),
    cmd(op::REQUEST_SENSE, &[0x03, 0x01, 0x00, 0x00, 0xff, 0x04]),
    cmd(op::READ_6, &[0x08, 0x1f, 0xff, 0xff, 0xff, 0x04]),
    cmd(op::WRITE_6, &[0x0a, 0x1f, 0xff, 0xff, 0xff, 0x04]),
    cmd(op::INQUIRY, &[0x12, 0x01, 0xff, 0xff, 0xff, 0x04]),
    cmd(op::MODE_SENSE_6, &[0x1a, 0x08, 0xff, 0xff, 0xff, 0x04]),
    cmd(op::READ_CAPACITY_10, &[0x25, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x01, 0x04]),
    cmd(op::READ_10, &[0x28, 0xe8, 0xff, 0xff, 0xff, 0xff, 0x00, 0xff, 0xff, 0x04]),
    cmd(op::WRITE_10, &[0x2a, 0xe8, 0xff, 0xff, 0xff, 0xff, 0x00, 0xff, 0xff, 0x04]),
    cmd(op::VERIFY_10, &[0x2f, 0xe6, 0xff, 0xff, 0xff, 0xff, 0x00, 0xff, 0xff, 0x04]),
    cmd(op::SYNCHRONIZE_CACHE_10, &[0x35, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00, 0xff, 0xff, 0x04]),
    cmd(op::WRITE_SAME_10, &[0x41, 0xec, 0xff, 0xff, 0xff, 0xff, 0x00, 0xff, 0xff, 0x04]),
    Supported {
        opcode: op::UNMAP,
        service_action: None,
        usage: &[0x42, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0x04],
        discard_only: true,
    },
    cmd(op::MODE_SENSE_10, &[0x5a, 0x08, 0xff, 0xff, 0x00, 0x00, 0x00, 0xff, 0xff, 0x04]),
    cmd(op::READ_16, &[0x88, 0xe8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04]),
    cmd(
        op::WRITE_16,
        &[0x8a, 0xe8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04],
    ),
    cmd(
        op::VERIFY_16,
        &[0x8f, 0xe6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04],
    ),
    cmd(
        op::SYNCHRONIZE_CACHE_16,
        &[0x91, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04],
    ),
    cmd(
        op::WRITE_SAME_16,
        &[0x93, 0xed, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04],
    ),
    Supported {
        opcode: op::SERVICE_ACTION_IN_16,
        service_action: Some(op::SA_READ_CAPACITY_16),
        usage: &[0x9e, 0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x04],
        discard_only: false,
    },
    cmd(op::REPORT_LUNS, &[0xa0, 0x00, 0xff, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04]),
    Supported {
        opcode: op::MAINTENANCE_IN,
        service_action: Some(op::SA_REPORT_SUPPORTED_OPCODES),
        usage: &[0xa3, 0x1f, 0x07, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04],
        discard_only: false,
    },
    cmd(op::READ_12, &[0xa8, 0xe8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04]),
    cmd(op::WRITE_12, &[0xaa, 0xe8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x04]),
];

/// REPORT SUPPORTED OPERATION CODES (SPC-4 6.35): all commands, or one
/// with its CDB usage map. Timeout descriptors (RCTD) are not reported.
fn report_supported_opcodes(disk: &Disk, cdb: &[u8]) -> Action {
    let options = cdb[2] & 0x07;
    let rctd = cdb[2] & 0x80 != 0;
    let (req_op, req_sa) = (cdb[3], be16(&cdb[4..6]));
    let alloc = be32(&cdb[6..10]) as usize;
    if rctd {
        return Action::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let offered = SUPPORTED.iter().filter(|c| disk.discard || !c.discard_only);
    if options == 0 {
        let mut v = vec![0u8; 4];
        for c in offered {
            v.push(c.opcode);
            v.push(0);
            v.extend_from_slice(&c.service_action.unwrap_or(0).to_be_bytes());
            v.push(0);
            v.push(if c.service_action.is_some() { 0x01 } else { 0x00 }); // SERVACTV
            v.extend_from_slice(&(c.usage.len() as u16).to_be_bytes());
        }
        let n = (v.len() - 4) as u32;
        v[0..4].copy_from_slice(&n.to_be_bytes());
        return data(v, alloc);
    }
    let takes_sa = |o: u8| SUPPORTED.iter().any(|c| c.opcode == o && c.service_action.is_some());
    let found = match options {
        // One command without a service action: refused for one that has them.
        1 if takes_sa(req_op) => return Action::Check(Sense::INVALID_FIELD_IN_CDB),
        1 => offered.clone().find(|c| c.opcode == req_op),
        // One command with a service action: refused for one that has none
        // (when the target knows the command at all).
        2 if !takes_sa(req_op) && SUPPORTED.iter().any(|c| c.opcode == req_op) => {
            return Action::Check(Sense::INVALID_FIELD_IN_CDB)
        }
        2 => offered.clone().find(|c| c.opcode == req_op && c.service_action == Some(req_sa)),
        // Either form.
        3 => offered.clone().find(|c| c.opcode == req_op && c.service_action.is_none_or(|sa| sa == req_sa)),
        _ => return Action::Check(Sense::INVALID_FIELD_IN_CDB),
    };
    let v = match found {
        // SUPPORT 011b: supported as the standard says.
        Some(c) => {
            let mut v = vec![0, 0x03];
            v.extend_from_slice(&(c.usage.len() as u16).to_be_bytes());
            v.extend_from_slice(c.usage);
            v
        }
        // SUPPORT 001b: not supported; no usage data.
        None => vec![0, 0x01, 0, 0],
    };
    data(v, alloc)
}

#[cfg(test)]
mod tests;
