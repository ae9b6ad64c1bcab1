//! A cluster's credentials from its Secret: the talosconfig for the Talos API and the kubeconfig of the
//! workload cluster. Errors name the Secret and the key, never their contents.

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};

use talos_api::{TalosCredentials, Talosconfig};

/// Secret key holding the talosctl client configuration.
pub const TALOSCONFIG_KEY: &str = "talosconfig";
/// Secret key holding the workload cluster's kubeconfig.
pub const KUBECONFIG_KEY: &str = "kube.config";

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("credentials Secret {namespace}/{name} not found")]
    NotFound { namespace: String, name: String },
    #[error("credentials Secret {namespace}/{name} has no {key:?} key")]
    MissingKey {
        namespace: String,
        name: String,
        key: &'static str,
    },
    /// The talosconfig's own errors never carry key material.
    #[error("the talosconfig in Secret {namespace}/{name} is not usable: {reason}")]
    Talosconfig {
        namespace: String,
        name: String,
        reason: String,
    },
    /// Only the position is reported: a parser's message could quote the secret text.
    #[error("the {KUBECONFIG_KEY} in Secret {namespace}/{name} is not a valid kubeconfig{at}")]
    Kubeconfig {
        namespace: String,
        name: String,
        at: String,
    },
    #[error("reading credentials Secret {namespace}/{name}: {source}")]
    Kube {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// What a cluster's Secret provides.
pub struct ClusterCredentials {
    pub talos: TalosCredentials,
    /// The talosconfig context's endpoints (control-plane nodes).
    pub endpoints: Vec<String>,
    /// The workload cluster's kubeconfig, when the Secret has one.
    pub workload: Option<Kubeconfig>,
}

impl std::fmt::Debug for ClusterCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCredentials")
            .field("endpoints", &self.endpoints)
            .field("workload", &self.workload.as_ref().map(|_| "<kubeconfig>"))
            .finish_non_exhaustive()
    }
}

/// Reads and parses the Secret `name` in `namespace`.
pub async fn load(
    client: kube::Client,
    namespace: &str,
    name: &str,
) -> Result<ClusterCredentials, CredentialsError> {
    let secrets: Api<Secret> = Api::namespaced(client, namespace);
    let (ns, n) = (namespace.to_string(), name.to_string());
    let secret = secrets
        .get_opt(name)
        .await
        .map_err(|source| CredentialsError::Kube {
            namespace: ns.clone(),
            name: n.clone(),
            source,
        })?
        .ok_or_else(|| CredentialsError::NotFound {
            namespace: ns.clone(),
            name: n.clone(),
        })?;
    parse(&secret, namespace, name)
}

/// Parses a Secret's credentials (separate from [`load`] so it is testable without an API server).
pub fn parse(
    secret: &Secret,
    namespace: &str,
    name: &str,
) -> Result<ClusterCredentials, CredentialsError> {
    let value = |key: &'static str| -> Option<String> {
        secret
            .data
            .as_ref()
            .and_then(|data| data.get(key))
            .map(|bytes| String::from_utf8_lossy(&bytes.0).into_owned())
            .or_else(|| {
                secret
                    .string_data
                    .as_ref()
                    .and_then(|data| data.get(key).cloned())
            })
    };
    let talosconfig = value(TALOSCONFIG_KEY).ok_or_else(|| CredentialsError::MissingKey {
        namespace: namespace.to_string(),
        name: name.to_string(),
        key: TALOSCONFIG_KEY,
    })?;
    let talos_error = |reason: String| CredentialsError::Talosconfig {
        namespace: namespace.to_string(),
        name: name.to_string(),
        reason,
    };
    let config = Talosconfig::from_yaml(&talosconfig).map_err(|e| talos_error(e.to_string()))?;
    let context = config
        .current_context()
        .map_err(|e| talos_error(e.to_string()))?;
    let talos = context
        .credentials()
        .map_err(|e| talos_error(e.to_string()))?;
    let endpoints = context.endpoints().to_vec();

    let workload = match value(KUBECONFIG_KEY) {
        None => None,
        Some(text) => {
            Some(
                Kubeconfig::from_yaml(&text).map_err(|e| CredentialsError::Kubeconfig {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    at: kubeconfig_error_position(&e),
                })?,
            )
        }
    };
    Ok(ClusterCredentials {
        talos,
        endpoints,
        workload,
    })
}

