//! Byte layouts the two ends agree on: the connection handle, the per-socket hello and the
//! per-chunk header. Every field is written and read explicitly, little-endian, so the
//! layout does not depend on the compiler, and every decoder rejects what it cannot trust.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

use crate::loss::plan::Effect;
use crate::transport::{WireHandle, HANDLE_WIRE_SIZE};
use crate::{Error, Result};

/// Version of everything in this file; both ends must speak the same one.
pub const PROTOCOL_VERSION: u16 = 1;

/// Opening bytes of a handle.
pub const HANDLE_MAGIC: u64 = u64::from_le_bytes(*b"LOSSYnet");

/// Opening bytes of a hello.
pub const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"LOSSYhi!");

/// Opening bytes of a chunk header.
pub const HEADER_MAGIC: u32 = u32::from_le_bytes(*b"LsMg");

/// Size of the random secret a listener puts in its handle.
pub const NONCE_SIZE: usize = 16;

/// Most sockets one connection may use.
pub const MAX_SOCKETS: usize = 16;

/// Size of a hello on the wire.
pub const HELLO_SIZE: usize = 40;

/// Size of a chunk header on the wire, before its lost-packet runs.
pub const HEADER_SIZE: usize = 56;

/// Size of one lost-packet run on the wire.
pub const RUN_SIZE: usize = 8;

/// Largest message the protocol carries (1 TiB, NCCL's limit for `maxP2pBytes`).
pub const MAX_MESSAGE_BYTES: u64 = 1 << 40;

/// Longest retransmission timeout per loss event a header may carry (the profile checks it).
pub use crate::loss::plan::MAX_RETRANSMIT_TIMEOUT;

/// The one byte a receiving side writes on each socket (the only bytes that ever flow from
/// receiver to sender) when its comm is closed in an orderly way, just before shutting the
/// socket down: a sender whose send then fails knows the peer left on purpose, not died.
pub const GOODBYE: u8 = 0x42;

fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn put(b: &mut [u8], at: usize, bytes: &[u8]) {
    b[at..at + bytes.len()].copy_from_slice(bytes);
}

/// What a peer needs to reach a listener: its address and the secret it must present.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    /// Address the listener is bound to (with the scope id for link-local IPv6).
    pub addr: SocketAddr,
    /// Random secret every socket of a connection repeats in its hello.
    pub nonce: [u8; NONCE_SIZE],
}

// Handle layout (HANDLE_WIRE_SIZE = 120 bytes):
// 0 magic u64 | 8 version u16 | 10 family u8 (4 or 6) | 11 zero |
// 12 port u16 | 14 zero u16 | 16 address, 16 bytes (IPv4: 4 then zeros) | 32 scope id u32 |
// 36 flow info u32 | 40 nonce, 16 bytes | 56..120 zeros.
impl Handle {
    /// Writes the handle into the wire bytes of an NCCL connection handle.
    pub fn encode(&self, out: &mut WireHandle) {
        out.fill(0);
        put(out, 0, &HANDLE_MAGIC.to_le_bytes());
        put(out, 8, &PROTOCOL_VERSION.to_le_bytes());
        put(out, 12, &self.addr.port().to_le_bytes());
        match self.addr {
            SocketAddr::V4(a) => {
                out[10] = 4;
                put(out, 16, &a.ip().octets());
            }
            SocketAddr::V6(a) => {
                out[10] = 6;
                put(out, 16, &a.ip().octets());
                put(out, 32, &a.scope_id().to_le_bytes());
                put(out, 36, &a.flowinfo().to_le_bytes());
            }
        }
        put(out, 40, &self.nonce);
    }

    /// Reads a handle, rejecting anything a listener of ours could not have written with
    /// `ncclInternalError`, the code NCCL's Socket plugin gives `connect` for a handle whose
    /// address is neither IPv4 nor IPv6 (`ncclSocketInit`, src/misc/socket.cc).
    pub fn decode(b: &WireHandle) -> Result<Handle> {
        let bad = |why: &str| Error::internal(format!("bad connection handle: {why}"));
        if get_u64(b, 0) != HANDLE_MAGIC {
            return Err(bad(
                "wrong magic (not from this plugin's socket transport: does the peer run wrap \
                 mode? NCCL_LOSSY_INNER, or transport = \"wrap\", must be alike on every rank)",
            ));
        }
        let version = get_u16(b, 8);
        if version != PROTOCOL_VERSION {
            return Err(bad(&format!(
                "protocol version {version}, expected {PROTOCOL_VERSION}"
            )));
        }
        let zeros = |r: std::ops::Range<usize>| b[r].iter().all(|&x| x == 0);
        if b[11] != 0 || get_u16(b, 14) != 0 || !zeros(56..HANDLE_WIRE_SIZE) {
            return Err(bad("reserved bytes are not zero"));
        }
        let port = get_u16(b, 12);
        if port == 0 {
            return Err(bad("port 0"));
        }
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&b[16..32]);
        let addr = match b[10] {
            4 => {
                if !zeros(20..40) {
                    return Err(bad("IPv4 handle with IPv6 fields set"));
                }
                SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3])),
                    port,
                )
            }
            6 => SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(octets),
                port,
                get_u32(b, 36),
                get_u32(b, 32),
            )),
            family => return Err(bad(&format!("unknown address family {family}"))),
        };
        let mut nonce = [0u8; NONCE_SIZE];
        nonce.copy_from_slice(&b[40..56]);
        Ok(Handle { addr, nonce })
    }
}

