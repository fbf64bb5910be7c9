//! Exact data and sense for each command, against the SPC-4 / SBC-3 layouts.

use super::*;
use proptest::prelude::*;

fn disk() -> Disk {
    Disk {
        blocks: 1 << 21, // 1 GiB of 512-byte blocks
        block_size: 512,
        read_only: false,
        discard: true,
        write_cache: true,
        serial: "disk0".into(),
        naa: naa_bits("vm1-disks/0"),
        descriptor_sense: false,
        max_transfer_blocks: 2048,
    }
}

fn check(a: Action) -> Sense {
    match a {
        Action::Check(s) => s,
        other => panic!("expected CHECK CONDITION, got {other:?}"),
    }
}

fn bytes(a: Action) -> Vec<u8> {
    match a {
        Action::Data(v) => v,
        other => panic!("expected data, got {other:?}"),
    }
}

fn cdb16(op: u8, lba: u64, len: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&len.to_be_bytes());
    c
}

fn cdb10(op: u8, lba: u32, len: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&len.to_be_bytes());
    c
}

#[test]
fn sense_formats_are_exact() {
    let s = Sense::LBA_OUT_OF_RANGE;
    assert_eq!(s.fixed(), [0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x21, 0x00, 0, 0, 0, 0]);
    assert_eq!(s.descriptor(), [0x72, 0x05, 0x21, 0x00, 0, 0, 0, 0]);
    let mut short = [0u8; 4];
    assert_eq!(Sense::WRITE_PROTECTED.write(false, &mut short), 4);
    assert_eq!(short, [0x70, 0, 0x07, 0]);
}

#[test]
fn unknown_and_malformed_commands_are_refused_exactly() {
    let d = disk();
    assert_eq!(check(execute(&d, &[0xc0, 0, 0, 0, 0, 0], &[])), Sense::INVALID_OPCODE);
    assert_eq!(check(execute(&d, &[], &[])), Sense::INVALID_OPCODE);
    // MODE SELECT is not offered.
    assert_eq!(check(execute(&d, &[0x15, 0x10, 0, 0, 12, 0], &[])), Sense::INVALID_OPCODE);
    // A CDB shorter than its group says.
    assert_eq!(check(execute(&d, &[op::READ_16, 0, 0], &[])), Sense::INVALID_FIELD_IN_CDB);
    // NACA in the control byte.
    assert_eq!(check(execute(&d, &[op::TEST_UNIT_READY, 0, 0, 0, 0, 0x04], &[])), Sense::INVALID_FIELD_IN_CDB);
    // SERVICE ACTION IN(16) with an action other than READ CAPACITY(16).
    let mut c = cdb16(op::SERVICE_ACTION_IN_16, 0, 32);
    c[1] = 0x12;
    assert_eq!(check(execute(&d, &c, &[])), Sense::INVALID_OPCODE);
    // UNMAP without discard.
    let nd = Disk { discard: false, ..disk() };
    assert_eq!(check(execute(&nd, &cdb10(op::UNMAP, 0, 24), &[])), Sense::INVALID_OPCODE);
}

#[test]
fn test_unit_ready_and_request_sense() {
    let d = disk();
    assert_eq!(execute(&d, &[0; 6], &[]), Action::Data(vec![]));
    let fixed = bytes(execute(&d, &[op::REQUEST_SENSE, 0, 0, 0, 252, 0], &[]));
    assert_eq!(fixed, Sense::NO_SENSE.fixed().to_vec());
    let desc = bytes(execute(&d, &[op::REQUEST_SENSE, 1, 0, 0, 252, 0], &[]));
    assert_eq!(desc, vec![0x72, 0, 0, 0, 0, 0, 0, 0]);
    // Cut to the allocation length.
    assert_eq!(bytes(execute(&d, &[op::REQUEST_SENSE, 0, 0, 0, 3, 0], &[])), vec![0x70, 0, 0]);
}

