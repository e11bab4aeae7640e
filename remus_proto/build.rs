fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/remus.proto");
    tonic_prost_build::configure().compile_protos(&["proto/remus.proto"], &["proto"])?;
    Ok(())
}
