//! The egress proxy of this host's guests: each connection a guest process
//! opens through the agent's proxy (`127.0.0.1:10800` in the guest) arrives
//! here over its tunnel and is judged by `runtime-egress` against the
//! sandbox's [`GuestNet`], which the control plane sets
//! ([`Host::set_network`](crate::Host::set_network)) before the machine
//! starts and again on each change. The data plane stays on the host that
//! runs the guest: no byte of it crosses the `Host` seam.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use runtime_egress::{Egress, EgressConfig, Policy, SandboxCa, SandboxNet, Secret};
use tokio::sync::watch;

use crate::types::{DuplexStream, GuestNet, Outbound};

/// What the proxy applies to one sandbox now: open connections follow
/// the watch channels, and end when they are dropped.
struct Live {
    policy: watch::Sender<Arc<Policy>>,
    secrets: watch::Sender<Arc<Vec<Secret>>>,
    /// Signs the connections opened from now on.
    ca: Arc<SandboxCa>,
}

/// Every sandbox's network on this host, and the proxy that applies it.
pub(crate) struct Networks {
    egress: Egress,
    live: Mutex<HashMap<String, Live>>,
}

impl Networks {
    pub(crate) fn new(cfg: EgressConfig) -> Networks {
        Networks {
            egress: Egress::new(cfg),
            live: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Live>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets or replaces `id`'s network. Open connections follow the new
    /// rules and secrets at once; the CA signs the connections opened from
    /// now on.
    pub(crate) fn set(&self, id: &str, net: GuestNet) {
        let GuestNet {
            policy,
            secrets,
            ca,
        } = net;
        let (policy, secrets) = (Arc::new(policy), Arc::new(secrets));
        let mut live = self.lock();
        match live.get_mut(id) {
            Some(l) => {
                l.policy.send_replace(policy);
                l.secrets.send_replace(secrets);
                l.ca = ca;
            }
            None => {
                live.insert(
                    id.to_owned(),
                    Live {
                        policy: watch::channel(policy).0,
                        secrets: watch::channel(secrets).0,
                        ca,
                    },
                );
            }
        }
    }

    /// Forgets `id`'s network: its open connections end, new ones close.
    pub(crate) fn forget(&self, id: &str) {
        if let Some(l) = self.lock().remove(id) {
            // Receivers see the channels close and end their connections;
            // the explicit off covers one that reads the value first.
            l.policy.send_replace(Arc::new(Policy::off()));
        }
    }

    /// Serves `runtime.internal` with `api` from now on (`None`: no more).
    pub(crate) fn serve_api(&self, api: Option<Arc<dyn runtime_egress::InternalApi>>) {
        self.egress.api().set(api);
    }

    /// What the proxy carried since it started.
    pub(crate) fn traffic(&self) -> runtime_egress::Traffic {
        self.egress.traffic()
    }

    /// Each sandbox's outbound bytes since the last call.
    pub(crate) fn take_outbound(&self) -> Vec<(String, u64)> {
        self.egress.take_outbound()
    }

    fn view(&self, id: &str) -> Option<SandboxNet> {
        self.lock().get(id).map(|l| SandboxNet {
            sandbox_id: id.to_owned(),
            policy: l.policy.subscribe(),
            secrets: l.secrets.subscribe(),
            ca: Arc::clone(&l.ca),
        })
    }
}

impl Networks {
    /// One end of a new proxy connection from `id`, served like its guest's.
    pub(crate) fn connection(&self, id: &str) -> Option<crate::types::EgressConnection> {
        let net = self.view(id)?;
        let (ours, theirs) = tokio::io::duplex(256 * 1024);
        let egress = self.egress.clone();
        tokio::spawn(async move { egress.serve(theirs, net).await });
        Some(crate::types::EgressConnection {
            stream: ours,
            tls: self.egress.client_tls(),
        })
    }
}

impl Outbound for Networks {
    fn accept(&self, sandbox_id: &str, conn: DuplexStream) {
        let Some(net) = self.view(sandbox_id) else {
            tracing::warn!(
                sandbox_id,
                "no network set for the sandbox: outbound connection closed"
            );
            return;
        };
        let egress = self.egress.clone();
        tokio::spawn(async move { egress.serve(conn, net).await });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use runtime_egress::Rules;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// The internet, less the hosts in `deny`.
    fn rules(deny: &[&str]) -> Policy {
        Rules {
            internet: true,
            allow: None,
            deny: Some(deny.iter().map(|d| d.to_string()).collect()),
            connect: None,
        }
        .validate()
        .unwrap()
    }

    async fn echo_server() -> std::net::SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    while let Ok(n) = c.read(&mut b).await {
                        if n == 0 || c.write_all(&b[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn head(c: &mut DuplexStream) -> String {
        let mut buf = Vec::new();
        let mut b = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            match tokio::time::timeout(Duration::from_secs(10), c.read(&mut b)).await {
                Ok(Ok(1)) => buf.push(b[0]),
                _ => break,
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// A guest connection: the proxy's end goes to `nets`, ours is returned.
    fn open(nets: &Networks, id: &str) -> DuplexStream {
        let (ours, theirs) = tokio::io::duplex(64 << 10);
        nets.accept(id, theirs);
        ours
    }

    async fn connect(c: &mut DuplexStream, target: &str) -> String {
        c.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        head(c).await
    }

    fn net(policy: Policy) -> GuestNet {
        GuestNet {
            policy,
            secrets: Vec::new(),
            ca: Arc::new(SandboxCa::generate().unwrap()),
        }
    }

    /// Reads until the stream ends; `true` when it did within 10 s.
    async fn ends(c: &mut DuplexStream) -> bool {
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut rest))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn connections_follow_the_rules_set_and_a_change_cuts_open_ones() {
        let addr = echo_server().await;
        let nets = Networks::new(EgressConfig {
            test_hosts: vec![("example.com".into(), addr)],
            ..EgressConfig::default()
        });
        let id = "sbx-a";

        // No network set yet: the connection is closed at once.
        let mut early = open(&nets, id);
        assert!(ends(&mut early).await);

        nets.set(id, net(rules(&[])));
        let mut refused = open(&nets, id);
        let h = connect(&mut refused, "10.1.2.3:443").await;
        assert!(h.starts_with("HTTP/1.1 403"), "{h}");

        let mut c = open(&nets, id);
        let h = connect(&mut c, "example.com:443").await;
        assert!(h.starts_with("HTTP/1.1 200"), "{h}");
        c.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");

        // A new policy reaches the open connection: it ends.
        nets.set(id, net(rules(&["example.com"])));
        assert!(ends(&mut c).await, "the open connection was not cut");
        let mut again = open(&nets, id);
        let h = connect(&mut again, "example.com:443").await;
        assert!(h.starts_with("HTTP/1.1 403"), "{h}");
    }

    #[tokio::test]
    async fn a_forgotten_network_ends_its_connections_and_no_other() {
        let addr = echo_server().await;
        let nets = Networks::new(EgressConfig {
            test_hosts: vec![("example.com".into(), addr)],
            ..EgressConfig::default()
        });
        let allow = || net(rules(&[]));
        nets.set("sbx-a", allow());
        nets.set("sbx-b", allow());
        let mut a = open(&nets, "sbx-a");
        let mut b = open(&nets, "sbx-b");
        for c in [&mut a, &mut b] {
            let h = connect(c, "example.com:443").await;
            assert!(h.starts_with("HTTP/1.1 200"), "{h}");
        }
        nets.forget("sbx-a");
        assert!(
            ends(&mut a).await,
            "the forgotten sandbox's connection lives on"
        );
        b.write_all(b"pong").await.unwrap();
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        let mut late = open(&nets, "sbx-a");
        assert!(ends(&mut late).await);
    }
}
