//! Certificates and keys for the test control plane, generated fresh for every start.

use std::net::{IpAddr, Ipv4Addr};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

use crate::Result;

/// PEM material the apiserver is started with.
pub struct ControlPlanePki {
    /// CA that signed the serving certificate; clients trust it.
    pub ca_pem: String,
    pub serving_cert_pem: String,
    pub serving_key_pem: String,
    /// Service-account token signing key (PKCS#8) and its public half (SPKI), as the apiserver flags want.
    pub service_account_key_pem: String,
    pub service_account_public_pem: String,
}

impl ControlPlanePki {
    pub fn generate() -> Result<Self> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "talos-upgrade-controller testenv CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

        let mut serving_params = CertificateParams::new(vec!["localhost".to_string()])?;
        serving_params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        serving_params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_key = KeyPair::generate()?;
        let serving_cert = serving_params.signed_by(&serving_key, &ca)?;

        let service_account_key = KeyPair::generate()?;

        Ok(ControlPlanePki {
            ca_pem: ca.pem(),
            serving_cert_pem: serving_cert.pem(),
            serving_key_pem: serving_key.serialize_pem(),
            service_account_key_pem: service_account_key.serialize_pem(),
            service_account_public_pem: service_account_key.public_key_pem(),
        })
    }
}
