//! A sandbox's network rules: the wire shape, its validation into a
//! [`Policy`], and the decisions the proxy takes with it.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

/// Most entries in one list; more is a mistake, and checks stay cheap.
pub const MAX_ENTRIES: usize = 256;
/// Ports open to every allowed host without a `connect` entry.
pub const WEB_PORTS: [u16; 2] = [80, 443];

/// Ports no sandbox reaches even when `connect` names them: telnet, mail
/// submission and relay, Windows RPC, NetBIOS and SMB, IRC.
pub const FORBIDDEN_PORTS: [u16; 20] = [
    23, 25, 135, 137, 138, 139, 445, 465, 587, 6660, 6661, 6662, 6663, 6664, 6665, 6666, 6667,
    6668, 6669, 6697,
];

/// Whether no rule can open `port`.
pub fn is_forbidden_port(port: u16) -> bool {
    FORBIDDEN_PORTS.contains(&port)
}

/// The `network` of a sandbox as the API carries it (camelCase JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rules {
    pub internet: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect: Option<Vec<String>>,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            internet: true,
            allow: None,
            deny: None,
            connect: None,
        }
    }
}

/// One wrong field of a [`Rules`]: its path (`allow[2]`) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Issue {
    pub field: String,
    pub message: String,
}

impl fmt::Display for Issue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// A host pattern of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    /// An exact name, lowercase, without a trailing dot.
    Name(String),
    /// `*.suffix`: every name below `suffix`, at any depth, not `suffix` itself.
    Below(String),
    /// An address or a CIDR range (an address is a range of one).
    Net(Net),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Net {
    addr: IpAddr,
    prefix: u8,
}

impl Net {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix_eq(&net.octets(), &ip.octets(), self.prefix)
            }
            _ => false,
        }
    }
}

fn prefix_eq(a: &[u8], b: &[u8], prefix: u8) -> bool {
    let full = usize::from(prefix / 8);
    let rest = prefix % 8;
    if a.get(..full) != b.get(..full) {
        return false;
    }
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    match (a.get(full), b.get(full)) {
        (Some(x), Some(y)) => x & mask == y & mask,
        _ => false,
    }
}

/// An IPv4-mapped IPv6 address is the IPv4 address it carries.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

impl Pattern {
    fn matches_name(&self, name: &str) -> bool {
        match self {
            Pattern::Name(n) => n == name,
            Pattern::Below(suffix) => name
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            Pattern::Net(_) => false,
        }
    }

    fn matches_addr(&self, ip: IpAddr) -> bool {
        match self {
            Pattern::Net(net) => net.contains(ip),
            _ => false,
        }
    }

    fn is_net(&self) -> bool {
        matches!(self, Pattern::Net(_))
    }
}

/// Whether `name` (lowercase, no trailing dot) matches a host pattern given as
/// a string: an exact name or `*.domain`. Used for secrets' hosts and test
/// hosts, whose patterns are names only.
pub(crate) fn name_matches(pattern: &str, name: &str) -> bool {
    let pattern = pattern.trim_end_matches('.').to_ascii_lowercase();
    match pattern.strip_prefix("*.") {
        Some(suffix) => Pattern::Below(suffix.to_owned()).matches_name(name),
        None => pattern == name,
    }
}

/// Validated rules, ready for decisions. Made by [`Rules::validate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    rules: Rules,
    allow: Vec<Pattern>,
    deny: Vec<Pattern>,
    connect: Vec<(Pattern, u16)>,
}

/// Why a connection is refused. `Display` is the short text the guest sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `internet: false`.
    InternetOff,
    /// `allow` is not empty and the host is not in it.
    NotAllowed { host: String },
    /// The host or one of its addresses is in `deny`.
    Denied { host: String },
    /// A port other than 80 and 443 that no `connect` entry opens.
    Port { host: String, port: u16 },
    /// An address no sandbox ever reaches (loopback, private, link-local…).
    Internal { host: String, addr: IpAddr },
}