#[test]
fn standard_inquiry_is_exact() {
    let d = disk();
    let v = bytes(execute(&d, &[op::INQUIRY, 0, 0, 0, 96, 0], &[]));
    assert_eq!(v.len(), 36);
    assert_eq!(&v[..8], &[0x00, 0x00, 0x06, 0x12, 31, 0, 0, 0x02]);
    assert_eq!(&v[8..16], b"VHOSTD  ");
    assert_eq!(&v[16..32], b"vhostd disk     ");
    assert_eq!(&v[32..36], b"0001");
    // Allocation length cuts; a page code without EVPD is refused.
    assert_eq!(bytes(execute(&d, &[op::INQUIRY, 0, 0, 0, 5, 0], &[])), vec![0, 0, 6, 0x12, 31]);
    assert_eq!(check(execute(&d, &[op::INQUIRY, 0, 0x80, 0, 96, 0], &[])), Sense::INVALID_FIELD_IN_CDB);
    assert_eq!(check(execute(&d, &[op::INQUIRY, 0x02, 0, 0, 96, 0], &[])), Sense::INVALID_FIELD_IN_CDB);
}

#[test]
fn vital_product_data_pages_are_exact() {
    let d = disk();
    let vpd = |page: u8| bytes(execute(&d, &[op::INQUIRY, 1, page, 0x10, 0, 0], &[]));
    assert_eq!(vpd(0x00), vec![0, 0x00, 0, 6, 0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2]);
    assert_eq!(vpd(0x80), [&[0u8, 0x80, 0, 5][..], b"disk0"].concat());
    let id = vpd(0x83);
    let naa = (3u64 << 60) | naa_bits("vm1-disks/0");
    let mut want = vec![0, 0x83, 0, 8 + 4 + 4 + 8 + 5, 0x01, 0x03, 0x00, 8];
    want.extend_from_slice(&naa.to_be_bytes());
    want.extend_from_slice(&[0x02, 0x01, 0x00, 13]);
    want.extend_from_slice(b"VHOSTD  disk0");
    assert_eq!(id, want);
    assert_eq!(id[8] >> 4, 3, "NAA 3: locally assigned");
    // Stable: the same name gives the same identifier, another name another.
    assert_eq!(naa_bits("vm1-disks/0"), naa_bits("vm1-disks/0"));
    assert_ne!(naa_bits("vm1-disks/0"), naa_bits("vm1-disks/1"));

    let bl = vpd(0xb0);
    assert_eq!(&bl[..4], &[0, 0xb0, 0, 0x3c]);
    assert_eq!(bl.len(), 4 + 0x3c);
    assert_eq!(bl[4], 0x01, "WSNZ");
    assert_eq!(be16(&bl[6..8]), 1);
    assert_eq!(be32(&bl[8..12]), 2048, "maximum transfer length");
    assert_eq!(be32(&bl[20..24]), MAX_UNMAP_BLOCKS);
    assert_eq!(be32(&bl[24..28]), MAX_UNMAP_DESCRIPTORS);
    assert_eq!(be64(&bl[36..44]), MAX_UNMAP_BLOCKS as u64, "maximum WRITE SAME length");

    let bc = vpd(0xb1);
    assert_eq!(&bc[..6], &[0, 0xb1, 0, 0x3c, 0, 1], "non-rotating");
    assert_eq!(vpd(0xb2), vec![0, 0xb2, 0, 4, 0, 0xe4, 0x02, 0]);
    let nd = Disk { discard: false, ..disk() };
    assert_eq!(bytes(execute(&nd, &[op::INQUIRY, 1, 0xb2, 0, 64, 0], &[])), vec![0, 0xb2, 0, 4, 0, 0, 0, 0]);
    let bl = bytes(execute(&nd, &[op::INQUIRY, 1, 0xb0, 0, 64, 0], &[]));
    assert_eq!(be32(&bl[20..24]), 0, "no UNMAP without discard");
    assert_eq!(check(execute(&d, &[op::INQUIRY, 1, 0x89, 0, 64, 0], &[])), Sense::INVALID_FIELD_IN_CDB);
}

