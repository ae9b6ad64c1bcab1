//! A counting HTTP proxy in front of the API server: the controller process talks to the API server only
//! through it, so every request the controller makes is counted (by scope, verb and resource) and
//! nothing else is (the benchmark's own clients, the simulator's workload mirror and the API server's
//! own loopback traffic go straight to the API server).
//!
//! Two scopes share one listener, told apart by a path prefix in the kubeconfig's `server`:
//! - `/m`: the management cluster (the controller's own kubeconfig);
//! - `/w/<cluster>`: a workload cluster (the `kube.config` in that cluster's credentials Secret).
//!
//! Every workload cluster of the benchmark is the same API server, so a Node or Pod list would return
//! the Nodes of all N clusters (1,000 Nodes at N = 200) where a real workload cluster has 5. The proxy
//! keeps a workload list of `nodes` or `pods` to the items of that cluster (node names start with
//! `<cluster>-`), so the controller parses what it would parse in production.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::header::{AUTHORIZATION, CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http_body_util::BodyExt;
use serde::Serialize;
use tokio_util_free::CancelOnDrop;

/// What one request counts as.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Key {
    /// `management` or `workload`.
    pub scope: &'static str,
    /// As the API server's audit log spells it: `get`, `list`, `watch`, `create`, `patch`, `update`,
    /// `delete`.
    pub verb: &'static str,
    /// `configmaps`, `kubernetesclusters/status`, `nodes`, ...
    pub resource: String,
}

#[derive(Debug, Clone, Default)]
pub struct Counts(pub BTreeMap<Key, u64>);

impl Counts {
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// `self - earlier`, key by key.
    pub fn since(&self, earlier: &Counts) -> Counts {
        Counts(crate::counts::minus(&self.0, &earlier.0))
    }

    /// `verb resource` → count, for the JSON report.
    pub fn breakdown(&self) -> BTreeMap<String, u64> {
        self.0
            .iter()
            .map(|(k, v)| (format!("{} {} {}", k.scope, k.verb, k.resource), *v))
            .collect()
    }

    /// [`Counts::breakdown`] as numbers for the by-request table.
    pub fn by_request(&self) -> BTreeMap<String, f64> {
        self.breakdown()
            .into_iter()
            .map(|(key, count)| (key, count as f64))
            .collect()
    }

    /// (watch requests, all other requests): issue #27's idle goal counts what the controller asks
    /// beyond its watches.
    pub fn watches_and_others(&self) -> (u64, u64) {
        self.0
            .iter()
            .fold((0, 0), |(watches, others), (key, count)| {
                if key.verb == crate::counts::WATCH_VERB {
                    (watches + count, others)
                } else {
                    (watches, others + count)
                }
            })
    }
}

struct ProxyState {
    /// The admin's config, for the upstream clients of each connection (see [`ConnectionState`]).
    upstream_config: kube::Config,
    counts: Mutex<Counts>,
    /// `--timeline`: one line per request, for reading a cluster's reconciles request by request.
    log: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
    /// Cluster name → when the API server answered the controller's first patch that set its
    /// `talos-status` to `in-progress` (the moment every reader of the object can see it).
    in_progress_written: Mutex<BTreeMap<String, std::time::SystemTime>>,
}

/// What the controller's patch of a cluster's annotations says when it reports a Talos run in progress.
const IN_PROGRESS_PATCH: &str = r#""upgrade.vitistack.io/talos-status":"in-progress""#;

pub struct Proxy {
    pub addr: SocketAddr,
    state: Arc<ProxyState>,
    _server: CancelOnDrop,
}

