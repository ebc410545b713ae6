//! Amazon ECR's login: an access key is exchanged for a registry password
//! with `ecr:GetAuthorizationToken`, a POST to the region's API
//! (`api.ecr.<region>.amazonaws.com`) signed with AWS Signature Version 4,
//! through the same egress as the pull. The answer's token is
//! `base64("AWS:<password>")`, valid 12 hours: the pull then uses it as
//! Basic credentials, as `aws ecr get-login-password` users do by hand.
//! The token is kept in memory ([`kept`]) until 10 minutes before it ends,
//! so builds in a row ask ECR once.

use base64::Engine as _;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::{header, Method, StatusCode};
use sha2::{Digest, Sha256};

use super::client::{error_text, parse_uri, read_small, send_with, Connector};
use super::PullError;

const TARGET: &str = "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken";
const CONTENT_TYPE: &str = "application/x-amz-json-1.1";
const SERVICE: &str = "ecr";

/// The account and region of an ECR registry host
/// (`<account>.dkr.ecr.<region>.amazonaws.com`, an optional port dropped).
pub fn ecr_region(registry: &str) -> Option<&str> {
    let host = registry.split(':').next()?;
    let rest = host.strip_suffix(".amazonaws.com")?;
    let (account, region) = rest.split_once(".dkr.ecr.")?;
    let valid = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    (account.len() == 12 && account.bytes().all(|b| b.is_ascii_digit()) && valid(region))
        .then_some(region)
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    // HMAC takes a key of any length.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// `YYYYMMDDTHHMMSSZ` of a UNIX time (UTC).
pub(super) fn amz_date(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// A request as Signature Version 4 signs it.
pub(super) struct Signed<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: &'a str,
    /// Lower-case names with trimmed values, sorted by name.
    pub headers: &'a [(&'a str, &'a str)],
    pub payload: &'a [u8],
    pub amz_date: &'a str,
    pub region: &'a str,
    pub service: &'a str,
}

/// The `Authorization` header's value for `r` under the key pair.
pub(super) fn authorization(r: &Signed<'_>, key_id: &str, secret: &str) -> String {
    let signed_headers = r
        .headers
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(";");
    let canonical_headers: String = r
        .headers
        .iter()
        .map(|(n, v)| format!("{n}:{v}\n"))
        .collect();
    let canonical = format!(
        "{}\n{}\n{}\n{canonical_headers}\n{signed_headers}\n{}",
        r.method,
        r.path,
        r.query,
        sha256_hex(r.payload)
    );
    let day = &r.amz_date[..8.min(r.amz_date.len())];
    let scope = format!("{day}/{}/{}/aws4_request", r.region, r.service);
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{}\n{scope}\n{}",
        r.amz_date,
        sha256_hex(canonical.as_bytes())
    );
    let k = hmac(format!("AWS4{secret}").as_bytes(), day.as_bytes());
    let k = hmac(&k, r.region.as_bytes());
    let k = hmac(&k, r.service.as_bytes());
    let k = hmac(&k, b"aws4_request");
    let signature = hex::encode(hmac(&k, to_sign.as_bytes()));
    format!("AWS4-HMAC-SHA256 Credential={key_id}/{scope}, SignedHeaders={signed_headers}, Signature={signature}")
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct TokenAnswer {
    authorization_data: Vec<AuthorizationData>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct AuthorizationData {
    authorization_token: String,
    /// When the token ends, in seconds since the epoch.
    #[serde(default)]
    expires_at: Option<f64>,
}

/// A registry password ECR gave, and until when it is used.
#[derive(Clone)]
struct Kept {
    user: String,
    password: String,
    until: u64,
}

/// At most this many tokens are kept (registries × access keys); the one
/// ending soonest makes room.
const KEPT_MAX: usize = 256;
/// A token is used until this long before it ends.
const KEPT_MARGIN_SECS: u64 = 600;

fn tokens() -> &'static std::sync::Mutex<std::collections::HashMap<String, Kept>> {
    static TOKENS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, Kept>>> =
        std::sync::OnceLock::new();
    TOKENS.get_or_init(Default::default)
}

/// The name a token is kept under: the registry, the access key and a
/// digest of its secret (a new secret asks ECR again).
pub(super) fn kept_key(registry: &str, access_key_id: &str, secret_access_key: &str) -> String {
    sha256_hex(format!("{registry}\n{access_key_id}\n{secret_access_key}").as_bytes())
}

/// The kept user name and password under `key`, while they last.
pub(super) fn kept(key: &str, unix_now: u64) -> Option<(String, String)> {
    let mut t = tokens().lock().unwrap_or_else(|e| e.into_inner());
    match t.get(key) {
        Some(k) if k.until > unix_now => Some((k.user.clone(), k.password.clone())),
        Some(_) => {
            t.remove(key);
            None
        }
        None => None,
    }
}

/// Keeps a token that ends at `expires_at` (used until the margin before).
fn keep(key: String, pair: &(String, String), expires_at: u64, unix_now: u64) {
    let until = expires_at.saturating_sub(KEPT_MARGIN_SECS);
    if until <= unix_now {
        return;
    }
    let mut t = tokens().lock().unwrap_or_else(|e| e.into_inner());
    t.retain(|_, k| k.until > unix_now);
    if t.len() >= KEPT_MAX && !t.contains_key(&key) {
        if let Some(soonest) = t
            .iter()
            .min_by_key(|(_, k)| k.until)
            .map(|(n, _)| n.clone())
        {
            t.remove(&soonest);
        }
    }
    t.insert(
        key,
        Kept {
            user: pair.0.clone(),
            password: pair.1.clone(),
            until,
        },
    );
}

/// Drops the token under `key` (the registry refused it).
pub(super) fn forget(key: &str) {
    tokens()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(key);
}

/// The user name and password of `registry` (an ECR host) for the access
/// key, from the region's `GetAuthorizationToken` through `connect`.
/// `unix_now` dates the signature.
pub async fn ecr_login(
    connect: &Connector<'_>,
    registry: &str,
    access_key_id: &str,
    secret_access_key: &str,
    unix_now: u64,
) -> Result<(String, String), PullError> {
    let region = ecr_region(registry).ok_or_else(|| PullError::Denied {
        registry: registry.to_string(),
        answer:
            "an access key is only for an ECR registry (<account>.dkr.ecr.<region>.amazonaws.com)"
                .into(),
    })?;
    let api = format!("api.ecr.{region}.amazonaws.com");
    let url = parse_uri(&format!("https://{api}/"))?;
    let date = amz_date(unix_now);
    let body = b"{}";
    let auth = authorization(
        &Signed {
            method: "POST",
            path: "/",
            query: "",
            headers: &[
                ("content-type", CONTENT_TYPE),
                ("host", &api),
                ("x-amz-date", &date),
                ("x-amz-target", TARGET),
            ],
            payload: body,
            amz_date: &date,
            region,
            service: SERVICE,
        },
        access_key_id,
        secret_access_key,
    );
    let headers = [
        (header::CONTENT_TYPE, CONTENT_TYPE.to_string()),
        (header::HeaderName::from_static("x-amz-date"), date.clone()),
        (
            header::HeaderName::from_static("x-amz-target"),
            TARGET.to_string(),
        ),
        (header::AUTHORIZATION, auth),
    ];
    let resp = send_with(
        connect,
        &url,
        Method::POST,
        &headers,
        Bytes::from_static(body),
    )
    .await?;
    let status = resp.status();
    let answer = read_small(resp, &url).await?;
    if status != StatusCode::OK {
        return Err(PullError::Denied {
            registry: registry.to_string(),
            answer: format!(
                "ECR's GetAuthorizationToken answered {status}: {}",
                error_text(&answer)
            ),
        });
    }
    let protocol = |problem: String| PullError::Protocol {
        url: url.to_string(),
        problem,
    };
    let t: TokenAnswer = serde_json::from_slice(&answer)
        .map_err(|e| protocol(format!("GetAuthorizationToken's answer: {e}")))?;
    let token = t
        .authorization_data
        .first()
        .ok_or_else(|| protocol("GetAuthorizationToken answered no authorization data".into()))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(token.authorization_token.trim())
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| protocol("the authorization token is not base64 text".into()))?;
    let (user, password) = decoded
        .split_once(':')
        .ok_or_else(|| protocol("the authorization token is not user:password".into()))?;
    let pair = (user.to_string(), password.to_string());
    if let Some(at) = token.expires_at.filter(|t| t.is_finite() && *t > 0.0) {
        keep(
            kept_key(registry, access_key_id, secret_access_key),
            &pair,
            at as u64,
            unix_now,
        );
    }
    Ok(pair)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// AWS's Signature Version 4 test suite, `get-vanilla`.
    #[test]
    fn signs_as_the_aws_test_suite_says() {
        let auth = authorization(
            &Signed {
                method: "GET",
                path: "/",
                query: "",
                headers: &[
                    ("host", "example.amazonaws.com"),
                    ("x-amz-date", "20150830T123600Z"),
                ],
                payload: b"",
                amz_date: "20150830T123600Z",
                region: "us-east-1",
                service: "service",
            },
            "AKIDEXAMPLE",
            "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        );
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
        );
    }

    #[test]
    fn dates_are_utc_in_the_basic_format() {
        assert_eq!(amz_date(0), "19700101T000000Z");
        assert_eq!(amz_date(1_440_938_160), "20150830T123600Z");
        assert_eq!(amz_date(951_782_400), "20000229T000000Z");
        assert_eq!(amz_date(1_796_342_399), "20261203T235959Z");
    }

    #[test]
    fn a_token_is_kept_until_shortly_before_it_ends_and_bounded() {
        let pair = ("AWS".to_string(), "pw".to_string());
        let key = kept_key("r1", "AKIA", "secret");
        assert_ne!(
            key,
            kept_key("r1", "AKIA", "other"),
            "a new secret is another key"
        );
        keep(key.clone(), &pair, 10_000, 1_000);
        assert_eq!(kept(&key, 1_000), Some(pair.clone()));
        assert_eq!(
            kept(&key, 10_000 - KEPT_MARGIN_SECS - 1),
            Some(pair.clone())
        );
        assert_eq!(
            kept(&key, 10_000 - KEPT_MARGIN_SECS),
            None,
            "used up to the margin"
        );
        // One that ends within the margin is not kept at all.
        let short = kept_key("r2", "AKIA", "secret");
        keep(short.clone(), &pair, 1_100, 1_000);
        assert_eq!(kept(&short, 1_000), None);
        // Forgotten when the registry refuses it.
        keep(key.clone(), &pair, 10_000, 1_000);
        forget(&key);
        assert_eq!(kept(&key, 1_000), None);
        // Never more than KEPT_MAX: the one ending soonest goes.
        for i in 0..KEPT_MAX + 10 {
            keep(
                kept_key("many", &i.to_string(), "s"),
                &pair,
                50_000 + i as u64,
                1_000,
            );
        }
        assert!(tokens().lock().unwrap().len() <= KEPT_MAX);
        assert_eq!(kept(&kept_key("many", "0", "s"), 1_000), None);
        assert!(kept(&kept_key("many", &(KEPT_MAX + 9).to_string(), "s"), 1_000).is_some());
    }

    #[test]
    fn only_ecr_hosts_have_a_region() {
        assert_eq!(
            ecr_region("123456789012.dkr.ecr.us-east-1.amazonaws.com"),
            Some("us-east-1")
        );
        assert_eq!(
            ecr_region("123456789012.dkr.ecr.eu-west-3.amazonaws.com:443"),
            Some("eu-west-3")
        );
        for bad in [
            "ghcr.io",
            "12345.dkr.ecr.us-east-1.amazonaws.com",
            "123456789012.dkr.ecr..amazonaws.com",
            "123456789012.dkr.ecr.us-east-1.amazonaws.com.evil.example",
            "123456789012.dkr.ecr.US_EAST.amazonaws.com",
        ] {
            assert_eq!(ecr_region(bad), None, "{bad}");
        }
    }
}
