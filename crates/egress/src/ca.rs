//! The sandbox's own certificate authority, which signs the certificates the
//! proxy shows for the hosts a secret names.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::ServerConfig;
use time::{Duration, OffsetDateTime};

use crate::error::EgressError;

/// Leaf configurations kept per CA; past this the cache starts over.
const MAX_LEAVES: usize = 512;

/// A per-sandbox CA. [`SandboxCa::cert_pem`] is what the guest trusts;
/// [`SandboxCa::key_pem`] with it is what the server persists.
pub struct SandboxCa {
    cert_pem: String,
    key_pem: String,
    cert_der: CertificateDer<'static>,
    /// The issuer as rcgen signs with it: the CA's fixed name and its key.
    issuer: Issuer<'static, KeyPair>,
    leaves: Mutex<HashMap<String, Arc<ServerConfig>>>,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCa").finish_non_exhaustive()
    }
}

/// Every sandbox CA has this name: a leaf names its issuer by it, so a CA
/// loaded from PEM signs leaves that chain to the certificate the guest has.
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "Runtime sandbox egress CA");
    dn.push(DnType::OrganizationName, "runtime");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::days(1);
    params.not_after = now + Duration::days(3650);
    params
}

impl SandboxCa {
    /// A new CA with a fresh key.
    pub fn generate() -> Result<Self, EgressError> {
        let key = KeyPair::generate().map_err(EgressError::Certificate)?;
        let cert = ca_params()
            .self_signed(&key)
            .map_err(EgressError::Certificate)?;
        let cert_pem = cert.pem();
        let key_pem = key.serialize_pem();
        Self::assemble(cert_pem, key_pem, cert.der().clone(), key)
    }

    /// A CA persisted earlier ([`SandboxCa::cert_pem`], [`SandboxCa::key_pem`]).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, EgressError> {
        let key = KeyPair::from_pem(key_pem).map_err(EgressError::Certificate)?;
        let der = pem_to_der(cert_pem).ok_or(EgressError::CaMismatch)?;
        // The certificate must hold this key's public half.
        let spki = key.public_key_raw();
        if !der.windows(spki.len()).any(|w| w == spki) {
            return Err(EgressError::CaMismatch);
        }
        Self::assemble(
            cert_pem.to_owned(),
            key_pem.to_owned(),
            CertificateDer::from(der),
            key,
        )
    }

    fn assemble(
        cert_pem: String,
        key_pem: String,
        cert_der: CertificateDer<'static>,
        key: KeyPair,
    ) -> Result<Self, EgressError> {
        Ok(Self {
            cert_pem,
            key_pem,
            cert_der,
            issuer: Issuer::new(ca_params(), key),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate (PEM) the guest trusts.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificate (DER).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The CA's private key (PKCS#8 PEM), for the server to persist.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// The TLS server configuration showing a certificate for `host`.
    pub(crate) fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, EgressError> {
        if let Some(cfg) = self.lock().get(host) {
            return Ok(cfg.clone());
        }
        let key = KeyPair::generate().map_err(EgressError::Certificate)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.subject_alt_names = vec![match host.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                host.to_owned()
                    .try_into()
                    .map_err(EgressError::Certificate)?,
            ),
        }];
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::days(1);
        params.not_after = now + Duration::days(90);
        let leaf = params
            .signed_by(&key, &self.issuer)
            .map_err(EgressError::Certificate)?;
        let chain = vec![leaf.der().clone(), self.cert_der.clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut cfg = ServerConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(EgressError::Tls)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(EgressError::Tls)?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        let mut leaves = self.lock();
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host.to_owned(), cfg.clone());
        Ok(cfg)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<ServerConfig>>> {
        self.leaves.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn pem_to_der(pem: &str) -> Option<Vec<u8>> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes())
        .ok()
        .map(|c| c.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_round_trip_keeps_the_chain() {
        let ca = SandboxCa::generate().unwrap();
        let again = SandboxCa::from_pem(ca.cert_pem(), ca.key_pem()).unwrap();
        assert_eq!(again.cert_pem(), ca.cert_pem());
        assert!(again.server_config("api.example.com").is_ok());
        let other = SandboxCa::generate().unwrap();
        assert!(matches!(
            SandboxCa::from_pem(ca.cert_pem(), other.key_pem()),
            Err(EgressError::CaMismatch)
        ));
    }
}
