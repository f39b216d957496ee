//! Which network interfaces become devices, chosen the way NCCL's own socket transport does.
//! The choice is a pure function over a list of addresses, so it is tested without touching
//! the host's real interfaces.

use std::net::{IpAddr, SocketAddr, SocketAddrV6};

/// Most devices the transport exposes.
pub const MAX_DEVICES: usize = 16;

/// Address family restriction from `NCCL_SOCKET_FAMILY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// IPv4 only (`AF_INET`).
    V4,
    /// IPv6 only (`AF_INET6`).
    V6,
}

impl Family {
    /// Parses NCCL's spelling (`AF_INET`, `AF_INET6`); anything else means "no restriction".
    pub fn parse(value: &str) -> Option<Family> {
        match value.trim() {
            "AF_INET" => Some(Family::V4),
            "AF_INET6" => Some(Family::V6),
            _ => None,
        }
    }

    fn admits(self, ip: &IpAddr) -> bool {
        matches!(
            (self, ip),
            (Family::V4, IpAddr::V4(_)) | (Family::V6, IpAddr::V6(_))
        )
    }
}

/// One address of one interface, as the host lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfaceAddr {
    /// Interface name, e.g. `eth0`.
    pub name: String,
    /// The address.
    pub ip: IpAddr,
    /// Interface index, used as the scope id of link-local IPv6 addresses.
    pub scope_id: u32,
    /// True for a loopback interface.
    pub is_loopback: bool,
}

impl IfaceAddr {
    /// The address to bind a listener on (port 0: any free port).
    pub fn bind_addr(&self) -> SocketAddr {
        match self.ip {
            IpAddr::V4(ip) => SocketAddr::new(IpAddr::V4(ip), 0),
            IpAddr::V6(ip) => {
                let scope = if is_v6_link_local(&self.ip) {
                    self.scope_id
                } else {
                    0
                };
                SocketAddr::V6(SocketAddrV6::new(ip, 0, 0, scope))
            }
        }
    }
}

fn is_v6_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
}

/// A parsed `NCCL_SOCKET_IFNAME`: prefixes (or exact names) to keep, or to leave out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfaceFilter {
    names: Vec<String>,
    exclude: bool,
    exact: bool,
}

impl IfaceFilter {
    /// Parses NCCL's syntax: a comma-separated list, `^` first to exclude, then `=` for exact
    /// names instead of prefixes; a `:port` suffix on an entry is ignored.
    pub fn parse(spec: &str) -> IfaceFilter {
        let mut rest = spec.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let names = rest
            .split(',')
            .map(|entry| entry.split(':').next().unwrap_or("").trim().to_string())
            .filter(|name| !name.is_empty())
            .collect();
        IfaceFilter {
            names,
            exclude,
            exact,
        }
    }

    /// True when the interface `name` passes the filter.
    pub fn matches(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|entry| {
            if self.exact {
                name == entry
            } else {
                name.starts_with(entry.as_str())
            }
        });
        listed != self.exclude
    }
}

/// The preferred address of an interface: IPv4, else global IPv6, else link-local IPv6.
fn rank(addr: &IfaceAddr) -> u8 {
    match addr.ip {
        IpAddr::V4(_) => 0,
        IpAddr::V6(_) if !is_v6_link_local(&addr.ip) => 1,
        IpAddr::V6(_) => 2,
    }
}

