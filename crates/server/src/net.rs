//! A sandbox's network: its rules (`network` at create, `GET`/`PUT
//! …/network`), the secrets it gets, its own CA, and the hand-over of its
//! guest's outbound connections to the egress proxy (`runtime-egress`).
//!
//! Rules and secrets reach open connections at once: each live sandbox has
//! watch channels the proxy's connections follow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use runtime_egress::{
    Egress, Policy, Rules, SandboxCa, SandboxNet, Secret, SecretRule, SecretValue,
};
use runtime_host::{DuplexStream, Outbound};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_iso;
use crate::service::sandboxes::find;
use crate::service::secrets;
use crate::{AppState, Inner};

const KIND: &str = "sandbox-net";
const CA_KIND: &str = "sandbox-ca";

/// What a create asked of the network.
#[derive(Debug, Clone, Default)]
pub struct CreateNet {
    pub rules: Option<Rules>,
    /// `None`: every secret; `Some([])`: none.
    pub secrets: Option<Vec<String>>,
}

/// The live network state of the sandboxes that have one.
pub struct Nets {
    egress: Egress,
    live: Mutex<HashMap<String, Arc<Live>>>,
}

struct Live {
    policy: watch::Sender<Arc<Policy>>,
    secrets: watch::Sender<Arc<Vec<Secret>>>,
    chosen: Option<Vec<String>>,
    ca: Arc<SandboxCa>,
}

