//! Rolling upgrades as data and pure decisions: the persisted progress of a run and the functions that
//! decide, from it and from what the nodes look like now, what to do next.

pub mod kubernetes;
pub mod progress;
pub mod talos;
