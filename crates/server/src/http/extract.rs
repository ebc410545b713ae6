//! Reading requests: percent-decoding, query strings, bodies as JSON
//! objects, `Prefer: wait`, and field-by-field validation that names every
//! wrong field in one answer.

use std::collections::{BTreeMap, HashSet};

use runtime_api::Issue;
use serde_json::{Map, Value};

use crate::domain::names::{valid_env_name, valid_name};
use crate::error::ApiError;

/// Percent-decodes one path segment or query component (`plus` = space).
pub(crate) fn percent_decode(s: &str, plus_is_space: bool) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let h = b.get(i + 1..i + 3)?;
                let h = std::str::from_utf8(h).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

pub(crate) fn parse_query(q: Option<&str>) -> Result<Vec<(String, String)>, ApiError> {
    let mut out = Vec::new();
    for part in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        match (percent_decode(k, true), percent_decode(v, true)) {
            (Some(k), Some(v)) => out.push((k, v)),
            _ => {
                return Err(ApiError::invalid(
                    "query",
                    "is not valid percent-encoded UTF-8",
                ))
            }
        }
    }
    Ok(out)
}

/// Checks a JSON object field by field, collecting every issue, then
/// refuses unknown fields. Each getter records its field as known.
pub(crate) struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: String,
    known: HashSet<String>,
    pub issues: Vec<Issue>,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(obj: &'a Map<String, Value>) -> Self {
        Fields {
            obj,
            prefix: String::new(),
            known: HashSet::new(),
            issues: Vec::new(),
        }
    }

    /// The fields of `obj`, an object inside the body under `name`: the
    /// issues it finds name `name.field`. Hand it back with [`Fields::absorb`].
    pub(crate) fn nested(obj: &'a Map<String, Value>, name: &str) -> Self {
        Fields {
            obj,
            prefix: format!("{name}."),
            known: HashSet::new(),
            issues: Vec::new(),
        }
    }

    /// Takes a [`Fields::nested`]'s issues, its unknown fields included.
    pub(crate) fn absorb(&mut self, inner: Fields<'_>) {
        if let Err(ApiError::Invalid { issues }) = inner.finish() {
            self.issues.extend(issues);
        }
    }

    pub(crate) fn issue(&mut self, field: &str, message: impl Into<String>) {
        self.issues.push(Issue {
            field: format!("{}{field}", self.prefix),
            message: message.into(),
        });
    }

    /// The value, `None` when absent or null.
    pub(crate) fn raw(&mut self, name: &str) -> Option<&'a Value> {
        self.known.insert(name.to_string());
        match self.obj.get(name) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub(crate) fn present(&self, name: &str) -> bool {
        self.obj.contains_key(name)
    }

    pub(crate) fn string(&mut self, name: &str) -> Option<String> {
        match self.raw(name)? {
            Value::String(s) => Some(s.clone()),
            _ => {
                self.issue(name, "must be a string");
                None
            }
        }
    }

    pub(crate) fn bool(&mut self, name: &str) -> Option<bool> {
        match self.raw(name)? {
            Value::Bool(b) => Some(*b),
            _ => {
                self.issue(name, "must be a boolean");
                None
            }
        }
    }

    pub(crate) fn int(&mut self, name: &str, min: i64, max: i64) -> Option<i64> {
        let v = self.raw(name)?;
        match v.as_i64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            Some(_) => {
                self.issue(name, format!("must be between {min} and {max}"));
                None
            }
            None => {
                self.issue(name, "must be an integer");
                None
            }
        }
    }

    pub(crate) fn one_of(&mut self, name: &str, allowed: &[&str]) -> Option<String> {
        let s = self.string(name)?;
        if allowed.contains(&s.as_str()) {
            Some(s)
        } else {
            self.issue(name, format!("must be one of {}", allowed.join(", ")));
            None
        }
    }

    /// A map of string to string.
    pub(crate) fn string_map(
        &mut self,
        name: &str,
        max_entries: usize,
    ) -> Option<Vec<(String, String)>> {
        let v = self.raw(name)?;
        let Value::Object(m) = v else {
            self.issue(name, "must be an object of strings");
            return None;
        };
        if m.len() > max_entries {
            self.issue(name, format!("must have at most {max_entries} entries"));
            return None;
        }
        let mut out = Vec::new();
        for (k, v) in m {
            match v {
                Value::String(s) => out.push((k.clone(), s.clone())),
                _ => self.issue(&format!("{name}.{k}"), "must be a string"),
            }
        }
        Some(out)
    }

    /// The `cursor` of a list whose cursors have `prefix`
    /// (`domain::cursor`): `None` when absent or empty, an issue when it is
    /// not one this server gave.
    pub(crate) fn cursor(&mut self, prefix: &str) -> Option<i64> {
        let c = self.string("cursor").filter(|c| !c.is_empty())?;
        let seq = crate::domain::cursor::decode(prefix, &c);
        if seq.is_none() {
            self.issue("cursor", "is not a cursor this server gave");
        }
        seq
    }

    /// Refuses with a named issue a field this server does not support.
    pub(crate) fn refuse(&mut self, name: &str, why: &str) {
        if self.raw(name).is_some() {
            self.issue(name, why.to_string());
        }
    }

    /// Records unknown fields, then answers every issue at once.
    pub(crate) fn finish(mut self) -> Result<(), ApiError> {
        let mut unknown: Vec<&String> = self
            .obj
            .keys()
            .filter(|k| !self.known.contains(*k))
            .collect();
        unknown.sort();
        for k in unknown {
            self.issues.push(Issue {
                field: format!("{}{k}", self.prefix),
                message: "is not a known field".into(),
            });
        }
        if self.issues.is_empty() {
            Ok(())
        } else {
            Err(ApiError::Invalid {
                issues: self.issues,
            })
        }
    }
}

