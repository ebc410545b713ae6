//! The protocol between the host and the guest agent, carried over one
//! virtio-serial port: length-prefixed frames, each on a numbered stream, so
//! many requests, output streams and file transfers share the port.
//!
//! This crate is a pure codec (bytes in, frames out) and depends on no other
//! crate of the workspace and on no I/O. Bytes from the guest are untrusted:
//! [`Decoder`] never panics and never allocates more than [`MAX_FRAME`].
//!
//! Frame layout (big endian): `u32 len | u8 kind | u8 channel | u32 stream | payload`,
//! where `len` counts everything after itself. `kind` is [`Kind::Control`]
//! (payload: one JSON [`Request`] or [`Reply`]) or [`Kind::Data`] (payload: raw
//! bytes on `channel` of `stream`). Stream 0 is the connection itself (hello,
//! ping). The host opens a stream per request with a fresh id below
//! [`GUEST_STREAM`]; the guest answers on that stream. The guest opens
//! streams of its own only for outbound TCP connections, with ids that have
//! [`GUEST_STREAM`] set ([`Reply::Outbound`]; tunnels are described in
//! [`flow`]).
//!
//! Versioning: the host sends [`Request::Hello`] first and the guest answers
//! with the version it speaks; new fields are optional (`#[serde(default)]`),
//! new message kinds are only sent once the peer announced a version that has
//! them. Unknown control messages decode to an error the caller may skip.

mod codec;
pub mod flow;
mod messages;

pub use codec::{encode, Decoder, Frame, Kind, ProtoError, HEADER_LEN, MAX_FRAME, MAX_PAYLOAD};
pub use messages::*;

/// The protocol version this build speaks. 1: the first; 2: watches
/// ([`Request::Watch`]); 3: traced files ([`ExecRequest::trace_files`]);
/// 4: shared volumes ([`Request::Share`]); 5: file reads with flow control
/// ([`Request::ReadFile`] `flow`, [`flow::READ_WINDOW`]).
pub const VERSION: u32 = 5;

/// The first version whose agents send a read file's bytes only within the
/// credits the host grants ([`Request::ReadFile`] `flow`).
pub const READ_FLOW_VERSION: u32 = 5;

/// The first version whose agents take [`Request::Share`].
pub const SHARE_VERSION: u32 = 4;

/// The largest 9P message of a share (the mount's `msize`): a guest that
/// sends a longer one is cut off.
pub const SHARE_MSIZE: usize = 256 * 1024;

/// The first version whose agents take [`Request::Watch`].
pub const WATCH_VERSION: u32 = 2;

/// The first version whose agents trace a command's files
/// ([`ExecRequest::trace_files`], [`Reply::Exited`] `files`).
pub const TRACE_VERSION: u32 = 3;

/// The bit set in the ids of streams the guest opens (outbound tunnels);
/// host-chosen ids never have it.
pub const GUEST_STREAM: u32 = 0x8000_0000;

/// The guest port of the agent's proxy listener (`127.0.0.1` and `[::1]`).
pub const PROXY_PORT: u16 = 10800;

/// Largest file one [`Request::ReadFile`] returns: the host holds a read
/// whole before it answers.
pub const MAX_READ_BYTES: u64 = 256 << 20;

/// The name of the virtio-serial port the agent opens (`/sys/class/virtio-ports/*/name`).
pub const PORT_NAME: &str = "runtime.agent";
