//! A test API server standing in for a simulated Talos cluster's workload cluster: the kubeconfig Talos
//! hands out for it, what the requests made with that kubeconfig may do there, and when its Nodes are
//! Ready.
//!
//! Talos hands out kubeconfigs with a client certificate, and talosctl accepts no other kind; the test
//! API server has no client CA, so those requests arrive as `system:anonymous`. Granting anonymous
//! requests anything is for an API server of the test's own, never for [`ControlPlane::shared`].

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, PostParams};

use crate::{ControlPlane, Result};

/// What requests arriving as `system:anonymous` may do (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnonymousAccess {
    /// Get, list and watch everything (ClusterRole and binding `testenv-anonymous-read`).
    Read,
    /// `cluster-admin` (binding `testenv-anonymous-admin`).
    Admin,
}

impl ControlPlane {
    /// Lets requests arriving as `system:anonymous` do `access` on this API server; granting it again
    /// is a no-op.
    pub async fn allow_anonymous(&self, access: AnonymousAccess) -> Result<()> {
        let client = self.client().await?;
        let (name, role) = match access {
            AnonymousAccess::Read => ("testenv-anonymous-read", "testenv-anonymous-read"),
            AnonymousAccess::Admin => ("testenv-anonymous-admin", "cluster-admin"),
        };
        if access == AnonymousAccess::Read {
            let read_all = ClusterRole {
                metadata: ObjectMeta {
                    name: Some(role.into()),
                    ..Default::default()
                },
                rules: Some(vec![PolicyRule {
                    api_groups: Some(vec!["*".into()]),
                    resources: Some(vec!["*".into()]),
                    verbs: vec!["get".into(), "list".into(), "watch".into()],
                    ..Default::default()
                }]),
                ..Default::default()
            };
            exists_or_created(
                Api::<ClusterRole>::all(client.clone())
                    .create(&PostParams::default(), &read_all)
                    .await,
            )?;
        }
        let binding = ClusterRoleBinding {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: role.into(),
            },
            subjects: Some(vec![Subject {
                kind: "User".into(),
                name: "system:anonymous".into(),
                api_group: Some("rbac.authorization.k8s.io".into()),
                ..Default::default()
            }]),
        };
        exists_or_created(
            Api::<ClusterRoleBinding>::all(client)
                .create(&PostParams::default(), &binding)
                .await,
        )
    }

    /// A kubeconfig for this API server shaped as Talos generates one: one cluster named `cluster`, one
    /// user `admin@<cluster>` with a client certificate and key (self-signed, `admin` in
    /// `system:masters`), namespace `default`. Its requests arrive as `system:anonymous` (see the
    /// module comment and [`ControlPlane::allow_anonymous`]).
    pub fn talos_shaped_kubeconfig(&self, cluster: &str) -> String {
        let key = rcgen::KeyPair::generate().expect("an ECDSA key");
        let mut params =
            rcgen::CertificateParams::new(Vec::<String>::new()).expect("certificate parameters");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "admin");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "system:masters");
        let cert = params.self_signed(&key).expect("a self-signed certificate");
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {cluster}\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: admin@{cluster}\n  user:\n    client-certificate-data: {crt}\n    client-key-data: {key}\ncontexts:\n- name: admin@{cluster}\n  context:\n    cluster: {cluster}\n    namespace: default\n    user: admin@{cluster}\ncurrent-context: admin@{cluster}\n",
            server = self.server(),
            ca = STANDARD.encode(self.ca_pem()),
            crt = STANDARD.encode(cert.pem()),
            key = STANDARD.encode(key.serialize_pem()),
        )
    }
}

/// A create that found the object there already (409) succeeded too.
fn exists_or_created<T>(created: kube::Result<T>) -> Result<()> {
    match created {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Whether `node` reports the condition `Ready` as `True`.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}