impl Refusal {
    /// The `X-Runtime-Egress` value for this refusal.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::InternetOff => "internet-off",
            Refusal::NotAllowed { .. } => "rule-not-allowed",
            Refusal::Denied { .. } => "rule-denied",
            Refusal::Port { .. } => "port-not-allowed",
            Refusal::Internal { .. } => "address-not-allowed",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::InternetOff => write!(f, "internet access is off for this sandbox"),
            Refusal::NotAllowed { host } => {
                write!(f, "{host} is not in this sandbox's allow list")
            }
            Refusal::Denied { host } => write!(f, "{host} is denied by this sandbox's rules"),
            Refusal::Port { host, port } if is_forbidden_port(*port) => write!(
                f,
                "port {port} of {host} is never open to sandboxes (telnet, mail, RPC, SMB or IRC)"
            ),
            Refusal::Port { host, port } => write!(
                f,
                "port {port} of {host} is not open to this sandbox (only 80 and 443, \
                 and the host:port pairs in connect)"
            ),
            Refusal::Internal { host, addr } if host == &addr.to_string() => write!(
                f,
                "{addr} is a private or internal address, which sandboxes never reach"
            ),
            Refusal::Internal { host, addr } => write!(
                f,
                "{host} is at {addr}, a private or internal address, which sandboxes never reach"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// How much is known of the target's addresses.
#[derive(Clone, Copy)]
pub(crate) enum Addrs<'a> {
    /// Not resolved yet: refuse only what no address could make allowed.
    Unresolved,
    /// Every address the connection may use.
    Known(&'a [IpAddr]),
}

/// Addresses the host treats specially beyond the fixed ranges.
#[derive(Debug, Default, Clone)]
pub(crate) struct Special {
    /// The host's own interface addresses: always refused.
    pub own: Vec<IpAddr>,
    /// Test-only stand-ins: exempt from the internal ranges.
    pub exempt: Vec<IpAddr>,
}

impl Policy {
    /// Everything refused (`internet: false`).
    pub fn off() -> Self {
        Self::from_parts(Rules {
            internet: false,
            ..Rules::default()
        })
    }

    /// Every public host on ports 80 and 443.
    pub fn open() -> Self {
        Self::from_parts(Rules::default())
    }

    fn from_parts(rules: Rules) -> Self {
        Self {
            rules,
            allow: Vec::new(),
            deny: Vec::new(),
            connect: Vec::new(),
        }
    }

    /// The rules this policy was made from, normalised (lowercase names).
    pub fn rules(&self) -> &Rules {
        &self.rules
    }

    pub fn internet(&self) -> bool {
        self.rules.internet
    }

    /// The ports this policy opens to some host: 80, 443 and every `connect`
    /// port that is not forbidden, sorted; empty when the internet is off.
    pub fn ports(&self) -> Vec<u16> {
        if !self.rules.internet {
            return Vec::new();
        }
        let mut ports: BTreeSet<u16> = WEB_PORTS.into_iter().collect();
        ports.extend(
            self.connect
                .iter()
                .map(|(_, p)| *p)
                .filter(|p| !is_forbidden_port(*p)),
        );
        ports.into_iter().collect()
    }

    /// The `connect` ports that stay closed because no sandbox reaches them
    /// ([`is_forbidden_port`]), sorted.
    pub fn forbidden_ports(&self) -> Vec<u16> {
        let ports: BTreeSet<u16> = self
            .connect
            .iter()
            .map(|(_, p)| *p)
            .filter(|p| is_forbidden_port(*p))
            .collect();
        ports.into_iter().collect()
    }

    /// Whether a connection to `host` (a name or an address) on `port` is
    /// allowed, without resolving the name: a name that only an `allow`
    /// address or CIDR could admit is refused here. Internal addresses are
    /// refused; the proxy also refuses a name whose addresses are internal.
    pub fn allows(&self, host: &str, port: u16) -> Result<(), Refusal> {
        let target = Host::parse(host);
        match &target {
            Host::Ip(ip) => self.check(&target, port, Addrs::Known(&[*ip]), &Special::default()),
            Host::Name(_) => self.check(&target, port, Addrs::Known(&[]), &Special::default()),
        }
    }

    /// The decision for a connection to `host:port` using `addrs`.
    pub(crate) fn check(
        &self,
        host: &Host,
        port: u16,
        addrs: Addrs<'_>,
        special: &Special,
    ) -> Result<(), Refusal> {
        if !self.rules.internet {
            return Err(Refusal::InternetOff);
        }
        let shown = host.to_string();
        if is_forbidden_port(port) {
            return Err(Refusal::Port { host: shown, port });
        }
        let name = host.name();
        let known: &[IpAddr] = match addrs {
            Addrs::Known(a) => a,
            Addrs::Unresolved => &[],
        };
        for &ip in known {
            if !special.exempt.contains(&ip)
                && (is_internal(ip) || special.own.contains(&canonical(ip)))
            {
                return Err(Refusal::Internal {
                    host: shown,
                    addr: ip,
                });
            }
        }
        let name_in =
            |list: &[Pattern]| name.is_some_and(|n| list.iter().any(|p| p.matches_name(n)));
        // Every address the connection may use must match for an address rule
        // to admit it; any one address in `deny` refuses it.
        let all_addrs_in = |list: &[&Pattern]| {
            !known.is_empty()
                && known
                    .iter()
                    .all(|&ip| list.iter().any(|p| p.matches_addr(ip)))
        };
        if name_in(&self.deny)
            || known
                .iter()
                .any(|&ip| self.deny.iter().any(|p| p.matches_addr(ip)))
        {
            return Err(Refusal::Denied { host: shown });
        }
        let unresolved_name = matches!(addrs, Addrs::Unresolved) && name.is_some();
        let pairs: Vec<&Pattern> = self
            .connect
            .iter()
            .filter(|(_, p)| *p == port)
            .map(|(h, _)| h)
            .collect();
        let pair_names: Vec<Pattern> = pairs.iter().map(|p| (*p).clone()).collect();
        if name_in(&pair_names)
            || all_addrs_in(&pairs)
            || (unresolved_name && pairs.iter().any(|p| p.is_net()))
        {
            return Ok(());
        }
        if !WEB_PORTS.contains(&port) {
            return Err(Refusal::Port { host: shown, port });
        }
        if self.allow.is_empty() || name_in(&self.allow) {
            return Ok(());
        }
        let nets: Vec<&Pattern> = self.allow.iter().filter(|p| p.is_net()).collect();
        if all_addrs_in(&nets) || (unresolved_name && !nets.is_empty()) {
            return Ok(());
        }
        Err(Refusal::NotAllowed { host: shown })
    }
}

impl Policy {
    /// Whether the sandbox may reach `runtime.internal` on `port`: the
    /// rules by name alone (it has no address), so `internet: false`, a
    /// `deny` naming it and an `allow` list that does not name it refuse it;
    /// only port 80 is served, whatever `connect` says.
    pub(crate) fn check_api(&self, port: u16) -> Result<(), Refusal> {
        let host = crate::API_HOST;
        if !self.rules.internet {
            return Err(Refusal::InternetOff);
        }
        if port != crate::API_PORT {
            return Err(Refusal::Port {
                host: host.into(),
                port,
            });
        }
        if self.deny.iter().any(|p| p.matches_name(host)) {
            return Err(Refusal::Denied { host: host.into() });
        }
        if self.allow.is_empty() || self.allow.iter().any(|p| p.matches_name(host)) {
            return Ok(());
        }
        Err(Refusal::NotAllowed { host: host.into() })
    }
}

/// A connection's target as the guest named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Host {
    /// Lowercase, without a trailing dot.
    Name(String),
    Ip(IpAddr),
}

impl Host {
    /// Parses a host as a guest sends it (`[::1]` or `::1`, a name, an IPv4).
    pub(crate) fn parse(s: &str) -> Host {
        let bare = s
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .unwrap_or(s);
        match bare.parse::<IpAddr>() {
            Ok(ip) => Host::Ip(ip),
            Err(_) => Host::Name(bare.trim_end_matches('.').to_ascii_lowercase()),
        }
    }

