//! virtio-scsi's wire format (virtio 1.2, section 5.6): feature bits, the
//! config space, the request and response headers of the request queues,
//! the control queue's task management and asynchronous notification
//! messages, and the event queue's events. Little-endian throughout; the
//! CDB and sense sizes are the config space's (`cdb_size`, `sense_size`).
//! Parsing takes any bytes (a guest's): short input is None, never a panic.

/// Feature bits.
pub mod features {
    /// A request may have both data-out and data-in buffers.
    pub const INOUT: u64 = 1 << 0;
    /// The device reports hotplug and hot-unplug on the event queue.
    pub const HOTPLUG: u64 = 1 << 1;
    /// The device reports LUN parameter changes.
    pub const CHANGE: u64 = 1 << 2;
    /// T10 protection information in the request header.
    pub const T10_PI: u64 = 1 << 3;
}

/// Sizes this device uses (and offers in its config space).
pub const CDB_SIZE: usize = 32;
pub const SENSE_SIZE: usize = 96;
/// A request header with `CDB_SIZE` bytes of CDB.
pub const REQ_LEN: usize = 19 + CDB_SIZE;
/// A response header with `SENSE_SIZE` bytes of sense.
pub const RESP_LEN: usize = 12 + SENSE_SIZE;
/// The config space's length.
pub const CONFIG_LEN: usize = 36;

/// The `response` byte of a command or task management response.
pub mod response {
    pub const OK: u8 = 0;
    pub const OVERRUN: u8 = 1;
    pub const ABORTED: u8 = 2;
    pub const BAD_TARGET: u8 = 3;
    pub const RESET: u8 = 4;
    pub const BUSY: u8 = 5;
    pub const TRANSPORT_FAILURE: u8 = 6;
    pub const TARGET_FAILURE: u8 = 7;
    pub const NEXUS_FAILURE: u8 = 8;
    pub const FAILURE: u8 = 9;
    /// Task management: done (the same value as OK: FUNCTION_COMPLETE).
    pub const FUNCTION_COMPLETE: u8 = 0;
    pub const FUNCTION_SUCCEEDED: u8 = 10;
    pub const FUNCTION_REJECTED: u8 = 11;
    pub const INCORRECT_LUN: u8 = 12;
}

/// Control queue request types.
pub mod ctrl {
    pub const TMF: u32 = 0;
    pub const AN_QUERY: u32 = 1;
    pub const AN_SUBSCRIBE: u32 = 2;
}

/// Task management functions (the TMF request's subtype).
pub mod tmf {
    pub const ABORT_TASK: u32 = 0;
    pub const ABORT_TASK_SET: u32 = 1;
    pub const CLEAR_ACA: u32 = 2;
    pub const CLEAR_TASK_SET: u32 = 3;
    pub const I_T_NEXUS_RESET: u32 = 4;
    pub const LOGICAL_UNIT_RESET: u32 = 5;
    pub const QUERY_TASK: u32 = 6;
    pub const QUERY_TASK_SET: u32 = 7;
}

/// Event queue events.
pub mod event {
    pub const NO_EVENT: u32 = 0;
    pub const TRANSPORT_RESET: u32 = 1;
    pub const ASYNC_NOTIFY: u32 = 2;
    pub const PARAM_CHANGE: u32 = 3;
    /// Set in an event when events were lost for want of a buffer.
    pub const EVENTS_MISSED: u32 = 0x8000_0000;
    /// TRANSPORT_RESET reasons (VIRTIO_SCSI_EVT_RESET_*).
    pub const HARD: u32 = 0;
    pub const RESCAN: u32 = 1;
    pub const REMOVED: u32 = 2;
}

fn le16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// The config space (read-only to the driver here, except that the spec
/// lets it write `sense_size` and `cdb_size`, which this device ignores).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Request queues.
    pub num_queues: u32,
    pub seg_max: u32,
    pub max_sectors: u32,
    pub cmd_per_lun: u32,
    /// The highest LUN number the target has.
    pub max_lun: u32,
}

