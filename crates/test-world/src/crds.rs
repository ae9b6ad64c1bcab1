//! The CustomResourceDefinitions a simulated cluster's objects need, and installing one.
//!
//! Two `KubernetesCluster` CRDs exist and cannot coexist in one API server (same name): the project's
//! ([`PROJECT_CLUSTER_CRD`], deploy/crd.yaml, generated from the core's types and checked to be up to
//! date by tests/integration/crd.rs), which preserves the fields it does not model, and vitistack's own
//! ([`VITISTACK_CLUSTER_CRD`], tests/fixtures/vitistack-crds, unmodified), which prunes unknown fields
//! and requires `phase`, `conditions` and `state` once a status exists. The controller must work under
//! both, so the end-to-end suites can run under either. The `Machine` CRD is always vitistack's.

use std::time::Duration;

use anyhow::Context;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};

/// The project's `KubernetesCluster` CRD: deploy/crd.yaml, what users install.
pub const PROJECT_CLUSTER_CRD: &str = include_str!("../../../deploy/crd.yaml");
/// vitistack's own `KubernetesCluster` CRD (vitistack/common), unmodified.
pub const VITISTACK_CLUSTER_CRD: &str =
    include_str!("../../../tests/fixtures/vitistack-crds/vitistack.io_kubernetesclusters.yaml");
/// vitistack's `Machine` CRD (vitistack/common), unmodified: the node inventory the controller reads.
pub const MACHINE_CRD: &str =
    include_str!("../../../tests/fixtures/vitistack-crds/vitistack.io_machines.yaml");

/// The name of either `KubernetesCluster` CRD.
pub const CLUSTER_CRD_NAME: &str = "kubernetesclusters.vitistack.io";
/// The name of the `Machine` CRD.
pub const MACHINE_CRD_NAME: &str = "machines.vitistack.io";

/// Field manager of the CRDs this crate applies.
const FIELD_MANAGER: &str = "test-world";
/// How long a new CRD may take to be established (a busy 2-core machine is slow).
const ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(60);

/// Installs (or updates to `yaml`) one CustomResourceDefinition, as `kubectl apply` would, and waits
/// until the API server has established it, so objects of its kind can be created right away.
///
/// A server-side apply: the tests of one binary share an API server and install the same CRDs at once,
/// and applying the same definition again is a no-op. When two applies race to create it, the loser's
/// conflict is retried (the retry finds the CRD and updates it instead).
pub async fn install_crd(client: &kube::Client, yaml: &str) -> anyhow::Result<()> {
    let crd: serde_json::Value = serde_yaml::from_str(yaml).context("a CRD's YAML")?;
    let name = crd["metadata"]["name"]
        .as_str()
        .context("a CRD without metadata.name")?
        .to_string();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut attempts = 0;
    loop {
        attempts += 1;
        match crds.patch(&name, &params, &Patch::Apply(&crd)).await {
            Ok(_) => break,
            Err(kube::Error::Api(status)) if status.code == 409 && attempts < 3 => continue,
            Err(error) => return Err(error).with_context(|| format!("applying CRD {name}")),
        }
    }
    testenv::crd_established(client, &name, ESTABLISHED_TIMEOUT)
        .await
        .map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_crd_is_one_document_with_its_name() {
        for (yaml, name) in [
            (PROJECT_CLUSTER_CRD, CLUSTER_CRD_NAME),
            (VITISTACK_CLUSTER_CRD, CLUSTER_CRD_NAME),
            (MACHINE_CRD, MACHINE_CRD_NAME),
        ] {
            let crd: CustomResourceDefinition = serde_yaml::from_str(yaml).expect("a CRD");
            assert_eq!(crd.metadata.name.as_deref(), Some(name));
        }
    }
}
