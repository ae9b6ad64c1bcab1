//! The repository's build scripts (scripts/build-talosctl.sh, build-helm.sh, build-image.sh,
//! build-conformance.sh), run the way tests and the benchmark use them: each builds something into a
//! cache (or finds it there) and prints where it is as its last line of stdout.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `scripts/<name>` of the repository this crate is part of.
pub fn path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts")
        .join(name)
}

/// Runs `bash <script> <args>` with `env` added and returns its stdout, or why it failed (naming the
/// script). Its stderr is inherited, so a build's progress shows; its stdin is closed.
pub fn try_stdout(script: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String, String> {
    let shown = std::iter::once(script.display().to_string())
        .chain(args.iter().map(|a| a.to_string()))
        .collect::<Vec<_>>()
        .join(" ");
    let output = Command::new("bash")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running {shown}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{shown} failed with {}", output.status));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// [`try_stdout`]'s last line, trimmed: the path or reference the script printed.
pub fn try_last_line(script: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<String, String> {
    let stdout = try_stdout(script, args, env)?;
    stdout
        .lines()
        .last()
        .map(|line| line.trim().to_string())
        .filter(|line| !line.is_empty())
        .ok_or_else(|| format!("{} printed nothing on stdout", script.display()))
}

/// [`try_stdout`], panicking (failing the test loudly, naming the script) when the script fails.
pub fn stdout(script: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    try_stdout(script, args, env).unwrap_or_else(|e| panic!("{e}"))
}

/// [`try_last_line`], panicking (failing the test loudly, naming the script) when the script fails or
/// prints nothing.
pub fn last_line(script: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    try_last_line(script, args, env).unwrap_or_else(|e| panic!("{e}"))
}

/// The binary a build script printed the path of as its last line; panics unless it is a file.
pub fn binary(script: &Path, args: &[&str]) -> PathBuf {
    let path = PathBuf::from(last_line(script, args, &[]));
    assert!(
        path.is_file(),
        "{} printed {}, which is not a file",
        script.display(),
        path.display()
    );
    path
}
