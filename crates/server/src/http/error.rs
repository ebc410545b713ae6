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
            ApiError::AccountKeyNeeded { action } => Parts {
                hint: Some(
                    "Use the admin key, or a key made with `runtime keys create --read-only` \
                     or `--account-wide`."
                        .into(),
                ),
                ..p(
                    StatusCode::FORBIDDEN,
                    codes::FORBIDDEN,
                    format!("Only an account-wide or read-only key may {action}."),
                )
            },
            ApiError::AdminOnly { action } => p(
                StatusCode::FORBIDDEN,
                codes::FORBIDDEN,
                format!("Only an admin (account-wide, full access) key may {action}."),
            ),
            ApiError::SessionScope { action } => Parts {
                hint: Some(
                    "A session reaches its own sandbox's commands, processes, files and previews; \
                     do the rest with an API key on your backend."
                        .into(),
                ),
                ..p(
                    StatusCode::FORBIDDEN,
                    codes::FORBIDDEN,
                    format!("A sandbox session may not {action}."),
                )
            },
            ApiError::SessionEnded { id, state } => Parts {
                hint: Some("Make a new one with sbx.sessions.create() on your backend.".into()),
                ..p(
                    StatusCode::UNAUTHORIZED,
                    codes::UNAUTHORIZED,
                    format!("Session {id} is {state}."),
                )
            },
            ApiError::OriginNotAllowed { origin } => Parts {
                hint: Some("Create the session with this page's origin in `origins`.".into()),
                ..p(
                    StatusCode::FORBIDDEN,
                    codes::FORBIDDEN,
                    format!("The page at {origin} is not one of this session's origins."),
                )
            },
            ApiError::LinkEnded { state } => Parts {
                hint: Some("Ask whoever shared it for a new link.".into()),
                retryable: Some(false),
                ..p(
                    StatusCode::GONE,
                    if *state == "revoked" {
                        codes::LINK_REVOKED
                    } else {
                        codes::LINK_EXPIRED
                    },
                    format!("This file link is {state}."),
                )
            },
            ApiError::RangeNotSatisfiable { len } => Parts {
                details: Some(json!({ "size": len })),
                ..p(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    codes::RANGE_NOT_SATISFIABLE,
                    format!("The range names no byte of this {len}-byte file."),
                )
            },
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
            ApiError::Missing {
                code,
                message,
                details,
                hint,
            } => Parts {
                details: details.clone(),
                hint: hint.clone(),
                ..p(StatusCode::NOT_FOUND, code, message.clone())
            },
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
            ApiError::NoCapacity { message, details } => Parts {
                details: Some(details.clone()),
                retryable: Some(true),
                hint: Some(
                    "The server's host is full for now; retry later, or stop or pause sandboxes."
                        .into(),
                ),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    codes::NO_CAPACITY,
                    message.clone(),
                )
            },
            ApiError::Unavailable { product } => Parts {
                retryable: Some(false),
                ..p(
                    StatusCode::NOT_IMPLEMENTED,
                    codes::UNAVAILABLE,
                    format!("{product}: not served by this self-hosted server."),
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
            ApiError::NodeUnreachable { node, message } => Parts {
                details: Some(json!({ "node": node })),
                retryable: Some(true),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    codes::HOST_UNAVAILABLE,
                    message.clone(),
                )
            },
            ApiError::Failed { code, message } => {
                p(StatusCode::INTERNAL_SERVER_ERROR, code, message.clone())
            }
            ApiError::Host(e) => host_parts(e),
            // The store (PostgreSQL) did not answer: the same request may
            // work once it does (a write's resend is still acted on once).
            ApiError::Server(crate::error::ServerError::Store { source, .. })
                if source.is_unreachable() =>
            {
                Parts {
                    retryable: Some(true),
                    ..p(
                        StatusCode::SERVICE_UNAVAILABLE,
                        codes::STORE_UNAVAILABLE,
                        "The store (the database every node shares) does not answer this node now; \
                         try again."
                            .into(),
                    )
                }
            }
            ApiError::Server(_) | ApiError::Internal { .. } => p(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::INTERNAL,
                "Internal server error.".into(),
            ),
        }
    }

    /// The code this error answers with.
    pub(crate) fn code(&self) -> &'static str {
        self.parts().code
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

