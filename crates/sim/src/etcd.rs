//! The simulated etcd cluster spanning the control-plane nodes.
//!
//! Only what upgrades observe is modelled: member ids, which members are healthy (their node is up,
//! the etcd service runs, no injected fault), the leader, leadership transfer, the legacy upgrade's
//! pre-checks (`ValidateForUpgrade`) and the upgrade mutex (talos-api.md §3.1).

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};

use serde::Serialize;

/// One etcd member (one per control-plane node; ids survive reboots because `/var` is preserved).
#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub id: u64,
    pub name: String,
    pub address: Ipv4Addr,
    /// The etcd service runs on the member's node (false while it is down, upgrading or booting).
    pub running: bool,
    /// `Fault::EtcdUnhealthy` is injected on the member's node.
    pub faulted: bool,
}

impl Member {
    /// Would a quorum read against this member succeed?
    pub(crate) fn healthy(&self) -> bool {
        self.running && !self.faulted
    }

    pub(crate) fn peer_url(&self) -> String {
        format!("https://{}:2380", self.address)
    }

    pub(crate) fn client_url(&self) -> String {
        format!("https://{}:2379", self.address)
    }
}

/// What a node's snapshot shows about its own member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EtcdMemberSnapshot {
    /// Member id as Talos prints it (`%016x`).
    pub member_id: String,
    pub healthy: bool,
    pub leader: bool,
}

/// Why a leadership transfer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ForfeitError {
    #[error("cannot forfeit leadership, only one member")]
    OnlyOneMember,
    #[error("no healthy member to transfer leadership to")]
    NoHealthyPeer,
}

#[derive(Debug)]
struct Inner {
    members: Vec<Member>,
    leader: Option<u64>,
    raft_term: u64,
    raft_index: u64,
}

/// The cluster-wide etcd state.
#[derive(Debug)]
pub(crate) struct EtcdCluster {
    inner: Mutex<Inner>,
    upgrade_mutex: Arc<Mutex<Option<String>>>,
}

/// Format a member id the way Talos does in resources.
pub(crate) fn member_id_hex(id: u64) -> String {
    format!("{id:016x}")
}

fn random_member_id() -> u64 {
    let bytes = uuid::Uuid::new_v4();
    let b = bytes.as_bytes();
    // etcd ids are non-zero; zero means "no leader" on the wire.
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]).max(1)
}

