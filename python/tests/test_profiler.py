"""nccl_lossy.profiler and performance_monitor with the real torch profiler (CPU) and the real
plugin, loaded the way NCCL loads it (tests/net_harness.py).

The merge test runs with the plugin's own trace file (NCCL_LOSSY_TRACE, docs/timeline.md),
written when the plugin's last connection closes."""

import json

import pytest

from conftest import TESTS, clean_env, run_python

torch = pytest.importorskip("torch")

from nccl_lossy.profiler import (  # noqa: E402
    LossyProfiler,
    ProfilerConfig,
    TraceFormatError,
    check_trace_events,
    load_trace,
    merge_trace_files,
    merge_traces,
)


def _ranges(trace, name):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == name]


def test_schedule_exports_chrome_and_tensorboard_traces_on_cpu(tmp_path):
    config = ProfilerConfig(output_dir=tmp_path, activities=("cpu", "cuda"), wait=1, warmup=1,
                            active=2, repeat=1, record_shapes=True, export_tensorboard=True)
    x = torch.randn(64, 64)
    with LossyProfiler(config) as prof:
        for step in range(6):
            with torch.profiler.record_function(f"train step {step}"):
                x = torch.tanh(x @ x)
            prof.step()
    assert len(prof.written["torch"]) == 1 and prof.written["merged"] == []  # no plugin trace
    trace = load_trace(prof.written["torch"][0])
    assert check_trace_events(trace) == []
    # wait 1 (step 0), warmup 1 (step 1), active 2: steps 2 and 3 only
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"train step 2", "train step 3"} <= names
    assert not names & {"train step 0", "train step 1", "train step 4", "train step 5"}
    assert any(e.get("name") == "aten::mm" and "Input Dims" in e.get("args", {}) for e in trace["traceEvents"])
    assert list((tmp_path / "tensorboard").glob("*.pt.trace.json"))


def test_config_rejects_a_bad_schedule(tmp_path):
    with pytest.raises(ValueError, match="active"):
        LossyProfiler(output_dir=tmp_path, active=0)
    with pytest.raises(ValueError, match="activity"):
        LossyProfiler(output_dir=tmp_path, activities=("tpu",))
    with pytest.raises(ValueError, match="unknown setting"):
        LossyProfiler(output_dir=tmp_path, actve=2)


def test_settings_given_to_the_profiler_leave_the_callers_config_alone(tmp_path):
    # LossyProfiler(config, active=5) wrote the setting into the caller's config, so the next
    # profiler built from it recorded 5 steps too, and a refused value stayed in it.
    base = ProfilerConfig(output_dir=tmp_path, active=2)
    assert LossyProfiler(base, active=5).config.active == 5
    with pytest.raises(ValueError, match="wait=-1"):
        LossyProfiler(base, wait=-1)
    assert (base.active, base.wait) == (2, 1)
    assert LossyProfiler(base).config.active == 2


# One 1 MiB message (512-byte packets, rate 0.5) before a known record_function range, one
# inside it, one in the backward phase; the steps and phases come from the integration.
MERGE_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import nccl_lossy
from nccl_lossy.profiler import LossyProfiler
from net_harness import Link
from nccl_lossy.steps import cell_totals

out_dir, trace_dir = sys.argv[2], sys.argv[3]

def counters_delta(before, after):
    a, b = cell_totals(before), cell_totals(after)
    out = []
    for (op, phase), counts in sorted(b.items()):
        prev = a.get((op, phase), {})
        grown = {c: counts[c] - prev.get(c, 0) for c in counts}
        if grown["messages"]:
            out.append({"op": op, "phase": phase, **grown})
    return out

integ = nccl_lossy.LossyMegatronIntegration(
    set={"mtu": 512, "model.rate": 0.5, "effect": "zero"}, patch_megatron=False)
integ.enable()
link = Link(1 << 20)
transfers = []

def transfer():
    before = nccl_lossy.stats()
    t0 = time.monotonic_ns()
    link.send()
    t1 = time.monotonic_ns()
    transfers.append({"t0_ns": t0, "t1_ns": t1, "step": integ.step_number,
                      "cells": counters_delta(before, nccl_lossy.stats())})

