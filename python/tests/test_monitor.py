"""performance_monitor: its JSON lines when the training loss diverges (no torch, no plugin), and
what it says when the plugin's counters or an asked-for sink are missing."""

import json
import math

import pytest

from conftest import TESTS, clean_env, run_python
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


# A training step that sets its own step first (`integ.step(it)`, Megatron's iteration) rather
# than at its end (attach()'s optimizer hook): the record carried the step before the call, so
# each line of the JSONL named the previous step and `lossy report --per-step --train-log` put
# every loss one step away from the packets the plugin counted for it. Both styles in one run.
STEP_FIRST = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import nccl_lossy
from nccl_lossy import performance_monitor
from net_harness import Link

torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, patch_megatron=False)
integ.enable()
link = Link(1 << 16)

@performance_monitor(integration=integ)
def step_first(it, sends):
    integ.step(it)                   # the step set first, then its traffic
    for _ in range(sends):
        link.send()

@performance_monitor(integration=integ)
def step_last(sends):
    integ.attach(model, opt)
    for _ in range(sends):
        link.send()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()                       # traffic first, then the optimizer's hook sets the next step
    integ.detach()

for it, sends in ((1, 1), (2, 2), (3, 3)):
    step_first(it, sends)
integ.step(4)                        # outside the monitored calls
step_last(4)
step_last(5)
by_step = {s["step"]: s["packets"] for s in nccl_lossy.stats()["by_step"]}
link.close()
print(json.dumps({"records": [[r["step"], r["packets"]] for r in step_first.monitor.records + step_last.monitor.records],
                  "by_step": by_step}))
"""


def test_a_record_carries_the_step_its_traffic_was_counted_under():
    proc = run_python(STEP_FIRST, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 64 KiB messages of 128 packets
    by_step = {int(k): v for k, v in out["by_step"].items()}
    assert by_step == {1: 128, 2: 256, 3: 384, 4: 512, 5: 640}
    assert out["records"] == [[s, p] for s, p in sorted(by_step.items())]


@pytest.mark.parametrize("options, named", [
    ({"batch_size": "8"}, "batch_size='8'"),
    ({"batch_size": 8, "seq_length": "128"}, "seq_length='128'"),
    ({"batch_size": -4}, "batch_size=-4"),
    ({"batch_size": 2.5}, "batch_size=2.5"),
    ({"batch_size": True}, "batch_size=True"),
    ({"first_step": "3"}, "first_step='3'"),
    ({"first_step": -1}, "first_step=-1"),
])
def test_a_size_or_first_step_that_is_no_count_is_refused_before_any_step_runs(tmp_path, options, named):
    # A batch size or sequence length of text failed after the first training step had run, as
    # a bare TypeError ("unsupported operand type(s) for /: 'str' and 'float'") that lost the
    # step's record; a negative one wrote negative throughput.
    ran = []
    with pytest.raises(ValueError) as err:
        monitor = PerformanceMonitor(tmp_path / "perf.jsonl", stats_source=lambda: {}, **options)
        monitor(lambda: ran.append(1))()
    assert named in str(err.value) and "allowed" in str(err.value), str(err.value)
    assert not ran and not (tmp_path / "perf.jsonl").exists()
    # numpy's integers are counts too
    np = pytest.importorskip("numpy")
    monitor = PerformanceMonitor(batch_size=np.int64(4), seq_length=np.int32(16), first_step=np.int64(2),
                                 stats_source=lambda: {"connections": []})
    monitor(lambda: None)()
    assert monitor.records[0]["step"] == 2 and monitor.records[0]["tokens_per_s"] > 0


@pytest.mark.parametrize("options, named", [
    ({"count_flops": "no"}, "count_flops='no'"),     # taken as true: every step under the counter
    ({"use_wandb": "false"}, "use_wandb='false'"),
    ({"count_flops": None}, "count_flops=None"),
])
def test_a_switch_that_is_no_bool_is_refused_naming_it(options, named):
    with pytest.raises(ValueError) as err:
        PerformanceMonitor(stats_source=lambda: {}, **options)
    assert named in str(err.value) and "allowed: True or False" in str(err.value), str(err.value)


@pytest.mark.parametrize("options, named", [
    ({"integration": 3}, "integration=3"),              # failed at the first call
    ({"profiler": "prof"}, "profiler='prof'"),          # failed after the first step had run
])
def test_an_integration_or_profiler_of_the_wrong_kind_is_refused_at_construction(options, named):
    ran = []
    with pytest.raises(TypeError) as err:
        PerformanceMonitor(stats_source=lambda: {}, **options)(lambda: ran.append(1))()
    assert named in str(err.value) and "allowed" in str(err.value), str(err.value)
    assert not ran


def test_an_output_that_names_no_file_is_refused_before_any_step_runs(tmp_path):
    # A directory (or "", the working directory) failed with IsADirectoryError after the first
    # training step had run; a number with "expected str, bytes or os.PathLike".
    ran = []
    for output, named in ((tmp_path, f"output={str(tmp_path)!r}"), ("", "output=''"), (3, "output=3")):
        with pytest.raises(ValueError) as err:
            PerformanceMonitor(output, stats_source=lambda: {})(lambda: ran.append(1))()
        assert named in str(err.value) and "allowed" in str(err.value), str(err.value)
    assert not ran
