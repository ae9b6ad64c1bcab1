//! Alertmanager silences during a Talos run (issue #23 item 2): the IO. A small client of
//! Alertmanager's API v2 (`GET /api/v2/silences`, `POST /api/v2/silences` to create or, with an id,
//! update, `DELETE /api/v2/silence/{id}` to expire) and the sync of one cluster's silences after each
//! reconcile: what [`talos_upgrade_core::silences`] wants against what Alertmanager holds.
//!
//! A silence is a courtesy: nothing here fails, holds or slows a run beyond its deadline. Every
//! problem (no connection, a timeout, an HTTP error, an answer that is not the API's) is logged,
//! counted (`talos_upgrade_silence_requests_total{result="error"}`) and said once per message by a
//! `SilenceFailed` Warning Event on the cluster; the next reconcile tries again.
//!
//! Alertmanager's list is read at most every [`LIST_TTL`] (one request for every cluster of the
//! controller), and kept current with the controller's own writes in between, so an idle fleet costs
//! one request a minute. After a restart the first list finds the controller's silences by their
//! `createdBy` and comment ([`SilenceKey`]).
//!
//! Transport and secrets as the alert gate's Prometheus client ([`crate::holds::alerts`]): `https`
//! verified against the auth Secret's `ca.crt` or the platform's roots, a bearer token (the Secret's
//! `token`) only over https or to a loopback host, no redirects, a deadline and a size cap on every
//! answer; the token is never logged or put in a message.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::Method;
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use jiff::Timestamp;
use kube::ResourceExt;
use serde::{Deserialize, Serialize};

use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::run::{Note, Reason};
use talos_upgrade_core::silences::{
    self, Change, ClusterIdentity, ClusterNames, Existing, Matcher, RunView, Scope, SilenceConfig,
    SilenceKey, SilenceMode,
};

use crate::holds::alerts;
use crate::http_auth::{self, AuthError, ExchangeError, SecretAuth};
use crate::metrics::Metrics;

/// How long one request may take.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// How long Alertmanager's list of silences is reused before it is read again.
pub const LIST_TTL: Duration = Duration::from_secs(60);
/// How long after a list that failed it is not asked again (the failure is reported instead): a
/// reconcile must not wait for an Alertmanager that does not answer at every poll.
pub const LIST_RETRY: Duration = Duration::from_secs(15);
/// Largest answer accepted (a list of every silence Alertmanager holds, expired ones included).
const MAX_ANSWER_BYTES: usize = 8 * 1024 * 1024;

/// The operator's Alertmanager settings (flags `--alertmanager-url`, `--alertmanager-auth-secret`,
/// `--silence-node-label`, `--silence-matchers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertmanagerConfig {
    pub url: String,
    /// `(namespace, name)` of the Secret with `token` and/or `ca.crt`.
    pub auth_secret: Option<(String, String)>,
    pub silences: SilenceConfig,
    /// How long one request may take ([`TIMEOUT`]).
    pub timeout: Duration,
    /// How long the list of silences is reused ([`LIST_TTL`]; tests shorten it).
    pub list_ttl: Duration,
    /// How long the auth Secret is reused ([`alerts::SECRET_TTL`]).
    pub secret_ttl: Duration,
}

/// Why the silences cannot be configured; the controller does not start with them.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "--alertmanager-url {url:?} is not an absolute http(s) URL without credentials, query or fragment"
    )]
    InvalidUrl { url: String },
    #[error("--alertmanager-auth-secret {value:?} is not <namespace>/<name>")]
    InvalidSecret { value: String },
    #[error("--silence-node-label: {0}")]
    InvalidNodeLabel(String),
    #[error("--silence-matchers {value:?}: {reason}")]
    InvalidMatchers { value: String, reason: String },
    #[error("cannot load the platform's root certificates to verify Alertmanager: {0}")]
    RootCertificates(String),
}

