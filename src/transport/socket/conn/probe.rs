//! What tests read of a connection's state: its sockets' kernel counters and what waits
//! unread in them.

use std::os::fd::AsRawFd;

use super::SocketRecvConn;

impl SocketRecvConn {
    /// The descriptors of the receiving sockets.
    pub(crate) fn socket_fds(&self) -> Vec<i32> {
        self.shared.sockets.iter().map(|s| s.as_raw_fd()).collect()
    }

    /// Whether each receiving socket delays its acknowledgements now (`TCP_QUICKACK` reads 0
    /// while the kernel keeps them delayed).
    pub(crate) fn acks_delayed(&self) -> Vec<bool> {
        self.shared
            .sockets
            .iter()
            .map(|sock| !sock.quickack().expect("TCP_QUICKACK"))
            .collect()
    }

    /// TCP segments the receiving sockets have sent so far (acknowledgements, and a goodbye
    /// at close): the kernel's own count, `tcpi_segs_out`.
    pub(crate) fn segments_sent(&self) -> u64 {
        self.shared
            .sockets
            .iter()
            .map(|sock| u64::from(super::shared::tcp_info(sock).tcpi_segs_out))
            .sum()
    }

    /// Bytes that have arrived on the receiving sockets and wait unread (each socket looked
    /// at up to 8 MiB), read without consuming them.
    pub(crate) fn bytes_waiting(&self) -> usize {
        let mut buf = vec![0u8; 8 << 20];
        self.shared
            .sockets
            .iter()
            .map(|sock| super::shared::peek_arrived(sock, &mut buf).unwrap_or(0))
            .sum()
    }

    /// TCP segments with data the receiving sockets' kernel has taken in so far, read by
    /// this side or not: `tcpi_data_segs_in`.
    pub(crate) fn segments_received(&self) -> u64 {
        self.shared
            .sockets
            .iter()
            .map(|sock| u64::from(super::shared::tcp_info(sock).tcpi_data_segs_in))
            .sum()
    }
}

/// The descriptors some epoll instance of this process watches (`tfd:` lines of the
/// `/proc/self/fdinfo` of each epoll descriptor).
pub(crate) fn epoll_watched() -> Vec<i32> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    fds.flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy().contains("eventpoll"))
        })
        .filter_map(|fd| {
            std::fs::read_to_string(format!(
                "/proc/self/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .ok()
        })
        .flat_map(|info| {
            info.lines()
                .filter_map(|l| {
                    l.strip_prefix("tfd:")?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                })
                .collect::<Vec<i32>>()
        })
        .collect()
}
