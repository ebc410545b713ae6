//! Following a build's log as it is written (`GET /v1/images/{id}/logs?
//! follow=true`): each new line, then the image once the build has ended.
//! A follow lasts at most [`FOLLOW_FOR`]; it then ends with `continue`
//! and the client asks again from where it was.

use std::time::Duration;

use futures::Stream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{get, not_found, view, ImageView};
use crate::domain::access::KeyInfo;
use crate::domain::image::LogLine;
use crate::error::{ApiError, ApiResult};
use crate::AppState;

/// The longest one follow lasts.
pub(crate) const FOLLOW_FOR: Duration = Duration::from_secs(300);
/// The most lines one read of the store takes.
const BATCH: usize = 500;
/// The shortest time between two reads of one follower (changes to other
/// images wake every follower; this keeps that cheap).
const SPACING: Duration = Duration::from_millis(200);

/// One event of a follow.
pub(crate) enum FollowEvent {
    Line(LogLine),
    /// The build ended: the image as it is now. The last event.
    Done(Box<ImageView>),
    /// The follow ended before the build did: ask again after this seq.
    Continue(u64),
    /// The image went away or the store failed. The last event.
    Error(ApiError),
}

struct Follower {
    st: AppState,
    id: String,
    after: u64,
    changes: watch::Receiver<u64>,
    until: Instant,
    ended: bool,
}

impl Follower {
    /// The next batch of events, waiting for one while the build goes on.
    async fn next(&mut self) -> Vec<FollowEvent> {
        loop {
            // Marked seen before reading, so a change after the read wakes us.
            self.changes.borrow_and_update();
            match self.lines() {
                Err(e) => return self.end(FollowEvent::Error(e)),
                Ok(lines) if !lines.is_empty() => return lines,
                Ok(_) => {}
            }
            let d = match self.st.store().get_image(&self.id) {
                Err(e) => return self.end(FollowEvent::Error(e.into())),
                Ok(None) => return self.end(FollowEvent::Error(not_found(&self.id))),
                Ok(Some(d)) => d,
            };
            if !d.state.in_progress() {
                // Lines written before the state changed come first.
                match self.lines() {
                    Err(e) => return self.end(FollowEvent::Error(e)),
                    Ok(lines) if !lines.is_empty() => return lines,
                    Ok(_) => {}
                }
                return match view(&self.st, d) {
                    Ok(v) => self.end(FollowEvent::Done(Box::new(v))),
                    Err(e) => self.end(FollowEvent::Error(e)),
                };
            }
            if Instant::now() >= self.until {
                let after = self.after;
                return self.end(FollowEvent::Continue(after));
            }
            tokio::select! {
                r = self.changes.changed() => {
                    if r.is_err() {
                        tokio::time::sleep(SPACING).await;
                    }
                }
                _ = tokio::time::sleep_until(self.until) => {}
            }
            tokio::time::sleep(SPACING).await;
        }
    }

    fn lines(&mut self) -> ApiResult<Vec<FollowEvent>> {
        let lines = self
            .st
            .store()
            .image_log_after(&self.id, self.after, BATCH)?;
        if let Some(last) = lines.last() {
            self.after = last.seq;
        }
        Ok(lines.into_iter().map(FollowEvent::Line).collect())
    }

    fn end(&mut self, e: FollowEvent) -> Vec<FollowEvent> {
        self.ended = true;
        vec![e]
    }
}

/// The events of image `id`'s log after seq `after`, as `key` sees it (a
/// 404 answers at once when it does not).
pub(crate) fn follow(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    after: u64,
) -> ApiResult<impl Stream<Item = Vec<FollowEvent>> + Send + 'static> {
    get(st, key, id)?;
    let f = Follower {
        st: st.clone(),
        id: id.to_string(),
        after,
        changes: st.inner.image_changes.subscribe(),
        until: Instant::now() + FOLLOW_FOR,
        ended: false,
    };
    Ok(futures::stream::unfold(f, |mut f| async move {
        if f.ended {
            return None;
        }
        let batch = f.next().await;
        Some((batch, f))
    }))
}
