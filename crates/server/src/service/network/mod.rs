//! A sandbox's network: the settings kept at create and fork (rules, the
//! secrets it gets), its own CA (its key sealed), the placeholders of its
//! secrets, and what its host's egress proxy is told to apply
//! ([`runtime_host::Host::set_network`]). The proxy itself runs on the host
//! that runs the guest: no byte of a guest's connection passes here. The
//! API's `GET`/`PUT …/network` are in [`rules`].
//!
//! Rules and secrets reach open connections at once: each change is set on
//! the host again, which its connections follow.

pub(crate) mod rules;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use runtime_egress::{Policy, SandboxCa, Secret, SecretRule, SecretValue};
use runtime_host::GuestNet;
use serde_json::json;

use crate::domain::network::{policy, CreateNet, Settings};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::service::secrets;
use crate::AppState;

const KIND: &str = "sandbox-net";
const CA_KIND: &str = "sandbox-ca";

/// The sandboxes whose network was set on the host, with what it was set
/// from: so a change of the rules or of the secrets sets it again.
#[derive(Default)]
pub(crate) struct Nets {
    live: Mutex<HashMap<String, Live>>,
}

#[derive(Clone)]
struct Live {
    policy: Policy,
    /// The key whose secrets it gets (`None`: no sandbox record, no secrets).
    owner: Option<String>,
    /// Which of them: `None` every one.
    chosen: Option<Vec<String>>,
    ca: Arc<SandboxCa>,
}

impl Nets {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Live>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Sets `l` as the network of `id` on the host (under the lock of
/// [`Nets`], so the newest change is the last one set).
fn set_on_host(st: &AppState, id: &str, l: &Live) {
    st.host().set_network(
        id,
        GuestNet {
            policy: l.policy.clone(),
            secrets: secrets_for(st, l.owner.as_deref(), l.chosen.as_deref()),
            ca: Arc::clone(&l.ca),
        },
    );
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
    let mut live = st.inner.nets.lock();
    if let Some(l) = live.get_mut(id) {
        l.policy = policy;
        set_on_host(st, id, l);
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

/// Sets the network of `id` on the host, unless it was set already, and
/// answers the CA certificates its guest trusts (its own, then the
/// operator's): for its machine spec, so a machine never starts before its
/// host knows its rules.
pub(crate) fn prepare_guest(st: &AppState, id: &str) -> Option<String> {
    // The operator's certificates (`--guest-ca`) follow the sandbox's own:
    // the guest's bundle and NODE_EXTRA_CA_CERTS hold them all.
    let extra = &st.config().guest_cas;
    match live(st, id) {
        Ok(ca) => Some(format!("{}\n{extra}", ca.cert_pem().trim_end())),
        Err(e) => {
            tracing::error!(sandbox_id = id, error = %e, "the sandbox has no network");
            (!extra.is_empty()).then(|| extra.clone())
        }
    }
}

fn secrets_for(st: &AppState, owner: Option<&str>, chosen: Option<&[String]>) -> Vec<Secret> {
    let Some(owner) = owner else {
        return Vec::new();
    };
    secrets::all_opened(st, owner)
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

/// The network of `id`, set on the host on first use: its CA.
fn live(st: &AppState, id: &str) -> ApiResult<Arc<SandboxCa>> {
    if let Some(l) = st.inner.nets.lock().get(id) {
        return Ok(Arc::clone(&l.ca));
    }
    // No record (never made, or a deleted sandbox's): no network at all.
    let fresh = match st.store().doc_get(KIND, id, "")? {
        Some(d) => {
            let s = Settings::from_doc(&d);
            Live {
                policy: policy(&s.rules),
                owner: owner(st, id),
                chosen: s.secrets,
                ca: ca(st, id)?,
            }
        }
        None => {
            tracing::warn!(
                sandbox_id = id,
                "no network settings kept: the sandbox gets no network"
            );
            Live {
                policy: Policy::off(),
                owner: None,
                chosen: Some(Vec::new()),
                ca: ca(st, id)?,
            }
        }
    };
    let mut live = st.inner.nets.lock();
    // Another caller may have set it meanwhile: the first one stands.
    let l = live.entry(id.to_string()).or_insert_with(|| {
        set_on_host(st, id, &fresh);
        fresh
    });
    Ok(Arc::clone(&l.ca))
}

/// Secrets changed: every sandbox whose network is set gets them anew.
pub(crate) fn secrets_changed(st: &AppState) {
    let live = st.inner.nets.lock();
    for (id, l) in live.iter() {
        set_on_host(st, id, l);
    }
}

/// The variables a sandbox's processes get for its secrets (placeholders).
pub(crate) fn secret_env(st: &AppState, id: &str) -> Vec<(String, String)> {
    let Some(owner) = owner(st, id) else {
        return Vec::new();
    };
    let chosen = load(st, id).unwrap_or_default().secrets;
    secrets::placeholders(st, &owner, chosen.as_deref())
}

/// The key that made sandbox `id`, whose secrets it gets (`None` for a
/// machine that is no sandbox, such as an image build's).
fn owner(st: &AppState, id: &str) -> Option<String> {
    match st.store().get_sandbox(id) {
        Ok(row) => row.map(|r| r.key_id),
        Err(e) => {
            tracing::error!(sandbox_id = id, error = %e, "reading the sandbox's key failed: no secrets");
            None
        }
    }
}

/// Forgets a deleted sandbox's network (its open connections end).
pub(crate) fn sandbox_gone(st: &AppState, id: &str) {
    st.inner.nets.lock().remove(id);
    st.host().forget_network(id);
    for kind in [KIND, CA_KIND] {
        if let Err(e) = st.store().doc_delete(kind, id, None) {
            tracing::warn!(sandbox_id = id, error = %e, "forgetting the sandbox's network failed");
        }
    }
}
