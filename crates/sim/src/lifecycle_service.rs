//! The Talos 1.13+ upgrade path (talos-api.md §1.4, §3.2): `machine.ImageService.Pull` streams layer
//! progress then the resolved name; `machine.LifecycleService.Upgrade` runs the installer against the
//! inactive A/B slot, streaming its output and ending with an exit code — no drain, no reboot; the new
//! version boots at the next `Reboot`. Older nodes answer `Unimplemented` like a server without the
//! service would.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::compat;
use super::image_ref::ImageRef;
use super::machine_service::{check_pullable, installer_version, pull_image, pull_not_found};
use super::node::Node;
use super::node_state::Slot;
use super::record::CallId;
use super::routing::{ApiContext, Proxy, single};
use talos_api::proto::{common, machine};

use machine::image_service_pull_layer_progress::Status as LayerStatus;
use machine::image_service_pull_response::Response as PullResponse;
use machine::lifecycle_service_install_progress::Response as InstallResponse;

pub(crate) const IMAGE_PULL: &str = "/machine.ImageService/Pull";
pub(crate) const LIFECYCLE_UPGRADE: &str = "/machine.LifecycleService/Upgrade";

fn require_lifecycle_api(node: &Node, service: &str) -> Result<(), Status> {
    if compat::has_lifecycle_api(&node.version()) {
        Ok(())
    } else {
        Err(Status::unimplemented(format!("unknown service {service}")))
    }
}

/// The `install-unavailable` fault: the pull or the install answers `Unavailable` before it starts.
fn install_unavailable(node: &Node) -> Result<(), Status> {
    if node.faults.current().install_unavailable {
        Err(Status::unavailable(
            "injected fault: the installation is unavailable",
        ))
    } else {
        Ok(())
    }
}

