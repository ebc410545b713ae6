//! The reverse proxy of previews: a request whose `Host` is
//! `<port>-<sandbox>.<preview domain>` is carried to the guest's port over
//! a new connection, WebSocket (and any other) upgrades passed through.
//!
//! A private preview's token comes as the header `x-runtime-preview-token`,
//! the query parameter `runtime_preview_token` (which also sets a cookie for
//! the rest of the page's requests) or that cookie; it is taken out of what
//! the guest's server sees. The checks are the previews service's.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use runtime_api::codes;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::domain::preview::{
    cookies_without_token, host_only_cookie, parse_host, token_in_cookies, token_in_query,
    without_token, COOKIE, TOKEN_HEADER, TOKEN_PARAM,
};
use crate::service::previews::{self, Admission};
use crate::AppState;

/// The preview a request's `Host` names: `<port>-<sandbox>.<domain>[:port]`.
pub(crate) fn target(st: &AppState, headers: &HeaderMap) -> Option<(u16, String)> {
    let host = headers.get(header::HOST)?.to_str().ok()?;
    parse_host(host, &st.config().preview_domain)
}

fn preview_error(status: StatusCode, code: &str, message: String) -> Response {
    let body = json!({"error": {"code": code, "status": status.as_u16(), "message": message}});
    (status, axum::Json(body)).into_response()
}

fn cookie_values(h: &HeaderMap) -> impl Iterator<Item = &str> {
    h.get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
}

/// The token a request carries, and whether it came in the query.
fn presented(req: &Request) -> Option<(String, bool)> {
    if let Some(v) = req
        .headers()
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        return Some((v.trim().to_string(), false));
    }
    if let Some(t) = req.uri().query().and_then(token_in_query) {
        return Some((t.to_string(), true));
    }
    token_in_cookies(cookie_values(req.headers())).map(|v| (v.to_string(), false))
}

/// Removes the token from what the guest's server sees.
fn scrub(req: &mut Request) {
    req.headers_mut().remove(TOKEN_HEADER);
    let cookies = cookies_without_token(cookie_values(req.headers()));
    req.headers_mut().remove(header::COOKIE);
    if let Some(c) = cookies {
        if let Ok(v) = HeaderValue::from_str(&c) {
            req.headers_mut().insert(header::COOKIE, v);
        }
    }
    let pq = without_token(req.uri().path(), req.uri().query());
    if let Ok(uri) = pq.parse() {
        *req.uri_mut() = uri;
    }
}