prof = LossyProfiler(output_dir=out_dir, trace_dir=trace_dir, activities=("cpu",),
                     wait=0, warmup=0, active=4, repeat=1)
prof.start()
integ.step(1)
integ.mark_forward()
transfer()                                   # 0: forward, outside the known range
time.sleep(0.01)
with torch.profiler.record_function("known transfer"):
    transfer()                               # 1: inside it
time.sleep(0.01)
integ.mark_backward()
transfer()                                   # 2: backward
integ.step(2)
link.close()          # the last connection closes: the plugin writes its trace file
plugin = json.load(open(prof.plugin_trace_path()))
prof.stop()
integ.disable()
print(json.dumps({"merged": [str(p) for p in prof.written["merged"]], "transfers": transfers,
                  "plugin": plugin}))
"""


def test_merged_trace_puts_a_known_transfer_inside_its_record_function_range(tmp_path):
    trace_dir = tmp_path / "trace"
    proc = run_python(MERGE_SCRIPT, env=clean_env(NCCL_SOCKET_IFNAME="lo", RANK=0,
                                                  NCCL_LOSSY_TRACE=str(trace_dir)),
                      args=(str(TESTS), str(tmp_path / "prof"), str(tmp_path / "trace")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["merged"]) == 1
    merged = load_trace(out["merged"][0])
    assert check_trace_events(merged) == []
    # the plugin's own file: one send event per transfer, on the plugin's monotonic clock,
    # inside the window the script measured around it
    own = sorted((e for e in out["plugin"]["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])
    assert [e["args"]["direction"] for e in own] == ["send"] * 3
    for event, transfer in zip(own, out["transfers"]):
        assert transfer["t0_ns"] <= event["ts"] * 1000 + 1000
        assert (event["ts"] + event["dur"]) * 1000 <= transfer["t1_ns"] + 1000
    plugin = sorted((e for e in merged["traceEvents"] if e.get("cat") == "lossy" and e["ph"] == "X"),
                    key=lambda e: e["ts"])
    assert len(plugin) == 3
    for event, transfer in zip(plugin, out["transfers"]):
        (cell,) = transfer["cells"]
        assert event["args"]["lost_packets"] == cell["lost_packets"]
        assert event["args"]["packets"] == 2048 and 820 <= cell["lost_packets"] <= 1228

    def inside(event, rng):
        return rng["ts"] <= event["ts"] and event["ts"] + event["dur"] <= rng["ts"] + rng["dur"]

    (known,) = _ranges(merged, "known transfer")
    assert inside(plugin[1], known)
    assert not inside(plugin[0], known) and not inside(plugin[2], known)
    # the integration's ranges frame the transfers: step 1, forward then backward
    (step1,) = _ranges(merged, "lossy:step 1")
    assert all(inside(e, step1) for e in plugin)
    (forward,) = _ranges(merged, "lossy:forward")
    # the phase goes on into step 2 (a range of its own there)
    (backward,) = [r for r in _ranges(merged, "lossy:backward") if inside(r, step1)]
    (step2,) = _ranges(merged, "lossy:step 2")
    assert step1["ts"] + step1["dur"] <= step2["ts"]
    assert inside(plugin[0], forward) and inside(plugin[1], forward)
    assert inside(plugin[2], backward) and not inside(plugin[2], forward)
    assert forward["ts"] + forward["dur"] <= backward["ts"]
    assert [e["args"]["phase"] for e in plugin] == ["forward", "forward", "backward"]
    assert all(e["args"]["step"] == 1 for e in plugin)


def test_merge_converts_the_plugin_clock_with_its_offset():
    # torch: ts 0 = epoch 1_000_000_000_000 ns; plugin: monotonic ns + 999_000_000_000 = epoch.
    torch_trace = {"baseTimeNanoseconds": 1_000_000_000_000, "traceEvents": [
        {"ph": "X", "name": "r", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0}]}
    plugin_trace = {"traceEvents": [
        {"ph": "X", "name": "AllReduce", "cat": "lossy", "pid": 1, "tid": 2,
         "ts": 1_000_012.0, "dur": 1.0, "args": {}}],
        "lossy_trace": {"format_version": 1, "clock": "CLOCK_MONOTONIC",
                        "monotonic_to_epoch_ns": 999_000_000_000}}
    merged = merge_traces(torch_trace, plugin_trace)
    event = merged["traceEvents"][1]
    # epoch = 1_000_012 us * 1000 + 999e9 ns = 1_000_000_012_000 ns -> 12 us after the base
    assert event["ts"] == pytest.approx(12.0)
    assert event["tid"] == (1 << 30) + 2
    with pytest.raises(ValueError, match="monotonic_to_epoch_ns"):
        merge_traces(torch_trace, {"traceEvents": [], "lossy_trace": {"format_version": 1,
                                                                       "clock": "CLOCK_MONOTONIC"}})
    # A plugin trace of a newer format is merged as far as this package reads it, and said
    # through Python's warnings (the package's logger has no handler: it said so to nobody).
    newer = {**plugin_trace, "lossy_trace": {**plugin_trace["lossy_trace"], "format_version": 99}}
    with pytest.warns(UserWarning, match="plugin trace format 99 is newer than this package's"):
        assert merge_traces(torch_trace, newer)["traceEvents"][1]["ts"] == pytest.approx(12.0)


# Three decorated steps through the real plugin: one message per phase each, a known matmul
# for the FLOP counter, the loss returned as a tensor.
MONITOR_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import nccl_lossy
from nccl_lossy import performance_monitor
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(
    set={"mtu": 512, "model.rate": 0.5, "effect": "zero"}, patch_megatron=False)
integ.enable()
integ.step(1)
link = Link(1 << 20)
a, b = torch.randn(32, 64), torch.randn(64, 16)

@performance_monitor(sys.argv[2], batch_size=4, seq_length=16, integration=integ,
                     count_flops=True, tensorboard_dir=sys.argv[3], use_wandb=True)
def train_step(k):
    integ.mark_forward()
    link.send()
    y = a @ b
    integ.mark_backward()
    link.send()
    integ.mark_any()
    integ.step()
    return torch.tensor(10.0 / k)

for k in (1, 2, 3):
    train_step(k)
by_step = {s["step"]: s["lost_packets"] for s in nccl_lossy.stats()["by_step"]}
link.close()
integ.disable()
print(json.dumps({"by_step": by_step}))
"""


