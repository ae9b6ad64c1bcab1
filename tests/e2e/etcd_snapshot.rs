//! The etcd snapshot before the control planes (issue 24 item 3), against the real API server, the
//! simulator (which streams a snapshot from a control plane and records the call) and, for the bucket,
//! a real S3-compatible server (SeaweedFS, scripts/build-seaweedfs.sh): the snapshot is stored,
//! verified and announced before the first control plane is upgraded; the newest N of a cluster are
//! kept; a snapshot that fails stops the run before any control plane; a bad `etcd-snapshot` value
//! starts nothing. With `etcd-snapshot: talos-and-kubernetes` a Kubernetes run does the same before
//! its first control-plane configuration change.

use std::path::{Path, PathBuf};

use object_store::ObjectStoreExt as _;
use talos_sim::{CallRecord, Fault};
use talos_upgrade_controller::etcd_snapshot::{
    self as snapshot, Destination, S3Destination, S3Options, SnapshotConfig,
};

use crate::world::{World, WorldSpec};

const ETCD_SNAPSHOT: &str = "/machine.MachineService/EtcdSnapshot";
const LEGACY_UPGRADE: &str = "/machine.MachineService/Upgrade";
const APPLY: &str = "/machine.MachineService/ApplyConfiguration";
const IMAGE_PULL: &str = "/machine.MachineService/ImagePull";

/// A run that takes a snapshot first, as the user starts it.
struct RunOf {
    /// `talos` or `kubernetes`: the run's annotations, its progress record, its snapshot's name.
    kind: &'static str,
    /// The nodes' Talos (a Kubernetes 1.35 run needs Talos 1.12).
    talos: &'static str,
    current: &'static str,
    target: &'static str,
    /// The `etcd-snapshot` value that asks for it (`None`: the default).
    mode: Option<&'static str>,
    /// The call that touches a control plane: the snapshot must come before the first.
    touches: &'static str,
    /// How long the whole run may take (`kubectl wait`).
    patience: &'static str,
}

/// Talos 1.11.6 -> 1.12.0 with the default mode.
const TALOS_RUN: RunOf = RunOf {
    kind: "talos",
    talos: "1.11.6",
    current: "1.11.6",
    target: "1.12.0",
    mode: None,
    touches: LEGACY_UPGRADE,
    patience: "180s",
};

/// Kubernetes 1.34.1 -> 1.35.0 on Talos 1.12.0, with `talos-and-kubernetes`.
const KUBERNETES_RUN: RunOf = RunOf {
    kind: "kubernetes",
    talos: "1.12.0",
    current: "1.34.1",
    target: "1.35.0",
    mode: Some("talos-and-kubernetes"),
    touches: APPLY,
    patience: "240s",
};

impl RunOf {
    fn annotation(&self, what: &str) -> String {
        format!("{}-{what}", self.kind)
    }

    /// Once the controller reports the current version: the mode, then the target.
    async fn start(&self, world: &World) {
        world
            .wait_for_annotation(&self.annotation("current"), self.current, "60s")
            .await;
        if let Some(mode) = self.mode {
            world.annotate("etcd-snapshot", mode).await;
        }
        world
            .annotate(&self.annotation("target"), self.target)
            .await;
    }

    async fn wait_for(&self, world: &World, status: &str) {
        world
            .wait_for_annotation(&self.annotation("status"), status, self.patience)
            .await;
    }
}

/// A fresh directory for one test's snapshots (removed by [`Scratch`]'s drop).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("tuc-etcd-snapshot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A world for `run` whose controller stores snapshots in `destination`, keeping `keep`.
async fn world_with(prefix: &str, run: &RunOf, destination: Destination, keep: usize) -> World {
    let mut world = World::start(
        prefix,
        WorldSpec {
            start_controller: false,
            talos: run.talos,
            ..WorldSpec::default()
        },
    )
    .await;
    world.set_etcd_snapshots(SnapshotConfig::new(destination, keep).expect("a snapshot config"));
    world.start_controller();
    world
}

/// [`world_with`] storing snapshots in `scratch`, keeping three.
async fn world_in(prefix: &str, run: &RunOf, scratch: &Scratch) -> World {
    world_with(prefix, run, Destination::Dir(scratch.0.clone()), 3).await
}

