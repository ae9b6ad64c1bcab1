//! The etcd snapshot before the control planes (issue 24 item 3): the IO of
//! [`talos_upgrade_core::etcd_snapshot`]. It streams `MachineService.EtcdSnapshot` from a control
//! plane into the operator's destination, a directory on a mounted volume (`--etcd-snapshot-dir`) or
//! an S3-compatible bucket (`--etcd-snapshot-s3-*`), hashing while it writes; checks that what came
//! is a whole etcd snapshot (etcd appends the SHA-256 of the database to every snapshot it streams,
//! etcd v3.6 `server/etcdserver/api/v3rpc/maintenance.go`; `etcdutl snapshot restore` checks it, and
//! `talosctl etcd snapshot` checks its size, talos v1.14.1 `cmd/talosctl/cmd/talos/etcd.go`);
//! reads the stored copy back and compares its size and SHA-256; and keeps the last N of the cluster,
//! deleting older ones of that cluster only.
//!
//! Names: `<prefix>/<namespace>/<cluster>/<UTC time>-<kind>-<target>.snapshot` (the prefix only for
//! S3; `<kind>`: `talos`, or `kubernetes` for a Kubernetes run with `talos-and-kubernetes`), e.g.
//! `default/prod/20261129T020000Z-talos-1.12.0.snapshot`. The time comes first, so the
//! names of a cluster sort oldest first, which is how the oldest are found to delete.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt as _;
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use talos_api::{TalosClient, TalosError};
use talos_upgrade_core::etcd_snapshot::Stored;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The SHA-256 etcd appends to a snapshot: its last 32 bytes.
const ETCD_HASH_LEN: usize = 32;

/// Where snapshots go, and how many of a cluster are kept.
#[derive(Debug, Clone)]
pub struct SnapshotConfig {
    pub destination: Destination,
    /// The newest this many snapshots of a cluster are kept (at least 1).
    pub keep: usize,
}

#[derive(Debug, Clone)]
pub enum Destination {
    /// A directory, typically a mounted volume.
    Dir(PathBuf),
    /// A bucket of an S3-compatible store.
    S3(S3Destination),
}

#[derive(Clone)]
pub struct S3Destination {
    store: Arc<AmazonS3>,
    bucket: String,
    prefix: String,
}

impl std::fmt::Debug for S3Destination {
    // The store holds the credentials: only the bucket and the prefix are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Destination")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// An S3-compatible bucket: its endpoint, and the credentials read from the operator's Secret.
pub struct S3Options {
    /// `https://…`; `http://` only for a loopback host (tests, a local gateway).
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    pub prefix: String,
    pub access_key_id: String,
    pub secret_access_key: String,
}

/// Why the destination flags cannot be used (the controller does not start).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "--etcd-snapshot-s3-endpoint {endpoint:?} is not an https URL (http is accepted for a \
         loopback host only)"
    )]
    InsecureEndpoint { endpoint: String },
    #[error("--etcd-snapshot-s3-bucket {bucket:?} cannot be used: {reason}")]
    Bucket { bucket: String, reason: String },
    #[error("--etcd-snapshot-keep must be 1 or more")]
    Keep,
    #[error("use either --etcd-snapshot-dir or --etcd-snapshot-s3-bucket, not both")]
    Both,
}

impl S3Destination {
    pub fn new(options: S3Options) -> Result<S3Destination, ConfigError> {
        let endpoint = options.endpoint.trim().trim_end_matches('/').to_string();
        let https = endpoint.starts_with("https://");
        let loopback_http = endpoint.starts_with("http://") && loopback(&endpoint);
        if !(https || loopback_http) {
            return Err(ConfigError::InsecureEndpoint { endpoint });
        }
        // reqwest's rustls has no provider of its own here: the controller's (ring) is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let store = AmazonS3Builder::new()
            .with_endpoint(&endpoint)
            .with_bucket_name(&options.bucket)
            .with_region(&options.region)
            .with_access_key_id(&options.access_key_id)
            .with_secret_access_key(&options.secret_access_key)
            // Path-style requests: what S3-compatible stores (SeaweedFS, MinIO, Ceph) all serve.
            .with_virtual_hosted_style_request(false)
            .with_allow_http(!https)
            .build()
            .map_err(|e| ConfigError::Bucket {
                bucket: options.bucket.clone(),
                reason: e.to_string(),
            })?;
        Ok(S3Destination {
            store: Arc::new(store),
            bucket: options.bucket,
            prefix: options.prefix.trim().trim_matches('/').to_string(),
        })
    }
}

