//! A sandbox's network: the settings kept at create and fork (rules, the
//! secrets it gets), its own CA (its key sealed), the placeholders of its
//! secrets, and the hand-over of each outbound connection of its guest to
//! the egress proxy (`runtime-egress`). The API's `GET`/`PUT …/network`
//! are in [`rules`].
//!
//! Rules and secrets reach open connections at once: each live sandbox has
//! watch channels the proxy's connections follow.

pub(crate) mod rules;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use runtime_egress::{Egress, Policy, SandboxCa, SandboxNet, Secret, SecretRule, SecretValue};
use runtime_host::{DuplexStream, Outbound};
use serde_json::json;
use tokio::sync::watch;

use crate::domain::network::{policy, CreateNet, Settings};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::service::secrets;
use crate::{AppState, Inner};

const KIND: &str = "sandbox-net";
const CA_KIND: &str = "sandbox-ca";

/// The live network state of the sandboxes that have one.
pub(crate) struct Nets {
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
    pub(crate) fn new(egress: Egress) -> Self {
        Nets {
            egress,
            live: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Live>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The settings of `id` (the default ones when it has none).
pub(crate) fn load(st: &AppState, id: &str) -> ApiResult<Settings> {
    Ok(st
        .store()
        .doc_get(KIND, id, "")?
        .map(|d| Settings::from_doc(&d))
        .unwrap_or_default())
}

fn save(st: &AppState, id: &str, s: &Settings) -> ApiResult<()> {
    st.store().doc_put(KIND, id, "", &s.to_doc())?;
    Ok(())
}

/// Keeps what a create asked (before the machine starts).
pub(crate) fn store_create(st: &AppState, id: &str, c: &CreateNet) -> ApiResult<()> {
    save(st, id, &Settings::at_create(c, iso(st.now_ms())))
}

/// A fork gets its source's rules, and its secrets unless it names some.
pub(crate) fn copy_settings(
    st: &AppState,
    from: &str,
    to: &str,
    secrets: Option<Vec<String>>,
) -> ApiResult<()> {
    let mut s = load(st, from)?;
    if let Some(names) = secrets {
        s.secrets = Some(names);
    }
    s.version = 1;
    s.updated_at = Some(iso(st.now_ms()));
    save(st, to, &s)?;
    // The copy trusts what its memory trusts: processes of the source that
    // loaded the CA go on in the copy, so the copy's egress signs with the
    // same CA (its key sealed again under the copy's id).
    keep_ca(st, to, &*ca(st, from)?)
}

/// Replaces the rules of `id`, its version bumped; open connections follow
/// at once. Answers the settings as kept.
pub(crate) fn replace_rules(
    st: &AppState,
    id: &str,
    rules: runtime_egress::Rules,
    policy: Policy,
) -> ApiResult<Settings> {
    let mut s = load(st, id)?;
    s.version += 1;
    s.rules = rules;
    s.updated_at = Some(iso(st.now_ms()));
    save(st, id, &s)?;
    if let Some(l) = st.inner.nets.lock().get(id) {
        l.policy.send_replace(Arc::new(policy));
    }
    Ok(s)
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
pub(crate) fn guest_ca_pem(st: &AppState, id: &str) -> Option<String> {
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
    let s = load(st, id)?;
    let l = Arc::new(Live {
        policy: watch::channel(Arc::new(policy(&s.rules))).0,
        secrets: watch::channel(Arc::new(secrets_for(st, s.secrets.as_deref()))).0,
        chosen: s.secrets,
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
pub(crate) fn secrets_changed(st: &AppState) {
    let lives: Vec<Arc<Live>> = st.inner.nets.lock().values().cloned().collect();
    for l in lives {
        let s = secrets_for(st, l.chosen.as_deref());
        l.secrets.send_replace(Arc::new(s));
    }
}

/// The variables a sandbox's processes get for its secrets (placeholders).
pub(crate) fn secret_env(st: &AppState, id: &str) -> Vec<(String, String)> {
    let chosen = load(st, id).unwrap_or_default().secrets;
    secrets::placeholders(st, chosen.as_deref())
}

/// Forgets a deleted sandbox's network (open connections end).
pub(crate) fn sandbox_gone(st: &AppState, id: &str) {
    if let Some(l) = st.inner.nets.lock().remove(id) {
        l.policy.send_replace(Arc::new(Policy::off()));
    }
    for kind in [KIND, CA_KIND] {
        if let Err(e) = st.store().doc_delete(kind, id, None) {
            tracing::warn!(sandbox_id = id, error = %e, "forgetting the sandbox's network failed");
        }
    }
}

/// Hands each outbound connection of a guest to the egress proxy.
pub(crate) struct Handler(pub(crate) Weak<Inner>);

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