impl Proxy {
    /// Serves HTTPS on 127.0.0.1 (a free port) with the API server's own serving certificate and key
    /// (PEM files), so the controller's kubeconfigs verify it with the API server's CA, and offers
    /// HTTP/2 by ALPN with kube-apiserver's default of 100 streams per connection: the controller
    /// connects, negotiates and queues as it would against the API server itself. Forwards with the
    /// admin's `upstream` config (which authenticates). With `log`, writes a line per request there:
    /// when it arrived and when the API server's answer started (Unix milliseconds), scope, cluster,
    /// verb, resource, status code and path.
    pub async fn start(
        upstream_config: kube::Config,
        serving_cert: &std::path::Path,
        serving_key: &std::path::Path,
        log: Option<&std::path::Path>,
    ) -> anyhow::Result<Proxy> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_file_iter(serving_cert)?.collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(serving_key)?;
        let mut tls = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let log = log
            .map(std::fs::File::create)
            .transpose()?
            .map(|file| Mutex::new(std::io::BufWriter::new(file)));
        let state = Arc::new(ProxyState {
            upstream_config,
            counts: Mutex::new(Counts::default()),
            log,
            in_progress_written: Mutex::new(BTreeMap::new()),
        });
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let router = axum::Router::new()
                    .fallback(handle)
                    .with_state(ConnectionState {
                        shared: shared.clone(),
                        upstreams: Default::default(),
                    });
                let service = hyper_util::service::TowerToHyperService::new(router);
                // As Go's listeners (the API server's) do: no Nagle delay between the frames of an
                // answer.
                let _ = tcp.set_nodelay(true);
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut server = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    );
                    server.http2().max_concurrent_streams(100);
                    let _ = server
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Ok(Proxy {
            addr,
            state,
            _server: CancelOnDrop(task),
        })
    }

    pub fn management_url(&self) -> String {
        format!("https://{}/m", self.addr)
    }

    pub fn workload_url(&self, cluster: &str) -> String {
        format!("https://{}/w/{cluster}", self.addr)
    }

    /// When the API server answered each cluster's first `talos-status: in-progress` patch.
    pub fn in_progress_written(&self) -> BTreeMap<String, std::time::SystemTime> {
        self.state
            .in_progress_written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Writes out the request log's buffer.
    pub fn flush_log(&self) {
        if let Some(log) = &self.state.log {
            use std::io::Write;
            let _ = log.lock().unwrap_or_else(|p| p.into_inner()).flush();
        }
    }

    pub fn counts(&self) -> Counts {
        self.state
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// One connection from the controller: its requests go upstream over connections of their own, so the
/// API server sees the controller's connections one for one (over HTTP/2: its streams and its order),
/// as it would without the proxy.
#[derive(Clone)]
struct ConnectionState {
    shared: Arc<ProxyState>,
    /// Scope → the client forwarding this connection's requests of that scope.
    upstreams: Arc<Mutex<BTreeMap<String, kube::Client>>>,
}

impl ConnectionState {
    /// The client forwarding this connection's requests of one scope: the management cluster (`None`)
    /// or a workload cluster.
    fn upstream(&self, cluster: Option<&str>) -> anyhow::Result<kube::Client> {
        let key = cluster.map_or_else(|| "/m".to_string(), str::to_string);
        let mut upstreams = self.upstreams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = upstreams.get(&key) {
            return Ok(client.clone());
        }
        let client =
            talos_upgrade_controller::api_client::client(self.shared.upstream_config.clone())?;
        upstreams.insert(key, client.clone());
        Ok(client)
    }
}

async fn handle(State(connection): State<ConnectionState>, request: Request) -> Response {
    match forward(&connection, request).await {
        Ok(response) => response,
        Err(error) => (StatusCode::BAD_GATEWAY, format!("bench proxy: {error:#}")).into_response(),
    }
}

/// The resource path of `/api/v1/...` or `/apis/<group>/<version>/...`, without namespace: the
/// resource (with its subresource, if any) and whether the request names a collection.
fn classify(path: &str) -> (String, bool) {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let rest: &[&str] = match segments.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => return (path.to_string(), false),
    };
    let rest = match rest {
        ["namespaces", _ns, resource, more @ ..] => {
            let mut v = vec![*resource];
            v.extend_from_slice(more);
            v
        }
        other => other.to_vec(),
    };
    match rest.as_slice() {
        [] => ("discovery".to_string(), false),
        [resource] => (resource.to_string(), true),
        [resource, _name] => (resource.to_string(), false),
        [resource, _name, sub, ..] => (format!("{resource}/{sub}"), false),
    }
}

async fn forward(connection: &ConnectionState, request: Request) -> anyhow::Result<Response> {
    let state = &*connection.shared;
    let (parts, body) = request.into_parts();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".to_string());
    let (scope, cluster, rest) = if let Some(rest) = path_and_query.strip_prefix("/m/") {
        ("management", None, format!("/{rest}"))
    } else if let Some(rest) = path_and_query.strip_prefix("/w/") {
        let (cluster, rest) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        ("workload", Some(cluster.to_string()), rest.to_string())
    } else {
        anyhow::bail!("unexpected path {path_and_query}");
    };
    let (path, query) = rest.split_once('?').unwrap_or((&rest, ""));
    // A workload list of Nodes or Pods asks the API server only for this cluster's objects (they carry
    // its label), as a real workload cluster holds only its own: otherwise the shared API server would
    // serialise every cluster's Nodes for each list and the benchmark would measure that.
    // Pods only when listed by label (the control-plane mirror pods): a drain lists a node's pods by
    // field, and a workload pod does not carry the label.
    let narrowed = match classify(path).0.as_str() {
        "nodes" => true,
        "pods" => query.contains("labelSelector="),
        _ => false,
    };
    let (path, query) = match &cluster {
        Some(cluster) if narrowed => (path, with_cluster_selector(query, cluster)),
        _ => (path, query.to_string()),
    };
    let rest = if query.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{query}")
    };
    let query = query.as_str();
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let (resource, collection) = classify(path);
    let verb = match parts.method.as_str() {
        "GET" if watch => "watch",
        "GET" if collection => "list",
        "GET" => "get",
        "POST" => "create",
        "PATCH" => "patch",
        "PUT" => "update",
        "DELETE" if collection => "deletecollection",
        "DELETE" => "delete",
        _ => "other",
    };
    {
        let mut counts = state.counts.lock().unwrap_or_else(|p| p.into_inner());
        *counts
            .0
            .entry(Key {
                scope,
                verb,
                resource: resource.clone(),
            })
            .or_default() += 1;
    }

    let bytes = axum::body::to_bytes(body, 64 << 20).await?;
    let reports_in_progress = verb == "patch"
        && resource == "kubernetesclusters"
        && std::str::from_utf8(&bytes).is_ok_and(|body| body.contains(IN_PROGRESS_PATCH));
    let mut builder = http::Request::builder()
        .method(parts.method.clone())
        .uri(rest.as_str());
    for (name, value) in &parts.headers {
        if name != HOST && name != AUTHORIZATION && name != CONNECTION && name != CONTENT_LENGTH {
            builder = builder.header(name, value);
        }
    }
    // What a report says, for the timeline: the Talos message of an annotation patch, the messages of
    // a status patch's conditions.
    let said = match (&state.log, verb, resource.as_str()) {
        (Some(_), "patch", "kubernetesclusters") => reported_messages(&bytes),
        _ => String::new(),
    };
    let upstream = builder.body(kube::client::Body::from(bytes))?;
    let sent = unix_millis(std::time::SystemTime::now());
    let response = connection
        .upstream(cluster.as_deref())?
        .send(upstream)
        .await?;
    if reports_in_progress && response.status().is_success() {
        let name = path.rsplit('/').next().unwrap_or_default().to_string();
        state
            .in_progress_written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name)
            .or_insert_with(std::time::SystemTime::now);
    }
    if let Some(log) = &state.log {
        use std::io::Write;
        let _ = writeln!(
            log.lock().unwrap_or_else(|p| p.into_inner()),
            "{sent} {} request {scope} {} {verb} {resource} {} {path}{said}",
            unix_millis(std::time::SystemTime::now()),
            cluster.as_deref().unwrap_or("-"),
            response.status().as_u16()
        );
    }
    let (mut head, body) = response.into_parts();
    head.headers.remove(TRANSFER_ENCODING);
    head.headers.remove(CONNECTION);
    let filterable = verb == "list" && (resource == "nodes" || resource == "pods");
    if let (Some(cluster), true, true) = (cluster, filterable, head.status.is_success()) {
        let collected = body.collect().await?.to_bytes();
        let filtered = keep_cluster_items(&collected, &cluster, &resource)?;
        head.headers.remove(CONTENT_LENGTH);
        return Ok(Response::from_parts(head, axum::body::Body::from(filtered)));
    }
    Ok(Response::from_parts(head, axum::body::Body::new(body)))
}

