//! Which network interfaces become devices, chosen the way NCCL's own socket transport does.
//! The choice is a pure function over a list of addresses, so it is tested without touching
//! the host's real interfaces.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

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

    /// NCCL's spelling of the family.
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "AF_INET",
            Family::V6 => "AF_INET6",
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
    /// Scope id of a link-local IPv6 address (its interface's index); unused otherwise.
    pub scope_id: u32,
    /// True for a loopback interface.
    pub is_loopback: bool,
    /// True when the interface is running (`IFF_RUNNING`: up and its link attached).
    pub running: bool,
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
    /// names instead of prefixes; a `:port` suffix on an entry is ignored. `None`, automatic
    /// selection, for a value of one character or none, which NCCL ignores
    /// (`src/misc/socket.cc`, `ncclFindInterfaces`: `strlen(env) > 1`).
    pub fn parse(spec: &str) -> Option<IfaceFilter> {
        if spec.len() <= 1 {
            return None;
        }
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
        Some(IfaceFilter {
            names,
            exclude,
            exact,
        })
    }

    /// True when the interface `name` passes the filter. A list without names (`,,`) admits
    /// every name, and with `^` none, as NCCL's `matchIfList` (`src/misc/utils.cc`) does.
    pub fn matches(&self, name: &str) -> bool {
        let listed = self.names.is_empty()
            || self.names.iter().any(|entry| {
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

/// Why `select` never takes `a`, fallbacks or not; `None` when it may. The checks, in order,
/// of NCCL's `ncclOsFindInterfaces` (`src/os/linux.cc`): the interface is running
/// (`IFF_RUNNING`), the address has the family asked for, it is not IPv6 loopback (never
/// used, whatever the family), the interface passes `filter`.
fn unusable(a: &IfaceAddr, filter: Option<&IfaceFilter>, family: Option<Family>) -> Option<String> {
    if !a.running {
        return Some("interface not running".into());
    }
    if let Some(f) = family.filter(|f| !f.admits(&a.ip)) {
        return Some(format!("not {}", f.name()));
    }
    if matches!(a.ip, IpAddr::V6(v6) if v6.is_loopback()) {
        return Some("IPv6 loopback, never used".into());
    }
    match filter {
        Some(f) if !f.matches(&a.name) && f.exclude => {
            Some("excluded by NCCL_SOCKET_IFNAME".into())
        }
        Some(f) if !f.matches(&a.name) => Some("not in NCCL_SOCKET_IFNAME".into()),
        _ => None,
    }
}

/// Picks one address per interface, in the order interfaces first appear in `addrs`, at most
/// `max` of them, among the addresses of running interfaces, of `family` when given, and never
/// IPv6 loopback. With `filter`, exactly the interfaces it admits; without it, as NCCL's own
/// Socket transport picks (`src/misc/socket.cc`, `ncclFindInterfaces`, NCCL 2.28.3 and later):
/// the IPoIB interfaces (`ib*`) alone when there are any, else everything but loopback and
/// `docker*`/`virbr*` bridges, falling back to `docker*`, then loopback, then `virbr*`.
pub fn select(
    addrs: &[IfaceAddr],
    filter: Option<&IfaceFilter>,
    family: Option<Family>,
    max: usize,
) -> Vec<IfaceAddr> {
    let pick = |keep: &dyn Fn(&IfaceAddr) -> bool| -> Vec<IfaceAddr> {
        let mut chosen: Vec<IfaceAddr> = Vec::new();
        let usable = addrs
            .iter()
            .filter(|a| unusable(a, filter, family).is_none());
        for a in usable.filter(|a| keep(a)) {
            match chosen.iter().position(|c| c.name == a.name) {
                Some(i) if rank(a) < rank(&chosen[i]) => chosen[i] = a.clone(),
                Some(_) => {}
                None if chosen.len() < max => chosen.push(a.clone()),
                None => {}
            }
        }
        chosen
    };
    if filter.is_some() {
        return pick(&|_| true);
    }
    let docker = |a: &IfaceAddr| a.name.starts_with("docker");
    let virbr = |a: &IfaceAddr| a.name.starts_with("virbr");
    let steps: [&dyn Fn(&IfaceAddr) -> bool; 5] = [
        &|a| !a.is_loopback && a.name.starts_with("ib"),
        &|a| !a.is_loopback && !docker(a) && !virbr(a),
        &|a| !a.is_loopback && docker(a),
        &|a| a.is_loopback,
        &|a| !a.is_loopback && virbr(a),
    ];
    steps
        .iter()
        .map(|keep| pick(keep))
        .find(|found| !found.is_empty())
        .unwrap_or_default()
}

/// Most addresses the "no usable interface" message lists.
const MAX_LISTED: usize = 32;

/// The error text when `select` chose nothing among `addrs` with these settings: the settings,
/// then each address found and why it was passed over.
pub fn none_usable(addrs: &[IfaceAddr], ifname: Option<&str>, family: Option<Family>) -> String {
    let filter = ifname.and_then(IfaceFilter::parse);
    let ifname = match ifname {
        None => "unset".to_string(),
        Some(v) if filter.is_none() => {
            format!("{v} (one character or none: ignored, as NCCL does)")
        }
        Some(v) => crate::error::echo(v, str::to_string),
    };
    let mut found: Vec<String> = addrs
        .iter()
        .take(MAX_LISTED)
        .map(|a| {
            let ip = match a.ip {
                IpAddr::V6(_) if is_v6_link_local(&a.ip) => format!("{}%{}", a.ip, a.scope_id),
                ip => ip.to_string(),
            };
            let why = unusable(a, filter.as_ref(), family).unwrap_or_else(|| "usable".into());
            format!("{} {ip} ({why})", a.name)
        })
        .collect();
    if addrs.len() > MAX_LISTED {
        found.push(format!("and {} more", addrs.len() - MAX_LISTED));
    }
    let found = if found.is_empty() {
        "none".to_string()
    } else {
        found.join(", ")
    };
    format!(
        "no usable network interface: NCCL_SOCKET_IFNAME={ifname}, NCCL_SOCKET_FAMILY={}; \
         addresses found: {found}; the interfaces used are the running ones \
         NCCL_SOCKET_IFNAME admits, with an address of NCCL_SOCKET_FAMILY",
        family.map_or("unset", Family::name)
    )
}

/// The list `getifaddrs(3)` returns, freed when dropped.
struct IfAddrList(*mut libc::ifaddrs);

impl IfAddrList {
    fn new() -> std::io::Result<IfAddrList> {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        // SAFETY: getifaddrs only writes the list's head into `head`, a valid pointer; on
        // success the list is ours until freeifaddrs, called once, by `drop`.
        if unsafe { libc::getifaddrs(&mut head) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(IfAddrList(head))
    }
}

impl Drop for IfAddrList {
    fn drop(&mut self) {
        // SAFETY: the head a successful getifaddrs returned, freed once, here; no reference
        // into the list outlives `self` (`host_addrs` copies what it keeps).
        unsafe { libc::freeifaddrs(self.0) }
    }
}

/// The IPv4 or IPv6 address of one `getifaddrs` entry, copied out; `None` for other families.
fn entry_addr(entry: &libc::ifaddrs) -> Option<IfaceAddr> {
    if entry.ifa_addr.is_null() || entry.ifa_name.is_null() {
        return None;
    }
    // SAFETY: a non-null ifa_addr points to a socket address, which starts with sa_family.
    let family = i32::from(unsafe { (*entry.ifa_addr).sa_family });
    let (ip, scope_id) = match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET entry's address is a sockaddr_in; read unaligned, copied.
            let sin =
                unsafe { std::ptr::read_unaligned(entry.ifa_addr.cast::<libc::sockaddr_in>()) };
            (
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
                0,
            )
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 entry's address is a sockaddr_in6; read unaligned, copied.
            let sin6 =
                unsafe { std::ptr::read_unaligned(entry.ifa_addr.cast::<libc::sockaddr_in6>()) };
            (
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                sin6.sin6_scope_id,
            )
        }
        _ => return None,
    };
    // SAFETY: a non-null ifa_name is a NUL-terminated string that lives as long as the list.
    let name = unsafe { CStr::from_ptr(entry.ifa_name) };
    Some(IfaceAddr {
        name: name.to_string_lossy().into_owned(),
        ip,
        scope_id,
        is_loopback: ip.is_loopback(),
        running: entry.ifa_flags & libc::IFF_RUNNING as libc::c_uint != 0,
    })
}

/// Every IPv4 and IPv6 address of every interface of this host, in `getifaddrs(3)` order, with
/// its interface's `IFF_RUNNING` flag: the list NCCL's `ncclOsFindInterfaces` walks.
pub fn host_addrs() -> std::io::Result<Vec<IfaceAddr>> {
    let list = IfAddrList::new()?;
    let mut out = Vec::new();
    let mut next = list.0;
    while !next.is_null() {
        // SAFETY: a non-null node of the list `list` owns, alive until `list` drops below.
        let entry = unsafe { &*next };
        out.extend(entry_addr(entry));
        next = entry.ifa_next;
    }
    drop(list);
    Ok(out)
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
            running: true,
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

    /// The interfaces `select` takes from [`host`] under `NCCL_SOCKET_IFNAME=spec`.
    fn sel(spec: &str) -> Vec<String> {
        names(&select(
            &host(),
            IfaceFilter::parse(spec).as_ref(),
            None,
            16,
        ))
    }

    fn down(name: &str, ip: &str, scope_id: u32) -> IfaceAddr {
        IfaceAddr {
            running: false,
            ..addr(name, ip, scope_id)
        }
    }

    #[test]
    fn interfaces_not_running_are_never_selected() {
        // NCCL (src/os/linux.cc, ncclOsFindInterfaces) skips an address whose interface lacks
        // IFF_RUNNING: an unplugged NIC keeping its address must not become device 0.
        let host = [down("eth1", "10.0.0.1", 2), addr("lo", "127.0.0.1", 1)];
        assert_eq!(names(&select(&host, None, None, 16)), ["lo=127.0.0.1"]);
        let eth = IfaceFilter::parse("eth");
        assert!(select(&host, eth.as_ref(), None, 16).is_empty());
        let host = [down("ib0", "10.1.0.1", 3), addr("eth0", "10.0.0.2", 2)];
        assert_eq!(names(&select(&host, None, None, 16)), ["eth0=10.0.0.2"]);
    }

    #[test]
    fn default_falls_back_to_docker_then_loopback_then_virbr() {
        // NCCL 2.28.3 and later (src/misc/socket.cc, ncclFindInterfaces): "^docker,lo,virbr",
        // then "docker", then "lo", then "virbr".
        let only = |keep: &[&str]| -> Vec<IfaceAddr> {
            host()
                .into_iter()
                .filter(|a| keep.contains(&a.name.as_str()))
                .collect()
        };
        let pick = |keep: &[&str]| names(&select(&only(keep), None, None, 16));
        assert_eq!(
            pick(&["lo", "eth0", "docker0", "virbr0"]),
            ["eth0=10.0.0.2"]
        );
        assert_eq!(pick(&["lo", "docker0", "virbr0"]), ["docker0=172.17.0.1"]);
        assert_eq!(pick(&["lo", "virbr0"]), ["lo=127.0.0.1"]);
        assert_eq!(pick(&["virbr0"]), ["virbr0=192.168.122.1"]);
    }

    #[test]
    fn ifname_of_one_character_means_automatic_selection() {
        // NCCL uses NCCL_SOCKET_IFNAME only when strlen > 1 (src/misc/socket.cc).
        let auto = names(&select(&host(), None, None, 16));
        for spec in ["^", "=", "e"] {
            assert_eq!(IfaceFilter::parse(spec), None, "{spec}");
            let got = names(&select(
                &host(),
                IfaceFilter::parse(spec).as_ref(),
                None,
                16,
            ));
            assert_eq!(got, auto, "NCCL_SOCKET_IFNAME={spec}");
        }
    }

    #[test]
    fn ifname_with_no_names_admits_everything_and_its_negation_nothing() {
        // parseStringList skips empty entries; matchIfList admits every name for an empty
        // list, and `^` inverts that (src/misc/utils.cc).
        let all = [
            "lo=127.0.0.1",
            "eth0=10.0.0.2",
            "docker0=172.17.0.1",
            "ib0=fd01::5",
            "virbr0=192.168.122.1",
            "eth10=fe80::a",
        ];
        assert_eq!(sel(",,"), all);
        assert_eq!(sel(":5000"), all);
        assert_eq!(sel("^,,"), Vec::<String>::new());
        assert_eq!(sel("^="), Vec::<String>::new());
    }

    #[test]
    fn ipv6_loopback_is_never_selected() {
        // NCCL skips ::1 whatever NCCL_SOCKET_FAMILY says (src/os/linux.cc).
        let lo = [addr("lo", "::1", 1)];
        assert!(select(&lo, None, Some(Family::V6), 16).is_empty());
        assert!(select(&lo, None, None, 16).is_empty());
        assert!(select(&lo, IfaceFilter::parse("lo").as_ref(), None, 16).is_empty());
    }

    #[test]
    fn no_usable_interface_message_names_settings_and_every_address() {
        let host = [
            addr("lo", "127.0.0.1", 1),
            addr("lo", "::1", 1),
            down("eth1", "10.0.0.1", 2),
            addr("eth0", "10.0.0.2", 3),
            addr("eth0", "fe80::2", 3),
        ];
        let filter = IfaceFilter::parse("=eth1");
        assert!(select(&host, filter.as_ref(), Some(Family::V6), 16).is_empty());
        let msg = none_usable(&host, Some("=eth1"), Some(Family::V6));
        assert_eq!(
            msg,
            "no usable network interface: NCCL_SOCKET_IFNAME==eth1, NCCL_SOCKET_FAMILY=AF_INET6; \
             addresses found: lo 127.0.0.1 (not AF_INET6), lo ::1 (IPv6 loopback, never \
             used), eth1 10.0.0.1 (interface not running), eth0 10.0.0.2 (not AF_INET6), \
             eth0 fe80::2%3 (not in NCCL_SOCKET_IFNAME); the interfaces used are the \
             running ones NCCL_SOCKET_IFNAME admits, with an address of NCCL_SOCKET_FAMILY"
        );
        let msg = none_usable(&host[..1], Some("^lo"), None);
        assert!(
            msg.contains(
                "NCCL_SOCKET_IFNAME=^lo, NCCL_SOCKET_FAMILY=unset; addresses found: lo \
                 127.0.0.1 (excluded by NCCL_SOCKET_IFNAME)"
            ),
            "{msg}"
        );
        let msg = none_usable(&[], None, Some(Family::V4));
        assert!(
            msg.contains(
                "NCCL_SOCKET_IFNAME=unset, NCCL_SOCKET_FAMILY=AF_INET; addresses found: none"
            ),
            "{msg}"
        );
        let msg = none_usable(&host[..1], Some("e"), None);
        assert!(
            msg.contains("NCCL_SOCKET_IFNAME=e (one character or none: ignored, as NCCL does)"),
            "{msg}"
        );
    }

    #[test]
    fn host_addrs_lists_this_hosts_running_loopback() {
        // Every other socket test runs over `lo`, so it is there and running.
        let all = host_addrs().expect("getifaddrs");
        let lo = all
            .iter()
            .find(|a| a.ip == IpAddr::from([127, 0, 0, 1]))
            .expect("127.0.0.1 listed");
        assert!(lo.running && lo.is_loopback, "{lo:?}");
        assert!(all.iter().all(|a| !a.name.is_empty()), "{all:?}");
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
