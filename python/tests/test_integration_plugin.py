"""LossyMegatronIntegration against the plugin's own counters: after every kind of toggle
(attribute, enable/disable, phase, step) a message goes through the real plugin, loaded the way
NCCL loads it, and the packets it lost must agree with ``injecting()``."""

import json

import pytest

from conftest import TESTS, clean_env, run_python

# 1 MiB messages cut into 512-byte packets: 2,048 packets each. With independent loss at rate
# 0.5 the chance that an injecting message loses none is 0.5**2048 (nil), and the lost count
# is Binomial(2048, 0.5): mean 1024, standard deviation sqrt(2048 / 4) = 22.6, so the window
# [820, 1228] (+-9 sd) cannot fail by chance; a message sent while not injecting loses exactly 0.
# The profile seed is fixed (the default, 1), so the counts are the same on every run.
SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(
    set={"mtu": 512, "model.rate": 0.5, "effect": "zero"}, patch_megatron=False)
integ.enable()                     # puts NCCL_NET_PLUGIN & co. in place; NCCL has not started
link = Link(1 << 20)               # loads the plugin from NCCL_NET_PLUGIN, as NCCL does
rows = []

def check(label):
    before = nccl_lossy.stats()["total"]
    link.send()
    after = nccl_lossy.stats()["total"]
    rows.append({"toggle": label, "injecting": integ.injecting(), "phase": integ.phase,
                 "packets": after["packets"] - before["packets"],
                 "lost": after["lost_packets"] - before["lost_packets"]})

check("enable()")
integ.enable_on_backward = False
integ.mark_backward()
check("mark_backward() with enable_on_backward False")
integ.enable_on_backward = True    # the phase stays backward: only the attribute changes
check("attribute enable_on_backward = True")
integ.mark_backward()
check("mark_backward() again")
integ.enable_on_backward = False
check("attribute enable_on_backward = False")
integ.enable_on_forward = False
integ.mark_forward()
check("mark_forward() with enable_on_forward False")
integ.enable_on_forward = True
check("attribute enable_on_forward = True")
integ.phase = "backward"
check("attribute phase = backward")
integ.mark_any()
check("mark_any()")
integ.disable()
check("disable()")
integ.enable()
check("enable() again")
integ.enabled = False
check("attribute enabled = False")
integ.enabled = True
check("attribute enabled = True")
integ.step(7)
check("step(7)")
integ.step_number = 9
check("attribute step_number = 9")
integ.step()
check("step()")
by_step = {s["step"]: s["packets"] for s in nccl_lossy.stats()["by_step"]}
link.close()
print(json.dumps({"rows": rows, "by_step": by_step, "step": integ.step_number}))
"""

EXPECTED = [
    ("enable()", True),
    ("mark_backward() with enable_on_backward False", False),
    ("attribute enable_on_backward = True", True),
    ("mark_backward() again", True),
    ("attribute enable_on_backward = False", False),
    ("mark_forward() with enable_on_forward False", False),
    ("attribute enable_on_forward = True", True),
    ("attribute phase = backward", False),
    ("mark_any()", True),
    ("disable()", False),
    ("enable() again", True),
    ("attribute enabled = False", False),
    ("attribute enabled = True", True),
    ("step(7)", True),
    ("attribute step_number = 9", True),
    ("step()", True),
]


def test_plugin_counters_agree_with_injecting_after_every_toggle():
    proc = run_python(SCRIPT, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    assert [(r["toggle"], r["injecting"]) for r in rows] == EXPECTED
    for r in rows:
        assert r["packets"] == 2048, r
        if r["injecting"]:
            assert 820 <= r["lost"] <= 1228, r  # the plugin injects, at the profile's rate
        else:
            assert r["lost"] == 0, r  # the plugin is off, as injecting() says
    # the steps reached the plugin: each step's message is counted under that step, the 13
    # before step(7) under the integration's step 0, which enable() told the plugin
    assert out["step"] == 10
    assert {int(k): v for k, v in out["by_step"].items()} == {0: 13 * 2048, 7: 2048, 9: 2048, 10: 2048}


# Three steps of three 1 MiB messages (512-byte packets: 6,144 packets a step) under
# loss_rate=0.2, burst_length=4 (Gilbert-Elliott, rate form), one message per phase.
STEPS_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(
    {"loss_rate": 0.2, "burst_length": 4, "effect": "zero"}, set={"mtu": 512},
    stats_dir=sys.argv[2], patch_megatron=False)
integ.enable()
link = Link(1 << 20)
for step in (1, 2, 3):
    integ.step(step)
    for phase in ("forward", "backward", "any"):
        integ.phase = phase
        link.send()
live_by_step = nccl_lossy.stats()["by_step"]
integ.step()                       # ends step 3 (the plugin is at step 4, no traffic)
link.close()                       # the plugin writes its statistics file
integ.disable()                    # writes the per-step file
print(json.dumps({"table": integ.step_table(), "live_by_step": live_by_step}))
"""


