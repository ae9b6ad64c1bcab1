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
    // The protos live at the top of the repository (`proto/`), beside the crates. The package directory
    // is read when the script runs, not when it is compiled, and the paths cargo watches are relative to
    // it: checkouts of the repository that share one target directory (git worktrees) then each generate
    // from their own protos instead of from the checkout that compiled the script.
    let package = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let relative = Path::new("../../proto");
    let root = package.join(relative);
    let mut files = Vec::new();
    collect_protos(&root, &mut files)?;
    files.sort();
    println!("cargo:rerun-if-changed={}", relative.display());
    for file in &files {
        let watched = file.strip_prefix(&package).unwrap_or(file);
        println!("cargo:rerun-if-changed={}", watched.display());
    }
    let descriptors = protox::compile(&files, [&root])?;
    // The client half is what the controller uses; the server half only serves the Talos node simulator,
    // which asks for it with the `server` feature.
    let server = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    tonic_prost_build::configure()
        .build_server(server)
        .build_client(true)
        // prost's codec with a small first encode buffer (see src/codec.rs).
        .codec_path("crate::codec::TalosCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
