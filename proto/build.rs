//! Generates Rust code for proto/sluice/v1/*.proto with the system `protoc`
//! (Debian: `apt-get install protobuf-compiler`; or set PROTOC).

fn main() {
    let protos = ["proto/sluice/v1/generate.proto", "proto/sluice/v1/workers.proto", "proto/sluice/v1/kvstore.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    if let Err(e) = tonic_prost_build::configure().compile_protos(&protos, &["proto"]) {
        panic!(
            "compiling {protos:?} failed: {e}\nprotoc is needed: `apt-get install protobuf-compiler` (or set PROTOC to its path)"
        );
    }
}
