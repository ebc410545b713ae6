//! The one place where errors become HTTP: each [`ApiError`] (and
//! [`HostError`]) to a status, a code and the one error body.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use runtime_api::{codes, ErrorBody, ErrorObject};
use runtime_host::{GuestFailure, HostError};
use serde_json::{json, Value};

use crate::error::ApiError;

struct Parts {
    status: StatusCode,
    code: &'static str,
    message: String,
    hint: Option<String>,
    details: Option<Value>,
    retryable: Option<bool>,
}

impl ApiError {
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