def test_per_step_statistics_from_the_plugin(tmp_path):
    import nccl_lossy

    stats_dir = tmp_path / "stats"
    proc = run_python(STEPS_SCRIPT, env=clean_env(NCCL_SOCKET_IFNAME="lo", RANK=3),
                      args=(str(TESTS), str(stats_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    table = out["table"]
    # one row per (step, collective, phase): the harness's messages carry no collective
    assert [(r["step"], r["op"], r["phase"]) for r in table] == [
        (s, "Unknown", p) for s in (1, 2, 3) for p in ("any", "backward", "forward")
    ]
    assert all(r["messages"] == 1 and r["packets"] == 2048 and r["bytes"] == 1 << 20 for r in table)
    # the rows add up to the plugin's own per-step counters
    plugin = {s["step"]: (s["packets"], s["lost_packets"]) for s in out["live_by_step"]}
    mine = {}
    for r in table:
        p, lost = mine.get(r["step"], (0, 0))
        mine[r["step"]] = (p + r["packets"], lost + r["lost_packets"])
    assert mine == plugin

    # The same from the files: the plugin's by_step, the recorded step x op x phase table,
    # the burst-length histogram.
    steps = nccl_lossy.read_stats(stats_dir, table="steps")
    assert [(r["step"], r["packets"], r["lost_packets"]) for r in steps] == [
        (s, *plugin[s]) for s in (1, 2, 3)
    ]
    assert all(r["rank"] == 3 for r in steps)
    step_ops = nccl_lossy.read_stats(stats_dir, table="step_ops")
    assert [{k: r[k] for k in table[0]} for r in step_ops] == table
    assert all(r["rank"] == 3 and "lossy-steps-rank3-" in r["file"] for r in step_ops)
    bursts = nccl_lossy.read_stats(stats_dir, table="bursts")
    lost = sum(r["lost_packets"] for r in table)
    assert sum(r["burst_length"] * r["count"] for r in bursts) == lost  # every loss in one burst
    # Loss rate 0.2 over 18,432 packets: the Gilbert-Elliott chain (p = 0.0625, r = 0.25) has
    # lag-1 correlation 1 - p - r = 0.6875, so the count's variance is n q (1 - q) times
    # (1 + 0.6875) / (1 - 0.6875) = 5.4: sd = sqrt(18432 * 0.16 * 5.4) = 126 packets, 0.0069
    # of the rate; +-0.035 is 5 sd. Bursts are geometric with mean 1 / r = 4 (variance 12);
    # over ~920 bursts the mean's sd is 0.11; +-0.6 is 5 sd.
    assert abs(lost / (9 * 2048) - 0.2) < 0.035
    burst_summary = nccl_lossy.summarize(bursts, by=("op",))
    assert burst_summary[0]["count"] == sum(r["count"] for r in bursts)
    assert abs(lost / burst_summary[0]["count"] - 4.0) < 0.6
    latency = nccl_lossy.read_stats(stats_dir, table="latency")
    assert sum(r["count"] for r in latency) == 9

    # pandas (in the test requirements): the same tables as DataFrames, summarize takes one;
    # without pandas, "auto" gives the plain rows
    try:
        import pandas as pd
    except ImportError:
        assert nccl_lossy.read_stats(stats_dir, table="steps", dataframe="auto") == steps
        return
    frame = nccl_lossy.read_stats(stats_dir, table="step_ops", dataframe=True)
    assert isinstance(frame, pd.DataFrame) and len(frame) == 9
    assert list(frame.columns) == list(nccl_lossy.statsfile.TABLES["step_ops"])
    assert isinstance(nccl_lossy.read_stats(stats_dir, table="steps", dataframe="auto"), pd.DataFrame)
    per_step = {r["step"]: r["lost_packets"] for r in nccl_lossy.summarize(frame, by=("step",))}
    assert per_step == {s: plugin[s][1] for s in (1, 2, 3)}
    everything = nccl_lossy.read_all(stats_dir)
    assert set(everything) == {"ops", "steps", "step_ops", "bursts", "latency"}
    assert everything["steps"] == steps


# Two integrations in one process, one after the other: the second starts at step 0 while the
# plugin was last told step 100. Its enable() must tell the plugin its own step.
SECOND = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

first = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, patch_megatron=False).enable()
link = Link(1 << 16)
first.step(100)
link.send()
first.disable()
second = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, patch_megatron=False).enable()
link.send()
second.step()
link.send()
by_step = {s["step"]: s["packets"] for s in nccl_lossy.stats()["by_step"]}
link.close()
print(json.dumps({"by_step": by_step, "step": second.step_number}))
"""


def test_enable_tells_the_plugin_the_integrations_own_step():
    proc = run_python(SECOND, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["step"] == 1
    # 64 KiB in 512-byte packets: 128 a message, each counted under the step it was sent in;
    # the second integration's message before its first step() is step 0's, not step 100's
    # (which made 256 there)
    assert {int(k): v for k, v in out["by_step"].items()} == {100: 128, 0: 128, 1: 128}


# A step whose backward phase is kept lossless: the plugin's per-step series says which of the
# step's packets were sent with injection off, so its loss rate is not diluted by them.
OFF_IN_A_STEP = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512, "model.rate": 0.5, "effect": "zero"},
                                            patch_megatron=False)
integ.enable()
link = Link(1 << 16)
integ.enable_on_backward = False
integ.step(1)
integ.mark_forward(); link.send()
integ.mark_backward(); link.send()
by_step = nccl_lossy.stats()["by_step"]
link.close()
print(json.dumps(by_step))
"""


def test_the_per_step_series_counts_packets_sent_with_injection_off():
    proc = run_python(OFF_IN_A_STEP, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (step,) = json.loads(proc.stdout.strip().splitlines()[-1])
    # two 64 KiB messages of 128 packets; the backward one was sent with injection off
    assert step["step"] == 1 and step["packets"] == 256, step
    assert step.get("packets_injection_off") == 128, step
    assert 0 < step["lost_packets"] <= 128, step


# attach() twice with the same optimizer (e.g. once per model chunk): its hooks were added again,
# so one optimizer step advanced the training step by two and the plugin's steps windows moved.
ATTACH_TWICE = r"""
import json
import torch
import nccl_lossy

class PlainOptimizer:            # like megatron-core's MegatronOptimizer: no torch step hooks
    def __init__(self, opt):
        self.opt = opt
    def step(self):
        self.opt.step()
        return True, None, None

integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False, record_steps=False)
steps = {}
for name, make in (("torch", lambda p: torch.optim.SGD(p, lr=0.1)),
                   ("wrapped", lambda p: PlainOptimizer(torch.optim.SGD(p, lr=0.1)))):
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    opt = make([p for c in chunks for p in c.parameters()])
    for chunk in chunks:
        integ.attach(chunk, opt)
    integ.attach(chunks, opt)
    integ.enable()
    seen = []
    for _ in range(2):
        start = integ.step_number
        sum(c(torch.ones(1, 2)).sum() for c in chunks).backward()
        opt.step()
        seen.append(integ.step_number - start)
    integ.detach()
    integ.attach(chunks, opt)      # attached again after detach(): hooked once more
    start = integ.step_number
    opt.step()
    seen.append(integ.step_number - start)
    integ.detach()
    integ.disable()
    steps[name] = seen
print(json.dumps(steps))
"""


def test_attaching_an_optimizer_again_does_not_count_its_steps_twice():
    proc = run_python(ATTACH_TWICE, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"torch": [1, 1, 1], "wrapped": [1, 1, 1]}


# Every state the plugin passes through while the integration moves between phases: the
# plugin's own control object, with each call recorded after it went through. A message the
# proxy posts between two calls sees that state, so none may be a phase whose traffic the
# integration keeps lossless with injection still on.
PHASE_ORDER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from nccl_lossy import control as _control

integ = nccl_lossy.LossyMegatronIntegration(enable_on_forward=False, patch_megatron=False)
integ.enable()
ctl = _control.control()
state = {"phase": integ.phase, "enabled": True}
seen = []
set_phase, set_enabled = ctl.set_phase, ctl.set_enabled

def recorded_phase(phase):
    set_phase(phase)
    state["phase"] = phase
    seen.append(dict(state))

def recorded_enabled(on):
    set_enabled(on)
    state["enabled"] = bool(on)
    seen.append(dict(state))

ctl.set_phase, ctl.set_enabled = recorded_phase, recorded_enabled
for _ in range(3):
    integ.mark_backward()
    integ.mark_forward()
seen.append("forward injects")
integ.enable_on_forward = True
integ.mark_backward()
seen.append("backward lossless")
integ.enable_on_backward = False
integ.mark_backward()
integ.mark_forward()
integ.mark_backward()
print(json.dumps(seen))
"""


def test_no_moment_between_two_control_calls_injects_a_phase_kept_lossless():
    # The integration set the phase and then the switch: from backward (injecting) to forward
    # (kept lossless) the plugin was in "forward, injecting" between the two calls.
    proc = run_python(PHASE_ORDER, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    lossless = {"forward"}  # the phases kept lossless, as the script changes them
    states = 0
    for entry in seen:
        if entry == "forward injects":
            lossless.discard("forward")
        elif entry == "backward lossless":
            lossless.add("backward")
        else:
            states += 1
            assert not (entry["phase"] in lossless and entry["enabled"]), (entry, lossless, seen)
    assert states >= 18, seen


# A step whose forward phase is kept lossless (enable_on_forward=False): half of its packets
# never met the loss model. The tables' loss_rate (lost over every packet) is then half the
# model's rate; the rate to hold against the model is lost over the packets sent with injection
# on, which `lossy report` gives as loss_rate_injecting. The Python tables, the live step table
# and summarize() had no such rate: a reader of them took the diluted one.
HALF_LOSSLESS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(
    set={"mtu": 512, "model.rate": 0.5, "effect": "zero"}, enable_on_forward=False,
    stats_dir=sys.argv[2], patch_megatron=False)
integ.enable()
link = Link(1 << 16)
integ.step(1)
integ.mark_forward(); link.send()      # 128 packets, injection off
integ.mark_backward(); link.send()     # 128 packets, loss at rate 0.5
integ.mark_any()
integ.step()
link.close()
integ.disable()
print(json.dumps({"table": integ.step_table()}))
"""


def test_the_tables_give_the_loss_rate_over_the_packets_that_met_the_model(tmp_path):
    import nccl_lossy

    stats_dir = tmp_path / "stats"
    proc = run_python(HALF_LOSSLESS, env=clean_env(NCCL_SOCKET_IFNAME="lo"),
                      args=(str(TESTS), str(stats_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    live = json.loads(proc.stdout.strip().splitlines()[-1])["table"]

    (step,) = nccl_lossy.read_stats(stats_dir, table="steps")
    assert (step["packets"], step["packets_injection_off"]) == (256, 128), step
    lost = step["lost_packets"]
    assert 0 < lost <= 128
    assert step["loss_rate"] == lost / 256
    assert step["loss_rate_injecting"] == lost / 128

    for rows in (nccl_lossy.read_stats(stats_dir, table="step_ops"),
                 nccl_lossy.read_stats(stats_dir), live):
        by_phase = {r["phase"]: r for r in rows}
        assert by_phase["forward"]["loss_rate_injecting"] is None  # none met the model
        assert by_phase["backward"]["loss_rate_injecting"] == by_phase["backward"]["lost_packets"] / 128
        (total,) = nccl_lossy.summarize(rows, by="op")
        assert total["packets"] == 256 and total["packets_injection_off"] == 128
        assert total["loss_rate"] == lost / 256
        assert total["loss_rate_injecting"] == lost / 128
    (total,) = nccl_lossy.summarize(nccl_lossy.read_stats(stats_dir, table="steps"), by="step")
    assert total["loss_rate_injecting"] == lost / 128
    frame = nccl_lossy.read_stats(stats_dir, table="steps", dataframe=True)
    assert list(frame.columns) == list(nccl_lossy.statsfile.TABLES["steps"])
    assert frame["loss_rate_injecting"].tolist() == [lost / 128]


# The integration's `with` block entered again inside itself (a helper that wraps its work in
# `with integ:`, called from a script that already did): the inner block's end detached every
# hook and switched injection off, so the rest of the outer block ran lossless, with no phases
# and no steps, and nothing said so.
REENTERED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512, "model.rate": 0.5, "effect": "zero"},
                                            enable_on_forward=False, patch_megatron=False)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
out = {}
with integ:
    integ.attach(model, opt)
    link = Link(1 << 16)
    with integ:                      # again, inside
        pass
    out["enabled_after_inner"] = integ.enabled
    before = nccl_lossy.stats()["total"]["lost_packets"]
    link.send()                      # phase any, injection on: loses packets
    out["lost_after_inner"] = nccl_lossy.stats()["total"]["lost_packets"] - before
    model(torch.ones(1, 4))          # the forward pre-hook still marks forward
    out["phase_after_forward"] = integ.phase
    opt.step()                       # the step hook still advances the step
    out["step"] = integ.step_number
out["enabled_after_outer"] = integ.enabled
out["hooks_after_outer"] = len(integ._detachers)
link.close()
print(json.dumps(out))
"""


def test_a_with_block_entered_again_inside_itself_leaves_the_outer_one_running():
    pytest.importorskip("torch")
    proc = run_python(REENTERED, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["enabled_after_inner"] is True, out
    assert out["lost_after_inner"] > 0, out
    assert out["phase_after_forward"] == "forward", out
    assert out["step"] == 1, out
    assert out["enabled_after_outer"] is False and out["hooks_after_outer"] == 0, out


#: The start of a script for step_tables(): an enabled integration recording steps, and a link.
STEPPING_HEAD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, stats_dir=sys.argv[2], patch_megatron=False)
integ.enable()
link = Link(1 << 16)
"""


def step_tables(script, tmp_path):
    """Runs ``script`` (given the tests' folder and a statistics directory, printing its
    integration's step table last): that table, then ``step_ops`` and ``steps`` as read back."""
    import nccl_lossy

    stats_dir = tmp_path / "stats"
    proc = run_python(script, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS), str(stats_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    live = json.loads(proc.stdout.strip().splitlines()[-1])["table"]
    read = nccl_lossy.read_stats
    return live, read(stats_dir, table="step_ops"), read(stats_dir, table="steps")


# A step set twice, traffic while the integration is disabled (an evaluation between training
# steps), and the step going back (a resume from the checkpoint of step 2 in the same process):
# the plugin's per-step series adds each message to the step it was sent in. The recorded table
# had two rows for one (step, collective, phase), out of step order, and left out the messages
# sent between disable() and enable(), so `steps` and `step_ops` disagreed on the step's packets.
REVISITED = STEPPING_HEAD + r"""
integ.step(1); link.send()
integ.step(2); link.send()
integ.step(2); link.send()       # the same step set twice
integ.step(3); link.send()
integ.disable(); link.send()     # traffic while disabled: the plugin is still at step 3
integ.enable(); link.send()
integ.step(2); integ.mark_backward(); link.send()   # back to step 2
integ.step(5)
link.close()
integ.disable()
print(json.dumps({"table": integ.step_table()}))
"""


def test_a_step_set_again_or_revisited_and_traffic_while_disabled_are_counted_once_each(tmp_path):
    live, step_ops, steps = step_tables(REVISITED, tmp_path)
    # 64 KiB messages in 512-byte packets: 128 packets each
    wanted = [(1, "any", 1, 128), (2, "any", 2, 256), (2, "backward", 1, 128), (3, "any", 3, 384)]
    for rows in (live, step_ops):
        assert [(r["step"], r["phase"], r["messages"], r["packets"]) for r in rows] == wanted
    assert [(r["step"], r["packets"]) for r in steps] == [(1, 128), (2, 384), (3, 384)]


# nccl_lossy.set_step() while an integration records steps (a training loop that keeps its
# own step count and tells the plugin directly): the plugin counted the traffic under the new
# step, but the integration's recorder still put it in the old one, so step_ops and the
# plugin's steps table disagreed about the same messages.
SET_STEP_DIRECTLY = STEPPING_HEAD + r"""
integ.step(1); link.send()
nccl_lossy.set_step(7); link.send(); link.send()
integ.step(8); link.send()
link.close()
integ.disable()
print(json.dumps({"table": integ.step_table()}))
"""


def test_a_step_set_through_the_module_moves_the_integrations_recorder_too(tmp_path):
    live, step_ops, steps = step_tables(SET_STEP_DIRECTLY, tmp_path)
    wanted = [(1, 1, 128), (7, 2, 256), (8, 1, 128)]
    for rows in (live, step_ops):
        assert [(r["step"], r["messages"], r["packets"]) for r in rows] == wanted
    assert [(r["step"], r["packets"]) for r in steps] == [(1, 128), (7, 256), (8, 128)]


# A resume from a checkpoint told through the module (nccl_lossy.set_step(iteration)) while an
# integration counts the optimizer's steps: the integration kept its own count, said
# step_number 1 for a plugin at step 7, and its next step() took the plugin back to step 2.
RESUMED_THROUGH_THE_MODULE = STEPPING_HEAD + r"""
integ.step(1); link.send()
nccl_lossy.set_step(7); link.send()
assert integ.step_number == 7, integ.step_number
integ.step(); link.send()
link.close()
integ.disable()
assert integ.step_number == 8, integ.step_number
print(json.dumps({"table": integ.step_table()}))
"""


def test_the_integration_counts_on_from_a_step_set_through_the_module(tmp_path):
    live, step_ops, steps = step_tables(RESUMED_THROUGH_THE_MODULE, tmp_path)
    assert [(r["step"], r["packets"]) for r in steps] == [(1, 128), (7, 128), (8, 128)]
    assert [(r["step"], r["packets"]) for r in live] == [(1, 128), (7, 128), (8, 128)]


# The same integration entered again while enabled (a helper wrapping its work in `with integ:`,
# or enable() called again) after a resume told through the module: enable() moved the plugin
# back to the step the integration had before set_step(7), so the traffic after it was counted
# under step 1 and the next step() was 2.
REENTERED_AFTER_A_RESUME = STEPPING_HEAD + r"""
integ.step(1); link.send()
nccl_lossy.set_step(7)
with integ:
    assert integ.step_number == 7, integ.step_number
    link.send()
integ.enable()
assert integ.step_number == 7, integ.step_number
link.send()
integ.step(); link.send()
link.close()
integ.disable()
assert integ.step_number == 8, integ.step_number
print(json.dumps({"table": integ.step_table()}))
"""


def test_enabling_an_enabled_integration_again_keeps_the_step_in_force(tmp_path):
    live, step_ops, steps = step_tables(REENTERED_AFTER_A_RESUME, tmp_path)
    assert [(r["step"], r["packets"]) for r in steps] == [(1, 128), (7, 256), (8, 128)]
    assert [(r["step"], r["packets"]) for r in live] == [(1, 128), (7, 256), (8, 128)]


# A relative NCCL_LOSSY_STATS and a script that changes its working directory after NCCL
# started: the plugin keeps the directory its init resolved, but the integration resolved the
# variable again at disable() and wrote the per-step file into the new working directory, apart
# from the plugin's file (read_stats found no per-step file beside it).
MOVED = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

os.chdir(sys.argv[2])
os.environ["NCCL_LOSSY_STATS"] = "stats"
integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, patch_megatron=False)
integ.enable()
link = Link(1 << 16)
integ.step(1); link.send()
os.mkdir("elsewhere"); os.chdir("elsewhere")
link.close()
integ.disable()
"""


def test_a_relative_statistics_directory_stays_where_it_was_when_the_script_moves(tmp_path):
    proc = run_python(MOVED, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS), str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    kept = sorted(p.name.split("-")[1] for p in (tmp_path / "stats").iterdir())
    assert kept == ["stats", "steps"], kept
    assert not (tmp_path / "elsewhere" / "stats").exists()


# attach(model, optimizer) starts at step 0 and the optimizer's step moves to step 1: the first
# training step's traffic is step 0's. The plugin's per-step series left step 0 out ("never
# set"), so the `steps` table and `lossy report --per-step` missed the first training step
# that step_ops, the profiler's "lossy:step 0" range and the monitor's record showed.
FIRST_STEP = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import nccl_lossy
from net_harness import Link

class Sending(torch.nn.Linear):      # a layer whose forward pass sends one message
    def forward(self, x):
        link.send()
        return super().forward(x)

torch.manual_seed(0)
model = Sending(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, stats_dir=sys.argv[2], patch_megatron=False)
with integ:
    integ.attach(model, opt)
    link = Link(1 << 16)
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    link.close()
print(json.dumps({"table": integ.step_table()}))
"""


def test_the_first_training_step_is_step_0_in_every_table(tmp_path):
    import nccl_lossy

    stats_dir = tmp_path / "stats"
    proc = run_python(FIRST_STEP, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS), str(stats_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    live = json.loads(proc.stdout.strip().splitlines()[-1])["table"]
    # one 64 KiB message (128 packets) in each step's forward pass
    assert [(r["step"], r["phase"], r["packets"]) for r in live] == [(0, "forward", 128), (1, "forward", 128)]
    steps = nccl_lossy.read_stats(stats_dir, table="steps")
    assert [(r["step"], r["packets"]) for r in steps] == [(0, 128), (1, 128)]


# Two integrations enabled at once in one process (one per model, or a helper that makes its
# own): the plugin's phase, step and switch are process-wide, so each one's enable(), phase and
# step() overwrite the other's (the second's enable() sent the plugin from step 5 back to 0)
# and both step tables count the same traffic. Nothing said so.
TWO_AT_ONCE = r"""
import json, warnings
import nccl_lossy

first = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
first.step(5)
second = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    second.enable()                   # while the first is enabled: warned
    second.disable()
    second.enable()                   # again: warned again
    first.disable()
    second.disable()
    first.enable()                    # one at a time: no warning
    first.disable()
print(json.dumps([str(w.message) for w in caught]))
"""


def test_a_second_integration_enabled_while_another_is_says_so():
    proc = run_python(TWO_AT_ONCE, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(messages) == 2, messages
    assert all("another LossyMegatronIntegration is enabled" in m and "step 5" in m for m in messages)


# Two integrations one after the other in one process, with one statistics directory (a sweep
# run in one process): the per-step file is named by rank, host and pid, so the second one's
# disable() wrote over the first one's file and step 100 was gone from step_ops, while the
# plugin's steps table (process-wide) kept it. The message sent between the first's disable()
# and the second's enable() is step 100's, in the plugin as in step_ops.
ONE_AFTER_THE_OTHER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

first = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, stats_dir=sys.argv[2], patch_megatron=False)
first.enable()
link = Link(1 << 16)
first.step(100); link.send()
first.disable(); link.send()
second = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512}, stats_dir=sys.argv[2], patch_megatron=False)
second.enable(); link.send()
second.step(); link.send()
link.close()
second.disable()
"""


def test_integrations_one_after_the_other_keep_every_step_in_the_per_step_file(tmp_path):
    import nccl_lossy

    stats_dir = tmp_path / "stats"
    proc = run_python(ONE_AFTER_THE_OTHER, env=clean_env(NCCL_SOCKET_IFNAME="lo"),
                      args=(str(TESTS), str(stats_dir)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    # 128 packets a message
    wanted = [(0, 128), (1, 128), (100, 256)]
    assert [(r["step"], r["packets"]) for r in nccl_lossy.read_stats(stats_dir, table="steps")] == wanted
    assert [(r["step"], r["packets"]) for r in nccl_lossy.read_stats(stats_dir, table="step_ops")] == wanted


# write_stats() in the middle of a step (a checkpoint's statistics, or the end of a run that
# never calls disable()): the plugin's file had the step's messages so far, the per-step file
# written beside it at the same moment ended at the last step boundary and left them out.
MID_STEP = STEPPING_HEAD + r"""
import shutil
integ.step(1); link.send()
integ.step(2); link.send()
integ.write_stats()              # step 2 is under way
shutil.copytree(sys.argv[2], sys.argv[3])
link.send()
integ.step(3)
integ.write_stats()
link.close()
integ.disable()
"""


def test_write_stats_in_the_middle_of_a_step_writes_the_step_so_far(tmp_path):
    import nccl_lossy

    stats_dir, mid = tmp_path / "stats", tmp_path / "mid-step"
    proc = run_python(MID_STEP, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS), str(stats_dir), str(mid)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    # 128 packets a message; step 2's second message came after the first write
    for directory, wanted in ((mid, [(1, 128), (2, 128)]), (stats_dir, [(1, 128), (2, 256)])):
        for table in ("steps", "step_ops"):
            rows = nccl_lossy.read_stats(directory, table=table)
            assert [(r["step"], r["packets"]) for r in rows] == wanted, (directory.name, table)


# disable() of an integration that was never enabled (a helper's cleanup in a `finally`, or a
# second object made only to read statistics) switched injection off process-wide, under the
# integration that was enabled, which went on saying injecting(). It leaves the plugin alone,
# as LossyProfiler.stop() of a profiler never started does; so does a second disable().
NEVER_ENABLED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(set={"mtu": 512, "model.rate": 0.5}, patch_megatron=False)
integ.enable()
integ.step(3)
link = Link(1 << 16)
rows = []

def check(label):
    before = nccl_lossy.stats()["total"]["lost_packets"]
    link.send()
    rows.append([label, integ.injecting(), nccl_lossy.stats()["total"]["lost_packets"] > before])

check("enabled")
other = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False)
other.disable()
check("another, never enabled, disable()d")
spent = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False)
spent.disable(revert_patches=True)
check("another disable(revert_patches=True)")
by_step = {s["step"]: s["packets"] for s in nccl_lossy.stats()["by_step"]}
link.close()
print(json.dumps({"rows": rows, "by_step": by_step, "step": integ.step_number}))
"""


def test_disable_of_an_integration_never_enabled_leaves_the_plugin_alone():
    proc = run_python(NEVER_ENABLED, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 128 packets a message at rate 0.5: losing none by chance is 0.5**128
    assert out["rows"] == [
        ["enabled", True, True],
        ["another, never enabled, disable()d", True, True],
        ["another disable(revert_patches=True)", True, True],
    ]
    # and the step stays the enabled integration's (the other's disable() did not move it to 0)
    assert out["step"] == 3
    assert {int(k): v for k, v in out["by_step"].items()} == {3: 3 * 128}