/// The keys of the S3 credentials Secret (`--etcd-snapshot-s3-credentials-secret`).
pub const ACCESS_KEY_ID: &str = "access-key-id";
pub const SECRET_ACCESS_KEY: &str = "secret-access-key";

/// Why the S3 credentials could not be read. Never holds the Secret's values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialsError {
    #[error("reading Secret {namespace}/{name} (--etcd-snapshot-s3-credentials-secret): {reason}")]
    Read {
        namespace: String,
        name: String,
        reason: String,
    },
    #[error(
        "Secret {namespace}/{name} (--etcd-snapshot-s3-credentials-secret) has no non-empty \
         {key:?} key"
    )]
    MissingKey {
        namespace: String,
        name: String,
        key: &'static str,
    },
}

/// The access key id and secret access key from the operator's Secret (read once, at start).
pub async fn s3_credentials(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<(String, String), CredentialsError> {
    use k8s_openapi::api::core::v1::Secret;
    let secret = kube::Api::<Secret>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .map_err(|e| CredentialsError::Read {
            namespace: namespace.to_string(),
            name: name.to_string(),
            reason: e.to_string(),
        })?;
    let data = secret.data.unwrap_or_default();
    let value = |key: &'static str| {
        data.get(key)
            .and_then(|bytes| String::from_utf8(bytes.0.clone()).ok())
            .map(|text| text.trim().to_string())
            .filter(|text| !text.is_empty())
            .ok_or_else(|| CredentialsError::MissingKey {
                namespace: namespace.to_string(),
                name: name.to_string(),
                key,
            })
    };
    Ok((value(ACCESS_KEY_ID)?, value(SECRET_ACCESS_KEY)?))
}

/// Whether an `http://host[:port]/…` URL names a loopback host.
fn loopback(url: &str) -> bool {
    let rest = url.trim_start_matches("http://");
    let authority = rest.split('/').next().unwrap_or_default();
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl SnapshotConfig {
    pub fn new(destination: Destination, keep: usize) -> Result<SnapshotConfig, ConfigError> {
        if keep == 0 {
            return Err(ConfigError::Keep);
        }
        Ok(SnapshotConfig { destination, keep })
    }

    /// `dir` or `s3`, for the metric.
    pub fn label(&self) -> &'static str {
        match self.destination {
            Destination::Dir(_) => "dir",
            Destination::S3(_) => "s3",
        }
    }

    /// Takes a snapshot through `client` (a control plane) and stores it for `cluster`, verified;
    /// then deletes the cluster's snapshots beyond the newest `keep`. The error is what failed, as
    /// the end of a sentence ("the etcd snapshot from control plane X failed: …").
    pub async fn take(
        &self,
        client: &TalosClient,
        name: &SnapshotName,
    ) -> Result<Stored, TakeError> {
        let stream = open(client).await?;
        let stored = match &self.destination {
            Destination::Dir(dir) => take_to_dir(stream, dir, name).await,
            Destination::S3(s3) => take_to_s3(stream, s3, name).await,
        }
        .map_err(TakeError::Failed)?;
        // Pruning never fails the run: the snapshot that matters is stored.
        if let Err(error) = self.prune(name).await {
            tracing::warn!(cluster = %name.cluster, %error, "deleting older etcd snapshots");
        }
        Ok(stored)
    }

    async fn prune(&self, name: &SnapshotName) -> Result<(), String> {
        match &self.destination {
            Destination::Dir(dir) => {
                let folder = dir.join(name.folder());
                let mut entries = tokio::fs::read_dir(&folder)
                    .await
                    .map_err(|e| format!("listing {}: {e}", folder.display()))?;
                let mut names = Vec::new();
                while let Some(entry) = entries
                    .next_entry()
                    .await
                    .map_err(|e| format!("listing {}: {e}", folder.display()))?
                {
                    let file = entry.file_name().to_string_lossy().into_owned();
                    if file.ends_with(SUFFIX) {
                        names.push(file);
                    }
                }
                for old in older_than_newest(names, self.keep) {
                    let path = folder.join(&old);
                    tokio::fs::remove_file(&path)
                        .await
                        .map_err(|e| format!("deleting {}: {e}", path.display()))?;
                    tracing::info!(path = %path.display(), "deleted an older etcd snapshot");
                }
            }
            Destination::S3(s3) => {
                let folder = ObjectPath::from(s3.key(&name.folder()));
                let listed: Vec<_> = s3
                    .store
                    .list(Some(&folder))
                    .collect::<Vec<_>>()
                    .await
                    .into_iter()
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("listing s3://{}/{folder}: {e}", s3.bucket))?;
                let names: Vec<String> = listed
                    .iter()
                    .map(|meta: &object_store::ObjectMeta| meta.location.to_string())
                    // Only this cluster's own folder, not a cluster whose name starts the same.
                    .filter(|key| {
                        key.strip_prefix(&format!("{folder}/"))
                            .is_some_and(|file| !file.contains('/') && file.ends_with(SUFFIX))
                    })
                    .collect();
                for old in older_than_newest(names, self.keep) {
                    let path = ObjectPath::from(old.as_str());
                    s3.store
                        .delete(&path)
                        .await
                        .map_err(|e| format!("deleting s3://{}/{old}: {e}", s3.bucket))?;
                    tracing::info!(bucket = %s3.bucket, key = %old, "deleted an older etcd snapshot");
                }
            }
        }
        Ok(())
    }
}

