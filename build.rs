//! Generates the Talos gRPC client and server code from proto/ with protox (no protoc needed).

use std::path::{Path, PathBuf};

fn collect_protos(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_protos(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new("proto");
    let mut files = Vec::new();
    collect_protos(root, &mut files)?;
    files.sort();
    println!("cargo:rerun-if-changed=proto");
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let descriptors = protox::compile(&files, [root])?;
    // The server half serves the Talos node simulator; the client half is what the controller uses.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // prost's codec with a small first encode buffer (see src/grpc_codec.rs).
        .codec_path("crate::grpc_codec::TalosCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