#[test]
fn a_serial_is_reported_printable_and_at_most_32_bytes() {
    let d = Disk { serial: "a\u{1}b".repeat(20), ..disk() };
    let v = bytes(execute(&d, &[op::INQUIRY, 1, 0x80, 0, 255, 0], &[]));
    assert_eq!(v[3], 32);
    assert!(v[4..].iter().all(|b| (0x20..0x7f).contains(b)), "{v:?}");
}

#[test]
fn read_capacity_is_exact() {
    let d = disk();
    let v = bytes(execute(&d, &[op::READ_CAPACITY_10, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]));
    assert_eq!(v, [((1u32 << 21) - 1).to_be_bytes(), 512u32.to_be_bytes()].concat());
    let mut c = cdb16(op::SERVICE_ACTION_IN_16, 0, 32);
    c[1] = 0x10;
    let v = bytes(execute(&d, &c, &[]));
    assert_eq!(v.len(), 32);
    assert_eq!(be64(&v[0..8]), (1 << 21) - 1);
    assert_eq!(be32(&v[8..12]), 512);
    assert_eq!(v[14], 0xc0, "LBPME and LBPRZ");
    let nd = Disk { discard: false, ..disk() };
    assert_eq!(bytes(execute(&nd, &c, &[]))[14], 0);
    // Beyond 2^32 blocks READ CAPACITY(10) says "use 16".
    let big = Disk { blocks: 1 << 33, ..disk() };
    let v = bytes(execute(&big, &[op::READ_CAPACITY_10, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]));
    assert_eq!(be32(&v[0..4]), u32::MAX);
    // An LBA without PMI is refused.
    assert_eq!(
        check(execute(&d, &[op::READ_CAPACITY_10, 0, 0, 0, 0, 1, 0, 0, 0, 0], &[])),
        Sense::INVALID_FIELD_IN_CDB
    );
}

#[test]
fn mode_sense_pages_and_write_protect_are_exact() {
    let d = disk();
    // MODE SENSE(6), caching page, block descriptor.
    let v = bytes(execute(&d, &[op::MODE_SENSE_6, 0, 0x08, 0, 255, 0], &[]));
    assert_eq!(v.len(), 4 + 8 + 20);
    assert_eq!(&v[..4], &[31, 0, 0x10, 8]);
    assert_eq!(&v[4..12], &[0, 0x20, 0, 0, 0, 0, 0x02, 0x00]);
    assert_eq!(&v[12..15], &[0x08, 0x12, 0x04], "caching page with WCE");
    // No block descriptor (DBD), control page.
    let v = bytes(execute(&d, &[op::MODE_SENSE_6, 0x08, 0x0a, 0, 255, 0], &[]));
    assert_eq!(v, vec![15, 0, 0x10, 0, 0x0a, 0x0a, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0]);
    // Read-only and descriptor sense show.
    let ro = Disk { read_only: true, descriptor_sense: true, write_cache: false, ..disk() };
    let v = bytes(execute(&ro, &[op::MODE_SENSE_6, 0x08, 0x3f, 0, 255, 0], &[]));
    assert_eq!(v[2], 0x90, "WP and DPOFUA");
    assert_eq!(&v[4..7], &[0x08, 0x12, 0x00], "no WCE");
    assert_eq!(&v[24..27], &[0x0a, 0x0a, 0x04], "D_SENSE");
    // MODE SENSE(10): all pages, 8-byte header.
    let mut c = [0u8; 10];
    c[0] = op::MODE_SENSE_10;
    c[2] = 0x3f;
    c[7..9].copy_from_slice(&512u16.to_be_bytes());
    let v = bytes(execute(&d, &c, &[]));
    assert_eq!(v.len(), 8 + 8 + 20 + 12);
    assert_eq!(be16(&v[0..2]) as usize, v.len() - 2);
    assert_eq!(v[3], 0x10);
    assert_eq!(be16(&v[6..8]), 8);
    // Changeable values: nothing is.
    let v = bytes(execute(&d, &[op::MODE_SENSE_6, 0x08, 0x48, 0, 255, 0], &[]));
    assert_eq!(&v[4..7], &[0x08, 0x12, 0x00]);
    // Saved values; an unknown page or subpage.
    assert_eq!(
        check(execute(&d, &[op::MODE_SENSE_6, 0, 0xc8, 0, 255, 0], &[])),
        Sense::SAVING_PARAMETERS_NOT_SUPPORTED
    );
    assert_eq!(check(execute(&d, &[op::MODE_SENSE_6, 0, 0x1c, 0, 255, 0], &[])), Sense::INVALID_FIELD_IN_CDB);
    assert_eq!(check(execute(&d, &[op::MODE_SENSE_6, 0, 0x08, 1, 255, 0], &[])), Sense::INVALID_FIELD_IN_CDB);
    // Allocation length cuts.
    assert_eq!(bytes(execute(&d, &[op::MODE_SENSE_6, 0, 0x08, 0, 4, 0], &[])), vec![31, 0, 0x10, 8]);
}

