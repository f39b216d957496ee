import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import nccl_lossy

TESTS = Path(__file__).resolve().parent
HARNESS = TESTS / "net_harness.py"
REPO = TESTS.parents[1]

# Variables of ours that a developer's shell may carry; every subprocess starts without them.
_OURS = (
    "NCCL_NET_PLUGIN",
    "NCCL_NET",
    "NCCL_PROTO",
    "NCCL_LOSSY_PROFILE",
    "NCCL_LOSSY_SET",
    "NCCL_LOSSY_STATS",
    "RANK",
)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(code, env=None, timeout=180, args=()):
    """Runs Python code in a fresh interpreter (the plugin's state is per process)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_harness(env, phases=("forward", "backward", "any"), nbytes=1 << 20):
    env = dict(env)
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    proc = subprocess.run(
        [sys.executable, str(HARNESS), ",".join(phases), str(nbytes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lib_path():
    return nccl_lossy.library_path()


def run_ranks(script, world, args=(), timeout=600, **env):
    """Starts ``world`` ranks of ``script`` (torch.distributed's variables set, gloo on
    loopback) and returns each rank's last stdout line as JSON, by rank. Any rank failing
    fails the test with its stderr."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=clean_env(RANK=r, WORLD_SIZE=world, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo", **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr[-6000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(outs, key=lambda o: o["rank"])


def lossy_binary():
    """The `lossy` command: NCCL_LOSSY_CLI when set, else built (incrementally) here."""
    given = os.environ.get("NCCL_LOSSY_CLI")
    if given:
        return given
    subprocess.run(
        ["cargo", "build", "--release", "-p", "lossy-cli", "--bin", "lossy"],
        cwd=REPO, check=True,
    )
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=REPO, check=True, capture_output=True, text=True,
    )
    return str(Path(json.loads(meta.stdout)["target_directory"]) / "release" / "lossy")
