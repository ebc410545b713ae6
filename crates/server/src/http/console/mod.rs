//! The web console's files, served at `/console` (docs/console.md): one
//! page of plain HTML, CSS and JavaScript, built into the binary, that
//! calls the same API with the key a person signs in with. The answers
//! carry a strict Content-Security-Policy (scripts and styles from these
//! files only, no inline code, no frames) and are revalidated by `ETag`,
//! so an upgraded server is never shown with an old page.

use std::sync::OnceLock;

use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::domain::access::sha256_hex;
use crate::error::{ApiError, ApiResult};

/// What every console answer says about how it may be used.
pub(crate) const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
form-action 'self'; frame-ancestors 'none'";

struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const ASSETS: &[Asset] = &[
    Asset {
        path: "/console/",
        content_type: "text/html; charset=utf-8",
        body: include_str!("index.html"),
    },
    Asset {
        path: "/console/app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("app.js"),
    },
    Asset {
        path: "/console/style.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("style.css"),
    },
];

/// Whether the request is the console's (`/console` and under it).
pub(crate) fn is_console_path(path: &str) -> bool {
    path == "/console" || path.starts_with("/console/")
}

fn etag(i: usize) -> &'static str {
    static TAGS: OnceLock<Vec<String>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|a| format!("\"{}\"", &sha256_hex(a.body.as_bytes())[..32]))
            .collect()
    });
    tags.get(i).map_or("\"\"", String::as_str)
}

/// Answers `GET` (and `HEAD`) of a console file; anything else under
/// `/console` is 404 `route_not_found` (405 for other methods).
pub(crate) fn handle(method: &Method, path: &str, headers: &HeaderMap) -> ApiResult<Response> {
    let path = if path == "/console" || path == "/console/index.html" {
        "/console/"
    } else {
        path
    };
    let Some(i) = ASSETS.iter().position(|a| a.path == path) else {
        return Err(ApiError::RouteNotFound {
            method: method.to_string(),
            path: path.to_string(),
        });
    };
    if method != Method::GET && method != Method::HEAD {
        return Err(ApiError::MethodNotAllowed {
            method: method.to_string(),
            path: path.to_string(),
        });
    }
    let asset = &ASSETS[i];
    let tag = etag(i);
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == tag));
    let mut resp = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else if method == Method::HEAD {
        StatusCode::OK.into_response()
    } else {
        (StatusCode::OK, asset.body).into_response()
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    if let Ok(v) = HeaderValue::from_str(tag) {
        h.insert(header::ETAG, v);
    }
    // Kept, but asked about each time: small files, and never stale.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    Ok(resp)
}
