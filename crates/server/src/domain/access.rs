//! Who may see and change what: the key a request carries, and the rules
//! that follow from it. Also how keys are made and hashed.

use base64::Engine;
use rand::RngCore;
use sha2::{Digest, Sha256};

/// The key a request is authenticated with.
#[derive(Debug, Clone)]
pub struct KeyInfo {
    pub id: String,
    pub read_only: bool,
    pub account_wide: bool,
}

/// Account-wide keys see every sandbox, and so do read-only keys (which
/// watch the account and can change nothing); others only their own.
pub(crate) fn visible(key: &KeyInfo, owner_key_id: &str) -> bool {
    key.account_wide || key.read_only || owner_key_id == key.id
}

pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// `prefix` and 32 random bytes as 43 base64url characters: the secret
/// part of every key, session, link and webhook secret.
pub(crate) fn random_token(prefix: &str) -> String {
    let mut secret = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut secret);
    let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret);
    format!("{prefix}{secret}")
}

/// A new API key `rtcloud_<uuid>_<43 base64url chars>` and its id.
pub(crate) fn new_key() -> (String, String) {
    let id = uuid::Uuid::new_v4().to_string();
    let key = random_token(&format!("rtcloud_{id}_"));
    (id, key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_have_the_cli_shape() {
        let (_, k) = new_key();
        let parts: Vec<&str> = k.splitn(3, '_').collect();
        assert_eq!(parts[0], "rtcloud");
        assert_eq!(parts[1].len(), 36);
        assert_eq!(k.len(), "rtcloud_".len() + 36 + 1 + 43);
    }

    #[test]
    fn a_key_sees_its_own_and_account_wide_or_read_only_keys_see_all() {
        let own = KeyInfo {
            id: "k1".into(),
            read_only: false,
            account_wide: false,
        };
        assert!(visible(&own, "k1"));
        assert!(!visible(&own, "k2"));
        let wide = KeyInfo {
            account_wide: true,
            ..own.clone()
        };
        assert!(visible(&wide, "k2"));
        let watcher = KeyInfo {
            read_only: true,
            ..own
        };
        assert!(visible(&watcher, "k2"));
    }

    #[test]
    fn hashes_are_lowercase_hex_sha256() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