    pub(crate) fn name(&self) -> Option<&str> {
        match self {
            Host::Name(n) => Some(n),
            Host::Ip(_) => None,
        }
    }

    /// A name a resolver or a TLS client may be given.
    pub(crate) fn is_valid(&self) -> bool {
        match self {
            Host::Ip(_) => true,
            Host::Name(n) => valid_name(n),
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        && n.parse::<IpAddr>().is_err()
}

/// Addresses no sandbox reaches whatever its rules say: loopback, private,
/// shared (CGNAT), link-local (the metadata address included), unspecified,
/// multicast, broadcast and reserved ranges, and IPv6 forms that carry them.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => internal_v6(v6),
    }
}

fn internal_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    ip.is_unspecified()
        || o[0] == 0 // "this network"
        || ip.is_loopback()
        || ip.is_private()
        || (o[0] == 100 && (o[1] & 0xc0) == 64) // 100.64.0.0/10 shared
        || ip.is_link_local() // 169.254.0.0/16, metadata
        || (o[0] == 192 && o[1] == 0 && o[2] == 0) // 192.0.0.0/24 protocol assignments
        || (o[0] == 198 && (o[1] & 0xfe) == 18) // 198.18.0.0/15 benchmarking
        || ip.is_multicast()
        || o[0] >= 240 // reserved and broadcast
}

