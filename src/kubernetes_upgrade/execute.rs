//! Performing the image actions on a node's Talos API: pre-pulls and machine-config patches.

use super::{ExecuteError, machine_config};
use talos_api::{ApplyMode, ContainerdNamespace, TalosClient, TalosError};
use talos_upgrade_core::kubernetes::{ImageField, ImagePull};

/// `ImagePull` of every image into the containerd namespace its field needs, one after the other (as
/// talosctl does; each call blocks until the image is there).
pub(super) async fn pull_images(
    client: &TalosClient,
    node: &str,
    images: &[ImagePull],
) -> Result<(), ExecuteError> {
    for pull in images {
        let namespace = if pull.field.pulls_into_system_namespace() {
            ContainerdNamespace::NsSystem
        } else {
            ContainerdNamespace::NsCri
        };
        match client.image_pull_legacy(&pull.image, namespace).await {
            Ok(()) => {
                tracing::info!(node, image = %pull.image, "pulled image");
            }
            // Talos versions without the legacy pull: the image is pulled when it is first used, so
            // there is nothing to pre-pull (talosctl ignores this answer too).
            Err(TalosError::Unimplemented { .. }) => {
                tracing::info!(node, image = %pull.image, "the node does not pre-pull images; skipped");
            }
            Err(error @ TalosError::NotFound { .. }) => {
                return Err(ExecuteError::Refused(format!(
                    "image {} not found on node {node}: {error}",
                    pull.image
                )));
            }
            Err(error) => {
                return Err(classify(
                    error,
                    &format!("pulling image {} on node {node}", pull.image),
                ));
            }
        }
    }
    Ok(())
}

/// Sets `field` to `image` in the node's machine config and applies it without a reboot. Nothing is
/// applied when the config already has the image.
///
/// Talos has no compare-and-swap for configs: a change someone else applies between our read and our
/// apply is overwritten. talosctl has the same window; it is short, and the config is only read here.
/// Like talosctl, the patch starts from the active config, so a config staged for the next boot
/// (`STAGED` apply) is replaced by the active one plus the new image.
pub(super) async fn patch_image(
    client: &TalosClient,
    node: &str,
    field: ImageField,
    image: &str,
) -> Result<(), ExecuteError> {
    let what = format!("setting {field} image {image} on node {node}");
    let config = client
        .machine_config()
        .await
        .map_err(|e| classify(e, &format!("reading the machine config for {what}")))?;
    let patched = match machine_config::set_image(config.as_bytes(), field, image) {
        Ok(Some(patched)) => patched,
        Ok(None) => {
            tracing::info!(node, %field, image, "image already configured; nothing to apply");
            return Ok(());
        }
        // The config itself is broken for us; reading it again will not change that.
        Err(error) => {
            return Err(ExecuteError::Refused(format!(
                "cannot set {field} image on node {node}: {error}"
            )));
        }
    };
    let outcome = client
        .apply_configuration(patched, ApplyMode::NoReboot, false)
        .await
        .map_err(|e| classify(e, &what))?;
    tracing::info!(
        node,
        %field,
        image,
        mode = ?outcome.mode,
        details = %outcome.mode_details,
        "applied the machine config"
    );
    Ok(())
}

/// Whether a Talos error is the node's final word or may pass. `doing` says what was attempted and
/// names the node; the error adds the endpoint and what Talos said (never config content: the client
/// does not put request data in errors).
pub(super) fn classify(error: TalosError, doing: &str) -> ExecuteError {
    match error {
        // The node looked at the request and said no: asking again gets the same answer.
        TalosError::InvalidArgument { .. }
        | TalosError::FailedPrecondition { .. }
        | TalosError::PermissionDenied { .. }
        | TalosError::Unimplemented { .. } => {
            ExecuteError::Refused(format!("{doing} was refused: {error}"))
        }
        // Down, rebooting, timed out, or a failure of the connection or of our credentials (which the
        // observation shows as unreachable; the step's deadline bounds the wait).
        TalosError::Unreachable { .. }
        | TalosError::Timeout { .. }
        | TalosError::Tls { .. }
        | TalosError::Config(_)
        | TalosError::NotFound { .. }
        | TalosError::Status { .. }
        | TalosError::Decode { .. }
        | TalosError::Watch { .. }
        | TalosError::UpgradeFailed { .. } => {
            ExecuteError::Transient(format!("{doing} failed: {error}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_and_transient_failures_are_told_apart() {
        let endpoint = "10.0.0.2:50000".to_string();
        let refused = classify(
            TalosError::InvalidArgument {
                endpoint: endpoint.clone(),
                message: "configuration validation failed".into(),
            },
            "setting kubelet image on node w-1",
        );
        let ExecuteError::Refused(message) = refused else {
            panic!("{refused:?}");
        };
        assert!(message.contains("node w-1"), "{message}");
        assert!(
            message.contains("configuration validation failed"),
            "{message}"
        );
        for error in [
            TalosError::Unreachable {
                endpoint: endpoint.clone(),
                reason: "connection refused".into(),
            },
            TalosError::Timeout {
                endpoint: endpoint.clone(),
                message: "deadline".into(),
            },
        ] {
            assert!(matches!(classify(error, "x"), ExecuteError::Transient(_)));
        }
    }
}