#[test]
fn reads_and_writes_become_range_checked_actions() {
    let d = disk();
    let end = 1u64 << 21;
    assert_eq!(execute(&d, &cdb10(op::READ_10, 8, 16), &[]), Action::Read { lba: 8, blocks: 16 });
    let mut w = cdb10(op::WRITE_10, 8, 16);
    w[1] = 0x08;
    assert_eq!(execute(&d, &w, &[]), Action::Write { lba: 8, blocks: 16, fua: true });
    assert_eq!(execute(&d, &cdb16(op::READ_16, end - 1, 1), &[]), Action::Read { lba: end - 1, blocks: 1 });
    assert_eq!(
        execute(&d, &cdb16(op::WRITE_16, end - 2, 2), &[]),
        Action::Write { lba: end - 2, blocks: 2, fua: false }
    );
    let mut r12 = [0u8; 12];
    r12[0] = op::READ_12;
    r12[2..6].copy_from_slice(&5u32.to_be_bytes());
    r12[6..10].copy_from_slice(&7u32.to_be_bytes());
    assert_eq!(execute(&d, &r12, &[]), Action::Read { lba: 5, blocks: 7 });
    // READ(6): 21-bit LBA, 0 means 256 blocks.
    assert_eq!(execute(&d, &[op::READ_6, 0x01, 0x02, 0x03, 0, 0], &[]), Action::Read { lba: 0x010203, blocks: 256 });
    // Zero blocks: nothing to move.
    assert_eq!(execute(&d, &cdb10(op::READ_10, 8, 0), &[]), Action::Data(vec![]));
    // Out of range, including overflow of lba + blocks.
    assert_eq!(check(execute(&d, &cdb16(op::READ_16, end, 1), &[])), Sense::LBA_OUT_OF_RANGE);
    assert_eq!(check(execute(&d, &cdb16(op::READ_16, end - 1, 2), &[])), Sense::LBA_OUT_OF_RANGE);
    assert_eq!(check(execute(&d, &cdb16(op::WRITE_16, u64::MAX, 2), &[])), Sense::LBA_OUT_OF_RANGE);
    // More than the maximum transfer length; protection information.
    assert_eq!(check(execute(&d, &cdb10(op::READ_10, 0, 2049), &[])), Sense::INVALID_FIELD_IN_CDB);
    let mut p = cdb10(op::READ_10, 0, 1);
    p[1] = 0x20;
    assert_eq!(check(execute(&d, &p, &[])), Sense::INVALID_FIELD_IN_CDB);
    // A read-only unit refuses writes (before the range).
    let ro = Disk { read_only: true, ..disk() };
    assert_eq!(check(execute(&ro, &cdb10(op::WRITE_10, 0, 1), &[])), Sense::WRITE_PROTECTED);
    assert_eq!(check(execute(&ro, &cdb16(op::WRITE_16, end, 1), &[])), Sense::WRITE_PROTECTED);
    assert_eq!(execute(&ro, &cdb10(op::READ_10, 0, 1), &[]), Action::Read { lba: 0, blocks: 1 });
}

