//! Environment variables with bad values: the error names the variable, the value and the
//! range that is allowed, so a user can fix it without reading the source.

use nccl_net_lossy::transport::socket::SocketConfig;

fn nsocks_error(value: &str) -> String {
    let value = value.to_string();
    SocketConfig::from_lookup(move |name| (name == "NCCL_LOSSY_NSOCKS").then(|| value.clone()))
        .expect_err("a bad NCCL_LOSSY_NSOCKS is refused")
        .message
}

#[test]
fn a_bad_nccl_lossy_nsocks_states_the_range() {
    for bad in ["0", "17", "two", "-1", "99999999999999999999"] {
        let message = nsocks_error(bad);
        assert!(
            message.contains(&format!("NCCL_LOSSY_NSOCKS={bad}")) && message.contains("1 to 16"),
            "for {bad:?}: {message}"
        );
    }
}

#[test]
fn a_bad_nccl_lossy_io_threads_is_refused_at_init_naming_the_range() {
    for bad in ["-1", "65", "four", "1.5"] {
        let value = bad.to_string();
        let message = SocketConfig::from_lookup(move |name| {
            (name == "NCCL_LOSSY_IO_THREADS").then(|| value.clone())
        })
        .expect_err("a bad NCCL_LOSSY_IO_THREADS is refused")
        .message;
        assert!(
            message.contains(&format!("NCCL_LOSSY_IO_THREADS={bad}"))
                && message.contains("0 to 64"),
            "for {bad:?}: {message}"
        );
    }
    for good in ["0", "1", "64", " 8 "] {
        let value = good.to_string();
        let config = SocketConfig::from_lookup(move |name| {
            (name == "NCCL_LOSSY_IO_THREADS").then(|| value.clone())
        });
        assert!(config.is_ok(), "{good:?} is a valid thread count");
    }
}

fn error_of(name: &'static str, value: &str) -> String {
    let value = value.to_string();
    SocketConfig::from_lookup(move |n| (n == name).then(|| value.clone()))
        .expect_err("a bad value is refused")
        .message
}

#[test]
fn a_bad_speed_or_socket_buffer_states_the_range() {
    for bad in ["0", "-5", "fast", "99999999999"] {
        let message = error_of("NCCL_LOSSY_SPEED_MBPS", bad);
        assert!(
            message.contains(&format!("NCCL_LOSSY_SPEED_MBPS={bad}"))
                && message.contains(&format!("1 to {}", i32::MAX)),
            "for {bad:?}: {message}"
        );
    }
    for bad in ["1", "4095", "99999999999", "big"] {
        let message = error_of("NCCL_LOSSY_SOCKBUF", bad);
        assert!(
            message.contains(&format!("NCCL_LOSSY_SOCKBUF={bad}"))
                && message.contains("4096 to 1073741824"),
            "for {bad:?}: {message}"
        );
    }
}

#[test]
fn a_bad_connect_retry_setting_states_the_range() {
    for bad in ["-1", "many", "100001", "1.5"] {
        let message = error_of("NCCL_SOCKET_RETRY_CNT", bad);
        assert!(
            message.contains(&format!("NCCL_SOCKET_RETRY_CNT={bad}"))
                && message.contains("0 to 100000"),
            "for {bad:?}: {message}"
        );
    }
    for bad in ["-1", "soon", "3600001"] {
        let message = error_of("NCCL_SOCKET_RETRY_SLEEP_MSEC", bad);
        assert!(
            message.contains(&format!("NCCL_SOCKET_RETRY_SLEEP_MSEC={bad}"))
                && message.contains("0 to 3600000"),
            "for {bad:?}: {message}"
        );
    }
}

#[test]
fn a_value_of_kilobytes_is_echoed_cut_with_its_length() {
    // Every rank logs an init failure, on stderr too: a 100 KB value (an environment
    // variable may hold 128 KiB) was echoed whole, in every variable's error. Cut as the
    // profile's errors cut values (`error::echo`), with the variable named and the length
    // said.
    let long = "9".repeat(100_000);
    for name in [
        "NCCL_LOSSY_NSOCKS",
        "NCCL_LOSSY_SPEED_MBPS",
        "NCCL_LOSSY_SOCKBUF",
        "NCCL_LOSSY_IO_THREADS",
        "NCCL_LOSSY_TIMEOUT",
        "NCCL_LOSSY_DELAYED_ACKS",
        "NCCL_SOCKET_FAMILY",
        "NCCL_SOCKET_RETRY_CNT",
        "NCCL_SOCKET_RETRY_SLEEP_MSEC",
    ] {
        let message = error_of(name, &long);
        assert!(
            message.len() < 1_000
                && message.contains(&format!("{name}=999"))
                && message.contains("(100000 bytes in all)"),
            "{name}: {} bytes: {}",
            message.len(),
            &message[..message.len().min(300)]
        );
    }
    let none = nccl_net_lossy::transport::socket::iface::none_usable(&[], Some(&long), None);
    assert!(
        none.len() < 1_000
            && none.contains("NCCL_SOCKET_IFNAME=999")
            && none.contains("(100000 bytes in all)"),
        "{} bytes: {}",
        none.len(),
        &none[..none.len().min(300)]
    );
}

#[test]
fn a_positive_timeout_too_small_for_a_float_is_refused_not_taken_as_off() {
    // `1e-400` and a long `0.000…1` are positive numbers that the float parser rounds to
    // 0.0, which means "off": the timeout the user asked for was silently dropped, while
    // `1e-300` (above the float's smallest) was refused as under 1 ms.
    let tiny = format!("0.{}1", "0".repeat(400));
    for bad in ["1e-400", "1E-999", tiny.as_str(), "+1e-400"] {
        let message = error_of("NCCL_LOSSY_TIMEOUT", bad);
        assert!(
            message.contains("NCCL_LOSSY_TIMEOUT=") && message.contains("0.001 to 604800"),
            "for {bad:?}: {message}"
        );
    }
    for off in ["0", "-0", "0.0", "0e-400", " 0 ", "000.000"] {
        let value = off.to_string();
        let config =
            SocketConfig::from_lookup(move |n| (n == "NCCL_LOSSY_TIMEOUT").then(|| value.clone()))
                .unwrap_or_else(|e| panic!("{off:?} is off: {}", e.message));
        assert_eq!(config.timeout, None, "{off:?} is off");
    }
}