impl Config {
    pub fn bytes(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let mut put = |off: usize, v: u32| c[off..off + 4].copy_from_slice(&v.to_le_bytes());
        put(0, self.num_queues);
        put(4, self.seg_max);
        put(8, self.max_sectors);
        put(12, self.cmd_per_lun);
        put(16, 16); // event_info_size: an event is 16 bytes
        put(20, SENSE_SIZE as u32);
        put(24, CDB_SIZE as u32);
        // max_channel 0 (28..30), max_target 0 (30..32): one target.
        put(32, self.max_lun);
        c
    }

    /// Parses a config space (a driver's view; for the frontend and tests).
    pub fn parse(c: &[u8]) -> Option<Config> {
        if c.len() < CONFIG_LEN {
            return None;
        }
        Some(Config {
            num_queues: le32(&c[0..]),
            seg_max: le32(&c[4..]),
            max_sectors: le32(&c[8..]),
            cmd_per_lun: le32(&c[12..]),
            max_lun: le32(&c[32..]),
        })
    }
}

/// A request queue's request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmdReq {
    pub lun: [u8; 8],
    /// The command's tag (task management names it).
    pub id: u64,
    pub task_attr: u8,
    pub prio: u8,
    pub crn: u8,
    pub cdb: [u8; CDB_SIZE],
}

impl CmdReq {
    /// Parses the first `REQ_LEN` bytes of a request.
    pub fn parse(b: &[u8]) -> Option<CmdReq> {
        if b.len() < REQ_LEN {
            return None;
        }
        let mut lun = [0u8; 8];
        lun.copy_from_slice(&b[0..8]);
        let mut cdb = [0u8; CDB_SIZE];
        cdb.copy_from_slice(&b[19..19 + CDB_SIZE]);
        Some(CmdReq { lun, id: le64(&b[8..]), task_attr: b[16], prio: b[17], crn: b[18], cdb })
    }

    pub fn bytes(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0..8].copy_from_slice(&self.lun);
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16] = self.task_attr;
        b[17] = self.prio;
        b[18] = self.crn;
        b[19..].copy_from_slice(&self.cdb);
        b
    }
}

/// A request queue's response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmdResp {
    /// Bytes of `sense` that are sense data.
    pub sense_len: u32,
    /// Bytes of the data buffers not transferred.
    pub residual: u32,
    pub status_qualifier: u16,
    /// The SCSI status (GOOD, CHECK CONDITION...).
    pub status: u8,
    /// The transport's verdict (`response::*`).
    pub response: u8,
    pub sense: [u8; SENSE_SIZE],
}

impl CmdResp {
    /// A response with `response`, SCSI status `status`, `residual`, and
    /// `sense` (cut to SENSE_SIZE).
    pub fn new(response: u8, status: u8, residual: u32, sense: &[u8]) -> CmdResp {
        let n = sense.len().min(SENSE_SIZE);
        let mut s = [0u8; SENSE_SIZE];
        s[..n].copy_from_slice(&sense[..n]);
        CmdResp { sense_len: n as u32, residual, status_qualifier: 0, status, response, sense: s }
    }

    pub fn bytes(&self) -> [u8; RESP_LEN] {
        let mut b = [0u8; RESP_LEN];
        b[0..4].copy_from_slice(&self.sense_len.to_le_bytes());
        b[4..8].copy_from_slice(&self.residual.to_le_bytes());
        b[8..10].copy_from_slice(&self.status_qualifier.to_le_bytes());
        b[10] = self.status;
        b[11] = self.response;
        b[12..].copy_from_slice(&self.sense);
        b
    }

    pub fn parse(b: &[u8]) -> Option<CmdResp> {
        if b.len() < RESP_LEN {
            return None;
        }
        let mut sense = [0u8; SENSE_SIZE];
        sense.copy_from_slice(&b[12..RESP_LEN]);
        Some(CmdResp {
            sense_len: le32(&b[0..]),
            residual: le32(&b[4..]),
            status_qualifier: le16(&b[8..]),
            status: b[10],
            response: b[11],
            sense,
        })
    }
}