/// The body as a JSON object; an empty body is `{}`.
/// One page of `rows` (in list order) after the row whose id is `cursor`:
/// keeps at most `limit` rows and answers the next page's cursor.
pub(crate) fn page_after<T>(
    rows: &mut Vec<T>,
    cursor: Option<&str>,
    limit: usize,
    id: impl Fn(&T) -> &str,
) -> Result<Option<String>, ApiError> {
    if let Some(c) = cursor {
        match rows.iter().position(|r| id(r) == c) {
            Some(i) => rows.drain(..=i).for_each(drop),
            None => {
                return Err(ApiError::invalid(
                    "cursor",
                    "is not a cursor this server gave",
                ))
            }
        }
    }
    let next = (rows.len() > limit).then(|| id(&rows[limit - 1]).to_string());
    rows.truncate(limit);
    Ok(next)
}

/// A body that takes no field: empty, or a JSON object with none (any field
/// is named in the error).
pub(crate) fn no_fields(body: &[u8]) -> Result<(), ApiError> {
    Fields::new(&json_object(body)?).finish()
}

pub(crate) fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid("body", "must be a JSON object")),
        Err(e) => Err(ApiError::invalid("body", format!("is not valid JSON: {e}"))),
    }
}

/// Query parameters as a JSON object of strings (repeated keys: last wins,
/// except for the names in `lists`, which become arrays).
pub(crate) fn query_object(q: &[(String, String)], lists: &[&str]) -> Map<String, Value> {
    let mut m = Map::new();
    for (k, v) in q {
        if lists.contains(&k.as_str()) {
            let e = m
                .entry(k.clone())
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Value::Array(a) = e {
                a.push(Value::String(v.clone()));
            }
        } else {
            m.insert(k.clone(), Value::String(v.clone()));
        }
    }
    m
}

/// Query getters: values arrive as strings.
impl Fields<'_> {
    pub(crate) fn q_int(&mut self, name: &str, min: i64, max: i64) -> Option<i64> {
        let s = self.string(name)?;
        match s.parse::<i64>() {
            Ok(n) if (min..=max).contains(&n) => Some(n),
            Ok(_) => {
                self.issue(name, format!("must be between {min} and {max}"));
                None
            }
            Err(_) => {
                self.issue(name, "must be an integer");
                None
            }
        }
    }

    pub(crate) fn q_bool(&mut self, name: &str) -> Option<bool> {
        match self.string(name)?.as_str() {
            "true" | "1" => Some(true),
            "false" | "0" => Some(false),
            _ => {
                self.issue(name, "must be true or false");
                None
            }
        }
    }
}

