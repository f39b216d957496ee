//! Tests that start their own binary again to run one plugin `init` alone, in a fresh
//! process with an environment of their choosing (the runtime reads it once per process).

use std::process::Command;

use super::{say_init_outcome, ROLE_ENV};

/// The command that runs the ignored test `child` of this binary (which calls [`serve`]) as
/// an `init` alone, on the loopback: add the environment, then run it.
pub fn command(child: &str) -> Command {
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        child,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE_ENV, "init_only")
    .env("NCCL_SOCKET_IFNAME", "lo");
    cmd
}

/// The child side: `init` alone, its outcome said on stdout, when the parent asked for it
/// with [`command`]; whether it did.
pub fn serve() -> bool {
    let asked = std::env::var(ROLE_ENV).as_deref() == Ok("init_only");
    if asked {
        say_init_outcome();
    }
    asked
}