/// Asserts `message` is a `kind` ("Talos" or "Kubernetes") run's failure for a snapshot `node`
/// refused (etcd could not read it); the endpoint in the node's answer varies, so it is not
/// compared.
fn assert_refused(message: &str, kind: &str, node: &str) {
    let prefix = format!(
        "{kind} upgrade failed: the etcd snapshot from control plane {node} failed: the node \
         refused it: Talos endpoint "
    );
    assert!(message.starts_with(&prefix), "{message}");
    assert!(
        message.contains("failed reading etcd snapshot")
            && message.ends_with("(none was touched): fix the node or the snapshot destination, then set resume to take it again"),
        "{message}"
    );
}

fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn is_control_plane(world: &World, node: &str) -> bool {
    node.starts_with(&world.node("cp-"))
}

/// What the `EtcdSnapshotTaken` Event says: (node, location, size, sha256).
fn parse_taken(message: &str) -> (String, String, u64, String) {
    let rest = message
        .strip_prefix("etcd snapshot from ")
        .unwrap_or_else(|| panic!("{message}"));
    let (node, rest) = rest.split_once(" stored at ").expect("stored at");
    let (location, rest) = rest.split_once(" (").expect("(");
    let (size, rest) = rest.split_once(" bytes, sha256 ").expect("bytes");
    let (sha, rest) = rest.split_once(')').expect(")");
    assert_eq!(rest, "; upgrading the control planes", "{message}");
    (
        node.to_string(),
        location.to_string(),
        size.parse().expect("size"),
        sha.to_string(),
    )
}

/// The snapshot the persisted run records (`gates.etcdSnapshot` of `talos.json`, `etcdSnapshot`
/// of `kubernetes.json`).
async fn recorded_snapshot(world: &World, run: &RunOf) -> serde_json::Value {
    let record = world.persisted_run(run.kind).await;
    match run.kind {
        "talos" => record["gates"]["etcdSnapshot"].clone(),
        _ => record["etcdSnapshot"].clone(),
    }
}

/// The EtcdSnapshot calls, and the index of the first call of `run` to a control plane.
fn snapshot_calls_and_first_control_plane(
    world: &World,
    run: &RunOf,
    record: &[CallRecord],
) -> (Vec<(usize, CallRecord)>, Option<usize>) {
    let snapshots = record
        .iter()
        .enumerate()
        .filter(|(_, c)| c.method == ETCD_SNAPSHOT)
        .map(|(i, c)| (i, c.clone()))
        .collect();
    let first_control_plane = record
        .iter()
        .position(|c| c.method == run.touches && is_control_plane(world, &c.node));
    (snapshots, first_control_plane)
}

fn metric(world: &World, destination: &str, result: &str) -> Option<String> {
    world
        .metrics
        .encode()
        .lines()
        .find(|l| {
            l.starts_with("talos_upgrade_etcd_snapshots_total{")
                && l.contains(&format!("destination=\"{destination}\""))
                && l.contains(&format!("result=\"{result}\""))
        })
        .and_then(|l| l.rsplit(' ').next().map(str::to_string))
}

fn snapshots_in(folder: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(folder)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// After `run` completed to a directory: one EtcdSnapshot call, to a control plane, answered, before
/// the run's first call to a control plane; the `EtcdSnapshotTaken` Event, the file in `folder`
/// (named after the run's kind and target), the progress record and what the node sent agree on
/// size and SHA-256. The calls, the snapshot call's index among them, and the file's name.
async fn stored_before_the_first_control_plane(
    world: &World,
    run: &RunOf,
    folder: &Path,
) -> (Vec<CallRecord>, usize, String) {
    let record = world.sim.record();
    let (snapshots, first_control_plane) =
        snapshot_calls_and_first_control_plane(world, run, &record);
    assert_eq!(snapshots.len(), 1, "{}", world.sim.record_json());
    let (at, call) = snapshots.into_iter().next().expect("one snapshot call");
    assert!(is_control_plane(world, &call.node), "{call:?}");
    assert_eq!(call.result, "ok");
    let first_control_plane = first_control_plane.expect("a control plane was touched");
    assert!(at < first_control_plane, "{}", world.sim.record_json());

    let events = world.event_messages("EtcdSnapshotTaken").await;
    assert_eq!(events.len(), 1, "{events:?}");
    let (node, location, size, sha) = parse_taken(&events[0]);
    assert_eq!(node, call.node);
    let path = PathBuf::from(location.strip_prefix("file://").expect("a file location"));
    assert!(path.starts_with(folder), "{location}");
    let file_name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        file_name.ends_with(&format!("-{}-{}.snapshot", run.kind, run.target)),
        "{file_name}"
    );
    let bytes = std::fs::read(&path).expect("the stored snapshot");
    assert_eq!(bytes.len() as u64, size);
    assert_eq!(sha256_hex(&bytes), sha);
    assert_eq!(call.params["size"], size);
    assert_eq!(call.params["sha256"], sha);
    let recorded = recorded_snapshot(world, run).await;
    assert_eq!(recorded["state"], "taken", "{recorded}");
    assert_eq!(recorded["node"], node);
    assert_eq!(recorded["location"], location);
    assert_eq!(recorded["size"], size);
    assert_eq!(recorded["sha256"], sha);
    (record, at, file_name)
}

