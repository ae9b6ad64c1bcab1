//! The simulated etcd cluster: membership, leadership transfer and the legacy upgrade's pre-checks.

use crate::common::*;
use talos_api::proto::machine;
use talos_sim::{Fault, SimConfig, Simulator, Timings};
use tonic::Code;

async fn start(control_planes: usize, workers: usize) -> Simulator {
    init();
    let config = SimConfig::uniform("etcd", control_planes, workers, "1.11.6", "1.34.1")
        .with_timings(Timings::fast());
    Simulator::start(config).await.expect("simulator starts")
}

fn upgrade(image: &str) -> machine::UpgradeRequest {
    machine::UpgradeRequest {
        image: image.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn members_status_and_leadership() {
    let sim = start(3, 1).await;
    let mut cp1 = admin(&sim, "cp-1").await;
    let members = cp1
        .etcd_member_list(machine::EtcdMemberListRequest { query_local: false })
        .await
        .unwrap()
        .into_inner();
    let members = &members.messages[0].members;
    assert_eq!(members.len(), 3);
    let names: Vec<_> = members.iter().map(|m| m.hostname.as_str()).collect();
    assert_eq!(names, ["cp-1", "cp-2", "cp-3"]);
    assert!(
        members
            .iter()
            .all(|m| m.id != 0 && m.client_urls[0].ends_with(":2379"))
    );

    let status = cp1.etcd_status(()).await.unwrap().into_inner();
    let status = status.messages[0].member_status.clone().unwrap();
    assert_eq!(status.member_id, members[0].id);
    let leader = status.leader;
    assert_eq!(
        leader, members[0].id,
        "the first control plane starts as leader"
    );
    let snapshot = sim.node_snapshot("cp-1").unwrap();
    let member = snapshot.etcd.unwrap();
    assert!(member.leader && member.healthy);
    assert_eq!(member.member_id, format!("{:016x}", members[0].id));

    // A non-leader forfeits nothing; the leader hands over to a healthy member.
    let mut cp2 = admin(&sim, "cp-2").await;
    let reply = cp2
        .etcd_forfeit_leadership(machine::EtcdForfeitLeadershipRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.messages[0].member, "");
    let reply = cp1
        .etcd_forfeit_leadership(machine::EtcdForfeitLeadershipRequest {})
        .await
        .unwrap()
        .into_inner();
    let new_leader = reply.messages[0].member.clone();
    assert!(new_leader == "cp-2" || new_leader == "cp-3", "{new_leader}");
    assert!(sim.node_snapshot(&new_leader).unwrap().etcd.unwrap().leader);
    assert!(!sim.node_snapshot("cp-1").unwrap().etcd.unwrap().leader);
    let calls = sim.record();
    assert_eq!(calls.len(), 2);
    assert!(
        calls
            .iter()
            .all(|c| c.method == "/machine.MachineService/EtcdForfeitLeadership")
    );

    // Workers have no etcd.
    let mut worker = admin(&sim, "worker-1").await;
    let status = worker
        .etcd_member_list(machine::EtcdMemberListRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    assert!(
        status
            .message()
            .ends_with("is only available on control plane nodes")
    );
    let status = worker
        .etcd_forfeit_leadership(machine::EtcdForfeitLeadershipRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
}

#[tokio::test]
async fn single_member_cannot_forfeit() {
    let sim = start(1, 0).await;
    let mut cp = admin(&sim, "cp-1").await;
    let status = cp
        .etcd_forfeit_leadership(machine::EtcdForfeitLeadershipRequest {})
        .await
        .unwrap_err();
    assert_eq!(
        status.message(),
        "cannot forfeit leadership, only one member"
    );
    // A single control plane may upgrade (nothing to keep quorum with).
    cp.upgrade(upgrade("ghcr.io/siderolabs/installer:v1.11.7"))
        .await
        .expect("single-member upgrade accepted");
}

#[tokio::test]
async fn two_members_refuse_upgrades_unless_forced() {
    let sim = start(2, 0).await;
    let mut cp = admin(&sim, "cp-1").await;
    let status = cp
        .upgrade(upgrade("ghcr.io/siderolabs/installer:v1.11.7"))
        .await
        .unwrap_err();
    assert!(
        status.message().contains("insufficient to maintain quorum"),
        "{status:?}"
    );
    cp.upgrade(machine::UpgradeRequest {
        image: "ghcr.io/siderolabs/installer:v1.11.7".into(),
        force: true,
        ..Default::default()
    })
    .await
    .expect("force skips the etcd checks");
}

#[tokio::test]
async fn a_rebooting_control_plane_blocks_the_next_ones_upgrade() {
    let sim = start(3, 0).await;
    // Hold cp-1 down so the check below cannot race its comeback.
    sim.inject_fault("cp-1", Fault::NeverReturns).unwrap();
    let mut cp1 = admin(&sim, "cp-1").await;
    cp1.upgrade(upgrade("ghcr.io/siderolabs/installer:v1.11.7"))
        .await
        .expect("first upgrade accepted");
    wait_snapshot(&sim, "cp-1", "down", |s| s.down).await;
    let cp2_member = sim.node_snapshot("cp-2").unwrap().etcd.unwrap();
    assert!(cp2_member.healthy);
    assert!(!sim.node_snapshot("cp-1").unwrap().etcd.unwrap().healthy);

    let mut cp2 = admin(&sim, "cp-2").await;
    let status = cp2
        .upgrade(upgrade("ghcr.io/siderolabs/installer:v1.11.7"))
        .await
        .unwrap_err();
    assert!(status.message().contains("not healthy"), "{status:?}");

    // The leader moved off the down member; the cluster still has quorum.
    let snapshots = [
        sim.node_snapshot("cp-2").unwrap(),
        sim.node_snapshot("cp-3").unwrap(),
    ];
    assert!(snapshots.iter().any(|s| s.etcd.as_ref().unwrap().leader));

    sim.clear_faults("cp-1").unwrap();
    wait_snapshot(&sim, "cp-1", "back and healthy", |s| {
        s.ready && s.talos_version == "1.11.7" && s.etcd.as_ref().is_some_and(|e| e.healthy)
    })
    .await;
    cp2.upgrade(upgrade("ghcr.io/siderolabs/installer:v1.11.7"))
        .await
        .expect("allowed once every member is healthy again");
}
