//! Roles and authorization, as apid does them: the role set comes from the client certificate's
//! Organization attributes, and each method requires one of a fixed set of roles (talos-api.md §1.1,
//! from machined's authz table). Unknown Organization values grant nothing.

use std::net::SocketAddr;

use rustls_pki_types::CertificateDer;
use tonic::Status;

/// The Talos roles the simulator knows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RoleSet {
    pub admin: bool,
    pub operator: bool,
    pub reader: bool,
    pub etcd_backup: bool,
}

impl RoleSet {
    fn add(&mut self, org: &str) {
        match org {
            "os:admin" => self.admin = true,
            "os:operator" => self.operator = true,
            "os:reader" => self.reader = true,
            "os:etcd:backup" => self.etcd_backup = true,
            // os:impersonator, os:image:verifier, os:meta:writer and anything else grant no access
            // to the methods the simulator serves.
            _ => {}
        }
    }
}

/// Who is calling, taken from the verified client certificate at handshake time.
#[derive(Debug, Clone)]
pub(crate) struct PeerIdentity {
    pub roles: RoleSet,
    pub remote: Option<SocketAddr>,
}

/// Access levels of the methods the simulator serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// admin, operator, reader.
    Read,
    /// admin, operator, reader, etcd:backup.
    EtcdRead,
    /// admin, operator, etcd:backup (not reader: a snapshot holds every Secret of the cluster).
    EtcdBackup,
    /// admin, operator.
    Operate,
    /// admin only.
    Admin,
}

impl Access {
    pub(crate) fn allows(self, roles: RoleSet) -> bool {
        match self {
            Access::Read => roles.admin || roles.operator || roles.reader,
            Access::EtcdRead => roles.admin || roles.operator || roles.reader || roles.etcd_backup,
            Access::EtcdBackup => roles.admin || roles.operator || roles.etcd_backup,
            Access::Operate => roles.admin || roles.operator,
            Access::Admin => roles.admin,
        }
    }
}

/// Required access per full method path (machined's authz table for the subset served here: talos
/// v1.14.1 `internal/app/machined/pkg/system/services/machined.go`).
pub(crate) fn required_access(method: &str) -> Access {
    match method {
        "/machine.MachineService/Version"
        | "/machine.MachineService/ServiceList"
        | "/machine.MachineService/Events"
        | "/machine.MachineService/Memory"
        | "/machine.MachineService/Dmesg"
        | "/machine.MachineService/Logs"
        | "/machine.MachineService/LogsContainers"
        | "/cluster.ClusterService/HealthCheck"
        | "/cosi.resource.State/Get"
        | "/cosi.resource.State/List"
        | "/cosi.resource.State/Watch" => Access::Read,
        "/machine.MachineService/EtcdStatus" | "/machine.MachineService/EtcdMemberList" => {
            Access::EtcdRead
        }
        // talos v1.14.1 `machined.go`: role.MakeSet(role.Admin, role.Operator, role.EtcdBackup).
        "/machine.MachineService/EtcdSnapshot" => Access::EtcdBackup,
        "/machine.MachineService/Reboot"
        | "/machine.MachineService/ImagePull"
        | "/machine.ImageService/Pull" => Access::Operate,
        // Upgrade, Rollback, EtcdForfeitLeadership, ApplyConfiguration, Read, Kubeconfig,
        // LifecycleService.Upgrade and anything not listed: admin only (deny by default).
        _ => Access::Admin,
    }
}

/// Refuse the call unless the peer's roles allow `method`.
pub(crate) fn authorize(peer: &PeerIdentity, method: &str) -> Result<(), Status> {
    if required_access(method).allows(peer.roles) {
        Ok(())
    } else {
        Err(Status::permission_denied("not authorized"))
    }
}

/// The roles in a client certificate's subject Organization attributes.
pub(crate) fn roles_from_cert(cert: &CertificateDer<'_>) -> Result<RoleSet, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| format!("cannot parse client certificate: {e}"))?;
    let mut roles = RoleSet::default();
    for org in parsed.subject().iter_organization() {
        if let Ok(value) = org.as_str() {
            roles.add(value);
        }
    }
    Ok(roles)
}

/// apid accepts client certificates whose extended key usage is exactly [ClientAuth].
pub(crate) fn check_client_eku(cert: &CertificateDer<'_>) -> Result<(), String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| format!("cannot parse client certificate: {e}"))?;
    let eku = parsed
        .extended_key_usage()
        .map_err(|e| format!("bad extended key usage: {e}"))?
        .ok_or("client certificate has no extended key usage")?
        .value;
    let only_client_auth = eku.client_auth
        && !eku.any
        && !eku.server_auth
        && !eku.code_signing
        && !eku.email_protection
        && !eku.time_stamping
        && !eku.ocsp_signing
        && eku.other.is_empty();
    if only_client_auth {
        Ok(())
    } else {
        Err("client certificate extended key usage must be exactly ClientAuth".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(org: &str) -> RoleSet {
        let mut r = RoleSet::default();
        r.add(org);
        r
    }

    #[test]
    fn table() {
        let reader = roles("os:reader");
        let operator = roles("os:operator");
        let admin = roles("os:admin");
        let nobody = roles("os:impersonator");
        for m in [
            "/machine.MachineService/Upgrade",
            "/machine.MachineService/Rollback",
            "/machine.MachineService/ApplyConfiguration",
            "/machine.MachineService/EtcdForfeitLeadership",
            "/machine.MachineService/Read",
            "/machine.LifecycleService/Upgrade",
            "/machine.MachineService/Kubeconfig",
        ] {
            assert!(!required_access(m).allows(reader), "{m}");
            assert!(!required_access(m).allows(operator), "{m}");
            assert!(required_access(m).allows(admin), "{m}");
        }
        assert!(required_access("/machine.MachineService/Reboot").allows(operator));
        assert!(!required_access("/machine.MachineService/Reboot").allows(reader));
        assert!(!required_access("/machine.ImageService/Pull").allows(reader));
        assert!(required_access("/machine.MachineService/Version").allows(reader));
        // What talosctl health, logs and dmesg read: readers too, as in Talos.
        for m in [
            "/machine.MachineService/Memory",
            "/machine.MachineService/Dmesg",
            "/machine.MachineService/Logs",
            "/machine.MachineService/LogsContainers",
            "/cluster.ClusterService/HealthCheck",
        ] {
            assert!(required_access(m).allows(reader), "{m}");
            assert!(!required_access(m).allows(nobody), "{m}");
        }
        assert!(!required_access("/machine.MachineService/Version").allows(nobody));
        assert!(
            required_access("/machine.MachineService/EtcdStatus").allows(roles("os:etcd:backup"))
        );
        // A snapshot holds every Secret: admin, operator and etcd:backup, not reader.
        let snapshot = required_access("/machine.MachineService/EtcdSnapshot");
        assert!(snapshot.allows(roles("os:etcd:backup")));
        assert!(snapshot.allows(operator) && snapshot.allows(admin));
        assert!(!snapshot.allows(reader) && !snapshot.allows(nobody));
    }
}