/// Serves one request to a preview.
pub(crate) async fn serve(st: AppState, mut req: Request, port: u16, sandbox: String) -> Response {
    let token = presented(&req);
    let (private, embed_origins) =
        match previews::admit(&st, &sandbox, port, token.as_ref().map(|(t, _)| t.as_str())) {
            Ok(Admission::Admitted {
                private,
                embed_origins,
            }) => (private, embed_origins),
            Ok(Admission::NotShared) => {
                return preview_error(
                    StatusCode::NOT_FOUND,
                    codes::PREVIEW_NOT_FOUND,
                    format!("Port {port} of sandbox {sandbox} is not shared."),
                )
            }
            Ok(Admission::TokenRequired) => {
                return preview_error(
                    StatusCode::UNAUTHORIZED,
                    codes::PREVIEW_TOKEN_REQUIRED,
                    format!("This preview is private: send its token as the {TOKEN_HEADER} header or the {TOKEN_PARAM} query parameter."),
                )
            }
            Ok(Admission::TokenInvalid) => {
                return preview_error(
                    StatusCode::FORBIDDEN,
                    codes::PREVIEW_TOKEN_INVALID,
                    "The preview token is wrong, expired or was rotated.".into(),
                )
            }
            Err(e) => return e.into_response_with("preview"),
        };
    // The token of a private preview that came in the query is set as the
    // cookie for the page's other requests.
    let set_cookie = token
        .filter(|(_, from_query)| private && *from_query)
        .map(|(t, _)| t);
    scrub(&mut req);
    if let Err(e) = previews::wake(&st, &sandbox).await {
        return e.into_response_with("preview");
    }
    let mut resp = match forward(&st, &sandbox, port, req).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    // The guest's cookies stay on its own preview's host: a `Domain`
    // would reach its sibling previews and the API's host.
    let guest_cookies: Vec<HeaderValue> = resp
        .headers()
        .get_all(header::SET_COOKIE)
        .iter()
        .filter_map(|v| HeaderValue::from_str(&host_only_cookie(v.to_str().ok()?)).ok())
        .collect();
    // `remove` takes every value of the name.
    resp.headers_mut().remove(header::SET_COOKIE);
    for v in guest_cookies {
        resp.headers_mut().append(header::SET_COOKIE, v);
    }
    if let Some(t) = set_cookie {
        // Under TLS the token never travels in the clear.
        let secure = if st.config().tls.is_some() {
            "; Secure"
        } else {
            ""
        };
        if let Ok(v) = HeaderValue::from_str(&format!(
            "{COOKIE}={t}; Path=/; HttpOnly; SameSite=Lax{secure}"
        )) {
            resp.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    if !embed_origins.is_empty() {
        if let Ok(v) =
            HeaderValue::from_str(&format!("frame-ancestors {}", embed_origins.join(" ")))
        {
            resp.headers_mut()
                .insert(header::CONTENT_SECURITY_POLICY, v);
        }
    }
    resp
}

/// Carries the request to the guest's port over a new connection, with
/// WebSocket (and any other) upgrades passed through.
async fn forward(
    st: &AppState,
    sandbox: &str,
    port: u16,
    mut req: Request,
) -> Result<Response, Response> {
    // Held until the guest's connection (or its upgrade) ends.
    let slot = std::sync::Arc::new(previews::slot(st, sandbox, port).ok_or_else(|| {
        let mut r = preview_error(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::PREVIEW_UNREACHABLE,
            format!(
                "This preview is serving {} requests at once, the most it may; retry shortly.",
                st.config().preview_max_concurrent
            ),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    })?);
    let (io, cut): (_, CancellationToken) =
        previews::connect(st, sandbox, port).await.map_err(|_| {
            preview_error(
                StatusCode::BAD_GATEWAY,
                codes::PREVIEW_UNREACHABLE,
                format!("Nothing listens on port {port} in the sandbox (a server must listen on 0.0.0.0 or localhost)."),
            )
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(io))
        .await
        .map_err(|e| {
            preview_error(
                StatusCode::BAD_GATEWAY,
                codes::PREVIEW_UNREACHABLE,
                format!("The sandbox's server did not answer: {e}"),
            )
        })?;
    // This request's own: a timeout ends it alone, a rotation all of them.
    let conn_cut = cut.child_token();
    let conn_slot = slot.clone();
    let conn_cut_on_timeout = conn_cut.clone();
    tokio::spawn(async move {
        let _slot = conn_slot;
        tokio::select! {
            _ = conn.with_upgrades() => {}
            _ = conn_cut.cancelled() => {}
        }
    });
    let upgrade = req
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let head_timeout = st.config().preview_head_timeout;
    let mut resp = match tokio::time::timeout(head_timeout, sender.send_request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return Err(preview_error(
                StatusCode::BAD_GATEWAY,
                codes::PREVIEW_UNREACHABLE,
                format!("The sandbox's server closed the connection: {e}"),
            ))
        }
        Err(_) => {
            conn_cut_on_timeout.cancel();
            return Err(preview_error(
                StatusCode::GATEWAY_TIMEOUT,
                codes::PREVIEW_UNREACHABLE,
                format!(
                    "The sandbox's server did not answer within {} s.",
                    head_timeout.as_secs()
                ),
            ));
        }
    };
    if let Some(client_side) = upgrade {
        super::forward::splice_upgrade(client_side, &mut resp, Some(cut), slot);
    }
    // The answer is ours to the client: our HTTP version, whatever the guest's.
    *resp.version_mut() = axum::http::Version::HTTP_11;
    Ok(resp.map(Body::new))
}
