//! Egress secrets: `PUT`, `GET` (list) and `DELETE /v1/egress-secrets`.

use axum::body::Bytes;
use serde_json::{json, Value};

use crate::domain::secret::{
    rule_method, valid_env_name, valid_header_name, valid_host_pattern, valid_rule_path,
    valid_value_bytes, Rule, MAX_VALUE, METHODS,
};
use crate::error::ApiResult;
use crate::http::extract::{json_object, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::secrets;
use crate::AppState;

/// `PUT /v1/egress-secrets/{name}`.
pub(super) async fn put(st: AppState, _ctx: Ctx, name: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    if !valid_env_name(&name) {
        f.issue(
            "name",
            "must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*, at most 128)",
        );
    }
    let value = f.string("value");
    match &value {
        None => f.issue("value", "is required"),
        Some(v) if v.is_empty() || v.len() > MAX_VALUE => {
            f.issue("value", "must be 1 to 8192 bytes")
        }
        Some(v) if !valid_value_bytes(v) => f.issue("value", "must be visible ASCII and spaces"),
        Some(_) => {}
    }
    let hosts = strings(&mut f, "hosts", 1, 16);
    if !f.present("hosts") {
        f.issue("hosts", "is required: the hosts the value may go to");
    }
    for (i, h) in hosts.iter().enumerate() {
        if !valid_host_pattern(h) {
            f.issue(
                &format!("hosts[{i}]"),
                "must be a lower-case host name or *.domain",
            );
        }
    }
    let header = f.string("header");
    if let Some(h) = &header {
        if !valid_header_name(h) {
            f.issue("header", "must be an HTTP header name");
        }
    }
    let format = f.string("format");
    if let Some(fm) = &format {
        if !fm.contains("{value}") {
            f.issue("format", "must contain {value}");
        }
        if header.is_none() {
            f.issue("format", "needs header");
        }
    }
    let env = f.string("env");
    if let Some(e) = &env {
        if !valid_env_name(e) {
            f.issue("env", "must be an environment variable name");
        }
    }
    let rules = rules(&mut f);
    match f.raw("only") {
        None => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(_) => f.issue(
            "only",
            "scoping a secret to some sandboxes is not supported by this server yet; name secrets at create instead",
        ),
    }
    for unsupported in ["githubApp", "git", "api"] {
        f.refuse(unsupported, "is not supported by this server yet");
    }
    f.finish()?;
    let p = secrets::Put {
        name,
        value: value.unwrap_or_default(),
        hosts,
        header,
        format,
        env,
        rules,
    };
    Reply::ok(secrets::put(&st, p)?)
}

fn strings(f: &mut Fields<'_>, field: &str, min: usize, max: usize) -> Vec<String> {
    match f.raw(field) {
        None => Vec::new(),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            if a.len() < min || a.len() > max {
                f.issue(field, format!("must have {min} to {max} entries"));
            }
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        }
        Some(_) => {
            f.issue(field, "must be an array of strings");
            Vec::new()
        }
    }
}

fn rules(f: &mut Fields<'_>) -> Option<Vec<Rule>> {
    let raw = f.raw("rules")?;
    let Value::Array(list) = raw else {
        f.issue("rules", "must be an array of {methods?, paths}");
        return None;
    };
    if list.is_empty() || list.len() > 16 {
        f.issue("rules", "must have 1 to 16 rules");
    }
    let mut out = Vec::new();
    for (i, r) in list.iter().enumerate() {
        let Value::Object(m) = r else {
            f.issue(
                &format!("rules[{i}]"),
                "must be an object {methods?, paths}",
            );
            continue;
        };
        for k in m.keys() {
            if k != "methods" && k != "paths" {
                f.issue(&format!("rules[{i}].{k}"), "is not a known field");
            }
        }
        let methods: Vec<String> = match m.get("methods") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .filter_map(|(j, v)| match v.as_str().and_then(rule_method) {
                    Some(m) => Some(m),
                    None => {
                        f.issue(
                            &format!("rules[{i}].methods[{j}]"),
                            format!("must be one of {}", METHODS.join(", ")),
                        );
                        None
                    }
                })
                .collect(),
            Some(_) => {
                f.issue(&format!("rules[{i}].methods"), "must be an array");
                Vec::new()
            }
        };
        let paths: Vec<String> = match m.get("paths") {
            Some(Value::Array(a)) if (1..=16).contains(&a.len()) => a
                .iter()
                .enumerate()
                .filter_map(|(j, v)| match v.as_str() {
                    Some(s) if valid_rule_path(s) => Some(s.to_string()),
                    _ => {
                        f.issue(
                            &format!("rules[{i}].paths[{j}]"),
                            "must be a canonical path, exact or ending in /* (no . or .. segments, ; \\ or encoded slash)",
                        );
                        None
                    }
                })
                .collect(),
            _ => {
                f.issue(&format!("rules[{i}].paths"), "must be 1 to 16 paths");
                Vec::new()
            }
        };
        out.push(Rule { methods, paths });
    }
    Some(out)
}

/// `GET /v1/egress-secrets?limit&after`.
pub(super) async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let limit = f.q_int("limit", 1, 100).map(|l| l as usize);
    let after = f.string("after");
    f.finish()?;
    let (page, next) = secrets::list(&st, &ctx.key, limit, after.as_deref())?;
    Reply::ok(json!({"secrets": page, "next": next}))
}

/// `DELETE /v1/egress-secrets/{name}`: the value is erased.
pub(super) async fn delete(st: AppState, ctx: Ctx, name: String) -> ApiResult<Reply> {
    secrets::delete(&st, &ctx.key, &name)?;
    Reply::ok(json!({"name": name, "deleted": true, "enforced": true}))
}