#[test]
fn verify_and_synchronize_cache() {
    let d = disk();
    let end = 1u64 << 21;
    assert_eq!(execute(&d, &cdb10(op::VERIFY_10, 0, 8), &[]), Action::Data(vec![]));
    assert_eq!(check(execute(&d, &cdb16(op::VERIFY_16, end, 1), &[])), Sense::LBA_OUT_OF_RANGE);
    let mut bytchk = cdb10(op::VERIFY_10, 0, 8);
    bytchk[1] = 0x02;
    assert_eq!(check(execute(&d, &bytchk, &[])), Sense::INVALID_FIELD_IN_CDB);
    assert_eq!(execute(&d, &cdb10(op::SYNCHRONIZE_CACHE_10, 0, 0), &[]), Action::Flush);
    assert_eq!(execute(&d, &cdb16(op::SYNCHRONIZE_CACHE_16, end - 1, 1), &[]), Action::Flush);
    assert_eq!(check(execute(&d, &cdb16(op::SYNCHRONIZE_CACHE_16, end + 1, 0), &[])), Sense::LBA_OUT_OF_RANGE);
    assert_eq!(check(execute(&d, &cdb16(op::SYNCHRONIZE_CACHE_16, end - 1, 2), &[])), Sense::LBA_OUT_OF_RANGE);
}

fn unmap_list(ranges: &[(u64, u32)]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&((6 + 16 * ranges.len()) as u16).to_be_bytes());
    v.extend_from_slice(&((16 * ranges.len()) as u16).to_be_bytes());
    v.extend_from_slice(&[0; 4]);
    for &(lba, n) in ranges {
        v.extend_from_slice(&lba.to_be_bytes());
        v.extend_from_slice(&n.to_be_bytes());
        v.extend_from_slice(&[0; 4]);
    }
    v
}

#[test]
fn unmap_parses_its_parameter_list_and_checks_each_range() {
    let d = disk();
    let end = 1u64 << 21;
    let list = unmap_list(&[(0, 8), (100, 0), (end - 4, 4)]);
    let c = cdb10(op::UNMAP, 0, list.len() as u16);
    assert_eq!(execute(&d, &c, &list), Action::Unmap(vec![(0, 8), (end - 4, 4)]));
    // No parameter list: nothing to do.
    assert_eq!(execute(&d, &cdb10(op::UNMAP, 0, 0), &[]), Action::Unmap(vec![]));
    // A list shorter than its header; data-out shorter than the CDB says.
    assert_eq!(check(execute(&d, &cdb10(op::UNMAP, 0, 4), &list)), Sense::PARAMETER_LIST_LENGTH_ERROR);
    assert_eq!(check(execute(&d, &cdb10(op::UNMAP, 0, 24), &list[..6])), Sense::PARAMETER_LIST_LENGTH_ERROR);
    // A range past the end; one too long; too many descriptors.
    let bad = unmap_list(&[(end - 1, 2)]);
    assert_eq!(check(execute(&d, &cdb10(op::UNMAP, 0, bad.len() as u16), &bad)), Sense::LBA_OUT_OF_RANGE);
    let long = unmap_list(&[(0, MAX_UNMAP_BLOCKS + 1)]);
    assert_eq!(
        check(execute(&d, &cdb10(op::UNMAP, 0, long.len() as u16), &long)),
        Sense::INVALID_FIELD_IN_PARAMETER_LIST
    );
    let many = unmap_list(&vec![(0, 1); MAX_UNMAP_DESCRIPTORS as usize + 1]);
    assert_eq!(
        check(execute(&d, &cdb10(op::UNMAP, 0, many.len() as u16), &many)),
        Sense::INVALID_FIELD_IN_PARAMETER_LIST
    );
    // ANCHOR; a read-only unit.
    let mut anchor = cdb10(op::UNMAP, 0, 24);
    anchor[1] = 1;
    assert_eq!(check(execute(&d, &anchor, &list)), Sense::INVALID_FIELD_IN_CDB);
    let ro = Disk { read_only: true, ..disk() };
    assert_eq!(check(execute(&ro, &cdb10(op::UNMAP, 0, 24), &list)), Sense::WRITE_PROTECTED);
}