const SUFFIX: &str = ".snapshot";

/// The names to delete: all but the newest `keep` (names sort oldest first).
fn older_than_newest(mut names: Vec<String>, keep: usize) -> Vec<String> {
    names.sort();
    let excess = names.len().saturating_sub(keep);
    names.truncate(excess);
    names
}

/// What a run's shell says when the controller has nowhere to put a snapshot (the core only asks for
/// one when it has; this is the guard).
pub const NO_DESTINATION: &str = "the controller has no etcd snapshot destination \
     (--etcd-snapshot-dir or --etcd-snapshot-s3-bucket)";

/// What taking a cluster's etcd snapshot needs besides the node: the destination, the cluster's name
/// (the snapshot's is made of it) and the metrics. Shared by the Talos run and the Kubernetes run.
pub struct SnapshotContext<'a> {
    pub config: &'a SnapshotConfig,
    pub namespace: String,
    pub cluster: String,
    pub metrics: &'a crate::metrics::Metrics,
}

/// Why a snapshot was not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TakeError {
    /// The node could not be called, or did not answer the call in time: taken again on the next
    /// pass, from whichever control plane is healthy then.
    NotReached(String),
    /// The node or the store failed, or the stored object did not verify: the run stops.
    Failed(String),
}

impl SnapshotContext<'_> {
    /// Takes the snapshot from `node` for a run of `kind` (`talos` or `kubernetes`, in the object's
    /// name) to `target`, stores it and verifies it; counts it in the metrics and logs it.
    pub async fn take(
        &self,
        access: &crate::cluster_access::Access,
        node: &str,
        kind: &'static str,
        target: &str,
        now: jiff::Timestamp,
    ) -> Result<Stored, TakeError> {
        let Some(inventory_node) = access.inventory.iter().find(|n| n.name == node) else {
            return Err(TakeError::Failed(
                "the node is no longer in the node inventory".to_string(),
            ));
        };
        let client = access
            .fleet
            .client(inventory_node.address)
            .map_err(|error| TakeError::NotReached(error.to_string()))?;
        let name = SnapshotName {
            namespace: self.namespace.clone(),
            cluster: self.cluster.clone(),
            kind,
            target: target.to_string(),
            at: now,
        };
        match self.config.take(&client, &name).await {
            Ok(stored) => {
                self.metrics.record_etcd_snapshot(self.config.label(), true);
                tracing::info!(
                    %node,
                    location = %stored.location,
                    size = stored.size,
                    sha256 = %stored.sha256,
                    "etcd snapshot stored"
                );
                Ok(stored)
            }
            Err(TakeError::NotReached(reason)) => {
                tracing::info!(%node, %reason, "etcd snapshot: the node did not answer; taken again on the next pass");
                Err(TakeError::NotReached(reason))
            }
            Err(TakeError::Failed(reason)) => {
                self.metrics
                    .record_etcd_snapshot(self.config.label(), false);
                tracing::warn!(%node, %reason, "etcd snapshot failed");
                Err(TakeError::Failed(reason))
            }
        }
    }
}

/// What a snapshot is named after.
#[derive(Debug, Clone)]
pub struct SnapshotName {
    pub namespace: String,
    pub cluster: String,
    /// `talos` (the Talos run) or `kubernetes`.
    pub kind: &'static str,
    pub target: String,
    pub at: jiff::Timestamp,
}

impl SnapshotName {
    fn folder(&self) -> String {
        format!("{}/{}", self.namespace, self.cluster)
    }