/// Talos 1.11.6 -> 1.12.0, workers first, to a directory keeping 2: the workers go, then one
/// EtcdSnapshot from a control plane, then the control planes; the file's size and SHA-256 are what
/// the Event and the progress record say and what the node sent; the older snapshots of this cluster
/// beyond the newest 2 are deleted, another cluster's are not.
#[tokio::test]
async fn a_snapshot_to_a_directory_comes_before_the_first_control_plane_and_is_verified() {
    let scratch = Scratch::new("dir");
    let world = world_with("es-dir", &TALOS_RUN, Destination::Dir(scratch.0.clone()), 2).await;
    // Older snapshots of this cluster, and one of another cluster in the same namespace.
    let folder = scratch.0.join(&world.ns.name).join(&world.cluster);
    let other = scratch.0.join(&world.ns.name).join("other-cluster");
    std::fs::create_dir_all(&folder).expect("folder");
    std::fs::create_dir_all(&other).expect("folder");
    for old in [
        "20250101T000000Z-talos-1.11.5.snapshot",
        "20250601T000000Z-talos-1.11.6.snapshot",
    ] {
        std::fs::write(folder.join(old), b"old").expect("an old snapshot");
    }
    std::fs::write(
        other.join("20250101T000000Z-talos-1.11.5.snapshot"),
        b"other",
    )
    .expect("another cluster's snapshot");

    world.upgrade_talos("1.11.6", "1.12.0").await;
    world.assert_each_node_upgraded_once(5);

    let (record, at, file_name) =
        stored_before_the_first_control_plane(&world, &TALOS_RUN, &folder).await;
    let workers_before = record[..at]
        .iter()
        .filter(|c| c.method == LEGACY_UPGRADE && !is_control_plane(&world, &c.node))
        .count();
    assert_eq!(workers_before, 2, "both workers went first");

    // Kept: the newest 2 of this cluster; the other cluster's untouched; no partial file left.
    assert_eq!(
        snapshots_in(&folder),
        vec![
            "20250601T000000Z-talos-1.11.6.snapshot".to_string(),
            file_name
        ]
    );
    assert_eq!(
        snapshots_in(&other),
        vec!["20250101T000000Z-talos-1.11.5.snapshot".to_string()]
    );
    assert_eq!(metric(&world, "dir", "ok").as_deref(), Some("1"));
    world.stop_controller().await;
}

/// `run` to `scratch` whose control planes all answer the snapshot with `fault`: the target is set
/// and the run fails at the snapshot, after one snapshot call and before any control plane. The
/// world and that call.
async fn run_failing_at_the_snapshot(
    prefix: &str,
    run: &RunOf,
    scratch: &Scratch,
    fault: Fault,
) -> (World, CallRecord) {
    let world = world_in(prefix, run, scratch).await;
    for cp in ["cp-1", "cp-2", "cp-3"] {
        world
            .sim
            .inject_fault(&world.node(cp), fault.clone())
            .expect("fault");
    }
    run.start(&world).await;
    run.wait_for(&world, "failed").await;
    let record = world.sim.record();
    let (snapshots, first_control_plane) =
        snapshot_calls_and_first_control_plane(&world, run, &record);
    // A run that failed for another reason says which in its message.
    let message = world.annotation(&run.annotation("message")).await;
    assert_eq!(
        first_control_plane,
        None,
        "{message}\n{}",
        world.sim.record_json()
    );
    assert_eq!(snapshots.len(), 1, "{message}\n{}", world.sim.record_json());
    let (_, call) = snapshots.into_iter().next().expect("one snapshot call");
    (world, call)
}

