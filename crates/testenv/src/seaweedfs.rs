//! A real S3-compatible server for the tests: SeaweedFS (`weed server -s3`: master, volume server,
//! filer and S3 gateway in one process), built by scripts/build-seaweedfs.sh, on 127.0.0.1 with free
//! ports, a temporary data directory and one identity with random keys. It dies with the test
//! process. A server that cannot start fails the test that asked for it, with its log.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::control_plane::{free_port, random_token, wait_for_port};
use crate::process::ManagedProcess;
use crate::{Error, Result};

/// The `weed` binary scripts/build-seaweedfs.sh built (or found in its cache); panics, naming the
/// script, when it cannot be had.
pub fn weed_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| crate::script::binary(&crate::script::path("build-seaweedfs.sh"), &[]))
}

/// A running SeaweedFS with an S3 gateway.
pub struct S3Server {
    process: ManagedProcess,
    dir: PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl S3Server {
    /// Starts one and waits for its S3 port. Buckets are created by the first upload to them
    /// (SeaweedFS's `-s3.autoCreateBucket`, for the admin identity the server is given).
    pub async fn start() -> Result<S3Server> {
        let weed = weed_binary();
        let dir = std::env::temp_dir().join(format!(
            "tuc-seaweedfs-{}-{}",
            std::process::id(),
            random_token()?.get(..8).unwrap_or("x")
        ));
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let access_key_id = format!("tuc{}", &random_token()?[..12]);
        let secret_access_key = random_token()?;
        let config = serde_json::json!({
            "identities": [{
                "name": "tuc",
                "credentials": [{"accessKey": access_key_id, "secretKey": secret_access_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]
        });
        let config_path = dir.join("s3.json");
        std::fs::write(&config_path, config.to_string())
            .map_err(|e| Error::io(format!("writing {}", config_path.display()), e))?;
        let mut ports = Vec::new();
        for _ in 0..8 {
            ports.push(free_port()?);
        }
        let [
            master,
            master_grpc,
            volume,
            volume_grpc,
            filer,
            filer_grpc,
            s3,
            s3_grpc,
        ] = <[u16; 8]>::try_from(ports).expect("eight ports");
        let loopback = Ipv4Addr::LOCALHOST.to_string();
        let mut command = Command::new(weed);
        command
            .arg("server")
            .arg(format!("-ip={loopback}"))
            .arg(format!("-ip.bind={loopback}"))
            .arg(format!("-dir={}", dir.display()))
            .arg(format!("-master.port={master}"))
            .arg(format!("-master.port.grpc={master_grpc}"))
            .arg("-master.volumeSizeLimitMB=64")
            .arg(format!("-volume.port={volume}"))
            .arg(format!("-volume.port.grpc={volume_grpc}"))
            .arg("-volume.max=8")
            .arg("-filer")
            .arg(format!("-filer.port={filer}"))
            .arg(format!("-filer.port.grpc={filer_grpc}"))
            .arg("-s3")
            .arg(format!("-s3.port={s3}"))
            .arg(format!("-s3.port.grpc={s3_grpc}"))
            // Its Iceberg and Lance catalogs listen on fixed ports by default: off, so two servers
            // can run side by side.
            .arg("-s3.port.iceberg=0")
            .arg("-s3.port.lance=0")
            .arg(format!("-s3.config={}", config_path.display()))
            .current_dir(&dir);
        let process = ManagedProcess::spawn("seaweedfs", command, &dir.join("weed.log"))?;
        wait_for_port(&process, s3, Duration::from_secs(60)).await?;
        Ok(S3Server {
            process,
            dir,
            endpoint: format!("http://{loopback}:{s3}"),
            access_key_id,
            secret_access_key,
        })
    }

    /// The last lines of its log, for a failure message.
    pub fn log_tail(&self) -> String {
        self.process.log_tail(40)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.process.stop(Duration::from_secs(5));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
