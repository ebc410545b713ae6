//! The server's errors: [`ServerError`] for its own setup and store,
//! [`ApiError`] for a request. They become HTTP in one place,
//! `http/error.rs`; nothing here knows HTTP.

use runtime_api::{codes, Issue};
use runtime_host::HostError;
use serde_json::Value;

/// Failures of the server's own setup and store (not of a request).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("store operation {op} failed")]
    Store {
        op: &'static str,
        #[source]
        source: crate::store::db::DbError,
    },
    /// `--store` names a database that does not answer (the URL shown
    /// without its password).
    #[error("cannot reach the store at {url}: {message}")]
    StoreUnreachable { url: String, message: String },
    #[error("I/O failed during {op} on {path}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a stored record could not be read: {what}")]
    Corrupt { what: String },
    #[error("no key has the id or name {which}")]
    KeyNotFound { which: String },
    #[error("{count} keys are named {which}; give the key's id")]
    KeyAmbiguous { which: String, count: usize },
    /// A whole key was given, and no key of the data directory is it (the
    /// secret is never repeated: only the id it spells).
    #[error("the key given (id {id}) is not a key of this data directory")]
    KeyUnknown { id: String },
    /// An operator's setting that cannot be applied (every bad one named).
    #[error("{message}")]
    BadSetting { message: String },
}

/// A request's failure. [`ApiError::parts`] is the one mapping to status and code.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid API key")]
    Unauthorized,
    #[error("this key may not {action}")]
    Forbidden { action: &'static str },
    /// A key of one tenant asking for what only the account's keys (the
    /// account-wide or read-only ones) may see.
    #[error("only an account-wide or read-only key may {action}")]
    AccountKeyNeeded { action: &'static str },
    /// Something only an admin (account-wide, full) key does, such as
    /// managing other keys.
    #[error("only an admin key may {action}")]
    AdminOnly { action: &'static str },
    /// A session token used for something beyond its sandbox's commands,
    /// processes, files and previews.
    #[error("a session may not {action}")]
    SessionScope { action: &'static str },
    /// A session token that expired or was revoked.
    #[error("session {id} is {state}")]
    SessionEnded { id: String, state: &'static str },
    /// A page at an origin the session does not list.
    #[error("origin {origin} may not use this session")]
    OriginNotAllowed { origin: String },
    /// A file link that expired or was revoked.
    #[error("the link is {state}")]
    LinkEnded { state: &'static str },
    /// A `Range` that names no byte of the file.
    #[error("range not satisfiable in {len} bytes")]
    RangeNotSatisfiable { len: u64 },
    #[error("no route {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("method {method} not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("invalid request")]
    Invalid { issues: Vec<Issue> },
    #[error("{what} {id} not found")]
    NotFound {
        code: &'static str,
        what: &'static str,
        id: String,
    },
    /// A 404 that says more than "no such thing": what exists instead
    /// (`details`) and what to do (`hint`).
    #[error("{message}")]
    Missing {
        code: &'static str,
        message: String,
        details: Option<Value>,
        hint: Option<String>,
    },
    #[error("name {name} is taken")]
    NameTaken {
        name: String,
        sandbox_id: Option<String>,
    },
    #[error("sandbox {id} is {state}")]
    NotRunning {
        id: String,
        state: runtime_api::SandboxState,
    },
    #[error("idempotency key reused with another request")]
    IdempotencyKeyReused,
    #[error("payload over {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("{message}")]
    Conflict {
        code: &'static str,
        message: String,
        details: Option<Value>,
    },
    #[error("{message}")]
    Unprocessable {
        code: &'static str,
        message: String,
        details: Option<Value>,
    },
    /// A lifecycle change the host could not make (`pause_failed`, `wake_failed`, …).
    #[error("{message}")]
    Failed { code: &'static str, message: String },
    /// A 402: the key may not spend this (`spending_limit_reached`).
    #[error("{message}")]
    PaymentRequired {
        code: &'static str,
        message: String,
        hint: &'static str,
        details: Value,
    },
    /// A 503: the host has no room for the machine now (`no_capacity`);
    /// it passes as others stop or pause.
    #[error("{message}")]
    NoCapacity { message: String, details: Value },
    /// A 503: the control plane whose machines run the sandbox did not
    /// answer (several control planes on one store).
    #[error("{message}")]
    NodeUnreachable { node: String, message: String },
    #[error("{feature} is not supported by this server")]
    Unsupported { feature: &'static str },
    /// A product of the client's surface this server does not offer.
    #[error("{product} are not served by this server")]
    Unavailable { product: &'static str },
    /// A 400 with its own code, naming the one field at fault.
    #[error("{message}")]
    BadField {
        code: &'static str,
        field: &'static str,
        message: String,
    },
    #[error("host failed")]
    Host(#[from] HostError),
    #[error("server failed")]
    Server(#[from] ServerError),
    #[error("internal failure: {what}")]
    Internal { what: String },
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            issues: vec![Issue {
                field: field.into(),
                message: message.into(),
            }],
        }
    }

    /// 409 `quota_exceeded`: a bounded count is full (`details.limit`).
    pub fn quota(message: String, limit: usize) -> Self {
        ApiError::Conflict {
            code: codes::QUOTA_EXCEEDED,
            message,
            details: Some(serde_json::json!({ "limit": limit })),
        }
    }

    pub fn sandbox_not_found(id: &str) -> Self {
        ApiError::NotFound {
            code: codes::SANDBOX_NOT_FOUND,
            what: "sandbox",
            id: id.to_string(),
        }
    }
}