#[test]
fn write_same_unmaps_or_writes_zeros() {
    let d = disk();
    let zero = vec![0u8; 512];
    let mut ws = cdb16(op::WRITE_SAME_16, 64, 32);
    ws[1] = 0x08; // UNMAP
    assert_eq!(execute(&d, &ws, &zero), Action::Unmap(vec![(64, 32)]));
    ws[1] = 0x09; // UNMAP, NDOB: no data-out
    assert_eq!(execute(&d, &ws, &[]), Action::Unmap(vec![(64, 32)]));
    ws[1] = 0x00;
    assert_eq!(execute(&d, &ws, &zero), Action::WriteZeroes { lba: 64, blocks: 32 });
    let nd = Disk { discard: false, ..disk() };
    ws[1] = 0x08;
    assert_eq!(execute(&nd, &ws, &zero), Action::WriteZeroes { lba: 64, blocks: 32 });
    let mut ws10 = cdb10(op::WRITE_SAME_10, 64, 32);
    ws10[1] = 0x08;
    assert_eq!(execute(&d, &ws10, &zero), Action::Unmap(vec![(64, 32)]));
    // NDOB is not in the 10-byte form; zero blocks (WSNZ); a pattern.
    ws10[1] = 0x01;
    assert_eq!(check(execute(&d, &ws10, &zero)), Sense::INVALID_FIELD_IN_CDB);
    assert_eq!(check(execute(&d, &cdb16(op::WRITE_SAME_16, 0, 0), &zero)), Sense::INVALID_FIELD_IN_CDB);
    let mut pattern = zero.clone();
    pattern[7] = 1;
    assert_eq!(check(execute(&d, &cdb16(op::WRITE_SAME_16, 0, 1), &pattern)), Sense::INVALID_FIELD_IN_PARAMETER_LIST);
    assert_eq!(check(execute(&d, &cdb16(op::WRITE_SAME_16, 0, 1), &zero[..100])), Sense::PARAMETER_LIST_LENGTH_ERROR);
    assert_eq!(check(execute(&d, &cdb16(op::WRITE_SAME_16, 1 << 21, 1), &zero)), Sense::LBA_OUT_OF_RANGE);
    let ro = Disk { read_only: true, ..disk() };
    assert_eq!(check(execute(&ro, &cdb16(op::WRITE_SAME_16, 0, 1), &zero)), Sense::WRITE_PROTECTED);
}

#[test]
fn report_luns_in_flat_addressing() {
    let mut c = [0u8; 12];
    c[0] = op::REPORT_LUNS;
    c[6..10].copy_from_slice(&4096u32.to_be_bytes());
    let v = bytes(report_luns(&[0, 1, 300], &c));
    assert_eq!(
        v,
        vec![0, 0, 0, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0x41, 0x2c, 0, 0, 0, 0, 0, 0]
    );
    // Well-known units only: none; an unknown select report.
    c[2] = 0x01;
    assert_eq!(bytes(report_luns(&[0, 1], &c)), vec![0; 8]);
    c[2] = 0x11;
    assert_eq!(check(report_luns(&[0], &c)), Sense::INVALID_FIELD_IN_CDB);
    // Allocation length under 16 is refused; 16 cuts the list.
    c[2] = 0;
    c[6..10].copy_from_slice(&15u32.to_be_bytes());
    assert_eq!(check(report_luns(&[0], &c)), Sense::INVALID_FIELD_IN_CDB);
    c[6..10].copy_from_slice(&16u32.to_be_bytes());
    assert_eq!(bytes(report_luns(&[0, 1, 2], &c)).len(), 16);
}

