//! Resolving names for guests without tying up the host: an asynchronous
//! resolver (hickory, reading the system's resolv.conf) whose lookups end
//! when their timeout drops them, instead of `getaddrinfo` on tokio's shared
//! blocking pool, where a timed-out lookup keeps its thread for as long as
//! the name server takes. Each sandbox has a bound on its lookups in flight.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::config::ResolverOpts;
use hickory_resolver::TokioResolver;
use tokio::time::timeout;

use crate::limits::PerSandbox;

/// Most addresses taken from one answer.
const MAX_ADDRS: usize = 32;

/// Answers kept by the resolver's cache (positive and negative).
const CACHE_SIZE: u64 = 4096;

pub(crate) struct Dns {
    /// `None` when the system's configuration could not be read: every
    /// lookup then fails (and the reason was logged once).
    resolver: Option<TokioResolver>,
    lookups: PerSandbox,
    timeout: Duration,
}

impl Dns {
    /// The system's name servers (resolv.conf).
    pub(crate) fn system(timeout: Duration, per_sandbox: usize) -> Self {
        let resolver = TokioResolver::builder_tokio()
            .map_err(|e| e.to_string())
            .and_then(|mut b| {
                tune(b.options_mut(), timeout);
                b.build().map_err(|e| e.to_string())
            });
        let resolver = match resolver {
            Ok(r) => Some(r),
            Err(err) => {
                tracing::error!(error = %err, "no DNS resolver: guests cannot resolve names");
                None
            }
        };
        Self {
            resolver,
            lookups: PerSandbox::new(per_sandbox),
            timeout,
        }
    }

    /// One name server at `addr` (UDP only): for tests.
    #[cfg(test)]
    pub(crate) fn with_server(addr: SocketAddr, timeout: Duration, per_sandbox: usize) -> Self {
        use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
        use hickory_resolver::net::runtime::TokioRuntimeProvider;
        let mut udp = ConnectionConfig::udp();
        udp.port = addr.port();
        let server = NameServerConfig::new(addr.ip(), true, vec![udp]);
        let mut b = TokioResolver::builder_with_config(
            ResolverConfig::from_name_servers(vec![server]),
            TokioRuntimeProvider::default(),
        );
        tune(b.options_mut(), timeout);
        Self {
            resolver: b.build().ok(),
            lookups: PerSandbox::new(per_sandbox),
            timeout,
        }
    }

    /// The addresses of `name` (no trailing dot), at most [`MAX_ADDRS`],
    /// each with `port`. `None` when it does not resolve within the timeout,
    /// waiting for a free lookup slot of the sandbox included.
    pub(crate) async fn lookup(
        &self,
        sandbox_id: &str,
        name: &str,
        port: u16,
    ) -> Option<Vec<SocketAddr>> {
        let resolver = self.resolver.as_ref()?;
        let slots = self.lookups.get(sandbox_id);
        // A fully qualified name: the host's search domains are never
        // appended, so a guest's `db` does not become `db.<the host's domain>`.
        let fqdn = format!("{name}.");
        let found = timeout(self.timeout, async {
            let _slot = slots.acquire().await.ok()?;
            resolver.lookup_ip(fqdn.as_str()).await.ok()
        })
        .await
        .ok()??;
        let mut out: Vec<SocketAddr> = Vec::new();
        for ip in found.iter().take(MAX_ADDRS) {
            let ip: IpAddr = ip;
            if !out.iter().any(|sa| sa.ip() == ip) {
                out.push(SocketAddr::new(ip, port));
            }
        }
        (!out.is_empty()).then_some(out)
    }
}

/// Options for guests' lookups: within the proxy's timeout, a cache.
fn tune(opts: &mut ResolverOpts, total: Duration) {
    opts.timeout = (total / 2).max(Duration::from_millis(100));
    opts.attempts = 2;
    opts.cache_size = CACHE_SIZE;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::net::UdpSocket;

    /// A name server that takes every query and never answers.
    async fn black_hole() -> (UdpSocket, SocketAddr) {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = s.local_addr().unwrap();
        (s, addr)
    }

    #[test]
    fn lookups_that_never_end_hold_no_blocking_thread() {
        // Two blocking threads only: one lookup on the blocking pool would
        // hold one for as long as the name server does not answer.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (_server, addr) = black_hole().await;
            let dns = Arc::new(Dns::with_server(addr, Duration::from_secs(3), 16));
            let done = Arc::new(AtomicUsize::new(0));
            let mut tasks = Vec::new();
            for i in 0..600 {
                let (dns, done) = (dns.clone(), done.clone());
                tasks.push(tokio::spawn(async move {
                    let got = dns
                        .lookup(
                            &format!("sbx-{}", i % 40),
                            &format!("x{i}.example.com"),
                            443,
                        )
                        .await;
                    done.fetch_add(1, Ordering::SeqCst);
                    got
                }));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            // While all 600 wait on the silent server, blocking work runs.
            let ran =
                tokio::time::timeout(Duration::from_secs(2), tokio::task::spawn_blocking(|| 42))
                    .await;
            assert_eq!(done.load(Ordering::SeqCst), 0, "a lookup ended early");
            assert_eq!(ran.unwrap().unwrap(), 42, "the blocking pool was busy");
            // And every lookup ends, unresolved, at its timeout.
            for t in tasks {
                assert_eq!(t.await.unwrap(), None);
            }
        });
    }

    #[tokio::test]
    async fn a_sandbox_has_a_few_lookups_in_flight_and_others_are_not_held() {
        let (server, addr) = black_hole().await;
        let dns = Arc::new(Dns::with_server(addr, Duration::from_secs(2), 2));
        for i in 0..5 {
            let dns = dns.clone();
            tokio::spawn(async move {
                dns.lookup("sbx-a", &format!("busy-a-{i}.example.com"), 443)
                    .await
            });
        }
        let other = dns.clone();
        tokio::spawn(async move { other.lookup("sbx-b", "free-b.example.com", 443).await });
        // What reached the name server in the first half second.
        let mut names: Vec<String> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        let mut buf = [0u8; 512];
        while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, server.recv(&mut buf)).await {
            let packet = String::from_utf8_lossy(&buf[..n]).into_owned();
            for i in 0..5 {
                let label = format!("busy-a-{i}");
                if packet.contains(&label) && !names.contains(&label) {
                    names.push(label);
                }
            }
            if packet.contains("free-b") && !names.iter().any(|n| n == "free-b") {
                names.push("free-b".into());
            }
        }
        let from_a = names.iter().filter(|n| n.starts_with("busy-a")).count();
        assert_eq!(from_a, 2, "{names:?}");
        assert!(names.iter().any(|n| n == "free-b"), "{names:?}");
    }
}