/// `--alertmanager-auth-secret`: `<namespace>/<name>`.
pub fn parse_secret_ref(value: &str) -> Result<(String, String), ConfigError> {
    alerts::parse_secret_ref(value).map_err(|_| ConfigError::InvalidSecret {
        value: value.to_string(),
    })
}

/// `--silence-node-label` and `--silence-matchers`.
pub fn parse_silence_config(
    node_label: &str,
    matchers: &str,
) -> Result<SilenceConfig, ConfigError> {
    Ok(SilenceConfig {
        node_label: SilenceConfig::parse_node_label(node_label)
            .map_err(ConfigError::InvalidNodeLabel)?,
        extra: SilenceConfig::parse_matchers(matchers).map_err(|reason| {
            ConfigError::InvalidMatchers {
                value: matchers.to_string(),
                reason,
            }
        })?,
    })
}

type HttpClient = http_auth::HttpClient<Full<Bytes>>;

/// The controller's Alertmanager: cheap to clone, shared by every reconcile.
#[derive(Clone)]
pub struct Alertmanager {
    inner: Arc<Inner>,
}

struct Inner {
    base: String,
    /// The client, with the bearer token and CA of the auth Secret when there is one.
    auth: SecretAuth<Full<Bytes>>,
    config: SilenceConfig,
    timeout: Duration,
    list_ttl: Duration,
    /// The controller's silences as last listed, kept current with its own writes.
    listing: tokio::sync::Mutex<Option<Listing>>,
    /// The last problem said of each cluster (namespace, name): said once per message.
    said: Mutex<HashMap<(String, String), String>>,
}

struct Listing {
    read_at: Instant,
    /// The controller's silences that are not expired; why not, when the list failed.
    ours: Result<Vec<Existing>, String>,
}

impl std::fmt::Debug for Alertmanager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alertmanager")
            .field("url", &self.inner.base)
            .field("auth_secret", &self.inner.auth.secret())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// A silence as Alertmanager's API v2 has it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ApiSilence {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    matchers: Vec<ApiMatcher>,
    starts_at: Timestamp,
    ends_at: Timestamp,
    created_by: String,
    comment: String,
    #[serde(default, skip_serializing)]
    status: Option<ApiStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ApiMatcher {
    name: String,
    value: String,
    is_regex: bool,
    /// Absent from silences made before Alertmanager 0.22: `=`.
    #[serde(default = "yes")]
    is_equal: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize)]
struct ApiStatus {
    state: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Created {
    #[serde(rename = "silenceID")]
    silence_id: String,
}

impl From<&Matcher> for ApiMatcher {
    fn from(matcher: &Matcher) -> Self {
        ApiMatcher {
            name: matcher.name.clone(),
            value: matcher.value.clone(),
            is_regex: matcher.is_regex,
            is_equal: matcher.is_equal,
        }
    }
}

impl From<&ApiMatcher> for Matcher {
    fn from(matcher: &ApiMatcher) -> Self {
        Matcher {
            name: matcher.name.clone(),
            value: matcher.value.clone(),
            is_regex: matcher.is_regex,
            is_equal: matcher.is_equal,
        }
    }
}

/// What one request is, for the metric and the messages.
#[derive(Debug, Clone, Copy)]
enum Operation {
    List,
    Create,
    Extend,
    Expire,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::List => "list",
            Operation::Create => "create",
            Operation::Extend => "extend",
            Operation::Expire => "expire",
        }
    }
}