/// The first bytes on every socket of a connection: who it belongs to and where it fits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The listener's secret, copied from its handle.
    pub nonce: [u8; NONCE_SIZE],
    /// Random id the connector chose for this connection.
    pub conn_id: u64,
    /// Position of this socket in the connection.
    pub index: u16,
    /// Number of sockets in the connection.
    pub count: u16,
}

// Hello layout (40 bytes): 0 magic u64 | 8 version u16 | 10 index u16 | 12 count u16 |
// 14 zero u16 | 16 nonce, 16 bytes | 32 connection id u64.
impl Hello {
    /// The hello's wire bytes.
    pub fn encode(&self) -> [u8; HELLO_SIZE] {
        let mut b = [0u8; HELLO_SIZE];
        put(&mut b, 0, &HELLO_MAGIC.to_le_bytes());
        put(&mut b, 8, &PROTOCOL_VERSION.to_le_bytes());
        put(&mut b, 10, &self.index.to_le_bytes());
        put(&mut b, 12, &self.count.to_le_bytes());
        put(&mut b, 16, &self.nonce);
        put(&mut b, 32, &self.conn_id.to_le_bytes());
        b
    }

    /// Bytes of the hello the connector sends before the rest: the magic, then the version
    /// and socket index, each in a send of its own (see `HELLO_CUTS` in `connect`).
    pub const START: usize = 12;

    /// Whether the first [`Hello::START`] bytes of a hello that is not complete yet are what a
    /// connector of this plugin sends: the magic, this version and a possible socket index.
    pub fn starts_as_ours(b: &[u8]) -> bool {
        b.len() >= Self::START
            && get_u64(b, 0) == HELLO_MAGIC
            && get_u16(b, 8) == PROTOCOL_VERSION
            && usize::from(get_u16(b, 10)) < MAX_SOCKETS
    }

    /// Reads a hello and checks it against the listener's secret; the error says why not.
    pub fn decode(b: &[u8; HELLO_SIZE], nonce: &[u8; NONCE_SIZE]) -> Result<Hello> {
        let bad = |why: String| Error::remote(format!("rejected peer hello: {why}"));
        if get_u64(b, 0) != HELLO_MAGIC {
            return Err(bad("wrong magic".into()));
        }
        let version = get_u16(b, 8);
        if version != PROTOCOL_VERSION {
            return Err(bad(format!(
                "protocol version {version}, expected {PROTOCOL_VERSION}"
            )));
        }
        if get_u16(b, 14) != 0 {
            return Err(bad("reserved bytes are not zero".into()));
        }
        if b[16..32] != nonce[..] {
            return Err(bad("wrong nonce (not a peer of this listener)".into()));
        }
        let (index, count) = (get_u16(b, 10), get_u16(b, 12));
        if count == 0 || usize::from(count) > MAX_SOCKETS || index >= count {
            return Err(bad(format!("socket {index} of {count}")));
        }
        let mut n = [0u8; NONCE_SIZE];
        n.copy_from_slice(&b[16..32]);
        Ok(Hello {
            nonce: n,
            conn_id: get_u64(b, 32),
            index,
            count,
        })
    }
}

/// Wire code of a loss effect.
pub fn effect_code(effect: Effect) -> u8 {
    match effect {
        Effect::Zero => 0,
        Effect::Stale => 1,
        Effect::Retransmit => 2,
        Effect::Bitflip => 3,
    }
}

/// The loss effect for a wire code, if it is one.
pub fn effect_from_code(code: u8) -> Option<Effect> {
    Some(match code {
        0 => Effect::Zero,
        1 => Effect::Stale,
        2 => Effect::Retransmit,
        3 => Effect::Bitflip,
        _ => return None,
    })
}

