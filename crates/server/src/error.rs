//! Errors, and the one place where they become HTTP.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use runtime_api::{codes, ErrorBody, ErrorObject, Issue};
use runtime_host::{GuestFailure, HostError};
use serde_json::{json, Value};

/// Failures of the server's own setup and store (not of a request).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("store operation {op} failed")]
    Store {
        op: &'static str,
        #[source]
        source: rusqlite::Error,
    },
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
    #[error("serving HTTP failed")]
    Serve(#[source] std::io::Error),
}

/// A request's failure. [`ApiError::parts`] is the one mapping to status and code.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid API key")]
    Unauthorized,
    #[error("this key may not {action}")]
    Forbidden { action: &'static str },
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
    #[error("{feature} is not supported by this server")]
    Unsupported { feature: &'static str },
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

pub type ApiResult<T> = Result<T, ApiError>;

struct Parts {
    status: StatusCode,
    code: &'static str,
    message: String,
    hint: Option<String>,
    details: Option<Value>,
    retryable: Option<bool>,
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            issues: vec![Issue {
                field: field.into(),
                message: message.into(),
            }],
        }
    }

    pub fn sandbox_not_found(id: &str) -> Self {
        ApiError::NotFound {
            code: codes::SANDBOX_NOT_FOUND,
            what: "sandbox",
            id: id.to_string(),
        }
    }

    fn parts(&self) -> Parts {
        let p = |status, code, message: String| Parts {
            status,
            code,
            message,
            hint: None,
            details: None,
            retryable: None,
        };
        match self {
            ApiError::Unauthorized => Parts {
                hint: Some(
                    "Send `Authorization: Bearer <key>` with a key from `runtime keys create`."
                        .into(),
                ),
                ..p(
                    StatusCode::UNAUTHORIZED,
                    codes::UNAUTHORIZED,
                    "Missing or invalid API key.".into(),
                )
            },
            ApiError::Forbidden { action } => p(
                StatusCode::FORBIDDEN,
                codes::FORBIDDEN,
                format!("This API key is read-only and may not {action}."),
            ),
            ApiError::RouteNotFound { method, path } => p(
                StatusCode::NOT_FOUND,
                codes::ROUTE_NOT_FOUND,
                format!("No route for {method} {path}."),
            ),
            ApiError::MethodNotAllowed { method, path } => p(
                StatusCode::METHOD_NOT_ALLOWED,
                codes::METHOD_NOT_ALLOWED,
                format!("{path} does not accept {method}."),
            ),
            ApiError::Invalid { issues } => {
                let names: Vec<&str> = issues.iter().map(|i| i.field.as_str()).collect();
                Parts {
                    details: Some(json!({ "issues": issues })),
                    ..p(
                        StatusCode::BAD_REQUEST,
                        codes::INVALID_REQUEST,
                        format!("Invalid request: {}.", names.join(", ")),
                    )
                }
            }
            ApiError::NotFound { code, what, id } => {
                p(StatusCode::NOT_FOUND, code, format!("No {what} {id}."))
            }
            ApiError::NameTaken { name, sandbox_id } => Parts {
                details: sandbox_id.as_ref().map(|id| json!({ "sandboxId": id })),
                hint: Some("Pick another name, or pass getOrCreate to reuse it.".into()),
                ..p(
                    StatusCode::CONFLICT,
                    codes::NAME_TAKEN,
                    format!("The name {name} is taken."),
                )
            },
            ApiError::NotRunning { id, state } => Parts {
                details: Some(json!({ "sandboxId": id, "state": state })),
                ..p(
                    StatusCode::CONFLICT,
                    if matches!(
                        state,
                        runtime_api::SandboxState::Paused | runtime_api::SandboxState::Pausing
                    ) {
                        codes::SANDBOX_PAUSED
                    } else {
                        codes::SANDBOX_NOT_RUNNING
                    },
                    format!("Sandbox {id} is {state}, not running."),
                )
            },
            ApiError::IdempotencyKeyReused => Parts {
                hint: Some("Use a new Idempotency-Key for a different request.".into()),
                ..p(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    codes::IDEMPOTENCY_KEY_REUSED,
                    "This Idempotency-Key was used with a different request.".into(),
                )
            },
            ApiError::PayloadTooLarge { limit } => Parts {
                details: Some(json!({ "limitBytes": limit })),
                ..p(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    codes::PAYLOAD_TOO_LARGE,
                    format!("The body is larger than {limit} bytes."),
                )
            },
            ApiError::Conflict {
                code,
                message,
                details,
            } => Parts {
                details: details.clone(),
                ..p(StatusCode::CONFLICT, code, message.clone())
            },
            ApiError::Unprocessable {
                code,
                message,
                details,
            } => Parts {
                details: details.clone(),
                ..p(StatusCode::UNPROCESSABLE_ENTITY, code, message.clone())
            },
            ApiError::PaymentRequired {
                code,
                message,
                hint,
                details,
            } => Parts {
                hint: Some((*hint).into()),
                details: Some(details.clone()),
                retryable: Some(false),
                ..p(StatusCode::PAYMENT_REQUIRED, code, message.clone())
            },
            ApiError::Unsupported { feature } => Parts {
                retryable: Some(false),
                ..p(
                    StatusCode::NOT_IMPLEMENTED,
                    codes::UNSUPPORTED,
                    format!("{feature} is not supported by this server yet."),
                )
            },
            ApiError::BadField {
                code,
                field,
                message,
            } => Parts {
                details: Some(json!({"issues": [{"field": field, "message": message}]})),
                retryable: Some(false),
                ..p(StatusCode::BAD_REQUEST, code, message.clone())
            },
            ApiError::Failed { code, message } => {
                p(StatusCode::INTERNAL_SERVER_ERROR, code, message.clone())
            }
            ApiError::Host(e) => host_parts(e),
            ApiError::Server(_) | ApiError::Internal { .. } => p(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::INTERNAL,
                "Internal server error.".into(),
            ),
        }
    }

    /// The status this error answers with.
    pub fn status(&self) -> StatusCode {
        self.parts().status
    }

    /// The one error body, logging 5xx details (which the body never carries).
    pub fn body(&self, request_id: &str) -> ErrorBody {
        let parts = self.parts();
        if parts.status.is_server_error() {
            tracing::error!(request_id, error = ?self, source = %error_chain(self), "request failed");
        }
        ErrorBody {
            error: ErrorObject {
                code: parts.code.to_string(),
                status: parts.status.as_u16(),
                message: parts.message,
                hint: parts.hint,
                details: parts.details,
                request_id: request_id.to_string(),
                retryable: parts.retryable,
                retry_after_ms: None,
            },
        }
    }

    pub fn into_response_with(self, request_id: &str) -> Response {
        let status = self.status();
        let body = self.body(request_id);
        let mut resp = (status, axum::Json(body)).into_response();
        if let Ok(v) = HeaderValue::from_str(request_id) {
            resp.headers_mut().insert("x-request-id", v);
        }
        resp
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

fn host_parts(e: &HostError) -> Parts {
    let p = |status, code, message: String| Parts {
        status,
        code,
        message,
        hint: None,
        details: None,
        retryable: None,
    };
    match e {
        HostError::Guest {
            failure, message, ..
        } => {
            let (status, code) = match failure {
                GuestFailure::FileNotFound => (StatusCode::NOT_FOUND, codes::FILE_NOT_FOUND),
                GuestFailure::IsADirectory => (StatusCode::CONFLICT, codes::IS_A_DIRECTORY),
                GuestFailure::NotADirectory => (StatusCode::CONFLICT, codes::NOT_A_DIRECTORY),
                GuestFailure::PermissionDenied => (StatusCode::FORBIDDEN, codes::PERMISSION_DENIED),
                GuestFailure::AlreadyExists => (StatusCode::CONFLICT, codes::ALREADY_EXISTS),
                GuestFailure::DirectoryNotEmpty => {
                    (StatusCode::CONFLICT, codes::DIRECTORY_NOT_EMPTY)
                }
                GuestFailure::InvalidPath | GuestFailure::BadRequest => {
                    return Parts {
                        details: Some(json!({"issues": [{"field": "path", "message": message}]})),
                        ..p(
                            StatusCode::BAD_REQUEST,
                            codes::INVALID_REQUEST,
                            message.clone(),
                        )
                    }
                }
                GuestFailure::CommandNotFound => {
                    (StatusCode::BAD_REQUEST, codes::COMMAND_NOT_FOUND)
                }
                GuestFailure::Io => (StatusCode::INTERNAL_SERVER_ERROR, codes::GUEST_ERROR),
                GuestFailure::ConnectionRefused => (StatusCode::BAD_GATEWAY, "connection_refused"),
            };
            if status.is_server_error() {
                return p(status, code, "Internal server error.".into());
            }
            p(status, code, message.clone())
        }
        HostError::NoSuchMachine { id } => Parts {
            details: Some(json!({ "sandboxId": id })),
            ..p(
                StatusCode::CONFLICT,
                codes::SANDBOX_NOT_RUNNING,
                format!("Sandbox {id} has no running machine."),
            )
        },
        HostError::LinkLost { .. } | HostError::Timeout { .. } => Parts {
            retryable: Some(true),
            ..p(
                StatusCode::SERVICE_UNAVAILABLE,
                codes::HOST_UNAVAILABLE,
                "The sandbox did not answer; try again.".into(),
            )
        },
        HostError::NotPaused { id } => Parts {
            details: Some(json!({ "sandboxId": id })),
            ..p(
                StatusCode::CONFLICT,
                codes::SANDBOX_NOT_RUNNING,
                format!("Sandbox {id} has no saved state to start from."),
            )
        },
        HostError::StartFailed { .. }
        | HostError::Io { .. }
        | HostError::Capture { .. }
        | HostError::BadCapture { .. } => p(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::INTERNAL,
            "Internal server error.".into(),
        ),
    }
}