    /// `<namespace>/<cluster>/<UTC time>-<kind>-<target>.snapshot`.
    pub fn key(&self) -> String {
        format!(
            "{}/{}-{}-{}{SUFFIX}",
            self.folder(),
            self.at.strftime("%Y%m%dT%H%M%SZ"),
            self.kind,
            self.target
        )
    }
}

impl S3Destination {
    fn key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }
}

/// Counts and hashes the bytes as they stream past, and checks that they end with the SHA-256 of
/// everything before (the hash etcd appends), without holding the snapshot in memory.
struct Verifier {
    size: u64,
    all: ring::digest::Context,
    database: ring::digest::Context,
    /// The last bytes seen (at most [`ETCD_HASH_LEN`]): the appended hash, once the stream ends.
    tail: Vec<u8>,
}

impl Verifier {
    fn new() -> Verifier {
        Verifier {
            size: 0,
            all: ring::digest::Context::new(&ring::digest::SHA256),
            database: ring::digest::Context::new(&ring::digest::SHA256),
            tail: Vec::with_capacity(2 * ETCD_HASH_LEN),
        }
    }

    fn update(&mut self, chunk: &[u8]) {
        self.size += chunk.len() as u64;
        self.all.update(chunk);
        // Everything but the last 32 bytes seen so far belongs to the database.
        if chunk.len() >= ETCD_HASH_LEN {
            self.database.update(&self.tail);
            let (body, tail) = chunk.split_at(chunk.len() - ETCD_HASH_LEN);
            self.database.update(body);
            self.tail.clear();
            self.tail.extend_from_slice(tail);
        } else {
            self.tail.extend_from_slice(chunk);
            if self.tail.len() > ETCD_HASH_LEN {
                let spill = self.tail.len() - ETCD_HASH_LEN;
                self.database.update(&self.tail[..spill]);
                self.tail.drain(..spill);
            }
        }
    }

    /// The size and SHA-256 (hex) of all the bytes, or why they are not a whole etcd snapshot.
    fn finish(self) -> Result<(u64, String), String> {
        let database = self.database.finish();
        // etcdutl's `hasChecksum`: whole 512-byte multiples of database, then the 32-byte hash.
        let whole = self.size > ETCD_HASH_LEN as u64 && self.size % 512 == ETCD_HASH_LEN as u64;
        if !whole || database.as_ref() != self.tail.as_slice() {
            return Err(format!(
                "the node sent {} bytes that do not end with the SHA-256 etcd appends to a whole \
                 snapshot (the stream was cut short or the data is corrupt)",
                self.size
            ));
        }
        Ok((self.size, hex(self.all.finish().as_ref())))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The stored copy's size and hash against what was written.
fn compare_stored(location: &str, written: (u64, &str), read: (u64, &str)) -> Result<(), String> {
    if written == read {
        return Ok(());
    }
    Err(format!(
        "the stored copy at {location} reads back as {} bytes with sha256 {}, not the {} bytes \
         with sha256 {} that were written",
        read.0, read.1, written.0, written.1
    ))
}

/// Opens the node's snapshot stream. A node that could not be connected to, or did not answer in
/// time, gave no answer to act on: that is a passing state (a loaded or restarting node), taken
/// again on the next pass; any answer from the node is its word and fails the run.
async fn open(client: &TalosClient) -> Result<talos_api::SnapshotStream, TakeError> {
    client.etcd_snapshot().await.map_err(opening_failed)
}

fn opening_failed(error: TalosError) -> TakeError {
    match error {
        TalosError::Unreachable { .. } | TalosError::Timeout { .. } => {
            TakeError::NotReached(error.to_string())
        }
        error => TakeError::Failed(format!("the node refused it: {error}")),
    }
}

/// The next chunk of the stream, counted into the verifier before it is stored anywhere.
async fn next_verified(
    stream: &mut talos_api::SnapshotStream,
    verifier: &mut Verifier,
) -> Result<Option<Vec<u8>>, String> {
    let chunk = stream
        .next_chunk()
        .await
        .map_err(|e| format!("the stream broke off: {e}"))?;
    if let Some(chunk) = &chunk {
        verifier.update(chunk);
    }
    Ok(chunk)
}

async fn take_to_dir(
    mut stream: talos_api::SnapshotStream,
    dir: &Path,
    name: &SnapshotName,
) -> Result<Stored, String> {
    let path = dir.join(name.key());
    let location = format!("file://{}", path.display());
    let partial = path.with_extension("snapshot.partial");
    let io = |what: &str, e: std::io::Error| format!("{what} {}: {e}", partial.display());
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| format!("creating {}: {e}", parent.display()))?;
    }
    let mut file = tokio::fs::File::create(&partial)
        .await
        .map_err(|e| io("creating", e))?;
    let mut verifier = Verifier::new();
    let streamed = async {
        while let Some(chunk) = next_verified(&mut stream, &mut verifier).await? {
            file.write_all(&chunk).await.map_err(|e| io("writing", e))?;
        }
        file.sync_all().await.map_err(|e| io("writing", e))?;
        Ok::<_, String>(())
    }
    .await;
    drop(file);
    let written = streamed.and_then(|()| verifier.finish());
    let (size, sha256) = match written {
        Ok(written) => written,
        Err(reason) => {
            // A partial file is never left to look like a snapshot.
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(reason);
        }
    };
    tokio::fs::rename(&partial, &path)
        .await
        .map_err(|e| format!("renaming {} to {}: {e}", partial.display(), path.display()))?;
    let read = read_back_file(&path).await?;
    compare_stored(&location, (size, &sha256), (read.0, &read.1))?;
    Ok(Stored {
        location,
        size,
        sha256,
    })
}

