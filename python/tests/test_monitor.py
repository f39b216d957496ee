"""performance_monitor: its JSON lines when the training loss diverges (no torch, no plugin), and
what it says when the plugin's counters or an asked-for sink are missing."""

import json
import math

import pytest

from conftest import clean_env, run_python
from nccl_lossy.monitor import PerformanceMonitor


def _strict(token):
    raise ValueError(f"not JSON: bare {token}")


@pytest.mark.parametrize(
    "loss, written",
    [(float("inf"), "inf"), (float("-inf"), "-inf"), (float("nan"), "nan"), (2.5, 2.5)],
)
def test_a_diverged_loss_is_written_as_valid_json(tmp_path, loss, written):
    out = tmp_path / "perf.jsonl"
    counts = {"packets": 0, "lost_packets": 0, "messages": 0}
    stats = {"connections": [{"by_op": [dict(op="AllReduce", phase="any", **counts)]}]}
    monitor = PerformanceMonitor(out, batch_size=2, stats_source=lambda: stats)

    @monitor
    def step():
        return {"loss": loss}

    assert step() == {"loss": loss}
    step()
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    for number, line in enumerate(lines):
        record = json.loads(line, parse_constant=_strict)
        assert record["step"] == number
        assert record["loss"] == written
    # the records kept in memory hold the float itself
    kept = monitor.records[0]["loss"]
    assert kept == loss or (math.isnan(kept) and math.isnan(loss))


MONITOR_WITHOUT_PLUGIN = r"""
import json
from nccl_lossy.monitor import PerformanceMonitor

monitor = PerformanceMonitor(use_wandb=True, tensorboard_dir="tb")

@monitor
def step():
    return 1.0

step()
step()
print(json.dumps(monitor.records))
"""


def test_a_monitor_without_plugin_counters_or_its_sinks_says_so_where_it_is_seen(tmp_path):
    # The plugin's counters could not be read (NCCL_NET_PLUGIN names no library) and wandb and
    # TensorBoard were asked for but missing: the monitor said so only into this package's
    # logger, which prints nothing unless the application configures logging, and wrote
    # packets: null for every step without a word.
    env = clean_env(NCCL_NET_PLUGIN=str(tmp_path / "missing" / "libnccl-net-lossy.so"))
    proc = run_python(MONITOR_WITHOUT_PLUGIN, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["packets"] for r in records] == [None, None]
    assert "no plugin counters" in proc.stderr and "NCCL_NET_PLUGIN=" in proc.stderr
    assert proc.stderr.count("no plugin counters") == 1  # once, not at every step
    assert "wandb" in proc.stderr


@pytest.mark.parametrize("env, rank", [({"RANK": "3"}, 3), ({}, None)])
def test_records_carry_the_launcher_rank_so_ranks_sharing_one_file_stay_apart(tmp_path, monkeypatch,
                                                                            env, rank):
    # Every rank of a torchrun job runs the decorated step and appends to the same file; the
    # plugin's counters in a record are that rank's, so the record says whose they are.
    from nccl_lossy.steps import _RANK_VARIABLES

    for name in _RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    counts = {"packets": 0, "lost_packets": 0, "messages": 0}
    stats = {"connections": [{"by_op": [dict(op="AllReduce", phase="any", **counts)]}]}
    out = tmp_path / "perf.jsonl"
    monitor = PerformanceMonitor(out, stats_source=lambda: stats)

    @monitor
    def step():
        return 1.0

    step()
    (line,) = out.read_text(encoding="utf-8").splitlines()
    assert json.loads(line)["rank"] == rank
    assert monitor.records[0]["rank"] == rank