def test_performance_monitor_writes_one_jsonl_record_per_step(tmp_path):
    jsonl = tmp_path / "perf.jsonl"
    proc = run_python(MONITOR_SCRIPT, env=clean_env(NCCL_SOCKET_IFNAME="lo"),
                      args=(str(TESTS), str(jsonl), str(tmp_path / "tb")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_step = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1])["by_step"].items()}
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    from nccl_lossy.monitor import RECORD_KEYS

    assert [r["step"] for r in records] == [1, 2, 3]
    for k, r in enumerate(records, start=1):
        assert list(r) == list(RECORD_KEYS)
        assert r["wall_s"] > 0
        assert r["samples_per_s"] == pytest.approx(4 / r["wall_s"])
        assert r["tokens_per_s"] == pytest.approx(64 / r["wall_s"])
        assert [(c["op"], c["phase"], c["messages"], c["packets"]) for c in r["by_op"]] == [
            ("Unknown", "backward", 1, 2048), ("Unknown", "forward", 1, 2048)]
        assert r["packets"] == 4096
        assert r["lost_packets"] == sum(c["lost_packets"] for c in r["by_op"]) == by_step[r["step"]]
        assert 2 * 820 <= r["lost_packets"] <= 2 * 1228
        assert r["flops"] == 2 * 32 * 64 * 16
        assert r["loss"] == pytest.approx(10.0 / k)
    # TensorBoard and wandb are optional: without them the monitor went on (above) without them
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert not (tmp_path / "tb").exists()
    else:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