#[test]
fn virtio_lun_fields_parse_and_round_trip_report_luns() {
    assert_eq!(parse_virtio_lun(&[1, 0, 0, 3, 0, 0, 0, 0]), Some((0, 3)));
    assert_eq!(parse_virtio_lun(&[1, 2, 0x41, 0x2c, 0, 0, 0, 0]), Some((2, 300)));
    assert_eq!(parse_virtio_lun(&[1, 0, 0xc1, 0x01, 0, 0, 0, 0]), Some((0, 0xc101)));
    for bad in
        [[0, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0x01, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 1], [1, 0, 0x80, 0, 0, 0, 0, 0]]
    {
        assert_eq!(parse_virtio_lun(&bad), None, "{bad:?}");
    }
}

#[test]
fn a_unit_that_is_not_there() {
    let v = bytes(no_such_unit(&[op::INQUIRY, 0, 0, 0, 36, 0]));
    assert_eq!(v[0], 0x7f);
    assert_eq!(v.len(), 36);
    assert_eq!(check(no_such_unit(&[op::INQUIRY, 1, 0x83, 0, 36, 0])), Sense::LUN_NOT_SUPPORTED);
    assert_eq!(check(no_such_unit(&cdb10(op::READ_10, 0, 1))), Sense::LUN_NOT_SUPPORTED);
    assert_eq!(check(no_such_unit(&[0; 6])), Sense::LUN_NOT_SUPPORTED);
    assert_eq!(bytes(no_such_unit(&[op::REQUEST_SENSE, 0, 0, 0, 18, 0])), Sense::LUN_NOT_SUPPORTED.fixed().to_vec());
}

fn rsoc(options: u8, opcode: u8, sa: u16, alloc: u32) -> [u8; 12] {
    let mut c = [0u8; 12];
    c[0] = op::MAINTENANCE_IN;
    c[1] = op::SA_REPORT_SUPPORTED_OPCODES as u8;
    c[2] = options;
    c[3] = opcode;
    c[4..6].copy_from_slice(&sa.to_be_bytes());
    c[6..10].copy_from_slice(&alloc.to_be_bytes());
    c
}

#[test]
fn report_supported_operation_codes() {
    let d = disk();
    let all = bytes(execute(&d, &rsoc(0, 0, 0, 4096), &[]));
    let n = be32(&all[0..4]) as usize;
    assert_eq!(n, all.len() - 4);
    assert_eq!(n % 8, 0);
    let descs: Vec<&[u8]> = all[4..].chunks(8).collect();
    assert_eq!(descs.len(), SUPPORTED.len());
    let rc16 = descs.iter().find(|d| d[0] == op::SERVICE_ACTION_IN_16).unwrap();
    assert_eq!(rc16, &&[0x9e, 0, 0, 0x10, 0, 0x01, 0, 16][..]);
    let read10 = descs.iter().find(|d| d[0] == op::READ_10).unwrap();
    assert_eq!(read10, &&[0x28, 0, 0, 0, 0, 0, 0, 10][..]);
    // Every command listed is one execute answers (not INVALID OPCODE).
    for c in descs {
        let mut cdb = [0u8; 16];
        cdb[0] = c[0];
        cdb[1] = c[3];
        if c[0] == op::REPORT_LUNS {
            continue;
        }
        assert_ne!(execute(&d, &cdb, &[]), Action::Check(Sense::INVALID_OPCODE), "{:#x}", c[0]);
    }
    // Without discard UNMAP is not listed.
    let nd = Disk { discard: false, ..disk() };
    let all = bytes(execute(&nd, &rsoc(0, 0, 0, 4096), &[]));
    assert!(all[4..].chunks(8).all(|d| d[0] != op::UNMAP));
    // One command: its usage map.
    assert_eq!(
        bytes(execute(&d, &rsoc(1, op::READ_10, 0, 64), &[])),
        vec![0, 3, 0, 10, 0x28, 0xe8, 0xff, 0xff, 0xff, 0xff, 0x00, 0xff, 0xff, 0x04]
    );
    let one = bytes(execute(&d, &rsoc(2, op::SERVICE_ACTION_IN_16, 0x10, 64), &[]));
    assert_eq!(&one[..4], &[0, 3, 0, 16]);
    // Not supported; the wrong option for a command with(out) service actions.
    assert_eq!(bytes(execute(&d, &rsoc(1, 0xc5, 0, 64), &[])), vec![0, 1, 0, 0]);
    assert_eq!(bytes(execute(&nd, &rsoc(1, op::UNMAP, 0, 64), &[])), vec![0, 1, 0, 0]);
    assert_eq!(check(execute(&d, &rsoc(1, op::SERVICE_ACTION_IN_16, 0, 64), &[])), Sense::INVALID_FIELD_IN_CDB);
    assert_eq!(check(execute(&d, &rsoc(2, op::READ_10, 0, 64), &[])), Sense::INVALID_FIELD_IN_CDB);
    assert_eq!(check(execute(&d, &rsoc(0x80, 0, 0, 64), &[])), Sense::INVALID_FIELD_IN_CDB, "RCTD");
    assert_eq!(check(execute(&d, &rsoc(5, 0, 0, 64), &[])), Sense::INVALID_FIELD_IN_CDB);
}

