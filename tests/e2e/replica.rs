//! The controller as its own process (the real `talos-upgrade-controller run` binary), for the suites
//! where what matters is between processes: leader election, shards. Each replica gets the flags a
//! Deployment would give it, with the tests' fast timings.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use tokio::process::{Child, Command};

/// The release catalog the replicas read (the user guide's releases).
pub const CATALOG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/release-catalog.yaml");

/// How one replica is started.
pub struct Replica<'a> {
    /// `HOSTNAME`: the replica's Lease identity and Events' reporting instance are `<host>-<pid>`.
    pub host: &'a str,
    /// `--namespace`; `None` watches every namespace.
    pub namespace: Option<&'a str>,
    /// `--leader-elect` with the Lease `(namespace, name)`; `None` runs without leader election.
    pub lease: Option<(&'a str, &'a str)>,
    /// `--watch-label-selector`: the shard.
    pub selector: Option<&'a str>,
    /// `--admin-listen`: where /metrics is served.
    pub admin_listen: String,
}

impl Replica<'_> {
    /// Starts the replica against the API server of `kubeconfig`. It dies with the test.
    pub fn start(&self, kubeconfig: &Path) -> Child {
        self.command(kubeconfig)
            .spawn()
            .expect("starting the controller binary")
    }

    /// [`Replica::start`], with its stdout and stderr captured (for `wait_with_output`).
    pub fn start_capturing(&self, kubeconfig: &Path) -> Child {
        self.command(kubeconfig)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the controller binary")
    }

    fn command(&self, kubeconfig: &Path) -> Command {
        let mut args: Vec<String> = [
            "run",
            "--poll-interval",
            "100ms",
            "--node-deadline",
            "60s",
            "--release-catalog",
            CATALOG,
        ]
        .map(String::from)
        .to_vec();
        args.extend(["--admin-listen".to_string(), self.admin_listen.clone()]);
        if let Some(namespace) = self.namespace {
            args.extend(["--namespace".to_string(), namespace.to_string()]);
        }
        if let Some((namespace, name)) = self.lease {
            // Short Lease times, so a standby takes over within seconds.
            args.extend(
                [
                    "--leader-elect",
                    "--leader-election-namespace",
                    namespace,
                    "--leader-election-lease",
                    name,
                    "--lease-duration",
                    "3s",
                    "--lease-grace",
                    "1s",
                ]
                .map(String::from),
            );
        }
        if let Some(selector) = self.selector {
            args.extend(["--watch-label-selector".to_string(), selector.to_string()]);
        }
        let mut command = Command::new(env!("CARGO_BIN_EXE_talos-upgrade-controller"));
        command
            .args(&args)
            .env("KUBECONFIG", kubeconfig)
            .env("HOSTNAME", self.host)
            .env_remove("POD_NAME")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }
}

/// The Lease identity of a replica started with `host`.
pub fn identity(host: &str, child: &Child) -> String {
    format!("{host}-{}", child.id().expect("a running replica"))
}

/// The holder of the Lease `name` in `namespace`, if held.
pub async fn holder(client: &kube::Client, namespace: &str, name: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    leases
        .get_opt(name)
        .await
        .expect("get lease")
        .and_then(|lease| lease.spec)
        .and_then(|spec| spec.holder_identity)
        .filter(|holder| !holder.is_empty())
}

/// A loopback address with a port free right now, for a replica's `--admin-listen`.
pub fn free_admin_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let address = listener.local_addr().expect("its address");
    format!("{address}")
}

/// GET `http://<address>/metrics`, retried until the replica serves it.
pub async fn scrape(address: &str) -> String {
    let url = format!("http://{address}/metrics");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match http_get(address, "/metrics").await {
            Ok(body) => return body,
            Err(error) if tokio::time::Instant::now() > deadline => {
                panic!("scraping {url}: {error}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// A plain HTTP/1.0 GET over loopback (the admin server speaks HTTP/1.1; no client crate needed).
async fn http_get(address: &str, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no HTTP response: {response:?}")))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(std::io::Error::other(format!("GET {path}: {head}")));
    }
    Ok(body.to_string())
}