/// Picks one address per interface, in the order interfaces first appear in `addrs`, at most
/// `max` of them. With `filter`, exactly the interfaces it admits; without it, as NCCL's own
/// Socket transport picks (`src/misc/socket.cc`, `ncclFindInterfaces`): the IPoIB interfaces
/// (`ib*`) alone when there are any, else everything but loopback and container/VM bridges
/// (`docker*`, `virbr*`), falling back to those bridges and then to loopback when nothing else
/// exists. IPv6 loopback is only used when asked for by
/// family, as NCCL does.
pub fn select(
    addrs: &[IfaceAddr],
    filter: Option<&IfaceFilter>,
    family: Option<Family>,
    max: usize,
) -> Vec<IfaceAddr> {
    let usable = |a: &&IfaceAddr| {
        let family_ok = family.map_or(true, |f| f.admits(&a.ip));
        let v6_loopback = matches!(a.ip, IpAddr::V6(v6) if v6.is_loopback());
        family_ok && (!v6_loopback || family == Some(Family::V6))
    };
    let pick = |keep: &dyn Fn(&IfaceAddr) -> bool| -> Vec<IfaceAddr> {
        let mut chosen: Vec<IfaceAddr> = Vec::new();
        for a in addrs.iter().filter(usable).filter(|a| keep(a)) {
            match chosen.iter().position(|c| c.name == a.name) {
                Some(i) if rank(a) < rank(&chosen[i]) => chosen[i] = a.clone(),
                Some(_) => {}
                None if chosen.len() < max => chosen.push(a.clone()),
                None => {}
            }
        }
        chosen
    };
    if let Some(filter) = filter {
        return pick(&|a| filter.matches(&a.name));
    }
    let found = pick(&|a| !a.is_loopback && a.name.starts_with("ib"));
    if !found.is_empty() {
        return found;
    }
    let bridge = |a: &IfaceAddr| a.name.starts_with("docker") || a.name.starts_with("virbr");
    let found = pick(&|a| !a.is_loopback && !bridge(a));
    if !found.is_empty() {
        return found;
    }
    let found = pick(&|a| !a.is_loopback && bridge(a));
    if !found.is_empty() {
        return found;
    }
    pick(&|a| a.is_loopback)
}

/// Every address of every interface of this host.
pub fn host_addrs() -> std::io::Result<Vec<IfaceAddr>> {
    Ok(if_addrs::get_if_addrs()?
        .into_iter()
        .map(|i| IfaceAddr {
            is_loopback: i.is_loopback(),
            ip: i.ip(),
            scope_id: i.index.unwrap_or(0),
            name: i.name,
        })
        .collect())
}

/// Link speed of interface `name` in Mbps from sysfs, when it reports a positive one.
pub fn sysfs_speed_mbps(name: &str) -> Option<i32> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{name}/speed")).ok()?;
    text.trim().parse::<i32>().ok().filter(|&s| s > 0)
}