/// A control queue request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtrlReq {
    /// Task management: `subtype` (`tmf::*`) on `lun`, naming task `id`.
    Tmf { subtype: u32, lun: [u8; 8], id: u64 },
    /// Asynchronous notification query or subscription (`ctrl::AN_*`).
    An { kind: u32, lun: [u8; 8], event_requested: u32 },
}

/// A TMF request's length, and its response's (the response byte).
pub const TMF_REQ_LEN: usize = 24;
pub const TMF_RESP_LEN: usize = 1;
/// An AN request's length, and its response's (event_actual, response).
pub const AN_REQ_LEN: usize = 16;
pub const AN_RESP_LEN: usize = 5;

impl CtrlReq {
    /// Parses a control request; None for a short one or an unknown type.
    pub fn parse(b: &[u8]) -> Option<CtrlReq> {
        if b.len() < 4 {
            return None;
        }
        let mut lun = [0u8; 8];
        match le32(b) {
            ctrl::TMF if b.len() >= TMF_REQ_LEN => {
                lun.copy_from_slice(&b[8..16]);
                Some(CtrlReq::Tmf { subtype: le32(&b[4..]), lun, id: le64(&b[16..]) })
            }
            kind @ (ctrl::AN_QUERY | ctrl::AN_SUBSCRIBE) if b.len() >= AN_REQ_LEN => {
                lun.copy_from_slice(&b[4..12]);
                Some(CtrlReq::An { kind, lun, event_requested: le32(&b[12..]) })
            }
            _ => None,
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(TMF_REQ_LEN);
        match *self {
            CtrlReq::Tmf { subtype, lun, id } => {
                b.extend_from_slice(&ctrl::TMF.to_le_bytes());
                b.extend_from_slice(&subtype.to_le_bytes());
                b.extend_from_slice(&lun);
                b.extend_from_slice(&id.to_le_bytes());
            }
            CtrlReq::An { kind, lun, event_requested } => {
                b.extend_from_slice(&kind.to_le_bytes());
                b.extend_from_slice(&lun);
                b.extend_from_slice(&event_requested.to_le_bytes());
            }
        }
        b
    }
}

/// An asynchronous notification response.
pub fn an_resp(event_actual: u32, response: u8) -> [u8; AN_RESP_LEN] {
    let mut b = [0u8; AN_RESP_LEN];
    b[0..4].copy_from_slice(&event_actual.to_le_bytes());
    b[4] = response;
    b
}

/// An event for the event queue: `event` (with EVENTS_MISSED or'ed in if
/// some were lost), the LUN field, and the reason.
pub fn event_bytes(event: u32, lun: [u8; 8], reason: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&event.to_le_bytes());
    b[4..12].copy_from_slice(&lun);
    b[12..16].copy_from_slice(&reason.to_le_bytes());
    b
}

/// The 8-byte LUN field for `unit` of target 0 as REPORT LUNS lists it
/// (single-level: peripheral addressing below 256, flat space above), as
/// `parse_virtio_lun` reads it. The event queue names units this way:
/// Linux takes an event's LUN bytes as the number REPORT LUNS gave it
/// (flat space for LUN 3 would be unit 16387 to it), as QEMU does too.
pub fn lun_field(unit: u16) -> [u8; 8] {
    let mut l = [0u8; 8];
    l[0] = 1;
    if unit < 256 {
        l[3] = unit as u8;
    } else {
        l[2] = 0x40 | (unit >> 8) as u8 & 0x3f;
        l[3] = unit as u8;
    }
    l
}

