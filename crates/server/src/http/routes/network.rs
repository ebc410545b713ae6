//! A sandbox's network: `GET`/`PUT …/network`, and the `network` and
//! `secrets` fields of a create or fork ([`parse_create`]).

use axum::body::Bytes;
use runtime_egress::Rules;
use serde_json::{json, Value};

use crate::domain::network::{policy, rules_from, CreateNet, Settings};
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::network;
use crate::AppState;

/// Parses `network` and `secrets` of a create, naming every wrong entry.
/// `known_secrets` answers the names of the secrets that exist (asked only
/// when the create names some).
pub(crate) fn parse_create(
    f: &mut Fields<'_>,
    known_secrets: impl FnOnce() -> Vec<String>,
) -> CreateNet {
    let mut out = CreateNet::default();
    if let Some(v) = f.raw("network") {
        out.rules = checked_rules(f, "network", v);
    }
    match f.raw("secrets") {
        None => {}
        Some(Value::Array(a)) => {
            let known = known_secrets();
            let mut names = Vec::new();
            for (i, v) in a.iter().enumerate() {
                match v.as_str() {
                    Some(n) if known.iter().any(|k| k == n) => names.push(n.to_string()),
                    Some(n) => f.issue(&format!("secrets[{i}]"), format!("no secret is named {n}")),
                    None => f.issue(&format!("secrets[{i}]"), "must be a secret's name"),
                }
            }
            out.secrets = Some(names);
        }
        Some(_) => f.issue("secrets", "must be an array of secret names"),
    }
    out
}

/// Rules from JSON, every wrong entry named under `prefix`.
/// (The body of a `PUT`, `prefix` empty, has its unknown fields named by
/// its own [`Fields`].)
fn checked_rules(f: &mut Fields<'_>, prefix: &str, v: &Value) -> Option<Rules> {
    let at = |name: &str| {
        if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        }
    };
    let Value::Object(m) = v else {
        f.issue(
            prefix,
            "must be an object {internet, allow?, deny?, connect?}",
        );
        return None;
    };
    let mut ok = true;
    for k in m.keys() {
        if !prefix.is_empty() && !["internet", "allow", "deny", "connect"].contains(&k.as_str()) {
            f.issue(&at(k), "is not a known field");
            ok = false;
        }
    }
    let internet = match m.get("internet") {
        Some(Value::Bool(b)) => *b,
        None => {
            f.issue(&at("internet"), "is required");
            ok = false;
            true
        }
        Some(_) => {
            f.issue(&at("internet"), "must be true or false");
            ok = false;
            true
        }
    };
    let mut list = |name: &str| -> Option<Vec<String>> {
        match m.get(name) {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.iter().all(Value::is_string) => Some(
                a.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect(),
            ),
            Some(_) => {
                f.issue(&at(name), "must be an array of strings");
                ok = false;
                None
            }
        }
    };
    let allow = list("allow");
    let deny = list("deny");
    let connect = list("connect");
    let rules = rules_from(internet, allow, deny, connect);
    if let Err(issues) = rules.validate() {
        for i in issues {
            f.issue(&at(&i.field), i.message);
        }
        ok = false;
    }
    ok.then_some(rules)
}

fn answer(id: &str, s: &Settings) -> Value {
    let policy = policy(&s.rules);
    let mut v = serde_json::to_value(&s.rules).unwrap_or_else(|_| json!({}));
    if let Value::Object(m) = &mut v {
        for k in ["allow", "deny", "connect"] {
            m.entry(k).or_insert_with(|| json!([]));
        }
        m.insert("sandboxId".into(), json!(id));
        m.insert("version".into(), json!(s.version));
        m.insert("enforced".into(), json!(true));
        m.insert("enforcedVersion".into(), json!(s.version));
        m.insert("ports".into(), json!(policy.ports()));
        m.insert("connectAllowed".into(), json!(true));
        m.insert("connectReason".into(), Value::Null);
        m.insert("forbiddenPorts".into(), json!(policy.forbidden_ports()));
        m.insert("updatedAt".into(), json!(s.updated_at));
    }
    v
}

/// `GET …/network`.
pub(super) async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let s = network::rules::get(&st, &ctx.key, &id)?;
    Reply::ok(answer(&id, &s))
}

/// `PUT …/network`: replaces the rules; open connections follow at once.
pub(super) async fn put(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    for k in ["internet", "allow", "deny", "connect"] {
        f.raw(k);
    }
    let whole = Value::Object(obj.clone());
    let rules = checked_rules(&mut f, "", &whole);
    f.finish()?;
    let rules = rules.ok_or_else(|| ApiError::Internal {
        what: "rules passed their checks but were not built".into(),
    })?;
    let s = network::rules::put(&st, &ctx.key, &id, rules)?;
    Reply::ok(answer(&id, &s))
}