impl EtcdCluster {
    /// A healthy cluster of the given (name, address) control planes; the first one leads.
    pub(crate) fn new(control_planes: &[(String, Ipv4Addr)]) -> Self {
        let members: Vec<Member> = control_planes
            .iter()
            .map(|(name, address)| Member {
                id: random_member_id(),
                name: name.clone(),
                address: *address,
                running: true,
                faulted: false,
            })
            .collect();
        let leader = members.first().map(|m| m.id);
        EtcdCluster {
            inner: Mutex::new(Inner {
                members,
                leader,
                raft_term: 2,
                raft_index: 1000,
            }),
            upgrade_mutex: Arc::new(Mutex::new(None)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every mutation below leaves Inner consistent before it can panic, so poisoning is harmless.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn members(&self) -> Vec<Member> {
        self.lock().members.clone()
    }

    pub(crate) fn member(&self, name: &str) -> Option<Member> {
        self.lock().members.iter().find(|m| m.name == name).cloned()
    }

    pub(crate) fn leader(&self) -> Option<u64> {
        self.lock().leader
    }

    pub(crate) fn raft(&self) -> (u64, u64) {
        let mut inner = self.lock();
        // Every status read sees a little progress, like a live cluster.
        inner.raft_index += 1;
        (inner.raft_term, inner.raft_index)
    }

    /// Record whether `name`'s etcd service runs; re-elects a leader if needed.
    pub(crate) fn set_running(&self, name: &str, running: bool) {
        let mut inner = self.lock();
        if let Some(m) = inner.members.iter_mut().find(|m| m.name == name) {
            m.running = running;
        }
        elect(&mut inner);
    }

    /// Record whether `name` has the EtcdUnhealthy fault; re-elects a leader if needed.
    pub(crate) fn set_faulted(&self, name: &str, faulted: bool) {
        let mut inner = self.lock();
        if let Some(m) = inner.members.iter_mut().find(|m| m.name == name) {
            m.faulted = faulted;
        }
        elect(&mut inner);
    }

    pub(crate) fn has_quorum(&self) -> bool {
        has_quorum(&self.lock().members)
    }

    pub(crate) fn snapshot_for(&self, name: &str) -> Option<EtcdMemberSnapshot> {
        let inner = self.lock();
        inner
            .members
            .iter()
            .find(|m| m.name == name)
            .map(|m| EtcdMemberSnapshot {
                member_id: member_id_hex(m.id),
                healthy: m.healthy(),
                leader: inner.leader == Some(m.id),
            })
    }

    /// `EtcdForfeitLeadership` on `name`: Ok("") if it was not the leader, else the new leader's name.
    pub(crate) fn forfeit(&self, name: &str) -> Result<String, ForfeitError> {
        let mut inner = self.lock();
        if inner.members.len() == 1 {
            return Err(ForfeitError::OnlyOneMember);
        }
        let Some(me) = inner.members.iter().find(|m| m.name == name).map(|m| m.id) else {
            return Ok(String::new());
        };
        if inner.leader != Some(me) {
            return Ok(String::new());
        }
        let next = inner
            .members
            .iter()
            .find(|m| m.id != me && m.healthy())
            .map(|m| (m.id, m.name.clone()));
        match next {
            Some((id, name)) => {
                inner.leader = Some(id);
                inner.raft_term += 1;
                Ok(name)
            }
            None => Err(ForfeitError::NoHealthyPeer),
        }
    }

    /// The legacy Upgrade's `ValidateForUpgrade`, with Talos's messages.
    pub(crate) fn validate_for_upgrade(&self) -> Result<(), String> {
        let inner = self.lock();
        if inner.members.len() == 2 {
            return Err(format!(
                "etcd member count({}) is insufficient to maintain quorum if upgrade commences",
                inner.members.len()
            ));
        }
        for member in &inner.members {
            if !member.healthy() {
                return Err(format!(
                    "etcd member {} is not healthy; all members must be healthy to perform an upgrade: context deadline exceeded",
                    member_id_hex(member.id)
                ));
            }
        }
        Ok(())
    }

    /// `TryLock` on `talos:v1:etcdUpgradeMutex`: fails at once if another node holds it.
    pub(crate) fn try_lock_upgrade(&self, holder: &str) -> Result<UpgradeLock, String> {
        let mut slot = self.upgrade_mutex.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(owner) = slot.as_ref() {
            return Err(format!(
                "failed to acquire upgrade mutex: mutex is locked by {owner}"
            ));
        }
        *slot = Some(holder.to_string());
        Ok(UpgradeLock {
            slot: self.upgrade_mutex.clone(),
        })
    }
}

/// Holds the upgrade mutex; released on drop (when the Upgrade RPC returns).
#[derive(Debug)]
pub(crate) struct UpgradeLock {
    slot: Arc<Mutex<Option<String>>>,
}

impl Drop for UpgradeLock {
    fn drop(&mut self) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

fn has_quorum(members: &[Member]) -> bool {
    let healthy = members.iter().filter(|m| m.running).count();
    healthy * 2 > members.len()
}

/// Keep the leader on a running member: a leader that stops loses leadership to the next running
/// member; without quorum there is no leader. A faulted member that still runs keeps leading (its
/// process is up; only health probes fail), which is the harder case for a controller.
fn elect(inner: &mut Inner) {
    if !has_quorum(&inner.members) {
        if inner.leader.is_some() {
            inner.leader = None;
            inner.raft_term += 1;
        }
        return;
    }
    let leader_ok = inner
        .leader
        .and_then(|id| inner.members.iter().find(|m| m.id == id))
        .is_some_and(|m| m.running);
    if leader_ok {
        return;
    }
    // Prefer a fully healthy member, else any running one.
    let next = inner
        .members
        .iter()
        .find(|m| m.healthy())
        .or_else(|| inner.members.iter().find(|m| m.running))
        .map(|m| m.id);
    inner.leader = next;
    inner.raft_term += 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(n: usize) -> EtcdCluster {
        let cps: Vec<_> = (1..=n)
            .map(|i| (format!("cp-{i}"), Ipv4Addr::new(127, 0, 0, i as u8)))
            .collect();
        EtcdCluster::new(&cps)
    }

    #[test]
    fn forfeit_moves_leadership() {
        let etcd = cluster(3);
        assert_eq!(etcd.forfeit("cp-2").unwrap(), "");
        let new = etcd.forfeit("cp-1").unwrap();
        assert_eq!(new, "cp-2");
        assert!(etcd.snapshot_for("cp-2").unwrap().leader);
        assert_eq!(cluster(1).forfeit("cp-1"), Err(ForfeitError::OnlyOneMember));
    }

    #[test]
    fn leader_moves_when_it_goes_down_and_quorum_matters() {
        let etcd = cluster(3);
        etcd.set_running("cp-1", false);
        assert!(!etcd.snapshot_for("cp-1").unwrap().leader);
        assert!(etcd.leader().is_some());
        assert!(etcd.validate_for_upgrade().is_err());
        etcd.set_running("cp-2", false);
        assert_eq!(etcd.leader(), None);
        etcd.set_running("cp-1", true);
        etcd.set_running("cp-2", true);
        assert!(etcd.validate_for_upgrade().is_ok());
    }

    #[test]
    fn upgrade_checks() {
        let err = cluster(2).validate_for_upgrade().unwrap_err();
        assert!(err.contains("insufficient to maintain quorum"), "{err}");
        let etcd = cluster(3);
        etcd.set_faulted("cp-3", true);
        assert!(
            etcd.validate_for_upgrade()
                .unwrap_err()
                .contains("not healthy")
        );
        let lock = etcd.try_lock_upgrade("cp-1").unwrap();
        let err = etcd.try_lock_upgrade("cp-2").unwrap_err();
        assert!(err.starts_with("failed to acquire upgrade mutex"), "{err}");
        drop(lock);
        assert!(etcd.try_lock_upgrade("cp-2").is_ok());
    }
}