proptest! {
    /// Any CDB and data-out get an answer; data never exceeds the
    /// allocation a CDB allows, and actions stay on the disk.
    #[test]
    fn any_cdb_gets_an_answer(cdb in proptest::collection::vec(any::<u8>(), 0..32),
                              out in proptest::collection::vec(any::<u8>(), 0..600),
                              ro: bool, discard: bool) {
        let d = Disk { read_only: ro, discard, blocks: 4096, ..disk() };
        let a = execute(&d, &cdb, &out);
        // The data path's decoder answers READ and WRITE exactly as execute
        // does, given the whole CDB field of a request header.
        let mut field = [0u8; wire::CDB_SIZE];
        field[..cdb.len()].copy_from_slice(&cdb);
        let rw = cdb.first().is_some_and(|o| matches!(o, 0x08 | 0x0a | 0x28 | 0x2a | 0xa8 | 0xaa | 0x88 | 0x8a));
        let t = transfer(&d, &field);
        prop_assert_eq!(t.is_some(), rw);
        if let Some(t) = t {
            prop_assert_eq!(Action::from(t), execute(&d, &field, &out));
        }
        let in_disk = |lba: u64, n: u32| lba + n as u64 <= d.blocks;
        match a {
            Action::Read { lba, blocks } => prop_assert!(in_disk(lba, blocks) && blocks > 0),
            Action::Write { lba, blocks, .. } | Action::WriteZeroes { lba, blocks } => {
                prop_assert!(!ro && in_disk(lba, blocks) && blocks > 0)
            }
            Action::Unmap(r) => prop_assert!(!ro && r.iter().all(|&(l, n)| in_disk(l, n))),
            _ => {}
        }
        let _ = no_such_unit(&cdb);
        let _ = report_luns(&[0, 1, 2], &cdb);
    }

    /// Every READ and WRITE CDB (any fields, NACA, protection, range)
    /// decodes on the data path exactly as execute answers it.
    #[test]
    fn transfer_answers_as_execute(opcode in proptest::sample::select(vec![0x08u8, 0x0a, 0x28, 0x2a, 0xa8, 0xaa, 0x88, 0x8a]),
                                   rest in proptest::collection::vec(any::<u8>(), wire::CDB_SIZE - 1),
                                   small: bool, ro: bool) {
        // Small fields often, so that many land on the disk.
        let mut field = [0u8; wire::CDB_SIZE];
        field[0] = opcode;
        for (f, r) in field[1..].iter_mut().zip(&rest) {
            *f = if small { r & 0x07 } else { *r };
        }
        let d = Disk { read_only: ro, blocks: 4096, ..disk() };
        let t = transfer(&d, &field);
        prop_assert!(t.is_some());
        prop_assert_eq!(Action::from(t.unwrap()), execute(&d, &field, &[]));
    }
}
