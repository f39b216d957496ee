"""performance_monitor's JSON lines when the training loss diverges (no torch, no plugin)."""

import json
import math

import pytest

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