/// The LUN field a driver addresses a command to `unit` of target 0 with,
/// as Linux's virtio_scsi writes it: flat space for every unit (some
/// targets, vhost-device-scsi among them, take no other form).
pub fn command_lun(unit: u16) -> [u8; 8] {
    let mut l = [0u8; 8];
    l[0] = 1;
    l[2] = 0x40 | (unit >> 8) as u8 & 0x3f;
    l[3] = unit as u8;
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_the_specs() {
        assert_eq!(REQ_LEN, 51);
        assert_eq!(RESP_LEN, 108);
    }

    #[test]
    fn config_space_layout() {
        let c = Config { num_queues: 2, seg_max: 126, max_sectors: 0xffff, cmd_per_lun: 128, max_lun: 3 };
        let b = c.bytes();
        assert_eq!(&b[0..4], &2u32.to_le_bytes());
        assert_eq!(&b[16..20], &16u32.to_le_bytes());
        assert_eq!(&b[20..24], &96u32.to_le_bytes());
        assert_eq!(&b[24..28], &32u32.to_le_bytes());
        assert_eq!(&b[28..32], &[0, 0, 0, 0]);
        assert_eq!(&b[32..36], &3u32.to_le_bytes());
        assert_eq!(Config::parse(&b), Some(c));
        assert_eq!(Config::parse(&b[..35]), None);
    }

    #[test]
    fn request_and_response_round_trip() {
        let mut cdb = [0u8; CDB_SIZE];
        cdb[0] = 0x28;
        let r = CmdReq { lun: lun_field(300), id: 0x1122_3344_5566_7788, task_attr: 0, prio: 1, crn: 2, cdb };
        let b = r.bytes();
        assert_eq!(&b[0..4], &[1, 0, 0x41, 0x2c]);
        assert_eq!(b[8], 0x88);
        assert_eq!(b[19], 0x28);
        assert_eq!(CmdReq::parse(&b), Some(r));
        assert_eq!(CmdReq::parse(&b[..REQ_LEN - 1]), None);
        assert_eq!(crate::parse_virtio_lun(&r.lun), Some((0, 300)));
        assert_eq!(crate::parse_virtio_lun(&lun_field(7)), Some((0, 7)));

        let sense = crate::Sense::LBA_OUT_OF_RANGE.fixed();
        let resp = CmdResp::new(response::OK, crate::status::CHECK_CONDITION, 4096, &sense);
        let b = resp.bytes();
        assert_eq!(&b[0..4], &18u32.to_le_bytes());
        assert_eq!(&b[4..8], &4096u32.to_le_bytes());
        assert_eq!((b[10], b[11]), (2, 0));
        assert_eq!(&b[12..30], &sense);
        assert_eq!(CmdResp::parse(&b), Some(resp));
        // Sense longer than the field is cut.
        assert_eq!(CmdResp::new(0, 2, 0, &[7u8; 200]).sense_len, 96);
    }

    #[test]
    fn control_requests_parse_and_refuse_short_or_unknown_ones() {
        let t = CtrlReq::Tmf { subtype: tmf::ABORT_TASK, lun: lun_field(1), id: 42 };
        let b = t.bytes();
        assert_eq!(b.len(), TMF_REQ_LEN);
        assert_eq!(CtrlReq::parse(&b), Some(t));
        assert_eq!(CtrlReq::parse(&b[..TMF_REQ_LEN - 1]), None);
        let a = CtrlReq::An { kind: ctrl::AN_SUBSCRIBE, lun: lun_field(0), event_requested: 0x10 };
        let b = a.bytes();
        assert_eq!(b.len(), AN_REQ_LEN);
        assert_eq!(CtrlReq::parse(&b), Some(a));
        assert_eq!(CtrlReq::parse(&[9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(CtrlReq::parse(&[0, 0]), None);
        assert_eq!(an_resp(0x10, response::OK), [0x10, 0, 0, 0, 0]);
    }

    #[test]
    fn events_are_laid_out_as_the_spec_says() {
        let e = event_bytes(event::TRANSPORT_RESET | event::EVENTS_MISSED, lun_field(2), event::REMOVED);
        assert_eq!(&e[0..4], &[1, 0, 0, 0x80]);
        assert_eq!(&e[4..12], &[1, 0, 0, 2, 0, 0, 0, 0], "peripheral addressing, as REPORT LUNS lists LUN 2");
        assert_eq!(command_lun(2), [1, 0, 0x40, 2, 0, 0, 0, 0], "flat space, as Linux addresses commands");
        assert_eq!(crate::parse_virtio_lun(&command_lun(300)), Some((0, 300)));
        assert_eq!(&e[12..16], &[2, 0, 0, 0]);
    }
}
