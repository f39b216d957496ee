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