fn internal_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return internal_v4(v4);
    }
    let embedded = |a: u16, b: u16| Ipv4Addr::new((a >> 8) as u8, a as u8, (b >> 8) as u8, b as u8);
    // IPv4-compatible (::a.b.c.d, deprecated) and NAT64 (64:ff9b::/96) carry an
    // IPv4 address in their last 32 bits; 6to4 (2002::/16) in bits 16..48.
    if s[..6] == [0, 0, 0, 0, 0, 0] {
        return true; // ::, ::1 and the deprecated compatible forms
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] && internal_v4(embedded(s[6], s[7])) {
        return true;
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1 {
        return true; // 64:ff9b:1::/48 local-use NAT64
    }
    if s[0] == 0x2002 && internal_v4(embedded(s[1], s[2])) {
        return true;
    }
    (s[0] & 0xfe00) == 0xfc00 // fc00::/7 unique local
        || (s[0] & 0xffc0) == 0xfe80 // fe80::/10 link-local
        || (s[0] & 0xffc0) == 0xfec0 // fec0::/10 site-local (deprecated)
        || (s[0] & 0xff00) == 0xff00 // multicast
        || (s[0] == 0x100 && s[1..4] == [0, 0, 0]) // 100::/64 discard
}

impl Rules {
    /// Checks every entry and builds the [`Policy`], or names every wrong
    /// entry by its path (`allow[2]`).
    pub fn validate(&self) -> Result<Policy, Vec<Issue>> {
        let mut issues = Vec::new();
        let mut lists = |field: &str, list: &Option<Vec<String>>| -> Vec<String> {
            let list = list.as_deref().unwrap_or_default();
            if list.len() > MAX_ENTRIES {
                issues.push(Issue {
                    field: field.to_owned(),
                    message: format!("at most {MAX_ENTRIES} entries ({} given)", list.len()),
                });
            }
            list.to_vec()
        };
        let allow_in = lists("allow", &self.allow);
        let deny_in = lists("deny", &self.deny);
        let connect_in = lists("connect", &self.connect);

        let mut host_list = |field: &str, list: &[String]| -> (Vec<Pattern>, Vec<String>) {
            let mut patterns = Vec::new();
            let mut shown = Vec::new();
            for (i, entry) in list.iter().enumerate() {
                match parse_pattern(entry) {
                    Ok((p, s)) => {
                        patterns.push(p);
                        shown.push(s);
                    }
                    Err(message) => issues.push(Issue {
                        field: format!("{field}[{i}]"),
                        message,
                    }),
                }
            }
            (patterns, shown)
        };
        let (allow, allow_shown) = host_list("allow", &allow_in);
        let (deny, deny_shown) = host_list("deny", &deny_in);
        let mut connect = Vec::new();
        let mut connect_shown = Vec::new();
        for (i, entry) in connect_in.iter().enumerate() {
            match parse_pair(entry) {
                Ok((p, port, s)) => {
                    connect.push((p, port));
                    connect_shown.push(s);
                }
                Err(message) => issues.push(Issue {
                    field: format!("connect[{i}]"),
                    message,
                }),
            }
        }
        if !issues.is_empty() {
            return Err(issues);
        }
        let keep = |orig: &Option<Vec<String>>, shown: Vec<String>| orig.as_ref().map(|_| shown);
        Ok(Policy {
            rules: Rules {
                internet: self.internet,
                allow: keep(&self.allow, allow_shown),
                deny: keep(&self.deny, deny_shown),
                connect: keep(&self.connect, connect_shown),
            },
            allow,
            deny,
            connect,
        })
    }
}

