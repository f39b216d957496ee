"""The control API through ctypes, on the real built library, each case in a fresh process."""

import json
import shutil

import pytest

from conftest import TESTS, clean_env, run_harness, run_python

CONTROL_CHECKS = r"""
import json, os, sys
import nccl_lossy
from nccl_lossy import control as c
ctl = c.control()
assert ctl.source == "package", ctl.source
assert ctl.version() == c.CONTROL_VERSION == 3
ctl.set_enabled(False); ctl.set_enabled(True)
for phase in ("forward", "backward", "any", 1, 2, 0):
    ctl.set_phase(phase)
ctl.set_step(0); ctl.set_step(2**63)
assert ctl.lib.ncclLossySetPhase(7) == -1  # the library refuses it too
try:
    ctl.set_phase(7)
except ValueError as err:
    print("phase7:", err)
else:
    raise SystemExit("set_phase accepted phase 7")
doc = nccl_lossy.stats()
assert doc["format_version"] == 1 and doc["pid"] == os.getpid(), doc
assert doc["connections"] == [] and doc["total"]["messages"] == 0, doc
full = ctl.stats_json()
assert json.loads(full)["pid"] == os.getpid()
# A buffer too small for the document: the call reports the full length and we grow.
small = c.ctypes.create_string_buffer(8)
n = ctl.lib.ncclLossyStatsJson(small, 8)
assert n >= 8 and small.raw[7] == 0 and small.raw[:7] == full.encode()[:7], (n, small.raw)
print("written:", nccl_lossy.write_stats())
"""