/// The fixed part of a chunk header; `runs` lost-packet runs follow it on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Position of the message in the connection's stream, from 0.
    pub seq: u64,
    /// Which chunk of the message follows the header.
    pub chunk: u8,
    /// Message size in bytes.
    pub size: u64,
    /// NCCL's tag for the message.
    pub tag: i32,
    /// What lost packets do.
    pub effect: Effect,
    /// Packet size of the loss plan.
    pub mtu: u32,
    /// Number of lost-packet runs that follow (those touching this chunk).
    pub runs: u32,
    /// Retransmission delay per loss event, in nanoseconds.
    pub retransmit_ns: u64,
    /// Seed of the flipped bits.
    pub flip_seed: u64,
}

// Header layout (56 bytes): 0 magic u32 | 4 effect u8 | 5 chunk u8 | 6 zero u16 | 8 tag i32 |
// 12 mtu u32 | 16 size u64 | 24 seq u64 | 32 retransmit ns u64 | 40 flip seed u64 |
// 48 run count u32 | 52 zero u32; then `runs` × (start u32, len u32).
impl Header {
    /// The header's wire bytes.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        put(&mut b, 0, &HEADER_MAGIC.to_le_bytes());
        b[4] = effect_code(self.effect);
        b[5] = self.chunk;
        put(&mut b, 8, &self.tag.to_le_bytes());
        put(&mut b, 12, &self.mtu.to_le_bytes());
        put(&mut b, 16, &self.size.to_le_bytes());
        put(&mut b, 24, &self.seq.to_le_bytes());
        put(&mut b, 32, &self.retransmit_ns.to_le_bytes());
        put(&mut b, 40, &self.flip_seed.to_le_bytes());
        put(&mut b, 48, &self.runs.to_le_bytes());
        b
    }

    /// Reads a header and checks the fields that depend neither on the posted receive nor
    /// on the socket it came from.
    pub fn decode(b: &[u8; HEADER_SIZE]) -> Result<Header> {
        let bad = |why: String| Error::remote(format!("bad chunk header: {why}"));
        if get_u32(b, 0) != HEADER_MAGIC {
            return Err(bad("wrong magic (stream out of step)".into()));
        }
        if get_u16(b, 6) != 0 || get_u32(b, 52) != 0 {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let effect =
            effect_from_code(b[4]).ok_or_else(|| bad(format!("unknown effect {}", b[4])))?;
        let chunk = b[5];
        if usize::from(chunk) >= MAX_SOCKETS {
            return Err(bad(format!("chunk {chunk}")));
        }
        let size = get_u64(b, 16);
        if size > MAX_MESSAGE_BYTES {
            return Err(bad(format!("size {size} over the protocol's limit")));
        }
        let mtu = get_u32(b, 12);
        if mtu < crate::loss::effect::MIN_MTU {
            return Err(bad(format!("mtu {mtu} below the minimum")));
        }
        let retransmit_ns = get_u64(b, 32);
        if retransmit_ns > MAX_RETRANSMIT_TIMEOUT.as_nanos() as u64 {
            return Err(bad(format!("retransmit timeout {retransmit_ns} ns")));
        }
        let runs = get_u32(b, 48);
        if runs > 0 && u64::from(runs) > crate::loss::effect::packet_count(size as usize, mtu) {
            return Err(bad(format!("{runs} lost-packet runs for {size} bytes")));
        }
        Ok(Header {
            seq: get_u64(b, 24),
            chunk,
            size,
            tag: get_u32(b, 8) as i32,
            effect,
            mtu,
            runs,
            retransmit_ns,
            flip_seed: get_u64(b, 40),
        })
    }
}

