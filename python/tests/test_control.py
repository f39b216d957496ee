"""The control API through ctypes, on the real built library, each case in a fresh process."""

import json

from conftest import clean_env, run_harness, run_python

CONTROL_CHECKS = r"""
import json, os, sys
import nccl_lossy
from nccl_lossy import control as c
ctl = c.control()
assert ctl.source == "package", ctl.source
assert ctl.version() == c.CONTROL_VERSION == 2
ctl.set_enabled(False); ctl.set_enabled(True)
for phase in ("forward", "backward", "any", 1, 2, 0):
    ctl.set_phase(phase)
ctl.set_step(0); ctl.set_step(2**63)
try:
    ctl.set_phase(7)
except c.ControlError as err:
    print("phase7:", err)
else:
    raise SystemExit("the library accepted phase 7")
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
    assert "phase7: ncclLossySetPhase returned -1" in proc.stdout
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