fn containerd_json(c: Option<&common::ContainerdInstance>) -> serde_json::Value {
    match c {
        Some(c) => json!({
            "driver": common::ContainerDriver::try_from(c.driver).map(|d| d.as_str_name()).unwrap_or("UNKNOWN"),
            "namespace": common::ContainerdNamespace::try_from(c.namespace).map(|n| n.as_str_name()).unwrap_or("UNKNOWN"),
        }),
        None => serde_json::Value::Null,
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ImageApi {
    ctx: ApiContext,
}

impl ImageApi {
    pub(crate) fn new(ctx: ApiContext) -> Self {
        ImageApi { ctx }
    }
}

type PullStream = ReceiverStream<Result<machine::ImageServicePullResponse, Status>>;

fn layer_progress(
    layer: &str,
    status: LayerStatus,
    elapsed: Duration,
    offset: i64,
    total: i64,
) -> machine::ImageServicePullResponse {
    machine::ImageServicePullResponse {
        response: Some(PullResponse::PullProgress(
            machine::ImageServicePullProgress {
                layer_id: layer.to_string(),
                progress: Some(machine::ImageServicePullLayerProgress {
                    status: status as i32,
                    elapsed: prost_types::Duration::try_from(elapsed).ok(),
                    offset,
                    total,
                }),
            },
        )),
    }
}

#[tonic::async_trait]
impl machine::image_service_server::ImageService for ImageApi {
    type PullStream = PullStream;

    async fn pull(
        &self,
        request: Request<machine::ImageServicePullRequest>,
    ) -> Result<Response<Self::PullStream>, Status> {
        let node = single(self.ctx.route(&request, IMAGE_PULL, Proxy::Streaming)?)?;
        require_lifecycle_api(&node, "machine.ImageService")?;
        let req = request.into_inner();
        let call = self.ctx.record(
            &node,
            IMAGE_PULL,
            json!({"image_ref": req.image_ref, "containerd": containerd_json(req.containerd.as_ref())}),
        );
        let start = (|| -> Result<ImageRef, Status> {
            install_unavailable(&node)?;
            let image = ImageRef::parse(&req.image_ref).map_err(Status::invalid_argument)?;
            // containerd resolves the reference before streaming anything: a missing image fails the
            // call, at once (Talos 1.14 makes a single attempt; talos-1.14.md §4.4).
            if !node.read(|s| s.pulled_images.contains(&req.image_ref)) {
                check_pullable(&node, &image, &req.image_ref).map_err(pull_not_found)?;
            }
            Ok(image)
        })();
        if let Err(status) = &start {
            self.ctx.finish(call, &Err::<(), _>(status.clone()));
        }
        start?;
        let already = node.read(|s| s.pulled_images.contains(&req.image_ref));
        let (tx, rx) = mpsc::channel(64);
        let (ctx, reference) = (self.ctx.clone(), req.image_ref.clone());
        let boot = node.boot_token();
        tokio::spawn(async move {
            let run = stream_pull(&ctx, &node, &reference, already, &tx);
            let result = tokio::select! {
                _ = boot.cancelled() => Err(Status::unavailable("node is rebooting")),
                result = run => result,
            };
            ctx.finish(call, &result);
            if let Err(status) = result {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

async fn stream_pull(
    ctx: &ApiContext,
    node: &Arc<Node>,
    reference: &str,
    already: bool,
    tx: &mpsc::Sender<Result<machine::ImageServicePullResponse, Status>>,
) -> Result<(), Status> {
    let gone = || Status::cancelled("client went away");
    const LAYERS: [(&str, i64); 2] = [
        ("sha256:1f3ae8b1c0d2e4f5", 48 * 1024 * 1024),
        ("sha256:9a7c6d5e4f3b2a10", 12 * 1024 * 1024),
    ];
    let started = Instant::now();
    if already {
        for (layer, total) in LAYERS {
            tx.send(Ok(layer_progress(
                layer,
                LayerStatus::AlreadyExists,
                started.elapsed(),
                total,
                total,
            )))
            .await
            .map_err(|_| gone())?;
        }
    } else {
        let slice = ctx.cluster.timings.pull() / (LAYERS.len() as u32 * 2);
        for (layer, total) in LAYERS {
            tx.send(Ok(layer_progress(
                layer,
                LayerStatus::Downloading,
                started.elapsed(),
                total / 2,
                total,
            )))
            .await
            .map_err(|_| gone())?;
            tokio::time::sleep(slice).await;
            tx.send(Ok(layer_progress(
                layer,
                LayerStatus::DownloadComplete,
                started.elapsed(),
                total,
                total,
            )))
            .await
            .map_err(|_| gone())?;
            tx.send(Ok(layer_progress(
                layer,
                LayerStatus::Extracting,
                started.elapsed(),
                0,
                total,
            )))
            .await
            .map_err(|_| gone())?;
            tokio::time::sleep(slice).await;
            tx.send(Ok(layer_progress(
                layer,
                LayerStatus::ExtractComplete,
                started.elapsed(),
                total,
                total,
            )))
            .await
            .map_err(|_| gone())?;
        }
        node.update(&ctx.cluster.etcd, |s| {
            s.pulled_images.insert(reference.to_string());
        });
    }
    tx.send(Ok(machine::ImageServicePullResponse {
        response: Some(PullResponse::Name(reference.to_string())),
    }))
    .await
    .map_err(|_| gone())
}

#[derive(Debug, Clone)]
pub(crate) struct LifecycleApi {
    ctx: ApiContext,
}

impl LifecycleApi {
    pub(crate) fn new(ctx: ApiContext) -> Self {
        LifecycleApi { ctx }
    }
}

type UpgradeStream = ReceiverStream<Result<machine::LifecycleServiceUpgradeResponse, Status>>;

fn progress_message(text: impl Into<String>) -> machine::LifecycleServiceUpgradeResponse {
    machine::LifecycleServiceUpgradeResponse {
        progress: Some(machine::LifecycleServiceInstallProgress {
            response: Some(InstallResponse::Message(text.into())),
        }),
    }
}

fn exit_code(code: i32) -> machine::LifecycleServiceUpgradeResponse {
    machine::LifecycleServiceUpgradeResponse {
        progress: Some(machine::LifecycleServiceInstallProgress {
            response: Some(InstallResponse::ExitCode(code)),
        }),
    }
}

#[tonic::async_trait]
impl machine::lifecycle_service_server::LifecycleService for LifecycleApi {
    type UpgradeStream = UpgradeStream;

    async fn upgrade(
        &self,
        request: Request<machine::LifecycleServiceUpgradeRequest>,
    ) -> Result<Response<Self::UpgradeStream>, Status> {
        let node = single(
            self.ctx
                .route(&request, LIFECYCLE_UPGRADE, Proxy::Streaming)?,
        )?;
        require_lifecycle_api(&node, "machine.LifecycleService")?;
        let req = request.into_inner();
        let image = req
            .source
            .as_ref()
            .map(|s| s.image_name.clone())
            .unwrap_or_default();
        let call = self.ctx.record(
            &node,
            LIFECYCLE_UPGRADE,
            json!({"image": image, "containerd": containerd_json(req.containerd.as_ref())}),
        );
        let cluster = &self.ctx.cluster;
        let claimed = (|| {
            install_unavailable(&node)?;
            if image.is_empty() {
                return Err(Status::invalid_argument("source.image_name is required"));
            }
            node.update(&cluster.etcd, |s| {
                if s.installing {
                    return Err(Status::failed_precondition(
                        "another install or upgrade is already running",
                    ));
                }
                if let Some(running) = s.sequence.filter(|seq| *seq != "boot") {
                    return Err(Status::failed_precondition(format!(
                        "cannot upgrade while sequence {running:?} is running"
                    )));
                }
                s.installing = true;
                Ok(())
            })
        })();
        if let Err(status) = &claimed {
            self.ctx.finish(call, &Err::<(), _>(status.clone()));
        }
        claimed?;

        let (tx, rx) = mpsc::channel(64);
        let ctx = self.ctx.clone();
        let boot = node.boot_token();
        tokio::spawn(async move {
            let run = run_installer(&ctx, &node, &image, &tx, call);
            tokio::select! {
                _ = boot.cancelled() => {
                    ctx.finish(call, &Err::<(), _>(Status::unavailable("node is rebooting")));
                    let _ = tx.send(Err(Status::unavailable("node is rebooting"))).await;
                }
                _ = run => {}
            }
            node.update(&ctx.cluster.etcd, |s| s.installing = false);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The installer's exit code for a failure of `category` (machinery v1.14.1 `constants/constants.go`,
/// "Installer/imager exit codes"): an installer image of 1.14 or later reports the category, an older
/// one (or one whose tag is not a version) exits 1 on every failure (talos v1.13 `cmd/installer`).
fn exit_code_for(installer: Option<&semver::Version>, category: i32) -> i32 {
    match installer {
        Some(v) if compat::installer_has_exit_codes(v) => category,
        _ => 1,
    }
}

/// What the installer says before it exits with `code`, in the words of the code's category.
fn category_line(code: i32) -> &'static str {
    match code {
        2 => {
            "invalid input: the installer options or configuration were rejected before work started"
        }
        3 => "unsupported: the requested operation is not supported for this version or feature",
        4 => "environment: host prerequisites are missing or unavailable",
        5 => "dependency: an external dependency (image pull, signer, overlay installer) failed",
        6 => "I/O: a local filesystem operation failed",
        7 => "install: the installation failed after it began",
        _ => "unknown error",
    }
}

/// The installer run: pull if needed, pre-flight (upgrade path), install into the inactive slot.
/// Failures end with a non-zero exit code, not a gRPC error (as the real service does): on a 1.14 or
/// later installer 5 for a failed pull (a dependency), 4 for a refused host version (the pre-flight
/// check, tagged environment in talos v1.14.1 `cmd/installer/pkg/install/preflight.go`), the injected
/// code of the `installer-exits` fault; 1 for all of them on older installers. A client that goes away
/// does not stop it: Talos waits on the installer with a detached context, so it runs to completion
/// and the new system is installed for the next boot (talos-1.14.md §4, "A client disconnect does not
/// cancel the install").
async fn run_installer(
    ctx: &ApiContext,
    node: &Arc<Node>,
    image: &str,
    tx: &mpsc::Sender<Result<machine::LifecycleServiceUpgradeResponse, Status>>,
    call: CallId,
) {
    let send = |msg| async move { tx.send(Ok(msg)).await.is_ok() };
    let installer = installer_version(image).ok();
    let installer = installer.as_ref();
    let fail = |category: i32, reason: String| async move {
        let code = exit_code_for(installer, category);
        let _ = tx
            .send(Ok(progress_message(format!("error: {reason}"))))
            .await;
        let _ = tx.send(Ok(exit_code(code))).await;
        ctx.cluster
            .record
            .finish(call, format!("exit code {code}: {reason}"));
    };
    // Whether the client still listens; the install goes on either way.
    let mut listening = send(progress_message(format!("pulling installer image {image}"))).await;
    if let Err(reason) = pull_image(ctx, node, image).await {
        fail(5, reason).await;
        return;
    }
    if let Some(code) = node.faults.take_installer_exit() {
        let code = exit_code_for(installer, code);
        fail(code, format!("{} (injected fault)", category_line(code))).await;
        return;
    }
    let target = match installer_version(image) {
        Ok(version) => version,
        Err(reason) => {
            fail(1, reason).await;
            return;
        }
    };
    // The pre-flight check: the installer asks the host for its version (`UpgradeableFrom`).
    if let Err(reason) = compat::check_upgrade_path(&node.version(), &target) {
        fail(4, format!("pre-flight checks failed: {reason}")).await;
        return;
    }
    let target = Slot {
        version: target,
        installer_image: image.to_string(),
    };
    let tag = compat::tag(&target.version);
    let steps = [
        format!("running installer {image}"),
        format!("pre-flight checks passed for upgrade to Talos {tag}"),
        format!("installing Talos {tag} into the inactive boot slot"),
        "writing bootloader configuration".to_string(),
    ];
    let slice = ctx.cluster.timings.install() / steps.len() as u32;
    for step in steps {
        if listening {
            listening = send(progress_message(step)).await;
        }
        tokio::time::sleep(slice).await;
    }
    node.update(&ctx.cluster.etcd, |s| s.next_boot = Some(target));
    let _ = send(progress_message(format!(
        "upgrade to Talos {tag} installed; reboot to activate it"
    )))
    .await;
    let _ = send(exit_code(0)).await;
    let result = if listening {
        "ok".to_string()
    } else {
        "ok (the client went away; the install ran to completion, as Talos's does)".to_string()
    };
    ctx.cluster.record.finish(call, result);
}