async fn read_back_file(path: &Path) -> Result<(u64, String), String> {
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| format!("reading back {}: {e}", path.display()))?;
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    let mut size = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = file
            .read(&mut buf)
            .await
            .map_err(|e| format!("reading back {}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        hash.update(&buf[..n]);
    }
    Ok((size, hex(hash.finish().as_ref())))
}

async fn take_to_s3(
    mut stream: talos_api::SnapshotStream,
    s3: &S3Destination,
    name: &SnapshotName,
) -> Result<Stored, String> {
    let key = s3.key(&name.key());
    let location = format!("s3://{}/{key}", s3.bucket);
    let path = ObjectPath::from(key.as_str());
    // Small snapshots go up in one PUT, large ones in parts, without holding them in memory.
    let mut upload = object_store::buffered::BufWriter::new(s3.store.clone(), path.clone());
    let mut verifier = Verifier::new();
    let streamed = async {
        while let Some(chunk) = next_verified(&mut stream, &mut verifier).await? {
            upload
                .write_all(&chunk)
                .await
                .map_err(|e| format!("uploading to {location}: {e}"))?;
        }
        Ok::<_, String>(())
    }
    .await;
    let (size, sha256) = match streamed.and_then(|()| verifier.finish()) {
        Ok(written) => written,
        Err(reason) => {
            // Nothing is stored for a snapshot that did not come whole.
            let _ = upload.abort().await;
            return Err(reason);
        }
    };
    upload
        .shutdown()
        .await
        .map_err(|e| format!("uploading to {location}: {e}"))?;
    // Read back, not just asked about: an ETag is not a SHA-256 and differs between stores.
    let got = s3
        .store
        .get(&path)
        .await
        .map_err(|e| format!("reading back {location}: {e}"))?;
    let mut body = got.into_stream();
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    let mut read = 0u64;
    while let Some(bytes) = body.next().await {
        let bytes = bytes.map_err(|e| format!("reading back {location}: {e}"))?;
        read += bytes.len() as u64;
        hash.update(&bytes);
    }
    let read_sha = hex(hash.finish().as_ref());
    compare_stored(&location, (size, &sha256), (read, &read_sha))?;
    Ok(Stored {
        location,
        size,
        sha256,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that was not reached is asked again; a node's answer fails the run, naming it.
    #[test]
    fn a_snapshot_the_node_did_not_answer_is_taken_again_and_one_it_refused_fails() {
        let endpoint = "127.0.0.2:50000".to_string();
        for passing in [
            TalosError::Unreachable {
                endpoint: endpoint.clone(),
                reason: "connection refused".into(),
            },
            TalosError::Timeout {
                endpoint: endpoint.clone(),
                message: "EtcdSnapshot did not answer within 30s".into(),
            },
        ] {
            assert!(
                matches!(opening_failed(passing), TakeError::NotReached(_)),
                "taken again"
            );
        }
        let refused = opening_failed(TalosError::Status {
            endpoint,
            code: tonic::Code::Unknown,
            message: "failed reading etcd snapshot".into(),
        });
        let TakeError::Failed(reason) = refused else {
            panic!("{refused:?}");
        };
        assert!(
            reason.starts_with("the node refused it: Talos endpoint 127.0.0.2:50000"),
            "{reason}"
        );
    }

    fn snapshot(pages: usize) -> Vec<u8> {
        let mut data: Vec<u8> = (0..pages * 4096).map(|i| (i * 7 % 251) as u8).collect();
        let hash = ring::digest::digest(&ring::digest::SHA256, &data);
        data.extend_from_slice(hash.as_ref());
        data
    }

    /// Whatever the chunking, a whole snapshot verifies and a cut or altered one does not.
    #[test]
    fn the_verifier_checks_the_hash_etcd_appends_across_any_chunking() {
        let whole = snapshot(3);
        let sha = hex(ring::digest::digest(&ring::digest::SHA256, &whole).as_ref());
        let mut corrupt = whole.clone();
        corrupt[100] ^= 1;
        let cases: &[(&str, &[u8], bool)] = &[
            ("whole", &whole, true),
            ("cut in half", &whole[..whole.len() / 2], false),
            ("without its hash", &whole[..whole.len() - 32], false),
            ("a byte changed", &corrupt, false),
            ("empty", &[], false),
        ];
        for (name, data, ok) in cases {
            for chunk in [1, 5, 31, 32, 33, 4096, 1 << 20] {
                let mut verifier = Verifier::new();
                for piece in data.chunks(chunk) {
                    verifier.update(piece);
                }
                match verifier.finish() {
                    Ok((size, hash)) => {
                        assert!(*ok, "{name} / {chunk}: verified");
                        assert_eq!(size, whole.len() as u64);
                        assert_eq!(hash, sha);
                    }
                    Err(reason) => {
                        assert!(!ok, "{name} / {chunk}: {reason}");
                        assert!(reason.contains("cut short"), "{reason}");
                    }
                }
            }
        }
    }

    #[test]
    fn names_sort_oldest_first_and_only_the_newest_are_kept() {
        let name = SnapshotName {
            namespace: "default".into(),
            cluster: "prod".into(),
            kind: "talos",
            target: "1.12.0".into(),
            at: "2026-11-29T02:03:04Z".parse().expect("time"),
        };
        assert_eq!(
            name.key(),
            "default/prod/20261129T020304Z-talos-1.12.0.snapshot"
        );
        let names = vec![
            "20261129T020304Z-talos-1.12.0.snapshot".to_string(),
            "20251231T235959Z-talos-1.11.6.snapshot".to_string(),
            "20261001T000000Z-talos-1.11.6.snapshot".to_string(),
        ];
        assert_eq!(
            older_than_newest(names.clone(), 2),
            vec!["20251231T235959Z-talos-1.11.6.snapshot"]
        );
        assert_eq!(older_than_newest(names.clone(), 3), Vec::<String>::new());
        assert_eq!(older_than_newest(names, 1).len(), 2);
    }

    /// https anywhere, http to a loopback host only; the credentials never show in Debug output.
    #[test]
    fn an_s3_destination_needs_https_off_loopback_and_hides_its_credentials() {
        let options = |endpoint: &str| S3Options {
            endpoint: endpoint.to_string(),
            bucket: "backups".to_string(),
            region: "eu-north-1".to_string(),
            prefix: "/etcd/".to_string(),
            access_key_id: "AKIDEXAMPLE".to_string(),
            secret_access_key: "wJalrXUtnFEMI-secret".to_string(),
        };
        let https = S3Destination::new(options("https://s3.eu-north-1.amazonaws.com"))
            .expect("https is accepted");
        assert_eq!(https.prefix, "etcd");
        let shown = format!("{https:?}");
        assert!(
            !shown.contains("AKIDEXAMPLE") && !shown.contains("wJalrXUtnFEMI"),
            "{shown}"
        );
        S3Destination::new(options("http://127.0.0.1:8333")).expect("loopback http");
        let refused = S3Destination::new(options("http://s3.example.com")).expect_err("refused");
        assert_eq!(
            refused,
            ConfigError::InsecureEndpoint {
                endpoint: "http://s3.example.com".to_string()
            }
        );
        assert_eq!(
            SnapshotConfig::new(Destination::Dir("/tmp".into()), 0).expect_err("keep 0"),
            ConfigError::Keep
        );
    }

    #[test]
    fn http_is_accepted_for_loopback_hosts_only() {
        for (url, ok) in [
            ("http://127.0.0.1:8333", true),
            ("http://localhost:8333/", true),
            ("http://[::1]:9000", true),
            ("http://10.0.0.5:9000", false),
            ("http://s3.example.com", false),
        ] {
            assert_eq!(loopback(url), ok, "{url}");
        }
    }
}