/// The messages a patch of a KubernetesCluster writes (` said: <message> | <message>`), empty when it
/// writes none: the annotations' `talos-message` and `kubernetes-message`, the conditions' messages.
fn reported_messages(body: &[u8]) -> String {
    let Ok(patch) = serde_json::from_slice::<serde_json::Value>(body) else {
        return String::new();
    };
    let annotations = ["talos-message", "kubernetes-message"]
        .into_iter()
        .filter_map(|key| {
            patch["metadata"]["annotations"][format!("upgrade.vitistack.io/{key}")].as_str()
        });
    let conditions = patch["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|condition| condition["message"].as_str());
    let said: Vec<&str> = annotations.chain(conditions).collect();
    if said.is_empty() {
        String::new()
    } else {
        format!(" said: {}", said.join(" | "))
    }
}

/// `at` in milliseconds since the Unix epoch, as the timeline writes times.
pub fn unix_millis(at: std::time::SystemTime) -> u128 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The label every simulated Node and mirror Pod of a benchmark cluster carries: the cluster's name.
pub const CLUSTER_LABEL: &str = "bench.vitistack.io/cluster";

/// `query` with `CLUSTER_LABEL=cluster` added to its label selector (URL-encoded).
fn with_cluster_selector(query: &str, cluster: &str) -> String {
    let requirement = format!("{}%3D{cluster}", CLUSTER_LABEL.replace('/', "%2F"));
    let mut found = false;
    let mut parts: Vec<String> = query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.strip_prefix("labelSelector=") {
            Some(selector) if !selector.is_empty() => {
                found = true;
                format!("labelSelector={selector}%2C{requirement}")
            }
            Some(_) => {
                found = true;
                format!("labelSelector={requirement}")
            }
            None => kv.to_string(),
        })
        .collect();
    if !found {
        parts.push(format!("labelSelector={requirement}"));
    }
    parts.join("&")
}

