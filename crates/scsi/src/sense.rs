//! Sense data (SPC-4 4.5): what a CHECK CONDITION carries, in the fixed
//! or the descriptor format as the initiator asked.

/// Sense keys used here.
pub mod key {
    pub const NO_SENSE: u8 = 0x0;
    pub const MEDIUM_ERROR: u8 = 0x3;
    pub const HARDWARE_ERROR: u8 = 0x4;
    pub const ILLEGAL_REQUEST: u8 = 0x5;
    pub const UNIT_ATTENTION: u8 = 0x6;
    pub const DATA_PROTECT: u8 = 0x7;
    pub const ABORTED_COMMAND: u8 = 0xb;
}

/// A sense key with its additional sense code and qualifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
}

impl Sense {
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Sense {
        Sense { key, asc, ascq }
    }

    pub const NO_SENSE: Sense = Sense::new(key::NO_SENSE, 0x00, 0x00);
    pub const INVALID_OPCODE: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x20, 0x00);
    pub const LBA_OUT_OF_RANGE: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x21, 0x00);
    pub const INVALID_FIELD_IN_CDB: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x24, 0x00);
    pub const LUN_NOT_SUPPORTED: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x25, 0x00);
    pub const INVALID_FIELD_IN_PARAMETER_LIST: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x26, 0x00);
    pub const PARAMETER_LIST_LENGTH_ERROR: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x1a, 0x00);
    pub const SAVING_PARAMETERS_NOT_SUPPORTED: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x39, 0x00);
    pub const WRITE_PROTECTED: Sense = Sense::new(key::DATA_PROTECT, 0x27, 0x00);
    pub const UNRECOVERED_READ_ERROR: Sense = Sense::new(key::MEDIUM_ERROR, 0x11, 0x00);
    pub const WRITE_ERROR: Sense = Sense::new(key::MEDIUM_ERROR, 0x0c, 0x00);
    pub const INTERNAL_TARGET_FAILURE: Sense = Sense::new(key::HARDWARE_ERROR, 0x44, 0x00);
    pub const RESET_OCCURRED: Sense = Sense::new(key::UNIT_ATTENTION, 0x29, 0x00);
    pub const REPORTED_LUNS_DATA_CHANGED: Sense = Sense::new(key::UNIT_ATTENTION, 0x3f, 0x0e);
    pub const CAPACITY_DATA_CHANGED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x09);

    /// Fixed format, current error (response code 0x70): 18 bytes.
    pub fn fixed(&self) -> [u8; 18] {
        let mut s = [0u8; 18];
        s[0] = 0x70;
        s[2] = self.key & 0x0f;
        s[7] = 10; // additional sense length: bytes 8..18
        s[12] = self.asc;
        s[13] = self.ascq;
        s
    }

    /// Descriptor format, current error (response code 0x72), no
    /// descriptors: 8 bytes.
    pub fn descriptor(&self) -> [u8; 8] {
        [0x72, self.key & 0x0f, self.asc, self.ascq, 0, 0, 0, 0]
    }

    /// The format asked for (`descriptor`: D_SENSE or REQUEST SENSE's
    /// DESC bit), written into `out`; returns the bytes written (the
    /// format's length, or less if `out` is shorter).
    pub fn write(&self, descriptor: bool, out: &mut [u8]) -> usize {
        let (f, d);
        let bytes: &[u8] = if descriptor {
            d = self.descriptor();
            &d
        } else {
            f = self.fixed();
            &f
        };
        let n = bytes.len().min(out.len());
        out[..n].copy_from_slice(&bytes[..n]);
        n
    }
}
