//! `GET /metrics`: the operator's metrics in the Prometheus text format, for
//! the account's keys only (the admin key, an account-wide key, or a
//! read-only key made for the scraper): they count every tenant's work.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::Response;

use crate::error::{ApiError, ApiResult};
use crate::http::authenticate;
use crate::service::telemetry;
use crate::AppState;

pub(crate) const PATH: &str = "/metrics";

pub(crate) async fn handle(st: &AppState, req: Request) -> ApiResult<Response> {
    if req.method() != Method::GET {
        return Err(ApiError::MethodNotAllowed {
            method: req.method().to_string(),
            path: PATH.into(),
        });
    }
    let caller = authenticate(st, req.headers())?;
    if caller.session.is_some() || !(caller.key.account_wide || caller.key.read_only) {
        return Err(ApiError::AccountKeyNeeded {
            action: "read the server's metrics",
        });
    }
    let text = telemetry::scrape(st).await?;
    let mut resp = Response::new(Body::from(text));
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}
