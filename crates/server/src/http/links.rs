//! `GET|PUT /v1/links/{token}`: file links used without a key. A download
//! answers the bytes (one `Range` honoured) or a folder as `.tar.gz`; an
//! upload writes the body to the link's path (at most its `maxBytes`).

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::Response;
use serde_json::json;

use crate::domain::access::sha256_hex;
use crate::domain::files::CHUNK_BYTES;
use crate::domain::link::byte_range;
use crate::error::{ApiError, ApiResult};
use crate::http::read_body;
use crate::service::{archives, files, links};
use crate::AppState;

/// The token of a link path, if it is one.
pub(crate) fn token_of(path: &str) -> Option<&str> {
    path.strip_prefix("/v1/links/")
        .filter(|t| !t.is_empty() && !t.contains('/'))
}

pub(crate) async fn handle(st: &AppState, req: Request, token: &str) -> ApiResult<Response> {
    let method = req.method().clone();
    if method != Method::GET && method != Method::PUT {
        return Err(ApiError::MethodNotAllowed {
            method: method.to_string(),
            path: "/v1/links/{token}".into(),
        });
    }
    let (l, owner) = links::resolve(st, token).await?;
    if l.method != method.as_str() {
        return Err(ApiError::MethodNotAllowed {
            method: method.to_string(),
            path: format!("this link (made for {})", l.method),
        });
    }
    if method == Method::PUT {
        let limit = l.max_bytes.map_or(CHUNK_BYTES, |m| m as usize);
        let data = read_body(req.into_body(), limit).await?.to_vec();
        let w = files::Write {
            path: l.path.clone(),
            mode: None,
            user: None,
            data,
        };
        let done = files::write(st, &owner, &l.sandbox_id, w).await?;
        let body = json!({ "path": done.path, "size": done.size, "sha256": done.sha256 });
        let mut resp = Response::new(Body::from(body.to_string()));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return Ok(resp);
    }
    let name = l.download_name();
    let disposition = HeaderValue::from_str(&format!("attachment; filename=\"{name}\""))
        .unwrap_or_else(|_| HeaderValue::from_static("attachment"));
    if l.archive {
        let pack = archives::Pack {
            path: l.path.clone(),
            gzip: true,
            user: None,
            exclude: Vec::new(),
        };
        let stream = archives::pack(st, &owner, &l.sandbox_id, pack).await?;
        let stream = futures::StreamExt::map(stream, |r| r.map(Bytes::from));
        let mut resp = Response::new(Body::from_stream(stream));
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/gzip"),
        );
        h.insert(header::CONTENT_DISPOSITION, disposition);
        return Ok(resp);
    }
    let range = req
        .headers()
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let data = files::read(st, &owner, &l.sandbox_id, &l.path, None).await?;
    let len = data.len() as u64;
    let span =
        byte_range(range.as_deref(), len).map_err(|()| ApiError::RangeNotSatisfiable { len })?;
    let sha = sha256_hex(&data);
    let (status, body, content_range) = match span {
        Some((a, b)) => (
            StatusCode::PARTIAL_CONTENT,
            data[a as usize..b as usize].to_vec(),
            Some(format!("bytes {a}-{}/{len}", b - 1)),
        ),
        None => (StatusCode::OK, data, None),
    };
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_DISPOSITION, disposition);
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Some(cr) = content_range.and_then(|c| HeaderValue::from_str(&c).ok()) {
        h.insert(header::CONTENT_RANGE, cr);
    }
    if let Ok(v) = HeaderValue::from_str(&sha) {
        h.insert("x-content-sha256", v);
    }
    Ok(resp)
}