impl Alertmanager {
    /// Checks the configuration (a bad one stops the controller at start); no request is made.
    pub fn new(
        config: AlertmanagerConfig,
        client: kube::Client,
    ) -> Result<Alertmanager, ConfigError> {
        let (base, https, loopback) =
            alerts::check_url(&config.url).map_err(|_| ConfigError::InvalidUrl {
                url: config.url.clone(),
            })?;
        let auth = SecretAuth::new(
            https,
            loopback,
            config.auth_secret,
            client,
            config.secret_ttl,
        )
        .map_err(|error| ConfigError::RootCertificates(error.to_string()))?;
        Ok(Alertmanager {
            inner: Arc::new(Inner {
                base: base.to_string(),
                auth,
                config: config.silences,
                timeout: config.timeout,
                list_ttl: config.list_ttl,
                listing: tokio::sync::Mutex::new(None),
                said: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// Brings `cluster`'s silences to what `mode` (the annotation's; `None`: the default) wants of
    /// `view`, the run as the reconcile left it. The Events to publish: `SilenceCreated`,
    /// `SilenceExpired`, and `SilenceFailed` once per problem.
    pub async fn sync(
        &self,
        cluster: &KubernetesCluster,
        mode: Option<SilenceMode>,
        view: &RunView<'_>,
        now: Timestamp,
        metrics: &Metrics,
    ) -> Vec<Note> {
        let mode = SilenceMode::or_default(mode);
        let namespace = cluster.namespace().unwrap_or_default();
        let name = cluster.name_any();
        let uid = cluster.uid().unwrap_or_default();
        let cluster_id = cluster.cluster_id().unwrap_or(&name).to_string();
        let identity = ClusterIdentity {
            names: ClusterNames {
                namespace: &namespace,
                cluster: &name,
                cluster_id: &cluster_id,
            },
            uid: &uid,
        };
        let wanted = silences::wanted(mode, &self.inner.config, &identity, view);
        let mut notes = Vec::new();
        let existing = match self.ours(&namespace, &name, &uid, metrics).await {
            Ok(existing) => existing,
            // A cluster that wants no silences (`off`) is not told of Alertmanager's problems: it
            // only looks for silences of its own left over.
            Err(problem) if mode == SilenceMode::Off => {
                tracing::debug!(%problem, "listing the silences");
                return notes;
            }
            Err(problem) => {
                notes.extend(self.failed(&namespace, &name, problem));
                return notes;
            }
        };
        let mut problems = Vec::new();
        for change in silences::plan(&wanted, &existing, now) {
            match self.change(&change, metrics).await {
                Ok(id) => notes.extend(announce(&change, &id, mode, &uid, view)),
                Err(problem) => problems.push(problem),
            }
        }
        match problems.into_iter().next() {
            Some(problem) => notes.extend(self.failed(&namespace, &name, problem)),
            None => {
                self.said_lock().remove(&(namespace, name));
            }
        }
        notes
    }

    /// Expires every silence of the cluster `namespace/name` with `uid` (deleted): in the
    /// background, logged.
    pub fn forget_cluster(&self, namespace: &str, name: &str, uid: &str, metrics: &Metrics) {
        let this = self.clone();
        let metrics = metrics.clone();
        let (namespace, name, uid) = (namespace.to_string(), name.to_string(), uid.to_string());
        self.said_lock().remove(&(namespace.clone(), name.clone()));
        tokio::spawn(async move {
            let ours = match this.ours(&namespace, &name, &uid, &metrics).await {
                Ok(ours) => ours,
                Err(problem) => {
                    tracing::warn!(%namespace, cluster = %name, %problem, "the silences of a deleted cluster are left to end on their own");
                    return;
                }
            };
            for existing in ours {
                let id = existing.id.clone();
                match this.change(&Change::Expire { existing }, &metrics).await {
                    Ok(_) => {
                        tracing::info!(%namespace, cluster = %name, silence = %id, "expired the silence of a deleted cluster")
                    }
                    Err(problem) => {
                        tracing::warn!(%namespace, cluster = %name, %problem, "expiring the silence of a deleted cluster")
                    }
                }
            }
        });
    }

    fn said_lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), String>> {
        self.inner
            .said
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A `SilenceFailed` Event for `problem`, unless it was the last one said of the cluster.
    fn failed(&self, namespace: &str, name: &str, problem: String) -> Option<Note> {
        tracing::warn!(%problem, "Alertmanager silence");
        let mut said = self.said_lock();
        let key = (namespace.to_string(), name.to_string());
        if said.get(&key) == Some(&problem) {
            return None;
        }
        said.insert(key, problem.clone());
        Some(Note::warning(
            Reason::SilenceFailed,
            format!("{problem}; the upgrade goes on without the silence"),
        ))
    }

    /// The cluster's silences that are not expired, from the list (read again once
    /// [`LIST_TTL`] has passed). Only those of this object (its uid): a silence of another cluster
    /// of the same namespace and name (deleted and created again while no controller watched, or
    /// another management cluster's sharing the Alertmanager) is never touched, and ends on its
    /// own within [`silences::SILENCE_FOR`].
    async fn ours(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        metrics: &Metrics,
    ) -> Result<Vec<Existing>, String> {
        let mut listing = self.inner.listing.lock().await;
        let stale = listing.as_ref().is_none_or(|listing| {
            let age = listing.read_at.elapsed();
            match listing.ours {
                Ok(_) => age >= self.inner.list_ttl,
                Err(_) => age >= LIST_RETRY.min(self.inner.list_ttl),
            }
        });
        if stale {
            let listed = self.list().await;
            metrics.record_silence_request(Operation::List.as_str(), listed.is_ok());
            *listing = Some(Listing {
                read_at: Instant::now(),
                ours: listed,
            });
        }
        match listing.as_ref().map(|listing| &listing.ours) {
            Some(Ok(ours)) => Ok(ours
                .iter()
                .filter(|s| s.key.namespace == namespace && s.key.name == name && s.key.uid == uid)
                .cloned()
                .collect()),
            Some(Err(problem)) => Err(problem.clone()),
            None => Ok(Vec::new()),
        }
    }

    /// Makes one change; the id of the silence it leaves (created, extended, expired).
    async fn change(&self, change: &Change, metrics: &Metrics) -> Result<String, String> {
        let (operation, result) = match change {
            Change::Create {
                wanted,
                starts_at,
                ends_at,
            } => (
                Operation::Create,
                self.post(None, &wanted.key, &wanted.matchers, *starts_at, *ends_at)
                    .await,
            ),
            Change::Extend {
                id,
                wanted,
                starts_at: _,
                ends_at,
            } => (Operation::Extend, self.extend(id, wanted, *ends_at).await),
            Change::Expire { existing } => (
                Operation::Expire,
                self.expire(&existing.id)
                    .await
                    .map(|()| existing.id.clone()),
            ),
        };
        metrics.record_silence_request(operation.as_str(), result.is_ok());
        let id = result?;
        // The list kept current with what was just written.
        let mut listing = self.inner.listing.lock().await;
        if let Some(Ok(ours)) = listing.as_mut().map(|listing| &mut listing.ours) {
            match change {
                Change::Create {
                    wanted,
                    starts_at,
                    ends_at,
                }
                | Change::Extend {
                    wanted,
                    starts_at,
                    ends_at,
                    ..
                } => {
                    if let Change::Extend { id: old, .. } = change {
                        ours.retain(|s| &s.id != old);
                    }
                    ours.push(Existing {
                        id: id.clone(),
                        key: wanted.key.clone(),
                        matchers: wanted.matchers.clone(),
                        // Alertmanager moves a start in the past to its now; an update in place
                        // keeps the one it had.
                        starts_at: *starts_at,
                        ends_at: *ends_at,
                    });
                }
                Change::Expire { existing } => ours.retain(|s| s.id != existing.id),
            }
        }
        Ok(id)
    }

    /// `GET /api/v2/silences`: the controller's silences that are not expired.
    async fn list(&self) -> Result<Vec<Existing>, String> {
        let body = self
            .request(Method::GET, "/api/v2/silences", None, Operation::List)
            .await?;
        let all: Vec<ApiSilence> = serde_json::from_slice(&body).map_err(|error| {
            format!(
                "the silences listed by Alertmanager at {} are not its API's JSON: {error}",
                self.inner.base
            )
        })?;
        Ok(all
            .into_iter()
            .filter(|silence| {
                silence
                    .status
                    .as_ref()
                    .is_none_or(|status| status.state != "expired")
            })
            .filter_map(|silence| {
                Some(Existing {
                    key: SilenceKey::parse(&silence.created_by, &silence.comment)?,
                    id: silence.id?,
                    matchers: silence.matchers.iter().map(Matcher::from).collect(),
                    starts_at: silence.starts_at,
                    ends_at: silence.ends_at,
                })
            })
            .collect())
    }

    /// `POST /api/v2/silences` (with `id`: an update); the silence's id.
    async fn post(
        &self,
        id: Option<&String>,
        key: &SilenceKey,
        matchers: &[Matcher],
        starts_at: Timestamp,
        ends_at: Timestamp,
    ) -> Result<String, String> {
        let silence = ApiSilence {
            id: id.cloned(),
            matchers: matchers.iter().map(ApiMatcher::from).collect(),
            starts_at,
            ends_at,
            created_by: silences::CREATED_BY.to_string(),
            comment: key.comment(),
            status: None,
        };
        let body = serde_json::to_vec(&silence).map_err(|error| error.to_string())?;
        let operation = if id.is_some() {
            Operation::Extend
        } else {
            Operation::Create
        };
        let answer = self
            .request(Method::POST, "/api/v2/silences", Some(body), operation)
            .await?;
        let created: Created = serde_json::from_slice(&answer).map_err(|error| {
            format!(
                "Alertmanager at {} answered a silence without its id: {error}",
                self.inner.base
            )
        })?;
        Ok(created.silence_id)
    }

    /// Writes the silence `id` again with a later end. Alertmanager updates an active silence in
    /// place only when its `startsAt` is the one it holds (which it set itself when the silence was
    /// created: a start in its past becomes its now), so that is read first; one expired meanwhile
    /// (by hand) is made again under a new id.
    async fn extend(
        &self,
        id: &str,
        wanted: &silences::Wanted,
        ends_at: Timestamp,
    ) -> Result<String, String> {
        check_id(id)?;
        let held = self
            .request(
                Method::GET,
                &format!("/api/v2/silence/{id}"),
                None,
                Operation::Extend,
            )
            .await;
        let current = match held {
            Ok(body) => serde_json::from_slice::<ApiSilence>(&body).ok(),
            Err(problem) if problem.contains("HTTP 404") => None,
            Err(problem) => return Err(problem),
        };
        match current.filter(|silence| {
            silence
                .status
                .as_ref()
                .is_none_or(|status| status.state != "expired")
        }) {
            Some(silence) => {
                let id = id.to_string();
                self.post(
                    Some(&id),
                    &wanted.key,
                    &wanted.matchers,
                    silence.starts_at,
                    ends_at,
                )
                .await
            }
            None => {
                self.post(
                    None,
                    &wanted.key,
                    &wanted.matchers,
                    Timestamp::now(),
                    ends_at,
                )
                .await
            }
        }
    }

    /// `DELETE /api/v2/silence/{id}`; one Alertmanager no longer knows is as good as expired.
    async fn expire(&self, id: &str) -> Result<(), String> {
        check_id(id)?;
        match self
            .request(
                Method::DELETE,
                &format!("/api/v2/silence/{id}"),
                None,
                Operation::Expire,
            )
            .await
        {
            Err(problem) if problem.contains("silence not found") => Ok(()),
            other => other.map(|_| ()),
        }
    }

    /// One request within the deadline; the answer's body, or why there is none (a sentence that
    /// names Alertmanager's URL, never the token).
    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        operation: Operation,
    ) -> Result<Bytes, String> {
        let shown = &self.inner.base;
        let what = operation.as_str();
        match tokio::time::timeout(self.inner.timeout, self.send(method, path, body)).await {
            Ok(result) => result
                .map_err(|problem| format!("Alertmanager at {shown} ({what} silences): {problem}")),
            Err(_) => Err(format!(
                "Alertmanager at {shown} ({what} silences) did not answer within {:?}",
                self.inner.timeout
            )),
        }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, String> {
        let (http, bearer) = self.connection().await?;
        let mut request = http_auth::request(method, format!("{}{path}", self.inner.base), bearer);
        if body.is_some() {
            request = request.header(CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|_| "cannot build the request".to_string())?;
        let (status, answer) = http_auth::exchange(&http, request, MAX_ANSWER_BYTES)
            .await
            .map_err(|error| match error {
                ExchangeError::Unreachable(causes) => format!("unreachable: {causes}"),
                ExchangeError::Reading(error) => format!("reading the answer failed: {error}"),
            })?;
        if !status.is_success() {
            let hint = if matches!(status.as_u16(), 401 | 403) {
                " (check the token of --alertmanager-auth-secret)"
            } else {
                ""
            };
            let text = String::from_utf8_lossy(&answer);
            let text: String = text.trim().chars().take(200).collect();
            return Err(format!("answered HTTP {status}{hint}: {text}"));
        }
        Ok(answer)
    }

    /// The client and Authorization header: from the auth Secret (read again once its TTL has
    /// passed), or the plain client without one.
    async fn connection(&self) -> Result<(HttpClient, Option<HeaderValue>), String> {
        self.inner.auth.connection().await.map_err(|problem| {
            let (namespace, name) = self.inner.auth.secret().expect("only a Secret fails");
            let shown = format!("Secret {namespace}/{name} (--alertmanager-auth-secret)");
            match problem {
                AuthError::Unreadable(error) => format!("cannot read the auth {shown}: {error}"),
                AuthError::Missing => format!("the auth {shown} does not exist"),
                AuthError::TokenOverPlainHttp => format!(
                    "refusing to send the bearer token of the auth {shown} over plain http: use an \
                     https URL"
                ),
                AuthError::BadToken => format!(
                    "the {:?} key of the auth {shown} is not a usable bearer token",
                    alerts::TOKEN_KEY
                ),
                AuthError::BadCa(problem) => {
                    format!("the {:?} key of the auth {shown} {problem}", alerts::CA_KEY)
                }
                AuthError::Client(error) => error,
            }
        })
    }
}

/// One reconcile's silences of one cluster: synced before the calls that start a node (so the
/// node is silenced before it is disrupted) and after the reconcile; the Events of both, published
/// with the reconcile's.
pub struct RunSilences<'a> {
    pub alertmanager: &'a Alertmanager,
    pub cluster: &'a KubernetesCluster,
    /// The annotation's mode (`None`: the default).
    pub mode: Option<SilenceMode>,
    /// The Talos target annotation, trimmed.
    pub requested: Option<&'a str>,
    pub paused: bool,
    pub now: Timestamp,
    pub metrics: &'a Metrics,
    notes: Mutex<Vec<Note>>,
}

impl<'a> RunSilences<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        alertmanager: &'a Alertmanager,
        cluster: &'a KubernetesCluster,
        mode: Option<SilenceMode>,
        requested: Option<&'a str>,
        paused: bool,
        now: Timestamp,
        metrics: &'a Metrics,
    ) -> Self {
        RunSilences {
            alertmanager,
            cluster,
            mode,
            requested,
            paused,
            now,
            metrics,
            notes: Mutex::new(Vec::new()),
        }
    }

    /// Syncs the silences with `run` (the record as saved: before the calls, with the nodes about to
    /// start in flight), within [`TIMEOUT`]; a sync that takes longer is left for the next one.
    pub async fn sync(&self, run: Option<&talos_upgrade_core::talos::Run>) {
        let view = RunView {
            run,
            requested: self.requested,
            paused: self.paused,
        };
        let synced = tokio::time::timeout(
            self.alertmanager.inner.timeout,
            self.alertmanager
                .sync(self.cluster, self.mode, &view, self.now, self.metrics),
        )
        .await;
        match synced {
            Ok(notes) => self
                .notes
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .extend(notes),
            Err(_) => tracing::warn!(
                "syncing the Alertmanager silences took too long; left for the next reconcile"
            ),
        }
    }

    /// The Events of every sync so far.
    pub fn take_notes(&self) -> Vec<Note> {
        std::mem::take(
            &mut *self
                .notes
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }
}

/// An id as Alertmanager makes them (a UUID), before it goes into a path.
fn check_id(id: &str) -> Result<(), String> {
    if !id.is_empty() && id.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
        Ok(())
    } else {
        Err(format!("{id:?} is not a silence id"))
    }
}

/// The Event that tells a change made.
fn announce(
    change: &Change,
    id: &str,
    mode: SilenceMode,
    uid: &str,
    view: &RunView<'_>,
) -> Option<Note> {
    let what = |key: &SilenceKey| match &key.scope {
        Scope::Node(node) => format!("node {node}"),
        Scope::Run => "the run's nodes".to_string(),
    };
    match change {
        Change::Create {
            wanted, ends_at, ..
        } => Some(Note::normal(
            Reason::SilenceCreated,
            format!(
                "Created Alertmanager silence {id} for {} while it is upgraded: {}, until {ends_at} \
                 unless extended",
                what(&wanted.key),
                silences::show(&wanted.matchers),
            ),
        )),
        Change::Extend { wanted, .. } => {
            tracing::debug!(silence = %id, matchers = %silences::show(&wanted.matchers), "extended");
            None
        }
        Change::Expire { existing } => Some(Note::normal(
            Reason::SilenceExpired,
            format!(
                "Expired Alertmanager silence {id} for {} ({}): {}",
                what(&existing.key),
                silences::show(&existing.matchers),
                silences::why_expired(&existing.key, mode, uid, view),
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags() {
        assert!(parse_secret_ref("monitoring/am").is_ok());
        assert!(parse_secret_ref("am").is_err());
        let config = parse_silence_config("node", r#"cluster="{clusterId}""#).unwrap();
        assert_eq!(config.extra.len(), 1);
        let error = parse_silence_config("no-de", "").unwrap_err().to_string();
        assert!(error.contains("--silence-node-label"), "{error}");
        let error = parse_silence_config("node", "cluster=x")
            .unwrap_err()
            .to_string();
        assert!(error.contains("--silence-matchers"), "{error}");
    }

    #[test]
    fn the_api_silence_shape() {
        let listed = r#"[{"id":"7a27","status":{"state":"active"},"updatedAt":"2026-11-28T12:53:37.609Z",
            "comment":"x cluster=ns/c uid=u run=1.12.0@2026-11-28T11:00:00Z scope=node:w1",
            "createdBy":"talos-upgrade-controller","endsAt":"2026-11-28T13:08:37.000Z",
            "matchers":[{"isEqual":true,"isRegex":false,"name":"node","value":"w1"}],
            "startsAt":"2026-11-28T12:53:37.609Z"}]"#;
        let all: Vec<ApiSilence> = serde_json::from_str(listed).unwrap();
        let key = SilenceKey::parse(&all[0].created_by, &all[0].comment).unwrap();
        assert_eq!(key.scope, Scope::Node("w1".into()));
        let posted = serde_json::to_value(&all[0]).unwrap();
        assert_eq!(posted["startsAt"], "2026-11-28T12:53:37.609Z");
        assert_eq!(posted["matchers"][0]["isEqual"], true);
        assert!(posted.get("status").is_none());
    }
}