def test_control_api_on_the_built_library(tmp_path):
    proc = run_python(CONTROL_CHECKS, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "phase7: phase 7: allowed: any, forward, backward" in proc.stdout
    assert "written: False" in proc.stdout  # no NCCL_LOSSY_STATS in this process


def test_write_stats_produces_a_readable_file(tmp_path):
    proc = run_python(CONTROL_CHECKS, env=clean_env(NCCL_LOSSY_STATS=tmp_path, RANK=5))
    assert proc.returncode == 0, proc.stderr
    assert "written: True" in proc.stdout
    files = list(tmp_path.glob("lossy-stats-rank5-*.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    doc = json.loads(files[0].read_text())
    assert doc["rank"] == 5 and doc["format_version"] == 1


def test_control_reaches_the_copy_nccl_loaded(tmp_path, lib_path):
    # The harness loads the plugin itself (as NCCL would), then sets phases through
    # nccl_lossy; the plugin's own statistics show each message under the phase set.
    out = run_harness(clean_env(NCCL_NET_PLUGIN=lib_path, NCCL_NET="lossy"))
    assert out["control_source"] == "mapped"
    cells = out["live_stats"]["connections"][0]["by_op"]
    assert sorted(c["phase"] for c in cells) == ["any", "backward", "forward"]
    assert all(c["messages"] == 1 and c["bytes"] == 1 << 20 for c in cells)


LOCATE = r"""
import ctypes, sys
from nccl_lossy import control as c
try:
    c.set_phase("forward")
except c.ControlError as err:
    print("error:", err)
else:
    print("bound:", c.control().source, c.control().path)
"""


def test_an_unloadable_library_is_reported_with_the_loaders_reason(tmp_path):
    bad = tmp_path / "bad.so"
    bad.write_text("not a library\n")
    try:
        import ctypes

        ctypes.CDLL(str(bad))
    except OSError as err:
        reason = str(err)
    proc = run_python(LOCATE, env=clean_env(NCCL_LOSSY_LIBRARY=bad))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out.startswith("error:") and str(bad) in out, out
    assert reason in out, out  # the dynamic loader's own words (e.g. invalid ELF header)


def test_a_plugin_path_that_cannot_be_opened_is_refused_not_replaced(tmp_path):
    missing = tmp_path / "gone" / "libnccl-net-lossy.so"
    proc = run_python(LOCATE, env=clean_env(NCCL_NET_PLUGIN=missing))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    # NCCL would not load the packaged copy: switches there would act on a detached copy
    assert out.startswith("error:"), out
    assert f"NCCL_NET_PLUGIN={missing}" in out and "No such file" in out, out

    # a bare name resolves as before: NCCL's search path, else the packaged copy
    proc = run_python(LOCATE, env=clean_env(NCCL_NET_PLUGIN="lossy"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("bound: package "), proc.stdout


VALUES = r"""
from nccl_lossy import control as c
for fn, bad in ((c.set_step, 2**64), (c.set_step, 1.5), (c.set_step, True), (c.set_step, "3"),
                (c.set_step, -1), (c.set_phase, 1.7), (c.set_phase, True), (c.set_phase, 5)):
    try:
        fn(bad)
    except ValueError as err:
        print("refused:", err)
    else:
        print("accepted:", fn.__name__, repr(bad))
c.set_step(2**64 - 1); c.set_phase(2); c.set_phase("Backward")
print("edges taken")
"""


def test_steps_and_phases_the_plugin_cannot_take_are_refused_naming_them():
    # ctypes would wrap 2**64 to step 0, truncate 1.5 to step 1 and take True as 1; phase 5
    # reached the library and came back as a bare return code.
    proc = run_python(VALUES)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "edges taken", proc.stdout
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 8, proc.stdout
    for line, value in zip(refused, ("18446744073709551616", "1.5", "True", "'3'", "-1")):
        assert "step" in line and value in line and "2**64" in line, line
    for line, value in zip(refused[5:], ("1.7", "True", "5")):
        assert "phase" in line and value in line and "forward" in line, line


NCCL_WITHOUT_US = r"""
import torch.distributed as dist
# torch cannot create an NCCL group without a GPU: stand in for one that has started
dist.is_initialized = lambda: True
dist.get_backend = lambda *a: "nccl"
from nccl_lossy import control as c
try:
    c.set_enabled(True)
except c.ControlError as err:
    print("error:", err)
else:
    print("bound:", c.control().source)
"""


def test_control_refuses_a_detached_copy_once_nccl_runs_without_this_plugin(lib_path):
    pytest.importorskip("torch")
    # NCCL started (torch's nccl backend) with no NCCL_NET_PLUGIN: it will never load this
    # plugin, so switches set on the packaged copy would reach nothing.
    proc = run_python(NCCL_WITHOUT_US)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip()
    assert out.startswith("error:"), out
    assert "nccl backend" in out and "NCCL_NET_PLUGIN" in out and "unset" in out, out
    # NCCL_NET_PLUGIN names this library: NCCL loads that file (now or at its first
    # communicator), and the loader hands both the same copy
    proc = run_python(NCCL_WITHOUT_US, env=clean_env(NCCL_NET_PLUGIN=lib_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "bound: NCCL_NET_PLUGIN", proc.stdout


LOADED_UNDER_ANOTHER_NAME = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])  # as NCCL loads libnccl-net.so when NCCL_NET_PLUGIN is unset
from nccl_lossy import control as c
c.set_step(42)
print(c.control().source, c.control().path)
"""


def test_control_finds_the_plugin_loaded_under_nccls_default_name(tmp_path, lib_path):
    copy = tmp_path / "libnccl-net.so"
    shutil.copy(lib_path, copy)
    proc = run_python(LOADED_UNDER_ANOTHER_NAME, args=(str(copy),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"mapped {copy}", proc.stdout


def test_integer_scalars_of_numpy_are_steps_and_phases():
    np = pytest.importorskip("numpy")
    from nccl_lossy.control import phase_code, step_value

    assert step_value(np.int64(12)) == 12 and type(step_value(np.uint64(2**64 - 1))) is int
    assert phase_code(np.int32(2)) == 2
    for bad in (np.float64(1.0), np.bool_(True)):
        with pytest.raises(ValueError):
            step_value(bad)


INSTALLED_AS_DEFAULT = r"""
import torch.distributed as dist
# NCCL started by torch, its communicators (and so the net plugin) still to come, lazily
dist.is_initialized = lambda: True
dist.get_backend = lambda *a: "nccl"
from nccl_lossy import control as c
c.set_step(3)
print(c.control().source, c.control().path)
"""


def test_the_plugin_installed_as_nccls_default_name_is_no_detached_copy(tmp_path, lib_path):
    pytest.importorskip("torch")
    # NCCL_NET_PLUGIN unset: NCCL will load libnccl-net.so from the loader's path, which is
    # this plugin; the refusal meant for a plugin NCCL never loads must not fire.
    shutil.copy(lib_path, tmp_path / "libnccl-net.so")
    proc = run_python(INSTALLED_AS_DEFAULT, env=clean_env(LD_LIBRARY_PATH=tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "NCCL_NET_PLUGIN libnccl-net.so", proc.stdout


SWITCH_VALUES = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import nccl_lossy
from net_harness import Link

nccl_lossy.LossyNetwork(set={"mtu": 512, "model.rate": 0.5, "effect": "zero"}).apply()
link = Link(1 << 20)                 # loads the plugin from NCCL_NET_PLUGIN, as NCCL does

def lost():
    before = nccl_lossy.stats()["total"]["lost_packets"]
    link.send()
    return nccl_lossy.stats()["total"]["lost_packets"] - before

rows = []
for value in ("false", "off", "", None, 2, -1, 0.0, 1.0, [], b"0", np.float64(0.0)):
    nccl_lossy.set_enabled(False)
    try:
        nccl_lossy.set_enabled(value)
        said = "accepted"
    except ValueError as err:
        said = f"refused: {err}"
    rows.append([repr(value), said, lost()])
taken = []
for value, on in ((True, True), (False, False), (1, True), (0, False), (np.bool_(True), True),
                  (np.bool_(False), False)):
    nccl_lossy.set_enabled(value)
    taken.append([repr(value), on, lost()])
link.close()
print(json.dumps({"rows": rows, "taken": taken}))
"""


def test_set_enabled_refuses_what_is_not_a_switch_instead_of_turning_loss_on():
    # set_enabled("false") (or "off", None, 2, ...) went to the plugin as truth values:
    # a string switched injection on, and 2 or -1 too, with no error.
    pytest.importorskip("numpy")
    proc = run_python(SWITCH_VALUES, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for value, said, lost in out["rows"]:
        assert said.startswith("refused: ") and value in said and "True or False" in said, (value, said)
        assert lost == 0, (value, said, lost)  # the plugin stayed off
    for value, on, lost in out["taken"]:
        # 2,048 packets at rate 0.5: none lost when off, hundreds when on
        assert (lost > 500) if on else (lost == 0), (value, lost)


def test_a_one_value_bool_array_or_tensor_is_a_switch():
    # Before the switch check, set_enabled took any truth value: a 0-d numpy bool array (what
    # `np.asarray(flag)` or `mask[()]` gives) or a one-element torch bool tensor switched loss
    # injection as it reads. Such a value is still a switch; an array of several is not.
    np = pytest.importorskip("numpy")
    from nccl_lossy.control import switch_value

    assert switch_value(np.array(True)) is True
    assert switch_value(np.array(False)) is False
    with pytest.raises(ValueError, match="True or False"):
        switch_value(np.array([True, False]))
    with pytest.raises(ValueError, match="True or False"):
        switch_value(np.array(0.0))
    torch = pytest.importorskip("torch")
    assert switch_value(torch.tensor(True)) is True
    assert switch_value(torch.tensor(False)) is False
    with pytest.raises(ValueError, match="True or False"):
        switch_value(torch.tensor([True, False]))


# Two threads change the phase at once (a forward pre-hook in the training thread and a
# gradient hook in one of autograd's threads), and two set the step at once (the integration's
# and the module's set_step). Each change is two things, the integration's state and the
# plugin's, and the phase push is two control calls (switch and phase): interleaved, they left
# the plugin injecting in the forward phase the integration keeps lossless, or counting traffic
# under another step than the recorder's. After each race a message shows the plugin's state:
# 128 packets at rate 0.5 lose none with probability 2**-128 while injecting, and exactly none
# while not.
RACES = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from nccl_lossy.steps import RECORDER
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(
    set={"mtu": 512, "model.rate": 0.5, "effect": "zero"}, enable_on_forward=False,
    patch_megatron=False)
integ.enable()
link = Link(1 << 16)

def race(*calls):
    barrier = threading.Barrier(len(calls))
    def run(call):
        barrier.wait()
        call()
    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for t in threads: t.start()
    for t in threads: t.join()

def by_step():
    return {s["step"]: s["packets"] for s in nccl_lossy.stats()["by_step"]}

wrong = []
for trial in range(200):
    race(integ.mark_forward, integ.mark_backward)
    before = nccl_lossy.stats()["total"]["lost_packets"]
    link.send()
    lost = nccl_lossy.stats()["total"]["lost_packets"] - before
    if (lost > 0) != integ.injecting():
        wrong.append(f"trial {trial}: phase {integ.phase}, injecting {integ.injecting()}, lost {lost}")
for trial in range(200):
    race(lambda: integ.step(1000 + 2 * trial), lambda: nccl_lossy.set_step(1001 + 2 * trial))
    before = by_step()
    link.send()
    grown = {s: n - before.get(s, 0) for s, n in by_step().items() if n != before.get(s, 0)}
    if grown != {RECORDER.step: 128}:
        wrong.append(f"step trial {trial}: recorder at step {RECORDER.step}, plugin counted {grown}")
link.close()
print(json.dumps(wrong[:5] + [f"{len(wrong)} of 400 races left a wrong state"] if wrong else []))
"""


def test_control_calls_from_several_threads_at_once_leave_the_plugin_as_python_says():
    proc = run_python(RACES, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# A DataLoader worker is forked while another thread of the training process is in the middle
# of a control call (a gradient hook in one of autograd's threads marking the phase): the
# child inherits the lock that call holds, held by a thread that does not exist in the child,
# and its first control call waited for it forever.
FORK_WHILE_CHANGING = r"""
import json, sys
import nccl_lossy
sys.path.insert(0, sys.argv[1])
from forking import hung_while

integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()

def worker():
    integ.step(5)
    nccl_lossy.set_phase("any")

print(json.dumps({"hung": hung_while(integ.mark_backward, worker, forks=40)}))
"""


def test_a_forked_worker_can_make_control_calls_while_a_thread_of_its_parent_was_in_one():
    proc = run_python(FORK_WHILE_CHANGING, env=clean_env(), timeout=400, args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"hung": 0}


def test_a_bool_tensor_is_no_step_nor_phase_as_a_bool_is_none():
    # True and numpy's True are refused as steps, but torch.tensor(True) (a comparison's
    # result, `integ.step(loss > 0)`) went through operator.index as step 1 (and phase 1,
    # forward), silently.
    torch = pytest.importorskip("torch")
    from nccl_lossy.control import phase_code, step_value, switch_value

    for bad in (torch.tensor(True), torch.tensor(False)):
        with pytest.raises(ValueError, match="2\\*\\*64"):
            step_value(bad)
        with pytest.raises(ValueError, match="forward"):
            phase_code(bad)
    assert step_value(torch.tensor(7)) == 7 and phase_code(torch.tensor(2)) == 2
    assert switch_value(torch.tensor(True)) is True  # a switch it is
