//! Generates the envelope types from proto/ with protox (a pure-Rust protobuf
//! compiler), so building needs no system protoc.

#[cfg(not(feature = "envelope"))]
fn main() {}

#[cfg(feature = "envelope")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = "../proto";
    let file = "trellara/v1/envelope.proto";
    println!("cargo:rerun-if-changed={proto_root}/{file}");
    let descriptors = protox::compile([file], [proto_root])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