# attach() on a real model and optimizer: the hooks' phases and steps become ranges.
RANGES_SCRIPT = r"""
import json, sys
import torch
import nccl_lossy
from nccl_lossy.profiler import LossyProfiler

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
integ = nccl_lossy.LossyMegatronIntegration(loss_rate=0.01, patch_megatron=False, apply_env=False)
integ.enable()
integ.attach(model, opt)
prof = LossyProfiler(output_dir=sys.argv[1], activities=("cpu",), wait=0, warmup=0, active=5,
                     repeat=1, export_chrome_trace=True)
prof.start()
x = torch.randn(8, 16)
for _ in range(2):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
integ.disable()
prof.stop()
print(json.dumps({"torch": [str(p) for p in prof.written["torch"]]}))
"""


def test_attached_model_marks_steps_and_phases_as_ranges(tmp_path):
    proc = run_python(RANGES_SCRIPT, env=clean_env(), args=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    trace = load_trace(out["torch"][0])

    def inside(event, rng):
        return rng["ts"] <= event["ts"] and event["ts"] + event.get("dur", 0) <= rng["ts"] + rng["dur"]

    steps = sorted(_ranges(trace, "lossy:step 0") + _ranges(trace, "lossy:step 1"), key=lambda e: e["ts"])
    assert [s["name"] for s in steps] == ["lossy:step 0", "lossy:step 1"]
    phases = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") in
              ("lossy:forward", "lossy:backward", "lossy:any")]
    # step 1 begins after the optimizer's step, in phase any (zero_grad), until the forward
    for step, before in zip(steps, ([], ["lossy:any"])):
        inner = sorted((p for p in phases if inside(p, step)), key=lambda e: e["ts"])
        assert [p["name"] for p in inner] == before + ["lossy:forward", "lossy:backward", "lossy:any"]
        forward, backward, _ = inner[len(before):]
        assert forward["ts"] + forward["dur"] <= backward["ts"]
        # the model's matmuls sit in the forward range; their gradients in the backward range
        mms = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == "aten::addmm"
               and inside(e, step)]
        assert len(mms) == 2 and all(inside(e, forward) for e in mms)
        assert any(e.get("name") == "aten::mm" and inside(e, backward) for e in trace["traceEvents"]
                   if e.get("ph") == "X")