/// Resolved sysfs path of the device behind interface `name` (absent for virtual ones).
pub fn sysfs_device_path(name: &str) -> Option<String> {
    let path = std::fs::canonicalize(format!("/sys/class/net/{name}/device")).ok()?;
    Some(path.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(name: &str, ip: &str, scope_id: u32) -> IfaceAddr {
        IfaceAddr {
            name: name.into(),
            ip: ip.parse().expect("ip"),
            scope_id,
            is_loopback: name == "lo",
        }
    }

    fn host() -> Vec<IfaceAddr> {
        vec![
            addr("lo", "127.0.0.1", 1),
            addr("lo", "::1", 1),
            addr("eth0", "fe80::1", 2),
            addr("eth0", "10.0.0.2", 2),
            addr("eth0", "fd00::2", 2),
            addr("docker0", "172.17.0.1", 3),
            addr("ib0", "fd01::5", 4),
            addr("ib0", "fe80::5", 4),
            addr("virbr0", "192.168.122.1", 5),
            addr("eth10", "fe80::a", 6),
        ]
    }

    fn names(v: &[IfaceAddr]) -> Vec<String> {
        v.iter().map(|a| format!("{}={}", a.name, a.ip)).collect()
    }

    #[test]
    fn default_takes_ib_interfaces_alone_when_there_are_any() {
        // As NCCL's own Socket transport (src/misc/socket.cc, ncclFindInterfaces): IPoIB first,
        // so a host's slow management Ethernet does not become a second device beside it.
        let got = select(&host(), None, None, MAX_DEVICES);
        assert_eq!(names(&got), ["ib0=fd01::5"]);
    }

    #[test]
    fn default_skips_loopback_and_bridges_and_prefers_ipv4() {
        let no_ib: Vec<_> = host().into_iter().filter(|a| a.name != "ib0").collect();
        let got = select(&no_ib, None, None, MAX_DEVICES);
        assert_eq!(names(&got), ["eth0=10.0.0.2", "eth10=fe80::a"]);
    }

    #[test]
    fn default_falls_back_to_bridges_then_loopback() {
        let only_bridge: Vec<_> = host()
            .into_iter()
            .filter(|a| a.name == "lo" || a.name == "docker0")
            .collect();
        assert_eq!(
            names(&select(&only_bridge, None, None, 16)),
            ["docker0=172.17.0.1"]
        );
        let only_lo: Vec<_> = host().into_iter().filter(|a| a.name == "lo").collect();
        assert_eq!(names(&select(&only_lo, None, None, 16)), ["lo=127.0.0.1"]);
        assert_eq!(
            names(&select(&only_lo, None, Some(Family::V6), 16)),
            ["lo=::1"]
        );
        assert!(select(&[], None, None, 16).is_empty());
    }

    #[test]
    fn family_restricts_addresses() {
        // ib0 has no IPv4 address: the other interfaces, as if it were not there.
        let v4 = select(&host(), None, Some(Family::V4), 16);
        assert_eq!(names(&v4), ["eth0=10.0.0.2"]);
        let v6 = select(&host(), None, Some(Family::V6), 16);
        assert_eq!(names(&v6), ["ib0=fd01::5"]);
        assert_eq!(Family::parse("AF_INET"), Some(Family::V4));
        assert_eq!(Family::parse("AF_INET6"), Some(Family::V6));
        assert_eq!(Family::parse("inet"), None);
    }

    #[test]
    fn ifname_prefix_exact_and_exclude() {
        let sel = |spec: &str| names(&select(&host(), Some(&IfaceFilter::parse(spec)), None, 16));
        assert_eq!(sel("eth"), ["eth0=10.0.0.2", "eth10=fe80::a"]);
        assert_eq!(sel("=eth1"), Vec::<String>::new());
        assert_eq!(sel("=eth10"), ["eth10=fe80::a"]);
        assert_eq!(sel("ib,lo"), ["lo=127.0.0.1", "ib0=fd01::5"]);
        assert_eq!(
            sel("^eth,lo,docker"),
            ["ib0=fd01::5", "virbr0=192.168.122.1"]
        );
        assert_eq!(
            sel("^=eth0,lo"),
            [
                "docker0=172.17.0.1",
                "ib0=fd01::5",
                "virbr0=192.168.122.1",
                "eth10=fe80::a"
            ]
        );
        assert_eq!(sel("eth0:5000"), ["eth0=10.0.0.2"]);
    }

    #[test]
    fn max_limits_the_device_count() {
        let many: Vec<_> = (0..40)
            .map(|i| addr(&format!("en{i}"), &format!("10.0.{i}.1"), i))
            .collect();
        let got = select(&many, None, None, MAX_DEVICES);
        assert_eq!(got.len(), MAX_DEVICES);
        assert_eq!(got[0].name, "en0");
    }

    #[test]
    fn link_local_v6_binds_with_its_scope_id() {
        let a = addr("eth10", "fe80::a", 6);
        match a.bind_addr() {
            SocketAddr::V6(v6) => assert_eq!(v6.scope_id(), 6),
            other => panic!("expected IPv6, got {other}"),
        }
        match addr("eth0", "fd00::2", 2).bind_addr() {
            SocketAddr::V6(v6) => assert_eq!(v6.scope_id(), 0),
            other => panic!("expected IPv6, got {other}"),
        }
    }
}
