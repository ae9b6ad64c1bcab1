//! The simulator through real clients: the project's Talos client, Talos's own Go client (the
//! conformance check) and the Kubernetes API for the workload mirror. One test binary, so they link once.

// Each suite uses a part of the common helpers.
#![allow(dead_code)]

mod common;

mod apply;
mod basics;
mod cosi;
mod etcd;
mod faults;
mod health;
mod mirrored;
mod talos_1_14;
mod talos_client;
mod talos_conformance;
mod talosctl;
mod upgrade;
mod workload;
