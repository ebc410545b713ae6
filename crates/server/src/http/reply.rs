//! NDJSON answers (`application/x-ndjson`): one JSON event per line. The
//! one builder for every streamed answer (exec, process output, the
//! interpreter) and for a process's output read at once.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use futures::{Stream, StreamExt};
use serde_json::Value;

/// Streams `events` as they come, one line per event and one body chunk
/// per batch; a silence of `heartbeat` sends an empty line, so proxies and
/// readers know the stream is alive. Never cached.
pub(crate) fn ndjson<S>(events: S, heartbeat: Duration) -> Response
where
    S: Stream<Item = Vec<Value>> + Send + 'static,
{
    let stream = futures::stream::unfold(Box::pin(events), move |mut events| async move {
        // Dropping `next()` on a heartbeat keeps the stream's own progress.
        match tokio::time::timeout(heartbeat, events.next()).await {
            Err(_) => Some((Ok::<_, Infallible>(Bytes::from_static(b"\n")), events)),
            Ok(None) => None,
            Ok(Some(batch)) => Some((Ok(lines(&batch)), events)),
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// `events` as one NDJSON body.
pub(crate) fn ndjson_now(events: &[Value]) -> Response {
    let mut resp = Response::new(Body::from(lines(events)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp
}

fn lines(events: &[Value]) -> Bytes {
    let mut out = Vec::new();
    for e in events {
        if serde_json::to_writer(&mut out, e).is_ok() {
            out.push(b'\n');
        }
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    async fn body(resp: Response) -> Vec<u8> {
        let mut out = Vec::new();
        let mut s = resp.into_body().into_data_stream();
        while let Some(chunk) = s.next().await {
            if let Ok(c) = chunk {
                out.extend_from_slice(&c);
            }
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_is_one_line_per_event_with_heartbeats_in_silences() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Vec<Value>>(4);
        let events =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) });
        let resp = ndjson(events, Duration::from_secs(1));
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/x-ndjson");
        assert_eq!(resp.headers()[header::CACHE_CONTROL], "no-store");
        tokio::spawn(async move {
            let _ = tx.send(vec![json!({"a": 1}), json!({"b": 2})]).await;
            tokio::time::sleep(Duration::from_millis(2500)).await;
            let _ = tx.send(vec![json!({"c": 3})]).await;
        });
        let got = String::from_utf8(body(resp).await).unwrap_or_default();
        assert_eq!(got, "{\"a\":1}\n{\"b\":2}\n\n\n{\"c\":3}\n");
    }

    #[tokio::test]
    async fn a_read_at_once_is_one_body() {
        let resp = ndjson_now(&[json!({"type": "stdout"}), json!({"type": "exit"})]);
        assert!(resp.headers().get(header::CACHE_CONTROL).is_none());
        let got = String::from_utf8(body(resp).await).unwrap_or_default();
        assert_eq!(got, "{\"type\":\"stdout\"}\n{\"type\":\"exit\"}\n");
    }
}
