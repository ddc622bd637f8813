fn main() -> Result<(), Box<dyn std::error::Error>> {
    // backend=kserve's client; protox parses the .proto in Rust, so no protoc is needed.
    println!("cargo:rerun-if-changed=proto/inference.proto");
    let files = protox::compile(["inference.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .compile_fds(files)?;
    Ok(())
}
