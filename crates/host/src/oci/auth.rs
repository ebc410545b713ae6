//! `WWW-Authenticate` challenges of registries (RFC 7235 syntax): `Bearer
//! realm="…",service="…",scope="…"` for a token service, or `Basic`.

/// What a registry's 401 asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
    Basic,
}

/// The first challenge of a `WWW-Authenticate` value that we can answer;
/// `None` for other schemes or a malformed one.
pub fn parse_challenge(h: &str) -> Option<Challenge> {
    let h = h.trim();
    let (scheme, rest) = match h.split_once(char::is_whitespace) {
        Some((s, r)) => (s, r),
        None => (h, ""),
    };
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let params = parse_params(rest)?;
    let get = |k: &str| {
        params
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.clone())
    };
    Some(Challenge::Bearer {
        realm: get("realm").filter(|r| !r.is_empty())?,
        service: get("service"),
        scope: get("scope"),
    })
}

/// `k=v, k="quoted \" value"` pairs; `None` when malformed.
fn parse_params(s: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace() || *c == ',') {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(out);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() || c == ',' {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') || key.is_empty() {
            return None;
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next()? {
                    '\\' => value.push(chars.next()?),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' || c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((key, value));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn bearer_challenges_give_realm_service_and_scope() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/python:pull""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/python:pull".into()),
            })
        );
        // Any case, spaces after commas, unquoted values, escapes, and
        // parameters in any order; scope and service may be missing.
        let c = parse_challenge(
            r#"bearer  scope="repository:a/b:pull,push", realm=https://r.example.com/t ,x="a\"b""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "https://r.example.com/t".into(),
                service: None,
                scope: Some("repository:a/b:pull,push".into()),
            })
        );
    }

    #[test]
    fn basic_and_what_cannot_be_answered() {
        assert_eq!(
            parse_challenge(r#"Basic realm="x""#),
            Some(Challenge::Basic)
        );
        assert_eq!(parse_challenge("basic"), Some(Challenge::Basic));
        assert_eq!(parse_challenge(r#"Digest realm="x""#), None);
        // A bearer challenge needs a realm, and well-formed parameters.
        assert_eq!(parse_challenge(r#"Bearer service="x""#), None);
        assert_eq!(parse_challenge(r#"Bearer realm="unterminated"#), None);
        assert_eq!(parse_challenge("Bearer realm"), None);
        assert_eq!(parse_challenge(""), None);
    }
}
