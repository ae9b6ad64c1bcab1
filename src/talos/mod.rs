//! The Talos API client: talosconfig parsing, mutual TLS, and the calls an upgrade needs.