/// A snapshot cut short (the stream ends early without an error) cannot be verified: the run stops
/// after the workers, before any control plane, naming the node and why; nothing is left in the
/// directory; `resume` takes it again and the run completes.
#[tokio::test]
async fn a_snapshot_that_cannot_be_verified_stops_the_run_before_any_control_plane() {
    let scratch = Scratch::new("cut");
    let (world, snapshot) =
        run_failing_at_the_snapshot("es-cut", &TALOS_RUN, &scratch, Fault::EtcdSnapshotTruncated)
            .await;
    let node = snapshot.node.clone();
    let sent = snapshot.params["size"].as_u64().expect("size");
    assert_eq!(world.upgrade_calls().len(), 2, "only the workers");
    let message = world.annotation("talos-message").await;
    assert_eq!(
        message,
        format!(
            "Talos upgrade failed: the etcd snapshot from control plane {node} failed: the node \
             sent {sent} bytes that do not end with the SHA-256 etcd appends to a whole snapshot \
             (the stream was cut short or the data is corrupt); the run stopped before upgrading \
             any control plane (none was touched): fix the node or the snapshot destination, then \
             set resume to take it again"
        )
    );
    assert_eq!(world.annotation("failed-nodes").await, "");
    let events = world.event_messages("UpgradeFailed").await;
    assert_eq!(events, vec![message.clone()]);
    let folder = scratch.0.join(&world.ns.name).join(&world.cluster);
    assert_eq!(snapshots_in(&folder), Vec::<String>::new());
    assert_eq!(metric(&world, "dir", "failed").as_deref(), Some("1"));
    assert_eq!(
        recorded_snapshot(&world, &TALOS_RUN).await["state"],
        "failed",
        "the run records it"
    );

    // Fixed, and resumed: taken again, then the control planes.
    for cp in ["cp-1", "cp-2", "cp-3"] {
        world.sim.clear_faults(&world.node(cp)).expect("clear");
    }
    world.annotate("resume", "true").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(5);
    let (snapshots, first_control_plane) =
        snapshot_calls_and_first_control_plane(&world, &TALOS_RUN, &world.sim.record());
    assert_eq!(snapshots.len(), 2);
    assert!(snapshots[1].0 < first_control_plane.expect("control planes upgraded"));
    assert_eq!(snapshots_in(&folder).len(), 1);
    assert_eq!(metric(&world, "dir", "ok").as_deref(), Some("1"));
    world.stop_controller().await;
}

/// The node refuses the snapshot (etcd could not read it): the run fails naming the node and the
/// node's answer, before any control plane.
#[tokio::test]
async fn a_snapshot_the_node_refuses_stops_the_run_naming_the_node() {
    let scratch = Scratch::new("refused");
    let (world, snapshot) =
        run_failing_at_the_snapshot("es-refused", &TALOS_RUN, &scratch, Fault::EtcdSnapshotFails)
            .await;
    let node = &snapshot.node;
    assert!(snapshot.result.starts_with("Unknown"), "{snapshot:?}");
    assert_refused(&world.annotation("talos-message").await, "Talos", node);
    world.stop_controller().await;
}

/// Kubernetes 1.34.1 -> 1.35.0 with `etcd-snapshot: talos-and-kubernetes`: the pre-pulls (which
/// restart nothing) go, then one EtcdSnapshot from a control plane, then the first control-plane
/// configuration change; the file is named after the Kubernetes run and agrees with the Event, the
/// run's record and the node; no Talos run took one.
#[tokio::test]
async fn a_kubernetes_run_with_talos_and_kubernetes_takes_one_before_its_first_control_plane() {
    let scratch = Scratch::new("k8s");
    let world = world_in("es-k8s", &KUBERNETES_RUN, &scratch).await;
    KUBERNETES_RUN.start(&world).await;
    KUBERNETES_RUN.wait_for(&world, "completed").await;
    assert_eq!(world.annotation("kubernetes-current").await, "1.35.0");

    let folder = scratch.0.join(&world.ns.name).join(&world.cluster);
    let (record, at, file_name) =
        stored_before_the_first_control_plane(&world, &KUBERNETES_RUN, &folder).await;
    let pulls_before = record[..at]
        .iter()
        .filter(|c| c.method == IMAGE_PULL)
        .count();
    assert!(
        pulls_before > 0,
        "the pre-pulls went first: {}",
        world.sim.record_json()
    );
    assert_eq!(snapshots_in(&folder), vec![file_name]);
    assert_eq!(metric(&world, "dir", "ok").as_deref(), Some("1"));
    world.stop_controller().await;
}

