//! Envelope encode+checksum and decode+validate throughput.
//!
//! `cargo bench -p trellara-common --bench envelope`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use trellara_common::envelope::{decode, encode, encode_into};
use trellara_common::sample;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("envelope");
    for (label, rows, text_len) in [
        ("rows=1/value=32B", 1, 32),
        ("rows=100/value=32B", 100, 32),
        ("rows=1000/value=256B", 1000, 256),
    ] {
        let envelope = sample::insert_transaction(rows, text_len);
        let bytes = encode(&envelope).expect("sample envelope is valid");
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        let mut buf = Vec::with_capacity(bytes.len());
        group.bench_function(format!("encode+checksum/{label}"), |b| {
            b.iter(|| {
                buf.clear();
                encode_into(black_box(&envelope), &mut buf).expect("valid");
                black_box(buf.len())
            })
        });
        group.bench_function(format!("validate/{label}"), |b| {
            b.iter(|| trellara_common::envelope::validate(black_box(&envelope)).expect("valid"))
        });
        group.bench_function(format!("decode+validate/{label}"), |b| {
            b.iter(|| decode(black_box(&bytes)).expect("valid"))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
