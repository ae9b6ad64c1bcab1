//! Talos 1.14 clusters (issue 22): configs created on 1.14 put the install image in an
//! `UnattendedInstallConfig` document (machinery v1.14.1, `config/types/runtime/unattended_install.go`)
//! and have no `machine.install.image`; the upgrade takes the installer from there.

use crate::world::{World, WorldSpec};

/// An Image Factory installer for bare metal, with a schematic (the document's own example's shape).
const METAL_INSTALLER: &str = "factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";
const TARGET: &str = "1.14.1";

/// A cluster created on Talos 1.14.0 (its install image only in `UnattendedInstallConfig`) is upgraded
/// to 1.14.1 with the same factory repository and schematic: every install call (`LifecycleService`)
/// carries it, and no node is touched on any other image.
#[tokio::test]
async fn a_cluster_created_on_1_14_is_upgraded_with_the_installer_of_its_unattended_install_config()
{
    let world = World::start(
        "t114-unattended",
        WorldSpec {
            talos: "1.14.0",
            kubernetes: "1.37.0",
            installer_repository: Some(METAL_INSTALLER),
            unattended_install: true,
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.14.0", "60s")
        .await;
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;

    let expected = format!("{METAL_INSTALLER}:v{TARGET}");
    let record = world.sim.record();
    let installs: Vec<(String, String)> = record
        .iter()
        .filter(|c| c.method.ends_with("LifecycleService/Upgrade"))
        .map(|c| {
            (
                c.node.clone(),
                c.params["image"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(installs.len(), 5, "{installs:?}");
    for (node, image) in &installs {
        assert_eq!(image, &expected, "the install on {node}");
    }
    let pulls: Vec<String> = record
        .iter()
        .filter(|c| c.method.ends_with("ImageService/Pull"))
        .map(|c| {
            c.params["image_ref"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert!(
        pulls.iter().all(|image| *image == expected),
        "every pull is of {expected}: {pulls:?}"
    );
    assert_eq!(
        world.annotation("talos-message").await,
        format!("Talos upgrade completed: now running {TARGET}")
    );
}
