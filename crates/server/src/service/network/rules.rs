//! A sandbox's network rules as the API reads and replaces them (`GET`/`PUT
//! …/network`).

use runtime_egress::Rules;

use crate::domain::access::KeyInfo;
use crate::domain::network::Settings;
use crate::error::{ApiError, ApiResult};
use crate::service::network::{load, replace_rules};
use crate::service::sandboxes::find;
use crate::AppState;

/// `GET …/network`: the sandbox's settings.
pub(crate) fn get(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<Settings> {
    find(st, key, id)?;
    load(st, id)
}

/// `PUT …/network`: replaces the rules (checked by the caller); open
/// connections follow at once.
pub(crate) fn put(st: &AppState, key: &KeyInfo, id: &str, rules: Rules) -> ApiResult<Settings> {
    find(st, key, id)?;
    let policy = rules.validate().map_err(|_| ApiError::Internal {
        what: "rules passed their checks but do not validate".into(),
    })?;
    let s = replace_rules(st, id, rules, policy)?;
    tracing::info!(sandbox_id = %id, version = s.version, "network rules changed");
    Ok(s)
}