impl Nets {
    pub fn new(egress: Egress) -> Self {
        Nets {
            egress,
            live: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Live>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Parses `network` and `secrets` of a create, naming every wrong entry.
pub fn parse_create(st: &AppState, f: &mut Fields<'_>) -> CreateNet {
    let mut out = CreateNet::default();
    if let Some(v) = f.raw("network") {
        out.rules = checked_rules(f, "network", v);
    }
    match f.raw("secrets") {
        None => {}
        Some(Value::Array(a)) => {
            let known = secrets::names(st).unwrap_or_default();
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
    // `internet: false` with an allow list is that list alone (the client's rule).
    let internet = internet || allow.as_ref().is_some_and(|a| !a.is_empty());
    let rules = Rules {
        internet,
        allow,
        deny,
        connect,
    };
    if let Err(issues) = rules.validate() {
        for i in issues {
            f.issue(&at(&i.field), i.message);
        }
        ok = false;
    }
    ok.then_some(rules)
}

/// Keeps what a create asked (before the machine starts).
pub fn store_create(st: &AppState, id: &str, c: &CreateNet) -> ApiResult<()> {
    let rules = c.rules.clone().unwrap_or_default();
    let doc = json!({
        "rules": serde_json::to_value(&rules).unwrap_or(Value::Null),
        "secrets": c.secrets,
        "version": 1,
        "updatedAt": now_iso(),
    });
    st.store().doc_put(KIND, id, "", &doc)?;
    Ok(())
}

/// A fork gets its source's rules, and its secrets unless it names some.
pub fn copy_settings(
    st: &AppState,
    from: &str,
    to: &str,
    secrets: Option<Vec<String>>,
) -> ApiResult<()> {
    let mut doc = load_doc(st, from)?;
    if let Some(s) = secrets {
        doc["secrets"] = json!(s);
    }
    doc["version"] = json!(1);
    doc["updatedAt"] = json!(now_iso());
    st.store().doc_put(KIND, to, "", &doc)?;
    // The copy trusts what its memory trusts: processes of the source that
    // loaded the CA go on in the copy, so the copy's egress signs with the
    // same CA (its key sealed again under the copy's id).
    keep_ca(st, to, &*ca(st, from)?)
}

/// Stores `ca` as the CA of `id`, its key sealed under that id.
fn keep_ca(st: &AppState, id: &str, ca: &SandboxCa) -> ApiResult<()> {
    let sealed = st
        .sealer()?
        .seal(&format!("ca:{id}"), ca.key_pem())
        .ok_or_else(|| ApiError::Internal {
            what: "sealing the sandbox's CA key".into(),
        })?;
    st.store().doc_put(
        CA_KIND,
        id,
        "",
        &json!({"cert": ca.cert_pem(), "key": sealed}),
    )?;
    Ok(())
}

fn load_doc(st: &AppState, id: &str) -> ApiResult<Value> {
    Ok(st.store().doc_get(KIND, id, "")?.unwrap_or_else(
        || json!({"rules": {"internet": true}, "secrets": null, "version": 1, "updatedAt": null}),
    ))
}

fn rules_of(doc: &Value) -> Rules {
    serde_json::from_value(doc["rules"].clone()).unwrap_or_default()
}

/// The sandbox's CA, made and kept (its key sealed) on first use.
fn ca(st: &AppState, id: &str) -> ApiResult<Arc<SandboxCa>> {
    let sealer = st.sealer()?;
    if let Some(d) = st.store().doc_get(CA_KIND, id, "")? {
        let cert = d["cert"].as_str().unwrap_or_default();
        let key = d["key"]
            .as_str()
            .and_then(|k| sealer.unseal(&format!("ca:{id}"), k));
        if let Some(key) = key {
            if let Ok(ca) = SandboxCa::from_pem(cert, &key) {
                return Ok(Arc::new(ca));
            }
        }
        tracing::warn!(
            sandbox_id = id,
            "the sandbox's CA could not be read; making a new one"
        );
    }
    let ca = SandboxCa::generate().map_err(|e| ApiError::Internal {
        what: format!("making the sandbox's CA: {e}"),
    })?;
    keep_ca(st, id, &ca)?;
    Ok(Arc::new(ca))
}

/// The CA certificate the guest of `id` trusts (for its machine spec).
pub fn guest_ca_pem(st: &AppState, id: &str) -> Option<String> {
    match live(st, id) {
        Ok(l) => Some(l.ca.cert_pem().to_string()),
        Err(e) => {
            tracing::error!(sandbox_id = id, error = %e, "the sandbox has no CA");
            None
        }
    }
}

fn secrets_for(st: &AppState, chosen: Option<&[String]>) -> Vec<Secret> {
    secrets::all_opened(st)
        .into_iter()
        .filter(|s| chosen.is_none_or(|c| c.contains(&s.name)))
        .map(|s| Secret {
            name: s.name,
            value: SecretValue::new(s.value),
            hosts: s.hosts,
            header: s.header,
            format: s.format,
            rules: s
                .rules
                .into_iter()
                .map(|r| SecretRule {
                    methods: r.methods,
                    paths: r.paths,
                })
                .collect(),
            placeholder: s.placeholder,
        })
        .collect()
}

/// The live state of a sandbox's network, loaded on first use.
fn live(st: &AppState, id: &str) -> ApiResult<Arc<Live>> {
    if let Some(l) = st.inner.nets.lock().get(id) {
        return Ok(l.clone());
    }
    let doc = load_doc(st, id)?;
    let policy = rules_of(&doc).validate().unwrap_or_else(|_| Policy::off());
    let chosen: Option<Vec<String>> = serde_json::from_value(doc["secrets"].clone()).ok();
    let l = Arc::new(Live {
        policy: watch::channel(Arc::new(policy)).0,
        secrets: watch::channel(Arc::new(secrets_for(st, chosen.as_deref()))).0,
        chosen,
        ca: ca(st, id)?,
    });
    Ok(st
        .inner
        .nets
        .lock()
        .entry(id.to_string())
        .or_insert(l)
        .clone())
}

/// Secrets changed: every live sandbox follows.
pub fn secrets_changed(st: &AppState) {
    let lives: Vec<Arc<Live>> = st.inner.nets.lock().values().cloned().collect();
    for l in lives {
        let s = secrets_for(st, l.chosen.as_deref());
        l.secrets.send_replace(Arc::new(s));
    }
}

/// The variables a sandbox's processes get for its secrets (placeholders).
pub fn secret_env(st: &AppState, id: &str) -> Vec<(String, String)> {
    let doc = load_doc(st, id).unwrap_or(Value::Null);
    let chosen: Option<Vec<String>> = serde_json::from_value(doc["secrets"].clone()).ok();
    secrets::placeholders(st, chosen.as_deref())
}

/// Forgets a deleted sandbox's network (open connections end).
pub fn sandbox_gone(st: &AppState, id: &str) {
    if let Some(l) = st.inner.nets.lock().remove(id) {
        l.policy.send_replace(Arc::new(Policy::off()));
    }
    for kind in [KIND, CA_KIND] {
        if let Err(e) = st.store().doc_delete(kind, id, None) {
            tracing::warn!(sandbox_id = id, error = %e, "forgetting the sandbox's network failed");
        }
    }
}

fn answer(id: &str, doc: &Value) -> Value {
    let rules = rules_of(doc);
    let policy = rules.validate().unwrap_or_else(|_| Policy::off());
    let mut v = serde_json::to_value(&rules).unwrap_or_else(|_| json!({}));
    let version = doc["version"].as_u64().unwrap_or(1);
    if let Value::Object(m) = &mut v {
        for k in ["allow", "deny", "connect"] {
            m.entry(k).or_insert_with(|| json!([]));
        }
        m.insert("sandboxId".into(), json!(id));
        m.insert("version".into(), json!(version));
        m.insert("enforced".into(), json!(true));
        m.insert("enforcedVersion".into(), json!(version));
        m.insert("ports".into(), json!(policy.ports()));
        m.insert("connectAllowed".into(), json!(true));
        m.insert("connectReason".into(), Value::Null);
        m.insert("forbiddenPorts".into(), json!(policy.forbidden_ports()));
        m.insert("updatedAt".into(), doc["updatedAt"].clone());
    }
    v
}

/// `GET …/network`.
pub async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    find(&st, &ctx.key, &id)?;
    Reply::ok(answer(&id, &load_doc(&st, &id)?))
}

/// `PUT …/network`: replaces the rules; open connections follow at once.
pub async fn put(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
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
    let row = find(&st, &ctx.key, &id)?;
    let policy = rules.validate().map_err(|_| ApiError::Internal {
        what: "rules passed their checks but do not validate".into(),
    })?;
    let mut doc = load_doc(&st, &row.record.id)?;
    let version = doc["version"].as_u64().unwrap_or(1) + 1;
    doc["rules"] = serde_json::to_value(&rules).unwrap_or(Value::Null);
    doc["version"] = json!(version);
    doc["updatedAt"] = json!(now_iso());
    st.store().doc_put(KIND, &id, "", &doc)?;
    if let Some(l) = st.inner.nets.lock().get(&id) {
        l.policy.send_replace(Arc::new(policy));
    }
    tracing::info!(sandbox_id = %id, version, "network rules changed");
    Reply::ok(answer(&id, &doc))
}

/// Hands each outbound connection of a guest to the egress proxy.
pub struct Handler(pub Weak<Inner>);

impl Outbound for Handler {
    fn accept(&self, sandbox_id: &str, conn: DuplexStream) {
        let Some(inner) = self.0.upgrade() else {
            return;
        };
        let st = AppState { inner };
        let l = match live(&st, sandbox_id) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(sandbox_id, error = %e, "no network state: connection dropped");
                return;
            }
        };
        let net = SandboxNet {
            sandbox_id: sandbox_id.to_string(),
            policy: l.policy.subscribe(),
            secrets: l.secrets.subscribe(),
            ca: l.ca.clone(),
        };
        let egress = st.inner.nets.egress.clone();
        st.spawn(async move { egress.serve(conn, net).await });
    }
}
