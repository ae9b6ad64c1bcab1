//! Kubeconfig files for the test control plane, readable by both kube-rs and the real `kubectl`.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

/// Who a kubeconfig authenticates as.
#[derive(Debug, Clone)]
pub enum Identity {
    /// A bearer token (the admin token, or a ServiceAccount token from the TokenRequest API).
    Token(String),
    /// The admin token, impersonating a user and groups (`kubectl --as`), so RBAC applies to that user.
    Impersonate {
        admin_token: String,
        user: String,
        groups: Vec<String>,
    },
}

/// Renders a single-context kubeconfig for `server`, trusting `ca_pem`.
pub fn render(server: &str, ca_pem: &str, identity: &Identity, namespace: &str) -> String {
    let ca = STANDARD.encode(ca_pem);
    let user = match identity {
        Identity::Token(token) => format!("    token: {}\n", quote(token)),
        Identity::Impersonate {
            admin_token,
            user,
            groups,
        } => {
            let mut out = format!(
                "    token: {}\n    as: {}\n",
                quote(admin_token),
                quote(user)
            );
            if !groups.is_empty() {
                out.push_str("    as-groups:\n");
                for group in groups {
                    out.push_str(&format!("    - {}\n", quote(group)));
                }
            }
            out
        }
    };
    format!(
        "apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: testenv\n  \
           cluster:\n    \
             server: {server}\n    \
             certificate-authority-data: {ca}\n\
         users:\n\
         - name: testenv\n  \
           user:\n\
         {user}\
         contexts:\n\
         - name: testenv\n  \
           context:\n    \
             cluster: testenv\n    \
             user: testenv\n    \
             namespace: {namespace}\n\
         current-context: testenv\n"
    )
}

/// JSON strings are valid YAML scalars and escape anything a value could contain.
fn quote(value: &str) -> String {
    serde_json::to_string(value).expect("strings always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impersonation_kubeconfig_parses_with_kube_rs() {
        let yaml = render(
            "https://127.0.0.1:6443",
            "-----BEGIN CERTIFICATE-----\n",
            &Identity::Impersonate {
                admin_token: "t0k\"en".into(),
                user: "alice".into(),
                groups: vec!["devs".into(), "ops".into()],
            },
            "team-a",
        );
        let parsed = kube::config::Kubeconfig::from_yaml(&yaml).expect("valid kubeconfig");
        let auth = parsed.auth_infos[0].auth_info.as_ref().expect("user");
        assert_eq!(auth.impersonate.as_deref(), Some("alice"));
        assert_eq!(
            auth.impersonate_groups.as_deref(),
            Some(&["devs".to_string(), "ops".to_string()][..])
        );
        let context = parsed.contexts[0].context.as_ref().expect("context");
        assert_eq!(context.namespace.as_deref(), Some("team-a"));
        let cluster = parsed.clusters[0].cluster.as_ref().expect("cluster");
        assert_eq!(cluster.server.as_deref(), Some("https://127.0.0.1:6443"));
    }
}