/// A Kubernetes run whose snapshot the node refuses fails there, naming the node and the node's
/// answer, before any control-plane configuration change; no node is failed. `resume` takes it
/// again and the run completes.
#[tokio::test]
async fn a_kubernetes_run_whose_snapshot_fails_stops_before_any_control_plane() {
    let scratch = Scratch::new("k8s-refused");
    let (world, snapshot) = run_failing_at_the_snapshot(
        "es-k8s-refused",
        &KUBERNETES_RUN,
        &scratch,
        Fault::EtcdSnapshotFails,
    )
    .await;
    let node = &snapshot.node;
    assert!(
        world.sim.record().iter().all(|c| c.method != APPLY),
        "{}",
        world.sim.record_json()
    );
    let message = world.annotation("kubernetes-message").await;
    assert_refused(&message, "Kubernetes", node);
    assert_eq!(world.annotation("failed-nodes").await, "");
    assert_eq!(world.event_messages("UpgradeFailed").await, vec![message]);
    assert_eq!(
        recorded_snapshot(&world, &KUBERNETES_RUN).await["state"],
        "failed"
    );
    assert_eq!(metric(&world, "dir", "failed").as_deref(), Some("1"));

    // Fixed, and resumed: taken again, then the control planes.
    for cp in ["cp-1", "cp-2", "cp-3"] {
        world.sim.clear_faults(&world.node(cp)).expect("clear");
    }
    world.annotate("resume", "true").await;
    KUBERNETES_RUN.wait_for(&world, "completed").await;
    let (snapshots, first_control_plane) =
        snapshot_calls_and_first_control_plane(&world, &KUBERNETES_RUN, &world.sim.record());
    assert_eq!(snapshots.len(), 2, "{}", world.sim.record_json());
    assert!(snapshots[1].0 < first_control_plane.expect("control planes changed"));
    assert_eq!(
        recorded_snapshot(&world, &KUBERNETES_RUN).await["state"],
        "taken"
    );
    assert_eq!(metric(&world, "dir", "ok").as_deref(), Some("1"));
    world.stop_controller().await;
}

/// `etcd-snapshot` with a value it does not know: the run does not start, the message and an
/// `InvalidOption` Event say why, no node gets any call; `off` lets the run go without a snapshot.
#[tokio::test]
async fn an_invalid_etcd_snapshot_value_starts_nothing() {
    let scratch = Scratch::new("invalid");
    let world = world_in("es-invalid", &TALOS_RUN, &scratch).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("etcd-snapshot", "sometimes").await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = "Talos upgrade not started: Annotation upgrade.vitistack.io/etcd-snapshot has the \
                   invalid value \"sometimes\": use off, talos (a snapshot before the first \
                   control plane of a Talos run; the default when the controller has a snapshot \
                   destination) or talos-and-kubernetes (also one before the first control plane \
                   of a Kubernetes run)";
    assert_eq!(world.annotation("talos-message").await, message);
    let event = world.wait_for_event("InvalidOption", Some(message)).await;
    assert_eq!(event.type_, "Warning");
    world.poke_and_wait(1).await;
    assert!(world.sim.record().is_empty(), "{}", world.sim.record_json());
    assert_eq!(
        world.event_count("InvalidOption").await,
        1,
        "{:#?}",
        world.cluster_events().await
    );

    // `off`: the run goes, without a snapshot.
    world.annotate("etcd-snapshot", "off").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(5);
    assert!(
        world.sim.record().iter().all(|c| c.method != ETCD_SNAPSHOT),
        "{}",
        world.sim.record_json()
    );
    world.stop_controller().await;
}

/// The test's own client of the bucket, to look at what the controller stored.
fn bucket_client(
    server: &testenv::seaweedfs::S3Server,
    bucket: &str,
) -> object_store::aws::AmazonS3 {
    // reqwest's rustls has no provider of its own here (as in the controller): ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&server.endpoint)
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_access_key_id(&server.access_key_id)
        .with_secret_access_key(&server.secret_access_key)
        .with_allow_http(true)
        .build()
        .expect("a client of the bucket")
}

async fn keys(store: &object_store::aws::AmazonS3, prefix: &str) -> Vec<String> {
    use futures::StreamExt as _;
    use object_store::ObjectStore as _;
    let prefix = object_store::path::Path::from(prefix);
    let mut keys: Vec<String> = store
        .list(Some(&prefix))
        .map(|meta| meta.expect("listing").location.to_string())
        .collect()
        .await;
    keys.sort();
    keys
}