/// Parses a host entry: a name, `*.domain`, an address or a CIDR. Returns the
/// pattern and its normalised text.
fn parse_pattern(entry: &str) -> Result<(Pattern, String), String> {
    let e = entry.trim();
    if e.is_empty() {
        return Err("is empty; give a host name, *.domain, an address or a CIDR".into());
    }
    if e != entry {
        return Err("has spaces around it".into());
    }
    if e.contains("://") || e.contains('/') && e.parse::<IpAddr>().is_err() && !looks_like_cidr(e) {
        return Err(format!(
            "{e:?} is not a host: give a host name, *.domain, an address or a CIDR, without a scheme or path"
        ));
    }
    if let Some((addr, prefix)) = e.split_once('/') {
        let addr = addr
            .strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(addr);
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| format!("{e:?} is not a CIDR: {addr:?} is not an IP address"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let prefix: u8 =
            prefix.parse().ok().filter(|p| *p <= max).ok_or_else(|| {
                format!("{e:?} is not a CIDR: the prefix length must be 0 to {max}")
            })?;
        let net = Net {
            addr: mask(ip, prefix),
            prefix,
        };
        return Ok((Pattern::Net(net), format!("{}/{prefix}", net.addr)));
    }
    if let Host::Ip(ip) = Host::parse(e) {
        let max = if ip.is_ipv4() { 32 } else { 128 };
        return Ok((
            Pattern::Net(Net {
                addr: canonical(ip),
                prefix: max,
            }),
            ip.to_string(),
        ));
    }
    let lower = e.trim_end_matches('.').to_ascii_lowercase();
    if let Some(suffix) = lower.strip_prefix("*.") {
        if !valid_name(suffix) {
            return Err(format!("{e:?} is not a valid *.domain pattern"));
        }
        return Ok((Pattern::Below(suffix.to_owned()), lower));
    }
    if lower.contains('*') {
        return Err(format!(
            "{e:?}: a wildcard is only allowed as a whole first label (*.example.com)"
        ));
    }
    if lower.contains(':') {
        return Err(format!("{e:?}: ports go in connect (host:port), not here"));
    }
    if !valid_name(&lower) {
        return Err(format!("{e:?} is not a valid host name"));
    }
    Ok((Pattern::Name(lower.clone()), lower))
}

fn looks_like_cidr(e: &str) -> bool {
    e.split_once('/').is_some_and(|(a, p)| {
        let a = a
            .strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(a);
        a.parse::<IpAddr>().is_ok() && !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())
    })
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match canonical(ip) {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let m = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix))
            };
            IpAddr::V4(Ipv4Addr::from(bits & m))
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let m = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(prefix))
            };
            IpAddr::V6(Ipv6Addr::from(bits & m))
        }
    }
}