/// Most bytes of a guest's own message that an answer repeats.
const GUEST_MESSAGE_BYTES: usize = 4096;

/// A guest's message as an answer may carry it: cut at
/// [`GUEST_MESSAGE_BYTES`] (on a character boundary), with a mark.
fn guest_message(m: &str) -> String {
    if m.len() <= GUEST_MESSAGE_BYTES {
        return m.to_string();
    }
    let mut end = GUEST_MESSAGE_BYTES;
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes cut)", &m[..end], m.len() - end)
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
            // The guest wrote it: at most a few lines of it go back.
            let message = &guest_message(message);
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
                GuestFailure::ConnectionRefused => {
                    (StatusCode::BAD_GATEWAY, codes::CONNECTION_REFUSED)
                }
                GuestFailure::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, codes::FILE_TOO_LARGE),
                GuestFailure::Unsupported => (StatusCode::NOT_IMPLEMENTED, codes::UNSUPPORTED),
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
        | HostError::Grow { .. }
        | HostError::BadCapture { .. } => p(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::INTERNAL,
            "Internal server error.".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use runtime_api::{Issue, SandboxState};
    use runtime_host::BootStage;

    #[test]
    fn a_guests_long_message_is_cut_in_the_answer() {
        let long = "é".repeat(10_000);
        let e = ApiError::Host(HostError::Guest {
            id: "s1".into(),
            failure: GuestFailure::PermissionDenied,
            message: long.clone(),
        });
        let (status, code, message, _) = answer(e);
        assert_eq!((status, code.as_str()), (403, codes::PERMISSION_DENIED));
        assert!(message.len() < 4200, "{}", message.len());
        assert!(message.ends_with("bytes cut)"), "{message}");
        assert!(long.starts_with(message.split('…').next().unwrap()));
        assert_eq!(guest_message("short"), "short");
    }

    /// Status, code and message of `e`'s answer, and its body's details.
    fn answer(e: ApiError) -> (u16, String, String, Option<Value>) {
        let status = e.status().as_u16();
        let b = e.body("req_1").error;
        assert_eq!(b.status, status, "the body repeats the status");
        assert_eq!(b.request_id, "req_1");
        (status, b.code, b.message, b.details)
    }

    #[test]
    fn each_request_error_has_its_status_and_code() {
        let cases: Vec<(ApiError, u16, &str)> = vec![
            (ApiError::Unauthorized, 401, codes::UNAUTHORIZED),
            (
                ApiError::Forbidden {
                    action: "make changes",
                },
                403,
                codes::FORBIDDEN,
            ),
            (
                ApiError::AccountKeyNeeded {
                    action: "read the metrics",
                },
                403,
                codes::FORBIDDEN,
            ),
            (
                ApiError::AdminOnly {
                    action: "manage other keys",
                },
                403,
                codes::FORBIDDEN,
            ),
            (
                ApiError::RouteNotFound {
                    method: "GET".into(),
                    path: "/v2".into(),
                },
                404,
                codes::ROUTE_NOT_FOUND,
            ),
            (
                ApiError::MethodNotAllowed {
                    method: "PATCH".into(),
                    path: "/v1/x".into(),
                },
                405,
                codes::METHOD_NOT_ALLOWED,
            ),
            (
                ApiError::invalid("name", "is bad"),
                400,
                codes::INVALID_REQUEST,
            ),
            (
                ApiError::sandbox_not_found("s1"),
                404,
                codes::SANDBOX_NOT_FOUND,
            ),
            (
                ApiError::NameTaken {
                    name: "a".into(),
                    sandbox_id: None,
                },
                409,
                codes::NAME_TAKEN,
            ),
            (
                ApiError::NotRunning {
                    id: "s1".into(),
                    state: SandboxState::Stopped,
                },
                409,
                codes::SANDBOX_NOT_RUNNING,
            ),
            (
                ApiError::NotRunning {
                    id: "s1".into(),
                    state: SandboxState::Paused,
                },
                409,
                codes::SANDBOX_PAUSED,
            ),
            (
                ApiError::NotRunning {
                    id: "s1".into(),
                    state: SandboxState::Pausing,
                },
                409,
                codes::SANDBOX_PAUSED,
            ),
            (
                ApiError::IdempotencyKeyReused,
                422,
                codes::IDEMPOTENCY_KEY_REUSED,
            ),
            (
                ApiError::PayloadTooLarge { limit: 10 },
                413,
                codes::PAYLOAD_TOO_LARGE,
            ),
            (
                ApiError::Conflict {
                    code: codes::NOT_PAUSABLE,
                    message: "m".into(),
                    details: None,
                },
                409,
                codes::NOT_PAUSABLE,
            ),
            (
                ApiError::Unprocessable {
                    code: codes::IMAGE_NOT_READY,
                    message: "m".into(),
                    details: None,
                },
                422,
                codes::IMAGE_NOT_READY,
            ),
            (
                ApiError::PaymentRequired {
                    code: codes::SPENDING_LIMIT_REACHED,
                    message: "m".into(),
                    hint: "h",
                    details: json!({}),
                },
                402,
                codes::SPENDING_LIMIT_REACHED,
            ),
            (
                ApiError::Unsupported { feature: "x" },
                501,
                codes::UNSUPPORTED,
            ),
            (
                ApiError::NoCapacity {
                    message: "m".into(),
                    details: json!({}),
                },
                503,
                codes::NO_CAPACITY,
            ),
            (
                ApiError::Unavailable { product: "Jobs" },
                501,
                codes::UNAVAILABLE,
            ),
            (
                ApiError::NodeUnreachable {
                    node: "node_b".into(),
                    message: "m".into(),
                },
                503,
                codes::HOST_UNAVAILABLE,
            ),
            (
                ApiError::BadField {
                    code: codes::ENV_TAKEN,
                    field: "env",
                    message: "m".into(),
                },
                400,
                codes::ENV_TAKEN,
            ),
            (
                ApiError::Failed {
                    code: codes::PAUSE_FAILED,
                    message: "m".into(),
                },
                500,
                codes::PAUSE_FAILED,
            ),
            (
                ApiError::Internal {
                    what: "secret detail".into(),
                },
                500,
                codes::INTERNAL,
            ),
            (
                ApiError::Server(crate::error::ServerError::Corrupt {
                    what: "secret detail".into(),
                }),
                500,
                codes::INTERNAL,
            ),
        ];
        for (e, status, code) in cases {
            let shown = format!("{e:?}");
            let (s, c, m, _) = answer(e);
            assert_eq!((s, c.as_str()), (status, code), "{shown}");
            assert!(!m.is_empty(), "{shown}: a message");
        }
    }

    #[test]
    fn a_store_that_does_not_answer_is_503_store_unavailable_and_retryable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let Err(source) =
            crate::store::db::pg_connect(&format!("postgres://u@127.0.0.1:{port}/db"))
        else {
            panic!("connected to a closed port");
        };
        let e = ApiError::Server(crate::error::ServerError::Store {
            op: "find key",
            source,
        });
        assert_eq!(e.parts().retryable, Some(true));
        let (status, code, message, _) = answer(e);
        assert_eq!((status, code.as_str()), (503, codes::STORE_UNAVAILABLE));
        assert!(!message.contains("127.0.0.1"), "{message}");
        // Any other store failure stays a plain 500.
        let other = ApiError::Server(crate::error::ServerError::Store {
            op: "read",
            source: crate::store::db::DbError::NoRow,
        });
        assert_eq!(answer(other).0, 500);
    }

    #[test]
    fn server_failures_answer_a_fixed_message_without_their_details() {
        for e in [
            ApiError::Internal {
                what: "secret detail".into(),
            },
            ApiError::Server(crate::error::ServerError::Corrupt {
                what: "secret detail".into(),
            }),
            ApiError::Host(HostError::Io {
                id: "s".into(),
                op: "secret detail",
                source: std::io::Error::other("x"),
            }),
        ] {
            let (_, _, m, d) = answer(e);
            assert_eq!(m, "Internal server error.");
            assert_eq!(d, None);
        }
    }

    #[test]
    fn an_invalid_request_names_every_wrong_field() {
        let e = ApiError::Invalid {
            issues: vec![
                Issue {
                    field: "vcpu".into(),
                    message: "too many".into(),
                },
                Issue {
                    field: "env.1A".into(),
                    message: "bad name".into(),
                },
            ],
        };
        let (_, _, m, d) = answer(e);
        assert_eq!(m, "Invalid request: vcpu, env.1A.");
        let issues = d.and_then(|d| d.get("issues").cloned()).unwrap_or_default();
        assert_eq!(issues.as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn each_host_error_has_its_status_and_code() {
        let guest = |failure| {
            ApiError::Host(HostError::Guest {
                id: "s".into(),
                failure,
                message: "m".into(),
            })
        };
        let cases: Vec<(ApiError, u16, &str)> = vec![
            (
                guest(GuestFailure::FileNotFound),
                404,
                codes::FILE_NOT_FOUND,
            ),
            (
                guest(GuestFailure::IsADirectory),
                409,
                codes::IS_A_DIRECTORY,
            ),
            (
                guest(GuestFailure::NotADirectory),
                409,
                codes::NOT_A_DIRECTORY,
            ),
            (
                guest(GuestFailure::PermissionDenied),
                403,
                codes::PERMISSION_DENIED,
            ),
            (
                guest(GuestFailure::AlreadyExists),
                409,
                codes::ALREADY_EXISTS,
            ),
            (
                guest(GuestFailure::DirectoryNotEmpty),
                409,
                codes::DIRECTORY_NOT_EMPTY,
            ),
            (
                guest(GuestFailure::InvalidPath),
                400,
                codes::INVALID_REQUEST,
            ),
            (guest(GuestFailure::BadRequest), 400, codes::INVALID_REQUEST),
            (
                guest(GuestFailure::CommandNotFound),
                400,
                codes::COMMAND_NOT_FOUND,
            ),
            (guest(GuestFailure::Io), 500, codes::GUEST_ERROR),
            (
                guest(GuestFailure::ConnectionRefused),
                502,
                codes::CONNECTION_REFUSED,
            ),
            (guest(GuestFailure::TooLarge), 413, codes::FILE_TOO_LARGE),
            (guest(GuestFailure::Unsupported), 501, codes::UNSUPPORTED),
            (
                ApiError::Host(HostError::NoSuchMachine { id: "s".into() }),
                409,
                codes::SANDBOX_NOT_RUNNING,
            ),
            (
                ApiError::Host(HostError::NotPaused { id: "s".into() }),
                409,
                codes::SANDBOX_NOT_RUNNING,
            ),
            (
                ApiError::Host(HostError::LinkLost { id: "s".into() }),
                503,
                codes::HOST_UNAVAILABLE,
            ),
            (
                ApiError::Host(HostError::Timeout {
                    id: "s".into(),
                    what: "x",
                }),
                503,
                codes::HOST_UNAVAILABLE,
            ),
            (
                ApiError::Host(HostError::StartFailed {
                    id: "s".into(),
                    stage: BootStage::Kernel,
                    reason: "r".into(),
                    console_tail: "secret console".into(),
                }),
                500,
                codes::INTERNAL,
            ),
            (
                ApiError::Host(HostError::Capture {
                    id: "s".into(),
                    reason: "r".into(),
                }),
                500,
                codes::INTERNAL,
            ),
        ];
        for (e, status, code) in cases {
            let shown = format!("{e:?}");
            let (s, c, m, _) = answer(e);
            assert_eq!((s, c.as_str()), (status, code), "{shown}");
            assert!(!m.contains("secret"), "{shown}: {m}");
        }
    }

    #[test]
    fn a_guest_io_failure_keeps_its_message_to_the_log() {
        let e = ApiError::Host(HostError::Guest {
            id: "s".into(),
            failure: GuestFailure::Io,
            message: "disk of /secret failed".into(),
        });
        let (_, _, m, _) = answer(e);
        assert_eq!(m, "Internal server error.");
    }
}
