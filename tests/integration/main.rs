//! Integration: the controller's edges against real components (a kube-apiserver + etcd from
//! `testenv`, the Talos simulator), one edge per module. One test binary, so they link once.

mod control_plane;
mod control_plane_failure;
mod crd;
mod event_recorder;
mod inventory;
mod kubernetes_upgrade_io;
mod progress_store;
mod talos_fleet;