/// The list with only the Nodes (or Pods on Nodes) of `cluster`.
fn keep_cluster_items(list: &[u8], cluster: &str, resource: &str) -> anyhow::Result<Vec<u8>> {
    let mut value: serde_json::Value = serde_json::from_slice(list)?;
    let prefix = format!("{cluster}-");
    if let Some(items) = value.get_mut("items").and_then(|i| i.as_array_mut()) {
        items.retain(|item| {
            let node = if resource == "nodes" {
                item["metadata"]["name"].as_str()
            } else {
                item["spec"]["nodeName"].as_str()
            };
            node.is_none_or(|n| n.starts_with(&prefix))
        });
    }
    Ok(serde_json::to_vec(&value)?)
}

#[cfg(test)]
mod tests {
    use super::{Counts, Key, classify};

    #[test]
    fn tells_watches_from_other_requests() {
        let key = |verb, resource: &str| Key {
            scope: "workload",
            verb,
            resource: resource.to_string(),
        };
        let counts = Counts(
            [
                (key("watch", "nodes"), 3),
                (key("list", "nodes"), 2),
                (key("patch", "kubernetesclusters"), 1),
            ]
            .into(),
        );
        assert_eq!(counts.watches_and_others(), (3, 3));
        assert_eq!(counts.by_request()["workload watch nodes"], 3.0);
    }

    #[test]
    fn adds_the_cluster_to_the_label_selector() {
        assert_eq!(
            super::with_cluster_selector("limit=500", "c1"),
            "limit=500&labelSelector=bench.vitistack.io%2Fcluster%3Dc1"
        );
        assert_eq!(
            super::with_cluster_selector("labelSelector=k8s-app%20in%20(a)&watch=true", "c1"),
            "labelSelector=k8s-app%20in%20(a)%2Cbench.vitistack.io%2Fcluster%3Dc1&watch=true"
        );
    }

    #[test]
    fn classifies_paths() {
        assert_eq!(classify("/api/v1/nodes"), ("nodes".into(), true));
        assert_eq!(classify("/api/v1/nodes/a"), ("nodes".into(), false));
        assert_eq!(
            classify("/api/v1/namespaces/x/configmaps"),
            ("configmaps".into(), true)
        );
        assert_eq!(
            classify("/apis/vitistack.io/v1alpha1/namespaces/x/kubernetesclusters/c/status"),
            ("kubernetesclusters/status".into(), false)
        );
        assert_eq!(
            classify("/api/v1/namespaces/x"),
            ("namespaces".into(), false)
        );
    }
}

/// A tiny stand-in for a cancel-on-drop guard (no tokio-util needed): aborts the task when dropped.
mod tokio_util_free {
    pub struct CancelOnDrop(pub tokio::task::JoinHandle<()>);
    impl Drop for CancelOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
}