/// Parses `Prefer: wait=N` (capped at 120 s).
pub(crate) fn prefer_wait(headers: &axum::http::HeaderMap) -> Option<u64> {
    let v = headers.get("prefer")?.to_str().ok()?;
    v.split([',', ';'])
        .filter_map(|p| p.trim().strip_prefix("wait="))
        .find_map(|n| n.trim().parse::<u64>().ok())
        .map(|n| n.min(120))
}

/// A mode as 3 or 4 octal digits (`"755"`), or an integer (0o755 = 493).
pub(crate) fn parse_mode(v: &Value) -> Option<u32> {
    match v {
        Value::String(s) if (1..=4).contains(&s.len()) => {
            u32::from_str_radix(s, 8).ok().filter(|m| *m <= 0o7777)
        }
        Value::Number(n) => n.as_u64().filter(|m| *m <= 0o7777).map(|m| m as u32),
        _ => None,
    }
}

/// The optional `name` of a body, checked.
pub(crate) fn checked_name(f: &mut Fields<'_>) -> Option<String> {
    let name = f.string("name");
    if let Some(n) = &name {
        if !valid_name(n) {
            f.issue(
                "name",
                "must be 1-128 characters without control characters",
            );
        }
    }
    name
}

/// The optional `labels` of a body (at most 32), checked.
pub(crate) fn checked_labels(f: &mut Fields<'_>) -> Option<BTreeMap<String, String>> {
    let labels = f.string_map("labels", 32);
    check_labels(f, labels)
}

pub(crate) fn check_labels(
    f: &mut Fields<'_>,
    labels: Option<Vec<(String, String)>>,
) -> Option<BTreeMap<String, String>> {
    let labels = labels?;
    let mut out = BTreeMap::new();
    for (k, v) in labels {
        // Characters, not bytes, as the client counts them (Runloop's layer
        // cuts its metadata into values of 256 UTF-16 units).
        if k.is_empty() || k.chars().count() > 63 || k.contains(':') {
            f.issue(
                &format!("labels.{k}"),
                "keys must be 1-63 characters without ':'",
            );
        } else if v.chars().count() > 256 {
            f.issue(
                &format!("labels.{k}"),
                "values must be at most 256 characters",
            );
        } else {
            out.insert(k, v);
        }
    }
    Some(out)
}

pub(crate) fn check_env(
    f: &mut Fields<'_>,
    env: Option<Vec<(String, String)>>,
) -> Option<Vec<(String, String)>> {
    let env = env?;
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > 32 * 1024 {
        f.issue("env", "must be at most 32 KiB in total");
    }
    for (k, _) in &env {
        if !valid_env_name(k) {
            f.issue(&format!("env.{k}"), "is not a valid variable name");
        }
    }
    Some(env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_counted_in_characters() {
        let body = serde_json::json!({"labels": {
            "fits": "é".repeat(256),
            "long": "é".repeat(257),
            "key:colon": "v",
        }});
        let obj = body.as_object().unwrap();
        let mut f = Fields::new(obj);
        let labels = checked_labels(&mut f).unwrap();
        assert_eq!(labels.keys().collect::<Vec<_>>(), ["fits"]);
        let mut fields: Vec<String> = f.issues.iter().map(|i| i.field.clone()).collect();
        fields.sort();
        assert_eq!(fields, ["labels.key:colon", "labels.long"]);
    }

    #[test]
    fn pages_follow_their_cursor() {
        let all: Vec<String> = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut page = all.clone();
        let next = page_after(&mut page, None, 2, String::as_str).unwrap_or_default();
        assert_eq!(
            (page, next.as_deref()),
            (vec!["a".to_string(), "b".into()], Some("b"))
        );
        let mut page = all.clone();
        let next = page_after(&mut page, Some("b"), 2, String::as_str).unwrap_or_default();
        assert_eq!(
            (page, next.as_deref()),
            (vec!["c".to_string(), "d".into()], Some("d"))
        );
        let mut page = all.clone();
        let next = page_after(&mut page, Some("d"), 2, String::as_str).unwrap_or_default();
        assert_eq!((page, next), (vec!["e".to_string()], None));
        let mut page = all;
        assert!(page_after(&mut page, Some("zz"), 2, String::as_str).is_err());
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%3Ab+c", true).as_deref(), Some("a:b c"));
        assert_eq!(percent_decode("a%3Ab+c", false).as_deref(), Some("a:b+c"));
        assert_eq!(percent_decode("%zz", false), None);
    }
}
