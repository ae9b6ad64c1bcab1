//! Finding the kube-apiserver, kube-controller-manager, etcd and kubectl binaries built by `scripts/build-k8s-bins.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, Result};

/// Environment variable naming the directory that holds `kube-apiserver`, `kube-controller-manager`,
/// `etcd` and `kubectl`.
pub const BIN_DIR_ENV: &str = "TUC_K8S_BIN_DIR";

/// The binaries of the test control plane.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub dir: PathBuf,
}

impl Binaries {
    /// Uses `$TUC_K8S_BIN_DIR` when set; otherwise runs the build script, which answers at once from its
    /// cache when the binaries were built before (and builds them, loudly and slowly, when not).
    pub fn locate() -> Result<Self> {
        let dir = match std::env::var_os(BIN_DIR_ENV) {
            Some(dir) => PathBuf::from(dir),
            None => Self::build()?,
        };
        let bins = Binaries { dir };
        for name in [
            "kube-apiserver",
            "kube-controller-manager",
            "etcd",
            "kubectl",
        ] {
            let path = bins.dir.join(name);
            if !is_executable(&path) {
                return Err(Error::Binaries(format!(
                    "{} is missing or not executable; run scripts/build-k8s-bins.sh and set {BIN_DIR_ENV} to \
                     the directory it prints",
                    path.display()
                )));
            }
        }
        Ok(bins)
    }

    pub fn kube_apiserver(&self) -> PathBuf {
        self.dir.join("kube-apiserver")
    }

    pub fn kube_controller_manager(&self) -> PathBuf {
        self.dir.join("kube-controller-manager")
    }

    pub fn etcd(&self) -> PathBuf {
        self.dir.join("etcd")
    }

    pub fn kubectl(&self) -> PathBuf {
        self.dir.join("kubectl")
    }

    fn build() -> Result<PathBuf> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-k8s-bins.sh");
        let output = Command::new("bash")
            .arg(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| Error::io(format!("running {}", script.display()), e))?;
        if !output.status.success() {
            return Err(Error::Binaries(format!(
                "{} failed with {}",
                script.display(),
                output.status
            )));
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        let dir = stdout.lines().last().unwrap_or_default().trim();
        if dir.is_empty() {
            return Err(Error::Binaries(format!(
                "{} printed no directory",
                script.display()
            )));
        }
        Ok(PathBuf::from(dir))
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}