/// Appends the wire bytes of `runs` to `out`.
pub fn encode_runs(runs: &[crate::loss::plan::PacketRun], out: &mut Vec<u8>) {
    for r in runs {
        out.extend_from_slice(&r.start.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
    }
}

/// Appends the runs held in `bytes` (a whole number of runs) to `out`.
pub fn decode_runs(bytes: &[u8], out: &mut Vec<crate::loss::plan::PacketRun>) {
    for r in bytes.chunks_exact(RUN_SIZE) {
        out.push(crate::loss::plan::PacketRun {
            start: get_u32(r, 0),
            len: get_u32(r, 4),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::plan::PacketRun;
    use std::net::SocketAddrV4;

    #[test]
    fn handle_round_trips_v4_and_v6() {
        let nonce = *b"0123456789abcdef";
        for addr in [
            SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 1, 2, 3), 40000)),
            SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().expect("ip"), 7, 0, 3)),
            SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::LOCALHOST, 65535, 0, 0)),
        ] {
            let h = Handle { addr, nonce };
            let mut wire = [0xaa; HANDLE_WIRE_SIZE];
            h.encode(&mut wire);
            assert_eq!(Handle::decode(&wire), Ok(h));
        }
    }

    #[test]
    fn handle_layout_is_little_endian_at_fixed_offsets() {
        let h = Handle {
            addr: "1.2.3.4:258".parse().expect("addr"),
            nonce: [9; NONCE_SIZE],
        };
        let mut w = [0; HANDLE_WIRE_SIZE];
        h.encode(&mut w);
        assert_eq!(&w[0..8], b"LOSSYnet");
        assert_eq!(&w[8..16], &[1, 0, 4, 0, 2, 1, 0, 0]);
        assert_eq!(&w[16..20], &[1, 2, 3, 4]);
        assert_eq!(&w[40..56], &[9; 16]);
    }

    #[test]
    fn handle_decode_rejects_garbage() {
        let good = {
            let mut w = [0; HANDLE_WIRE_SIZE];
            Handle {
                addr: "127.0.0.1:5000".parse().expect("addr"),
                nonce: [1; NONCE_SIZE],
            }
            .encode(&mut w);
            w
        };
        assert!(Handle::decode(&[0; HANDLE_WIRE_SIZE]).is_err());
        assert!(Handle::decode(&[0xff; HANDLE_WIRE_SIZE]).is_err());
        for (at, value) in [
            (0, 0u8),
            (8, 2),
            (10, 5),
            (11, 1),
            (12, 0),
            (60, 1),
            (95, 1),
            (22, 1),
        ] {
            let mut w = good;
            w[at] = value;
            if at == 12 {
                w[13] = 0;
            }
            let err = Handle::decode(&w).expect_err("corrupted handle must not decode");
            assert_eq!(err.kind, crate::ErrorKind::Internal);
        }
    }

    #[test]
    fn hello_round_trips_and_rejects_bad_fields() {
        let nonce = [7; NONCE_SIZE];
        let h = Hello {
            nonce,
            conn_id: 0x0102_0304_0506_0708,
            index: 2,
            count: 4,
        };
        let wire = h.encode();
        assert_eq!(Hello::decode(&wire, &nonce), Ok(h));
        assert!(Hello::decode(&wire, &[8; NONCE_SIZE]).is_err());
        for (at, value) in [(0, 0u8), (8, 9), (10, 4), (12, 0), (12, 17), (14, 1)] {
            let mut w = wire;
            w[at] = value;
            assert!(Hello::decode(&w, &nonce).is_err(), "byte {at} = {value}");
        }
    }

    #[test]
    fn header_round_trips_and_validates() {
        let h = Header {
            seq: 5,
            chunk: 3,
            size: 1 << 20,
            tag: -3,
            effect: Effect::Bitflip,
            mtu: 4096,
            runs: 2,
            retransmit_ns: 200_000,
            flip_seed: u64::MAX,
        };
        let wire = h.encode();
        assert_eq!(Header::decode(&wire), Ok(h));
        let with = |f: &dyn Fn(&mut Header)| {
            let mut x = h;
            f(&mut x);
            Header::decode(&x.encode())
        };
        assert!(with(&|x| x.chunk = MAX_SOCKETS as u8).is_err());
        assert!(with(&|x| x.mtu = 63).is_err());
        assert!(with(&|x| x.size = MAX_MESSAGE_BYTES + 1).is_err());
        assert!(with(&|x| x.runs = 257).is_err()); // 256 packets of 4096 bytes in 1 MiB
        assert!(with(&|x| x.runs = 256).is_ok());
        assert!(with(&|x| x.retransmit_ns = u64::MAX).is_err());
        for (at, value) in [(4, 9u8), (0, 0), (6, 1), (52, 1)] {
            let mut w = wire;
            w[at] = value;
            assert!(Header::decode(&w).is_err(), "byte {at} = {value}");
        }
    }

    #[test]
    fn runs_round_trip() {
        let runs = [
            PacketRun { start: 1, len: 2 },
            PacketRun {
                start: 9,
                len: u32::MAX,
            },
        ];
        let mut bytes = Vec::new();
        encode_runs(&runs, &mut bytes);
        assert_eq!(bytes.len(), 2 * RUN_SIZE);
        let mut back = Vec::new();
        decode_runs(&bytes, &mut back);
        assert_eq!(back, runs);
    }
}
