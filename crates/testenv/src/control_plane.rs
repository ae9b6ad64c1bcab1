//! Starting, using and stopping etcd + kube-apiserver.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::kubeconfig::{self, Identity};
use crate::pki::ControlPlanePki;
use crate::process::ManagedProcess;
use crate::{Binaries, Error, Result};

/// How long kube-apiserver may take to report ready. A cold start on 2 busy cores takes 10–40 s.
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(180);
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Lines of each log shown when a test fails.
const LOG_TAIL_LINES: usize = 60;
const DIR_PREFIX: &str = "tuc-testenv-";

/// The process ids of a running control plane.
#[derive(Debug, Clone, Copy)]
pub struct ProcessIds {
    pub kube_apiserver: u32,
    pub etcd: u32,
}

/// A running etcd + kube-apiserver pair on loopback.
pub struct ControlPlane {
    server: String,
    ca_pem: String,
    admin_token: String,
    admin_kubeconfig: PathBuf,
    bins: Binaries,
    dir: PathBuf,
    // Field order is drop order: the controller manager, then the apiserver, then its etcd.
    controller_manager: ManagedProcess,
    apiserver: ManagedProcess,
    /// kube-apiserver's arguments, to start it again the same way (see [`ControlPlane::restart_apiserver`]).
    apiserver_args: Vec<String>,
    etcd: ManagedProcess,
}