def test_load_trace_refuses_a_fifo_a_device_and_bad_bytes_naming_the_file(tmp_path):
    # A FIFO given as a trace blocked the reader for ever (read whole with read_text), and a
    # file that is not UTF-8 gave a bare UnicodeDecodeError naming no file. Read in a child
    # with a deadline, so that a reader that blocks fails instead of hanging the suite.
    import os

    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"traceEvents": [], "name": "caf\xe9"}')
    code = ("import sys\n"
            "from nccl_lossy.profiler import load_trace, TraceFormatError\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        load_trace(path)\n"
            "        print('read', path)\n"
            "    except TraceFormatError as err:\n"
            "        print('TraceFormatError', err)\n")
    proc = run_python(code, args=(str(fifo), str(zero), str(latin)), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3, proc.stdout
    assert lines[0].startswith("TraceFormatError") and str(fifo) in lines[0], lines[0]
    assert "a FIFO" in lines[0] and "regular file" in lines[0], lines[0]
    assert lines[1].startswith("TraceFormatError") and "a character device" in lines[1], lines[1]
    assert lines[2].startswith("TraceFormatError") and str(latin) in lines[2], lines[2]
    assert "UTF-8" in lines[2], lines[2]


def test_load_trace_names_the_file_for_json_python_cannot_decode(tmp_path):
    # JSON nested deeper than Python's json reads raised a bare RecursionError, and an integer
    # of more digits than int() converts a bare ValueError, neither naming the file.
    import sys

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    cases = [deep]
    if hasattr(sys, "get_int_max_str_digits"):
        long = tmp_path / "long.json"
        long.write_text('{"traceEvents": [], "n": ' + "9" * 5000 + "}")
        cases.append(long)
    for path in cases:
        with pytest.raises(TraceFormatError) as err:
            load_trace(path)
        assert str(path) in str(err.value), err.value


# Two profilers one after the other in one process, into one directory (a profile early in
# training and another later): each keeps its own files.
TWICE_SCRIPT = r"""
import json, sys
import torch
from nccl_lossy.profiler import LossyProfiler

written = []
for name in ("first window", "second window"):
    prof = LossyProfiler(output_dir=sys.argv[1], activities=("cpu",), wait=0, warmup=0,
                         active=1, repeat=1)
    prof.start()
    with torch.profiler.record_function(name):
        torch.ones(4).sum()
    prof.step()
    prof.stop()
    written += [str(p) for p in prof.written["torch"]]
print(json.dumps(written))
"""


def test_a_second_profiler_in_the_process_keeps_the_first_ones_trace(tmp_path):
    proc = run_python(TWICE_SCRIPT, env=clean_env(RANK=0), args=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(written) == 2 and len(set(written)) == 2
    names = [{e.get("name") for e in load_trace(p)["traceEvents"]} for p in written]
    assert "first window" in names[0] and "second window" in names[1]


# A profiled window while the plugin's connections stay open (as in training, where NCCL keeps
# them until the process group is destroyed): at export the profiler asks the plugin in this
# process to write its trace file now, so the merge holds every message sent so far.
# "open": no connection closed yet; "stale": a first connection closed after one message (the
# plugin wrote its file then), the window sent two more; "profile": the trace directory comes
# from the profile's own `trace` key, not NCCL_LOSSY_TRACE, and the profiler is given none;
# "off": the plugin traces nothing, yet the profiler was given a trace directory.
WINDOW_SCRIPT = r"""
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import torch
import nccl_lossy
from nccl_lossy.profiler import LossyProfiler
from net_harness import Link

kind = sys.argv[4]
integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, patch_megatron=False)
integ.enable()
if kind == "stale":
    first = Link(1 << 16)
    first.send()
    first.close()                      # the plugin writes its trace file: one message
link = Link(1 << 16)
prof = LossyProfiler(output_dir=sys.argv[2], trace_dir=None if kind == "profile" else sys.argv[3],
                     activities=("cpu",), wait=0, warmup=0, active=1, repeat=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prof.start()
    for _ in range(2 if kind == "stale" else 1):
        link.send()
    prof.step()
    prof.stop()
link.close()
integ.disable()
print(json.dumps({"merged": [str(p) for p in prof.written["merged"]],
                  "warnings": [str(w.message) for w in caught]}))
"""


def run_window(tmp_path, kind):
    trace_dir = tmp_path / "trace"
    env = clean_env(NCCL_SOCKET_IFNAME="lo", RANK=0)
    if kind == "profile":
        profile = tmp_path / "traced.toml"
        profile.write_text(f'trace = "{trace_dir}"\n')
        env["NCCL_LOSSY_PROFILE"] = str(profile)
    elif kind != "off":
        env["NCCL_LOSSY_TRACE"] = str(trace_dir)
    proc = run_python(WINDOW_SCRIPT, env=env,
                      args=(str(TESTS), str(tmp_path / "prof"), str(trace_dir), kind))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return trace_dir, json.loads(proc.stdout.strip().splitlines()[-1])


def _sends(merged):
    return [e for e in load_trace(merged)["traceEvents"] if e.get("cat") == "lossy" and e["ph"] == "X"]


@pytest.mark.parametrize("kind,sends", [("open", 1), ("stale", 3), ("profile", 1)])
def test_an_export_merges_every_message_the_plugin_sent_so_far(tmp_path, kind, sends):
    _, out = run_window(tmp_path, kind)
    (merged,) = out["merged"]
    assert len(_sends(merged)) == sends
    assert [w for w in out["warnings"] if "trace" in w] == []


def test_an_export_whose_plugin_traces_nothing_says_how_to_turn_tracing_on(tmp_path):
    trace_dir, out = run_window(tmp_path, "off")
    assert out["merged"] == []
    (warning,) = [w for w in out["warnings"] if "trace" in w]
    assert "traces nothing" in warning and "NCCL_LOSSY_TRACE" in warning
    assert str(trace_dir) in warning


# The plugin takes the first rank variable holding an unsigned integer (Rust's u64 parse);
# the profiler must find the file under the same name, whatever the variables hold.
NAME_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from nccl_lossy.profiler import LossyProfiler
from net_harness import Link
os.environ["NCCL_NET_PLUGIN"] = str(nccl_lossy.library_path())
link = Link(1 << 12)
link.send()
link.close()
print(json.dumps({"expected": str(LossyProfiler(trace_dir=sys.argv[2]).plugin_trace_path()),
                  "written": sorted(os.listdir(sys.argv[2]))}))
"""


@pytest.mark.parametrize("rank", ["-1", "1_0", "\u0663"])
def test_the_profiler_names_the_plugins_trace_file_as_the_plugin_does(tmp_path, rank):
    trace_dir = tmp_path / "trace"
    proc = run_python(NAME_SCRIPT, env=clean_env(NCCL_SOCKET_IFNAME="lo", RANK=rank,
                                                 OMPI_COMM_WORLD_RANK=5,
                                                 NCCL_LOSSY_TRACE=str(trace_dir)),
                      args=(str(TESTS), str(trace_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    traces = [n for n in out["written"] if n.startswith("lossy-trace-")]
    assert [str(trace_dir / n) for n in traces] == [out["expected"]]


# The plugin cannot write its trace file at export (its directory was replaced by a file):
# that costs the merge of that export, not the training run that called prof.step().
CUT_SCRIPT = r"""
import json, os, shutil, sys, warnings
sys.path.insert(0, sys.argv[1])
import torch
import nccl_lossy
from nccl_lossy.profiler import LossyProfiler
from net_harness import Link

os.environ["NCCL_NET_PLUGIN"] = str(nccl_lossy.library_path())
link = Link(1 << 12)
link.send()
link.close()                       # the plugin writes its trace file
shutil.rmtree(sys.argv[3])
open(sys.argv[3], "w").close()
prof = LossyProfiler(output_dir=sys.argv[2], trace_dir=sys.argv[3], activities=("cpu",),
                     wait=0, warmup=0, active=1, repeat=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prof.start()
    torch.ones(3).sum()
    prof.step()
    prof.stop()
print(json.dumps({"torch": [str(p) for p in prof.written["torch"]],
                  "merged": [str(p) for p in prof.written["merged"]],
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_a_plugin_that_cannot_write_its_trace_at_export_is_a_warning_not_a_crash(tmp_path):
    trace_dir = tmp_path / "trace"
    proc = run_python(CUT_SCRIPT, env=clean_env(NCCL_SOCKET_IFNAME="lo", RANK=0,
                                                NCCL_LOSSY_TRACE=str(trace_dir)),
                      args=(str(TESTS), str(tmp_path / "prof"), str(trace_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["torch"]) == 1 and out["merged"] == []
    (warning,) = [w for w in out["warnings"] if "could not write its trace" in w]
    assert "ncclLossyWriteTrace" in warning
    assert "cannot create trace directory" in proc.stderr


def test_the_profiler_names_the_trace_file_of_a_non_ascii_host_as_the_plugin_does(tmp_path):
    # A host name of its own in a UTS namespace (root only): the plugin keeps ASCII letters
    # and digits, '-', '_', '.' and writes '_' for any other character.
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    probe = unshare and subprocess.run([unshare, "--uts", "true"], capture_output=True)
    if not probe or probe.returncode != 0:
        pytest.skip("needs unshare --uts (root)")
    trace_dir = tmp_path / "trace"
    proc = subprocess.run(
        [unshare, "--uts", "sh", "-c",
         'printf "n\\303\\251ud-7" > /proc/sys/kernel/hostname && exec "$@"', "sh",
         sys.executable, "-c", NAME_SCRIPT, str(TESTS), str(trace_dir)],
        env=clean_env(NCCL_SOCKET_IFNAME="lo", RANK=0, NCCL_LOSSY_TRACE=str(trace_dir)),
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    traces = [n for n in out["written"] if n.startswith("lossy-trace-")]
    assert len(traces) == 1 and traces[0].startswith("lossy-trace-rank0-n_ud-7-")
    assert [str(trace_dir / n) for n in traces] == [out["expected"]]


@pytest.mark.parametrize("ts", ["soon", None, [1]])
def test_a_plugin_event_whose_time_is_no_number_is_a_trace_error_naming_file_and_event(tmp_path, ts):
    # It failed with a bare ValueError / TypeError of float() ("could not convert string to
    # float: 'soon'") naming neither the file nor the event.
    torch_path = tmp_path / "torch.json"
    torch_path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "r", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0}]}))
    plugin_path = tmp_path / "lossy-trace.json"
    plugin_path.write_text(json.dumps({
        "lossy_trace": {"format_version": 1, "clock": "CLOCK_REALTIME"},
        "traceEvents": [{"ph": "X", "name": "ok", "pid": 1, "tid": 0, "ts": 1.0, "dur": 1.0},
                        {"ph": "X", "name": "bad", "pid": 1, "tid": 0, "ts": ts, "dur": 1.0}]}))
    with pytest.raises(TraceFormatError) as err:
        merge_trace_files(torch_path, plugin_path, tmp_path / "merged.json")
    text = str(err.value)
    assert str(plugin_path) in text and "traceEvents.1" in text and repr(ts) in text, text
    assert not (tmp_path / "merged.json").exists()


# A plugin trace file the profiler finds but cannot merge (an event of another layout): the
# export's merge is skipped with a warning, and prof.step() returns to the training loop.
BAD_EVENT_SCRIPT = r"""
import json, sys, warnings
import torch
from nccl_lossy.profiler import LossyProfiler
prof = LossyProfiler(output_dir=sys.argv[1], trace_dir=sys.argv[2], activities=("cpu",),
                     wait=0, warmup=0, active=1, repeat=1)
path = prof.plugin_trace_path()
path.parent.mkdir(parents=True)
path.write_text(json.dumps({"lossy_trace": {"format_version": 1, "clock": "CLOCK_REALTIME"},
                            "traceEvents": [{"ph": "X", "name": "s", "pid": 1, "tid": 0,
                                             "ts": "soon", "dur": 1}]}))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prof.start()
    torch.ones(3).sum()
    prof.step()
    prof.stop()
print(json.dumps({"torch": [str(p) for p in prof.written["torch"]],
                  "merged": [str(p) for p in prof.written["merged"]],
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_a_plugin_trace_event_the_merge_cannot_read_is_a_warning_not_a_crash(tmp_path):
    trace_dir = tmp_path / "trace"
    # no plugin library reachable: the profiler merges the file it finds as it is
    proc = run_python(BAD_EVENT_SCRIPT, env=clean_env(RANK=0, NCCL_LOSSY_LIBRARY=str(tmp_path / "none.so")),
                      args=(str(tmp_path / "prof"), str(trace_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["torch"]) == 1 and out["merged"] == []
    (warning,) = [w for w in out["warnings"] if "no merged trace" in w]
    assert "traceEvents.0" in warning and "'soon'" in warning, warning


@pytest.mark.parametrize("settings, named", [
    ({"activities": "cpu"}, "activities='cpu'"),          # iterated as 'c', 'p', 'u'
    ({"activities": None}, "activities=None"),
    ({"record_shapes": "no"}, "record_shapes='no'"),      # taken as true
    ({"export_tensorboard": 1}, "export_tensorboard=1"),
    ({"merge": None}, "merge=None"),
    ({"extra": None}, "extra=None"),                      # failed at start(): **None
    ({"output_dir": None}, "output_dir=None"),
    ({"trace_dir": 3}, "trace_dir=3"),
])
def test_a_setting_of_the_wrong_kind_is_refused_at_construction_naming_it(tmp_path, settings, named):
    # These were taken as they came: text iterated as activity names, "no" recording shapes,
    # extra=None failing only at start() inside torch, output_dir=None with a bare TypeError.
    with pytest.raises(ValueError) as err:
        LossyProfiler(**{"output_dir": tmp_path, **settings})
    assert named in str(err.value) and "allowed" in str(err.value), str(err.value)


def test_a_profiler_given_something_else_than_a_config_says_what_it_takes(tmp_path):
    # LossyProfiler("prof") failed with "replace() should be called on dataclass instances".
    with pytest.raises(TypeError, match=r"config='prof': allowed: a ProfilerConfig or None"):
        LossyProfiler("prof")


def test_a_second_start_without_stop_is_refused_and_keeps_the_running_profiler(tmp_path):
    # start() twice built a second torch profiler over the first, silently: the first one's
    # recording cycle was lost and never exported.
    prof = LossyProfiler(output_dir=tmp_path, activities=("cpu",), wait=0, warmup=0, active=1)
    prof.start()
    running = prof._profile
    try:
        with pytest.raises(RuntimeError, match="already started"):
            prof.start()
        assert prof._profile is running
    finally:
        prof.stop()
    prof.start()  # after stop(), a new start is fine
    prof.stop()


# The integration's ranges (lossy:step N, lossy:forward ...) were still open when the torch
# profiler's window ended (training calls integ.step(), which opens the next step's range, then
# prof.step(), which ends the window): torch warned "Warning: lossy:backward" on stderr
# (collection.cpp) for a range begun and never ended in the window, and exported it with an
# end it made up. The profiler ends the ranges at the window's end and opens them again when
# the next window records; stop() in the middle of a window does the same.
CYCLES_SCRIPT = r"""
import json, sys
import torch
import nccl_lossy
from nccl_lossy.profiler import LossyProfiler

integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
prof = LossyProfiler(output_dir=sys.argv[1], activities=("cpu",), wait=0, warmup=1, active=2,
                     repeat=0)
for steps in (6, 2, 5):                # start, stop (the last in the middle of a window), start
    prof.start()
    for _ in range(steps):
        integ.mark_forward(); torch.ones(8).sum()
        integ.mark_backward(); torch.ones(8).sum()
        integ.step()
        prof.step()
    integ.mark_forward(); torch.ones(8).sum()
    prof.stop()
integ.disable()
print(json.dumps([str(p) for p in prof.written["torch"]]))
"""


def test_profiler_windows_end_the_integrations_ranges_without_a_torch_warning(tmp_path):
    proc = run_python(CYCLES_SCRIPT, env=clean_env(), args=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Warning: lossy:" not in proc.stderr, proc.stderr[-4000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(written) >= 4
    for path in written:
        trace = load_trace(path)
        names = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("lossy:")}
        assert {"lossy:forward", "lossy:backward"} <= names, (path, names)
        assert any(n.startswith("lossy:step ") for n in names), (path, names)


# A window that begins at prof.step() (after the wait steps) while the integration's step and
# phase stay as they are had no lossy ranges at all: they were opened only at the next phase
# or step change, and a window without one showed no training section.
WAITED_SCRIPT = r"""
import json, sys
import torch
import nccl_lossy
from nccl_lossy.profiler import LossyProfiler

integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
integ.step(4)
integ.mark_forward()
prof = LossyProfiler(output_dir=sys.argv[1], activities=("cpu",), wait=1, warmup=1, active=1)
prof.start()
for _ in range(3):
    torch.ones(8).sum()
    prof.step()
prof.stop()
integ.disable()
print(json.dumps([str(p) for p in prof.written["torch"]]))
"""


def test_a_window_after_the_wait_steps_shows_the_step_and_phase_in_force(tmp_path):
    proc = run_python(WAITED_SCRIPT, env=clean_env(), args=(str(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = json.loads(proc.stdout.strip().splitlines()[-1])
    trace = load_trace(path)
    assert _ranges(trace, "lossy:step 4") and _ranges(trace, "lossy:forward")