/// The same run to a bucket of a real S3-compatible server (SeaweedFS over loopback http), its
/// credentials read from a Secret as the binary reads `--etcd-snapshot-s3-credentials-secret`: the
/// object is there with the size and SHA-256 the Event and the record say, under the prefix; the newest
/// 2 of the cluster are kept, another cluster's object is not touched.
#[tokio::test]
async fn a_snapshot_to_an_s3_bucket_is_stored_read_back_and_pruned() {
    let server = testenv::seaweedfs::S3Server::start()
        .await
        .unwrap_or_else(|e| panic!("SeaweedFS did not start: {e}"));
    let bucket = "tuc-snapshots";
    let store = bucket_client(&server, bucket);
    let mut world = World::start(
        "es-s3",
        WorldSpec {
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await;
    // The server's filer comes up after its port: the first upload (which also creates the bucket)
    // is retried until it is taken.
    let folder = format!("etcd/{}/{}", world.ns.name, world.cluster);
    let old = format!("{folder}/20250101T000000Z-talos-1.11.5.snapshot");
    let older_kept = format!("{folder}/20250601T000000Z-talos-1.11.6.snapshot");
    let other = format!(
        "etcd/{}/other-cluster/20250101T000000Z-talos-1.11.5.snapshot",
        world.ns.name
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match store
            .put(
                &object_store::path::Path::from(old.as_str()),
                b"old".to_vec().into(),
            )
            .await
        {
            Ok(_) => break,
            Err(error) if std::time::Instant::now() < deadline => {
                tracing::debug!(%error, "SeaweedFS not ready yet");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            Err(error) => panic!(
                "SeaweedFS never took an upload: {error}\n{}",
                server.log_tail()
            ),
        }
    }
    for key in [&older_kept, &other] {
        store
            .put(
                &object_store::path::Path::from(key.as_str()),
                b"old".to_vec().into(),
            )
            .await
            .expect("an old snapshot");
    }

    world
        .ns
        .kubectl_ok(&[
            "create",
            "secret",
            "generic",
            "snapshot-bucket",
            &format!("--from-literal=access-key-id={}", server.access_key_id),
            &format!(
                "--from-literal=secret-access-key={}",
                server.secret_access_key
            ),
        ])
        .await;
    let (access_key_id, secret_access_key) =
        snapshot::s3_credentials(&world.ns.client, &world.ns.name, "snapshot-bucket")
            .await
            .expect("the credentials Secret");
    let destination = Destination::S3(
        S3Destination::new(S3Options {
            endpoint: server.endpoint.clone(),
            bucket: bucket.to_string(),
            region: "us-east-1".to_string(),
            prefix: "/etcd/".to_string(),
            access_key_id,
            secret_access_key,
        })
        .expect("the bucket"),
    );
    world.set_etcd_snapshots(SnapshotConfig::new(destination, 2).expect("config"));
    world.start_controller();
    world.upgrade_talos("1.11.6", "1.12.0").await;
    world.assert_each_node_upgraded_once(5);

    let record = world.sim.record();
    let (snapshots, first_control_plane) =
        snapshot_calls_and_first_control_plane(&world, &TALOS_RUN, &record);
    assert_eq!(snapshots.len(), 1, "{}", world.sim.record_json());
    assert!(snapshots[0].0 < first_control_plane.expect("control planes upgraded"));
    let events = world.event_messages("EtcdSnapshotTaken").await;
    assert_eq!(events.len(), 1, "{events:?}");
    let (node, location, size, sha) = parse_taken(&events[0]);
    assert_eq!(node, snapshots[0].1.node);
    let key = location
        .strip_prefix(&format!("s3://{bucket}/"))
        .unwrap_or_else(|| panic!("{location}"))
        .to_string();
    assert!(
        key.starts_with(&format!("{folder}/")) && key.ends_with("-talos-1.12.0.snapshot"),
        "{key}"
    );
    let stored = store
        .get(&object_store::path::Path::from(key.as_str()))
        .await
        .expect("the stored object")
        .bytes()
        .await
        .expect("its bytes");
    assert_eq!(stored.len() as u64, size);
    assert_eq!(sha256_hex(&stored), sha);
    assert_eq!(snapshots[0].1.params["sha256"], sha);
    let recorded = recorded_snapshot(&world, &TALOS_RUN).await;
    assert_eq!(recorded["location"], location);
    assert_eq!(recorded["size"], size);
    assert_eq!(recorded["sha256"], sha);

    assert_eq!(keys(&store, &folder).await, vec![older_kept, key]);
    assert_eq!(
        keys(&store, &format!("etcd/{}/other-cluster", world.ns.name)).await,
        vec![other]
    );
    assert_eq!(metric(&world, "s3", "ok").as_deref(), Some("1"));
    world.stop_controller().await;
}