fn kubeconfig_error_position(error: &kube::config::KubeconfigError) -> String {
    // Walk to the YAML error, if any, for its line and column; its message is not used.
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(yaml) = current.downcast_ref::<serde_yaml::Error>()
            && let Some(location) = yaml.location()
        {
            return format!(" (line {}, column {})", location.line(), location.column());
        }
        source = current.source();
    }
    String::new()
}

/// The workload cluster's kubeconfig does not make a client (its message never quotes the file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the workload kubeconfig cannot be used: {0}")]
pub struct WorkloadClientError(String);

/// A client for the workload cluster described by `kubeconfig`.
pub async fn workload_client(kubeconfig: Kubeconfig) -> Result<kube::Client, WorkloadClientError> {
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| WorkloadClientError(e.to_string()))?;
    // kube retries 429 answers for minutes by default. An eviction refused by a PodDisruptionBudget is a
    // 429 the drain must see at once; every other call is retried by the next reconcile anyway.
    config.default_retry = false;
    crate::api_client::client(config).map_err(|e| WorkloadClientError(e.to_string()))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;

    use k8s_openapi::ByteString;

    use super::*;
    use talos_sim::pki::{CertAuthority, ClientRole, Validity, talosconfig_yaml};

    fn talosconfig() -> String {
        let ca = CertAuthority::generate().expect("ca");
        let identity = ca
            .client_identity(&ClientRole::Admin, Validity::one_year())
            .expect("identity");
        talosconfig_yaml(
            "my-cluster",
            &[Ipv4Addr::new(127, 0, 0, 11)],
            &[],
            ca.cert_pem(),
            &identity,
        )
    }

    fn secret(entries: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                entries
                    .iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Secret::default()
        }
    }

    const KUBECONFIG: &str =
        "apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts: []\n";

    #[test]
    fn a_complete_secret_yields_both_credentials() {
        let parsed = parse(
            &secret(&[
                (TALOSCONFIG_KEY, &talosconfig()),
                (KUBECONFIG_KEY, KUBECONFIG),
            ]),
            "team-a",
            "my-cluster",
        )
        .expect("credentials");
        assert_eq!(parsed.endpoints, vec!["127.0.0.11".to_string()]);
        assert!(parsed.workload.is_some());
        assert!(!format!("{parsed:?}").contains("PRIVATE KEY"));
    }

    #[test]
    fn broken_secrets_say_which_secret_and_key_without_their_contents() {
        let good = talosconfig();
        let bad_key = good.replace("key: ", "key: bm90IGEga2V5");
        let cases: Vec<(Secret, &str)> = vec![
            (
                secret(&[(KUBECONFIG_KEY, KUBECONFIG)]),
                "credentials Secret team-a/my-cluster has no \"talosconfig\" key",
            ),
            (
                secret(&[(TALOSCONFIG_KEY, "context: [unclosed")]),
                "the talosconfig in Secret team-a/my-cluster is not usable",
            ),
            (
                secret(&[(TALOSCONFIG_KEY, &bad_key)]),
                "the talosconfig in Secret team-a/my-cluster is not usable",
            ),
            (
                secret(&[
                    (TALOSCONFIG_KEY, &good),
                    (KUBECONFIG_KEY, "clusters: {broken: ["),
                ]),
                "the kube.config in Secret team-a/my-cluster is not a valid kubeconfig",
            ),
        ];
        for (secret, expected) in cases {
            let error = parse(&secret, "team-a", "my-cluster").expect_err(expected);
            let message = error.to_string();
            assert!(message.starts_with(expected), "{message}");
            assert!(!message.contains("PRIVATE KEY"), "{message}");
            assert!(!message.contains("bm90IGEga2V5"), "{message}");
        }
    }
}