impl ControlPlane {
    /// The control plane shared by every test of this test binary, started on first use.
    ///
    /// Panics (failing the calling test loudly, with the component logs) when it cannot start: a test that
    /// needs the API server never silently skips.
    pub fn shared() -> &'static ControlPlane {
        static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
        let mut first = false;
        let started = SHARED.get_or_init(|| {
            first = true;
            Self::start_blocking().map_err(|e| e.to_string())
        });
        match started {
            Ok(control_plane) => {
                if first {
                    control_plane.watch_for_crashes();
                }
                control_plane
            }
            Err(error) => panic!("the test control plane could not start: {error}"),
        }
    }

    /// If etcd or kube-apiserver dies under a running test binary, every later request would hang until
    /// its timeout and fail without saying why. Instead, print both logs and end the test binary at once.
    fn watch_for_crashes(&'static self) {
        std::thread::Builder::new()
            .name("testenv-watchdog".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(200));
                    for process in [&self.etcd, &self.apiserver, &self.controller_manager] {
                        if let Some(status) = process.crashed() {
                            // Written to the raw stderr handle: the test harness's output capture would
                            // swallow eprintln! from a process that is about to exit.
                            use std::io::Write;
                            let _ = writeln!(
                                std::io::stderr(),
                                "\ntestenv: {} exited unexpectedly ({status}); the control plane at {} is \
                                 gone, failing this test binary.\n{}",
                                process.name(),
                                self.server,
                                self.failure_report()
                            );
                            std::process::exit(101);
                        }
                    }
                }
            })
            .expect("spawning the testenv watchdog");
    }

    /// Starts a control plane from synchronous code, or from inside a Tokio runtime (on a helper thread, so
    /// the readiness checks do not block the caller's runtime).
    pub fn start_blocking() -> Result<ControlPlane> {
        std::thread::spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::io("building a Tokio runtime", e))?
                .block_on(ControlPlane::start())
        })
        .join()
        .unwrap_or_else(|_| {
            Err(Error::Client(
                "the control plane start thread panicked".into(),
            ))
        })
    }

    /// Starts etcd and kube-apiserver in a new temporary directory and waits until the API is ready.
    pub async fn start() -> Result<ControlPlane> {
        let bins = Binaries::locate()?;
        remove_stale_dirs();
        // Free ports are picked by binding port 0 and releasing it; another process can take one in between,
        // so a start that fails on a taken port is retried with new ports.
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(&bins).await {
                Err(Error::Start { ref logs, .. })
                    if attempt < 3 && logs.contains("address already in use") =>
                {
                    continue;
                }
                result => return result,
            }
        }
    }

    async fn start_once(bins: &Binaries) -> Result<ControlPlane> {
        let dir = new_dir()?;
        let pki = ControlPlanePki::generate()?;
        let write = |name: &str, contents: &str| -> Result<PathBuf> {
            let path = dir.join(name);
            fs::write(&path, contents)
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
            Ok(path)
        };
        // Not used by the apiserver; there for people poking at it with curl --cacert.
        write("ca.crt", &pki.ca_pem)?;
        let serving_cert = write("apiserver.crt", &pki.serving_cert_pem)?;
        let serving_key = write("apiserver.key", &pki.serving_key_pem)?;
        let sa_key = write("sa.key", &pki.service_account_key_pem)?;
        let sa_pub = write("sa.pub", &pki.service_account_public_pem)?;
        let admin_token = random_token()?;
        let tokens = write(
            "tokens.csv",
            &format!("{admin_token},testenv-admin,testenv-admin-uid,\"system:masters\"\n"),
        )?;

        let etcd_client = free_port()?;
        let etcd_peer = free_port()?;
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let etcd_peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let mut etcd_cmd = Command::new(bins.etcd());
        etcd_cmd.args([
            "--name=testenv".to_string(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={etcd_peer_url}"),
            format!("--initial-advertise-peer-urls={etcd_peer_url}"),
            format!("--initial-cluster=testenv={etcd_peer_url}"),
            // Test data is thrown away; fsync only costs time.
            "--unsafe-no-fsync".to_string(),
            "--log-level=warn".to_string(),
        ]);
        let etcd = ManagedProcess::spawn("etcd", etcd_cmd, &dir.join("etcd.log"))?;
        wait_for_port(&etcd, etcd_client, ETCD_READY_TIMEOUT).await?;

        let apiserver_port = free_port()?;
        let server = format!("https://127.0.0.1:{apiserver_port}");
        let apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".to_string(),
            "--advertise-address=127.0.0.1".to_string(),
            format!("--secure-port={apiserver_port}"),
            format!("--cert-dir={}", dir.join("pki").display()),
            format!("--tls-cert-file={}", serving_cert.display()),
            format!("--tls-private-key-file={}", serving_key.display()),
            format!("--token-auth-file={}", tokens.display()),
            "--authorization-mode=RBAC".to_string(),
            format!("--service-account-issuer={server}"),
            format!("--service-account-key-file={}", sa_pub.display()),
            format!("--service-account-signing-key-file={}", sa_key.display()),
            "--service-cluster-ip-range=10.0.0.0/24".to_string(),
            "--allow-privileged=true".to_string(),
            // Only the disruption controller runs (below), so nothing would create the default
            // ServiceAccount pods need.
            "--disable-admission-plugins=ServiceAccount".to_string(),
            // Flow control only costs CPU on a 2-core test machine with a single client.
            "--enable-priority-and-fairness=false".to_string(),
        ];
        let mut apiserver_cmd = Command::new(bins.kube_apiserver());
        apiserver_cmd.args(&apiserver_args);
        let apiserver =
            ManagedProcess::spawn("kube-apiserver", apiserver_cmd, &dir.join("apiserver.log"))?;

        let admin_kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(
            &admin_kubeconfig,
            &server,
            &pki.ca_pem,
            &Identity::Token(admin_token.clone()),
            "default",
        )?;
        // The eviction API only lets a pod go when its PodDisruptionBudget's status allows it, and that
        // status is computed by the disruption controller. No other controller runs: the node lifecycle
        // controller would mark the simulated nodes NotReady, and the rest are not needed.
        let mut controller_manager_cmd = Command::new(bins.kube_controller_manager());
        controller_manager_cmd.args([
            format!("--kubeconfig={}", admin_kubeconfig.display()),
            "--controllers=disruption".to_string(),
            "--leader-elect=false".to_string(),
            // No serving endpoint: nothing scrapes it, and a fixed default port would clash between
            // test binaries running at once.
            "--secure-port=0".to_string(),
            "--use-service-account-credentials=false".to_string(),
        ]);
        let controller_manager = ManagedProcess::spawn(
            "kube-controller-manager",
            controller_manager_cmd,
            &dir.join("controller-manager.log"),
        )?;
        let control_plane = ControlPlane {
            server,
            ca_pem: pki.ca_pem,
            admin_token,
            admin_kubeconfig,
            bins: bins.clone(),
            dir,
            controller_manager,
            apiserver,
            apiserver_args,
            etcd,
        };
        control_plane.wait_ready().await?;
        Ok(control_plane)
    }

    /// Polls `/readyz` and then the `default` namespace, failing fast (with logs) if a process exits.
    async fn wait_ready(&self) -> Result<()> {
        let client = self.client().await?;
        let deadline = Instant::now() + APISERVER_READY_TIMEOUT;
        let mut last_error = String::from("no answer yet");
        loop {
            for process in [&self.etcd, &self.apiserver] {
                if let Some(status) = process.exited() {
                    return Err(self.start_error(
                        process.name(),
                        format!("{} exited with {status}", process.name()),
                    ));
                }
            }
            if Instant::now() > deadline {
                return Err(self.start_error(
                    "kube-apiserver",
                    format!(
                        "not ready after {}s (last answer: {last_error})",
                        APISERVER_READY_TIMEOUT.as_secs()
                    ),
                ));
            }
            match self.readyz(&client).await {
                Ok(body) if body.trim() == "ok" => {
                    match Api::<Namespace>::all(client.clone()).get("default").await {
                        Ok(_) => return Ok(()),
                        Err(e) => last_error = format!("namespace default: {e}"),
                    }
                }
                Ok(body) => last_error = body,
                Err(e) => last_error = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The body of `GET /readyz` (`ok` when ready; with `verbose`, one line per check).
    pub async fn readyz(&self, client: &Client) -> Result<String> {
        let request = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(|e| Error::Client(e.to_string()))?;
        Ok(client.request_text(request).await?)
    }

    fn start_error(&self, component: &'static str, reason: String) -> Error {
        Error::Start {
            component,
            reason,
            logs: self.failure_report(),
        }
    }

    /// The tail of the apiserver and etcd logs, for a failing test's output.
    pub fn failure_report(&self) -> String {
        let mut report = String::new();
        for process in [&self.apiserver, &self.etcd, &self.controller_manager] {
            report.push_str(&format!(
                "===== {} log (pid {}, last {LOG_TAIL_LINES} lines of {}) =====\n{}\n",
                process.name(),
                process.pid(),
                process.log_path().display(),
                process.log_tail(LOG_TAIL_LINES)
            ));
        }
        report
    }

    /// `https://127.0.0.1:PORT` of the API server.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// PEM of the CA that signed the API server's serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    pub fn binaries(&self) -> &Binaries {
        &self.bins
    }

    /// A kubeconfig for the admin user (`system:masters`), for `kubectl` and for the demo.
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The temporary directory holding certificates, logs and kubeconfigs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A client with cluster-admin rights (`system:masters`).
    pub async fn client(&self) -> Result<Client> {
        self.client_for(&Identity::Token(self.admin_token.clone()), "default")
            .await
    }

    /// A client that impersonates `user` in `groups`, so RBAC decides what it may do.
    pub async fn client_as_user(&self, user: &str, groups: &[&str]) -> Result<Client> {
        self.client_for(&self.impersonation(user, groups), "default")
            .await
    }

    /// A client authenticated with a real token of the ServiceAccount `namespace/name` (created if missing).
    pub async fn client_for_service_account(&self, namespace: &str, name: &str) -> Result<Client> {
        let token = self.service_account_token(namespace, name).await?;
        self.client_for(&Identity::Token(token), namespace).await
    }

    /// A token of the ServiceAccount `namespace/name` from the TokenRequest API (the account is created if
    /// missing).
    pub async fn service_account_token(&self, namespace: &str, name: &str) -> Result<String> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client().await?, namespace);
        if accounts.get_opt(name).await?.is_none() {
            let account = ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    ..ObjectMeta::default()
                },
                ..ServiceAccount::default()
            };
            accounts.create(&PostParams::default(), &account).await?;
        }
        let request = TokenRequest {
            spec: TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..TokenRequestSpec::default()
            },
            ..TokenRequest::default()
        };
        let answer = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await?;
        answer.status.map(|status| status.token).ok_or_else(|| {
            Error::Client(format!(
                "TokenRequest for {namespace}/{name} returned no token"
            ))
        })
    }

    fn impersonation(&self, user: &str, groups: &[&str]) -> Identity {
        Identity::Impersonate {
            admin_token: self.admin_token.clone(),
            user: user.to_string(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        }
    }

    async fn client_for(&self, identity: &Identity, namespace: &str) -> Result<Client> {
        let yaml = kubeconfig::render(&self.server, &self.ca_pem, identity, namespace);
        let parsed = Kubeconfig::from_yaml(&yaml).map_err(|e| Error::Client(e.to_string()))?;
        let config = Config::from_custom_kubeconfig(parsed, &KubeConfigOptions::default())
            .await
            .map_err(|e| Error::Client(e.to_string()))?;
        Client::try_from(config).map_err(|e| Error::Client(e.to_string()))
    }

    fn write_kubeconfig(&self, path: &Path, identity: &Identity, namespace: &str) -> Result<()> {
        write_kubeconfig(path, &self.server, &self.ca_pem, identity, namespace)
    }

    /// Creates a fresh namespace `<prefix>-<n>` and returns a guard for one test.
    pub async fn test_namespace(&'static self, prefix: &str) -> TestNamespace {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let client = match self.client().await {
            Ok(client) => client,
            Err(e) => panic!("admin client: {e}\n{}", self.failure_report()),
        };
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        if let Err(e) = Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await
        {
            panic!("creating namespace {name}: {e}\n{}", self.failure_report());
        }
        let kubeconfig = self.dir.join(format!("{name}.kubeconfig"));
        if let Err(e) = self.write_kubeconfig(
            &kubeconfig,
            &Identity::Token(self.admin_token.clone()),
            &name,
        ) {
            panic!("{e}");
        }
        TestNamespace {
            name,
            client,
            kubeconfig,
            control_plane: self,
        }
    }

    /// Restarts kube-apiserver on the same port, with the same data (etcd keeps running), and waits until
    /// it is ready again: what clients see when the API server is upgraded or crashes and comes back.
    pub async fn restart_apiserver(&self) -> Result<()> {
        let mut command = Command::new(self.bins.kube_apiserver());
        command.args(&self.apiserver_args);
        self.apiserver.restart(command, Duration::from_secs(10))?;
        self.wait_ready().await
    }

    /// The process ids of kube-apiserver and etcd, for measuring what they cost (the benchmark).
    pub fn process_ids(&self) -> ProcessIds {
        ProcessIds {
            kube_apiserver: self.apiserver.pid(),
            etcd: self.etcd.pid(),
        }
    }

    /// Stops etcd (as a test of what the apiserver and our clients do without it).
    pub fn stop_etcd(&self) {
        self.etcd.stop(Duration::from_secs(5));
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.apiserver.stop(Duration::from_secs(10));
        self.etcd.stop(Duration::from_secs(10));
        if std::env::var_os("TUC_KEEP_TESTENV").is_none() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// One test's namespace on the shared control plane, with an admin client and `kubectl` set up for it.
///
/// Dropped during a panic (a failing test), it prints the apiserver and etcd logs.
pub struct TestNamespace {
    pub name: String,
    pub client: Client,
    kubeconfig: PathBuf,
    control_plane: &'static ControlPlane,
}

/// What a `kubectl` invocation printed.
#[derive(Debug)]
pub struct KubectlOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl TestNamespace {
    pub fn control_plane(&self) -> &'static ControlPlane {
        self.control_plane
    }

    /// Kubeconfig (admin, this namespace as the default) for the real `kubectl`.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Writes a kubeconfig that impersonates `user` in `groups`, with this namespace as the default.
    pub fn kubeconfig_as_user(&self, user: &str, groups: &[&str]) -> PathBuf {
        let path = self
            .control_plane
            .dir
            .join(format!("{}-{user}.kubeconfig", self.name).replace(':', "_"));
        let identity = self.control_plane.impersonation(user, groups);
        if let Err(e) = self
            .control_plane
            .write_kubeconfig(&path, &identity, &self.name)
        {
            panic!("{e}");
        }
        path
    }

    /// Runs the real `kubectl` with this namespace's admin kubeconfig.
    pub async fn kubectl(&self, args: &[&str]) -> KubectlOutput {
        self.kubectl_with(&self.kubeconfig, args, None).await
    }

    /// Runs the real `kubectl` with the given kubeconfig, feeding `stdin` (for `apply -f -`) if given.
    pub async fn kubectl_with(
        &self,
        kubeconfig: &Path,
        args: &[&str],
        stdin: Option<&str>,
    ) -> KubectlOutput {
        use tokio::io::AsyncWriteExt;
        let mut child = tokio::process::Command::new(self.control_plane.bins.kubectl())
            .env("KUBECONFIG", kubeconfig)
            .args(args)
            .stdin(if stdin.is_some() {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("running kubectl {args:?}: {e}"));
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes())
                .await
                .unwrap_or_else(|e| panic!("writing kubectl's stdin: {e}"));
        }
        let output = child
            .wait_with_output()
            .await
            .unwrap_or_else(|e| panic!("waiting for kubectl {args:?}: {e}"));
        KubectlOutput {
            success: output.status.success(),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    /// `kubectl apply -f -` of a YAML document, panicking unless it succeeds.
    pub async fn kubectl_apply(&self, yaml: &str) -> String {
        let output = self
            .kubectl_with(&self.kubeconfig, &["apply", "-f", "-"], Some(yaml))
            .await;
        assert!(
            output.success,
            "kubectl apply failed:\nstdout: {}\nstderr: {}",
            output.stdout, output.stderr
        );
        output.stdout
    }

    /// Installs a CustomResourceDefinition with `kubectl apply` and waits until the API server has
    /// established it. Tests of one binary may install the same CRD at once: when two applies race to
    /// create it, the loser's `AlreadyExists` is retried (the retry updates it instead).
    pub async fn install_crd(&self, yaml: &str, name: &str) {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let output = self
                .kubectl_with(&self.kubeconfig, &["apply", "-f", "-"], Some(yaml))
                .await;
            if output.success {
                break;
            }
            assert!(
                attempts < 3 && output.stderr.contains("AlreadyExists"),
                "kubectl apply of CRD {name} failed:\nstdout: {}\nstderr: {}",
                output.stdout,
                output.stderr
            );
        }
        self.wait_crd_established(name).await;
    }

    /// Waits until the CRD `name` is established (see [`crd_established`]), at most 60 s.
    pub async fn wait_crd_established(&self, name: &str) {
        if let Err(error) = crd_established(&self.client, name, Duration::from_secs(60)).await {
            panic!("{error}");
        }
    }

    /// Runs `kubectl` and panics with its output unless it succeeds; returns stdout.
    pub async fn kubectl_ok(&self, args: &[&str]) -> String {
        let output = self.kubectl(args).await;
        assert!(
            output.success,
            "kubectl {} failed:\nstdout: {}\nstderr: {}",
            args.join(" "),
            output.stdout,
            output.stderr
        );
        output.stdout
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "test in namespace {} failed; control plane at {}\n{}",
                self.name,
                self.control_plane.server,
                self.control_plane.failure_report()
            );
        }
    }
}

fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca_pem: &str,
    identity: &Identity,
    namespace: &str,
) -> Result<()> {
    let yaml = kubeconfig::render(server, ca_pem, identity, namespace);
    fs::write(path, yaml).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

pub(crate) fn free_port() -> Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| Error::io("binding a free loopback port", e))?;
    listener
        .local_addr()
        .map(|addr| addr.port())
        .map_err(|e| Error::io("reading a bound port", e))
}

pub(crate) async fn wait_for_port(
    process: &ManagedProcess,
    port: u16,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    loop {
        if let Some(status) = process.exited() {
            return Err(Error::Start {
                component: process.name(),
                reason: format!("exited with {status}"),
                logs: process.log_tail(LOG_TAIL_LINES),
            });
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Start {
                component: process.name(),
                reason: format!("port {port} not open after {}s", timeout.as_secs()),
                logs: process.log_tail(LOG_TAIL_LINES),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) fn random_token() -> Result<String> {
    let mut bytes = [0u8; 24];
    use std::io::Read;
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Error::io("reading /dev/urandom", e))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// `$TMPDIR/tuc-testenv-<pid>-<n>`; the pid lets a later run delete what a killed run left behind.
fn new_dir() -> Result<PathBuf> {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "{DIR_PREFIX}{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    Ok(dir)
}

/// Deletes directories of earlier runs whose process is gone. The shared control plane lives in a static
/// and is never dropped, so its directory is cleaned up here by the next run instead.
fn remove_stale_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next() else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Waits until the CRD `name` is established, so objects of its kind can be created, for at most
/// `within`. (`kubectl wait --for=condition=Established` right after an apply can fail while the new CRD
/// has no conditions yet, so this polls the CRD itself.)
pub async fn crd_established(
    client: &kube::Client,
    name: &str,
    within: Duration,
) -> std::result::Result<(), String> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let deadline = Instant::now() + within;
    loop {
        let established = crds.get_opt(name).await.ok().flatten().is_some_and(|crd| {
            crd.status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
        if established {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("CRD {name} was not established within {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
