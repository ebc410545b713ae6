//! The crate's errors. Refusals by the rules are [`crate::Refusal`], not errors.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EgressError {
    #[error("making a certificate failed")]
    Certificate(#[source] rcgen::Error),
    #[error("the CA certificate is not valid PEM or does not hold the key given with it")]
    CaMismatch,
    #[error("configuring TLS failed")]
    Tls(#[source] rustls::Error),
}