/// Parses a `connect` entry: `host:port`, `[v6]:port`, `cidr:port`.
fn parse_pair(entry: &str) -> Result<(Pattern, u16, String), String> {
    let e = entry.trim();
    let (host, port) = if let Some(rest) = e.strip_prefix('[') {
        let (inner, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("{e:?} is not host:port: missing ']'"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| format!("{e:?} is not host:port: no port after the address"))?;
        (inner, port)
    } else {
        match e.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => {
                return Err(format!(
                    "{e:?}: write an IPv6 address in brackets, as [2001:db8::1]:5432"
                ))
            }
            Some(hp) => hp,
            None => return Err(format!("{e:?} is not host:port: no port")),
        }
    };
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{e:?}: the port must be a number from 1 to 65535"))?;
    let (pattern, shown) = parse_pattern(host)?;
    let shown = match pattern {
        Pattern::Net(Net {
            addr: IpAddr::V6(_),
            ..
        }) => format!("[{shown}]:{port}"),
        _ => format!("{shown}:{port}"),
    };
    Ok((pattern, port, shown))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(internet: bool, allow: &[&str], deny: &[&str], connect: &[&str]) -> Policy {
        let v = |l: &[&str]| Some(l.iter().map(|s| s.to_string()).collect());
        Rules {
            internet,
            allow: v(allow),
            deny: v(deny),
            connect: v(connect),
        }
        .validate()
        .unwrap()
    }

    fn check(p: &Policy, host: &str, port: u16, addrs: &[&str]) -> Result<(), Refusal> {
        let addrs: Vec<IpAddr> = addrs.iter().map(|a| a.parse().unwrap()).collect();
        p.check(
            &Host::parse(host),
            port,
            Addrs::Known(&addrs),
            &Special::default(),
        )
    }

    #[test]
    fn wildcard_is_subdomains_only() {
        let p = rules(true, &["*.example.org"], &[], &[]);
        assert!(check(&p, "a.example.org", 443, &["93.184.215.14"]).is_ok());
        assert!(check(&p, "b.a.example.org", 443, &["93.184.215.14"]).is_ok());
        assert!(check(&p, "example.org", 443, &["93.184.215.14"]).is_err());
        assert!(check(&p, "badexample.org", 443, &["93.184.215.14"]).is_err());
    }

    #[test]
    fn deny_wins_and_ports() {
        let p = rules(
            true,
            &["*.example.org"],
            &["bad.example.org", "203.0.113.0/24"],
            &["db.example.net:5432", "[2001:db8::1]:22"],
        );
        assert!(matches!(
            check(&p, "bad.example.org", 443, &["93.184.215.14"]),
            Err(Refusal::Denied { .. })
        ));
        assert!(matches!(
            check(&p, "ok.example.org", 443, &["203.0.113.9"]),
            Err(Refusal::Denied { .. })
        ));
        assert!(matches!(
            check(&p, "ok.example.org", 8080, &["93.184.215.14"]),
            Err(Refusal::Port { port: 8080, .. })
        ));
        assert!(check(&p, "db.example.net", 5432, &["93.184.215.14"]).is_ok());
        assert!(check(&p, "db.example.net", 443, &["93.184.215.14"]).is_err());
        assert!(check(&p, "2001:db8::1", 22, &["2001:db8::1"]).is_ok());
        assert_eq!(p.ports(), vec![22, 80, 443, 5432]);
        assert!(p.forbidden_ports().is_empty());
        let mail = rules(
            true,
            &[],
            &[],
            &["smtp.example.net:25", "db.example.net:5432"],
        );
        assert!(matches!(
            check(&mail, "smtp.example.net", 25, &["93.184.215.14"]),
            Err(Refusal::Port { port: 25, .. })
        ));
        assert_eq!(mail.ports(), vec![80, 443, 5432]);
        assert_eq!(mail.forbidden_ports(), vec![25]);
    }

    #[test]
    fn cidr_and_address_entries() {
        let p = rules(true, &["198.51.100.0/24", "2001:db8::/32"], &[], &[]);
        assert!(check(&p, "198.51.100.7", 443, &["198.51.100.7"]).is_ok());
        assert!(check(&p, "::ffff:198.51.100.7", 443, &["::ffff:198.51.100.7"]).is_ok());
        assert!(check(&p, "2001:db8::5", 80, &["2001:db8::5"]).is_ok());
        assert!(check(&p, "198.51.101.7", 443, &["198.51.101.7"]).is_err());
        // A name is admitted by its addresses only when every one matches.
        assert!(check(&p, "x.example.com", 443, &["198.51.100.1"]).is_ok());
        assert!(check(&p, "x.example.com", 443, &["198.51.100.1", "192.0.2.1"]).is_err());
        // Before resolution a name may still be admitted by an address entry.
        assert!(p
            .check(
                &Host::parse("x.example.com"),
                443,
                Addrs::Unresolved,
                &Special::default()
            )
            .is_ok());
        assert!(p.allows("x.example.com", 443).is_err());
    }

    #[test]
    fn internal_addresses_always_refused() {
        let p = rules(
            true,
            &["127.0.0.1", "10.0.0.0/8", "169.254.169.254", "::1"],
            &[],
            &[],
        );
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd00:ec2::254",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a00:1",
            "2002:a00:1::1",
        ] {
            assert!(
                matches!(check(&p, a, 443, &[a]), Err(Refusal::Internal { .. })),
                "{a} was not refused"
            );
        }
        assert!(!is_internal("93.184.215.14".parse().unwrap()));
        assert!(!is_internal(
            "2606:2800:21f:cb07:6820:80da:af6b:8b2c".parse().unwrap()
        ));
    }

    #[test]
    fn own_addresses_refused_and_test_stand_ins_exempt() {
        let p = Policy::open();
        let own: IpAddr = "203.0.113.5".parse().unwrap();
        let special = Special {
            own: vec![own],
            exempt: vec![],
        };
        assert!(matches!(
            p.check(
                &Host::parse("example.com"),
                443,
                Addrs::Known(&[own]),
                &special
            ),
            Err(Refusal::Internal { .. })
        ));
        let mapped: IpAddr = "::ffff:203.0.113.5".parse().unwrap();
        assert!(p
            .check(&Host::Ip(mapped), 443, Addrs::Known(&[mapped]), &special)
            .is_err());
        let local: IpAddr = "127.0.0.1".parse().unwrap();
        let test = Special {
            own: vec![],
            exempt: vec![local],
        };
        assert!(p
            .check(
                &Host::parse("example.com"),
                443,
                Addrs::Known(&[local]),
                &test
            )
            .is_ok());
        assert!(p
            .check(
                &Host::parse("example.com"),
                443,
                Addrs::Known(&[local]),
                &Special::default()
            )
            .is_err());
    }

    #[test]
    fn off_refuses_everything() {
        let p = rules(false, &[], &[], &[]);
        assert_eq!(
            check(&p, "example.com", 443, &["93.184.215.14"]),
            Err(Refusal::InternetOff)
        );
        assert!(p.ports().is_empty());
        assert_eq!(
            Policy::off().allows("example.com", 443),
            Err(Refusal::InternetOff)
        );
        assert!(Policy::open().allows("example.com", 443).is_ok());
        assert!(Policy::open().allows("example.com", 22).is_err());
    }

    #[test]
    fn validation_names_every_wrong_entry() {
        let r: Rules = serde_json::from_str(
            r#"{"internet":true,
                "allow":["example.com","https://example.com/x","","a.*.example.com","10.0.0.0/33","Example.ORG."],
                "deny":["ok.example.com","exa mple.com"],
                "connect":["db.example.net:5432","db.example.net","[::1]:70000","::1:22","*.example.org:22","10.0.0.0/8:5432"]}"#,
        )
        .unwrap();
        let issues = r.validate().unwrap_err();
        let fields: Vec<&str> = issues.iter().map(|i| i.field.as_str()).collect();
        assert_eq!(
            fields,
            vec![
                "allow[1]",
                "allow[2]",
                "allow[3]",
                "allow[4]",
                "deny[1]",
                "connect[1]",
                "connect[2]",
                "connect[3]"
            ],
            "{issues:?}"
        );
        assert!(issues.iter().all(|i| !i.message.is_empty()));
        let unknown = serde_json::from_str::<Rules>(r#"{"internet":true,"allowed":[]}"#);
        assert!(unknown.is_err());
    }

    #[test]
    fn normalised_rules_round_trip() {
        let r = Rules {
            internet: true,
            allow: Some(vec!["Example.COM.".into(), "10.1.2.3/8".into()]),
            deny: None,
            connect: Some(vec!["[2001:DB8::1]:22".into()]),
        };
        let p = r.validate().unwrap();
        assert_eq!(
            p.rules().allow.as_deref(),
            Some(&["example.com".to_string(), "10.0.0.0/8".to_string()][..])
        );
        assert_eq!(
            p.rules().connect.as_deref(),
            Some(&["[2001:db8::1]:22".to_string()][..])
        );
        assert_eq!(p.rules().deny, None);
    }
}
