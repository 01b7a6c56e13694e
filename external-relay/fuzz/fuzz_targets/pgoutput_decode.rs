//! The first byte picks the decode context (protocol version, stream block);
//! the rest is one pgoutput message. Any panic is a bug.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use trellara_external_relay::pgoutput::{DecodeContext, ProtoVersion, decode};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    let ctx = DecodeContext {
        version: if mode & 1 == 0 { ProtoVersion::V1 } else { ProtoVersion::V2 },
        in_stream_block: mode & 2 != 0,
    };
    let _ = decode(&Bytes::copy_from_slice(payload), ctx);
});
