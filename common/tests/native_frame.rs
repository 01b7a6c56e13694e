//! Native frames: round trips for any envelope bytes and frame size, every
//! corrupted byte refused, missing or reordered frames refused.

use proptest::prelude::*;
use trellara_common::envelope;
use trellara_common::native_frame::{
    FrameHeader, HEADER_LEN, MAX_FRAME_BYTES, MIN_FRAME_BYTES, Reassembler, encode_frames,
};
use trellara_common::sample;

fn frames(lsn: u64, index: u32, bytes: &[u8], size: usize) -> Vec<Vec<u8>> {
    encode_frames(lsn, index, bytes, size)
        .expect("valid frame size")
        .collect()
}

fn reassemble(all: &[Vec<u8>], max: usize) -> Result<Vec<Vec<u8>>, String> {
    let mut r = Reassembler::new(max);
    let mut out = Vec::new();
    for f in all {
        if let Some(bytes) = r.push(f).map_err(|e| e.to_string())? {
            out.push(bytes);
        }
    }
    r.finish().map_err(|e| e.to_string())?;
    Ok(out)
}

#[test]
fn sample_envelopes_round_trip_through_frames() {
    for (i, env) in [
        sample::mixed_transaction(),
        sample::insert_transaction(500, 300),
        sample::partitioned_chunk(),
    ]
    .iter()
    .enumerate()
    {
        let bytes = envelope::encode(env).expect("sample encodes");
        for size in [MIN_FRAME_BYTES, 100, 4096, MAX_FRAME_BYTES] {
            let f = frames(0x16_B374_D848, 0, &bytes, size);
            assert!(f.iter().all(|f| f.len() <= size), "sample {i} size {size}");
            let out = reassemble(&f, 1 << 24).expect("frames reassemble");
            assert_eq!(out.len(), 1);
            let mut decoded = envelope::decode(&out[0]).expect("decodes");
            decoded.checksum = 0;
            assert_eq!(&decoded, env, "sample {i} size {size}");
        }
    }
}

fn frame_size() -> impl Strategy<Value = usize> {
    prop_oneof![
        MIN_FRAME_BYTES..MIN_FRAME_BYTES + 64,
        MIN_FRAME_BYTES..4096usize,
        Just(MAX_FRAME_BYTES),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_any_size_round_trip(
        bytes in proptest::collection::vec(any::<u8>(), 1..6000),
        size in frame_size(),
        lsn in any::<u64>(),
        index in 0u32..4,
    ) {
        let f = frames(lsn, index, &bytes, size);
        let payload = size - HEADER_LEN;
        prop_assert_eq!(f.len(), bytes.len().div_ceil(payload));
        for (i, frame) in f.iter().enumerate() {
            prop_assert!(frame.len() <= size);
            let (h, _) = FrameHeader::parse(frame).expect("own frame parses");
            prop_assert_eq!(h.frame_index as usize, i);
            prop_assert_eq!(h.commit_lsn, lsn);
            prop_assert_eq!(h.envelope_index, index);
            prop_assert_eq!(h.is_last(), i + 1 == f.len());
        }
        if index == 0 {
            let out = reassemble(&f, bytes.len()).expect("reassembles at exactly its size");
            prop_assert_eq!(out, vec![bytes.clone()]);
            if bytes.len() > 1 {
                prop_assert!(reassemble(&f, bytes.len() - 1).is_err(), "size limit enforced");
            }
        }
    }

    #[test]
    fn every_corrupted_byte_is_detected(
        bytes in proptest::collection::vec(any::<u8>(), 1..600),
        size in MIN_FRAME_BYTES..300usize,
        pick in any::<prop::sample::Index>(),
        offset in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let mut f = frames(42, 0, &bytes, size);
        let which = pick.index(f.len());
        let at = offset.index(f[which].len());
        f[which][at] ^= flip;
        prop_assert!(FrameHeader::parse(&f[which]).is_err(), "frame {} byte {} ^ {:#x} accepted", which, at, flip);
        prop_assert!(reassemble(&f, 1 << 20).is_err());
    }

    #[test]
    fn missing_or_reordered_frames_are_refused(
        bytes in proptest::collection::vec(any::<u8>(), 2..600),
        size in MIN_FRAME_BYTES..120usize,
        a in any::<prop::sample::Index>(),
        b in any::<prop::sample::Index>(),
    ) {
        let f = frames(42, 0, &bytes, size);
        prop_assume!(f.len() >= 2);
        let (i, j) = (a.index(f.len()), b.index(f.len()));
        let mut missing = f.clone();
        missing.remove(i);
        prop_assert!(reassemble(&missing, 1 << 20).is_err(), "frame {} dropped but accepted", i);
        prop_assume!(i != j);
        let mut swapped = f.clone();
        swapped.swap(i, j);
        prop_assert!(reassemble(&swapped, 1 << 20).is_err(), "frames {} and {} swapped but accepted", i, j);
        let mut duplicated = f.clone();
        duplicated.insert(i, f[i].clone());
        prop_assert!(reassemble(&duplicated, 1 << 20).is_err(), "frame {} duplicated but accepted", i);
    }
}
