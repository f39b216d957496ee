"""The integration inside a job a launcher set up (`lossy run`, or the user's shell): values the
code leaves at their defaults keep what the environment says, a value the code sets that
differs from the environment's is refused, missing variables are filled in, and the per-step
statistics land where the plugin writes its own."""

import json
import subprocess
import sys

import nccl_lossy
from conftest import TESTS, clean_env, lossy_binary, run_python

VARS = (
    "NCCL_NET",
    "NCCL_NET_PLUGIN",
    "NCCL_PROTO",
    "NCCL_LOSSY_PROFILE",
    "NCCL_LOSSY_SET",
    "NCCL_LOSSY_STATS",
)

# Loses half the packets (512-byte packets: 2,048 in a 1 MiB message) and zeroes them, so
# `lossy run` also pins NCCL_PROTO=Simple. The embedded default loses 1%: a lost count in
# [820, 1228] (+-9 sd of Binomial(2048, 0.5)) proves the plugin read this profile.
HALF = 'seed = 5\nmtu = 512\neffect = "zero"\nmodel = { kind = "uniform", rate = 0.5 }\n'
ZERO_1PCT = 'effect = "zero"\nmodel = { kind = "uniform", rate = 0.01 }\n'

# A train.py as a user writes it: the integration with its defaults (apply_env=True).
TRAIN = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

VARS = %r
before = {k: os.environ.get(k) for k in VARS}
integ = nccl_lossy.LossyMegatronIntegration(enable_on_forward=False, patch_megatron=False)
integ.enable()
after = {k: os.environ.get(k) for k in VARS}
link = Link(1 << 20)               # loads the plugin from NCCL_NET_PLUGIN, as NCCL does
integ.step(1)
integ.mark_backward()
link.send()
integ.mark_forward()
link.send()
integ.step()
link.close()                       # the plugin writes its statistics file
written = integ.write_stats()
integ.disable()
print(json.dumps({"before": before, "after": after, "written": written and str(written),
                  "profile": str(integ.network.profile),
                  "stats_dir": str(integ.network.stats_dir)}))
""" % (VARS,)


def test_lossy_run_environment_survives_enable_and_gets_the_per_step_file(tmp_path):
    prof = tmp_path / "half.toml"
    prof.write_text(HALF)
    stats = tmp_path / "stats"
    proc = subprocess.run(
        [lossy_binary(), "run", "--profile", str(prof), "--stats", str(stats), "--",
         sys.executable, "-c", TRAIN, str(TESTS)],
        env=clean_env(NCCL_SOCKET_IFNAME="lo", RANK=2),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    before = out["before"]
    assert before["NCCL_LOSSY_PROFILE"] == str(prof) and before["NCCL_LOSSY_STATS"] == str(stats)
    assert before["NCCL_PROTO"] == "Simple" and before["NCCL_NET"] == "lossy"
    # enable() changed nothing the launcher set
    assert out["after"] == before
    # the integration describes what is in force
    assert out["profile"] == str(prof.resolve())
    assert out["stats_dir"] == str(stats.resolve())

    # the plugin read the launcher's profile: half the backward packets lost, none forward
    cells = nccl_lossy.read_stats(stats, table="step_ops")
    assert [(r["step"], r["phase"], r["packets"]) for r in cells] == [
        (1, "backward", 2048), (1, "forward", 2048)
    ]
    lost = {r["phase"]: r["lost_packets"] for r in cells}
    assert lost["forward"] == 0 and 820 <= lost["backward"] <= 1228, lost
    assert all(r["rank"] == 2 for r in cells)
    # the per-step file is where write_stats() said, next to the plugin's own file
    assert out["written"] is not None and out["written"].startswith(str(stats))
    assert sorted(p.name.split("-")[1] for p in stats.glob("lossy-*-rank2-*.json")) == ["stats", "steps"]


WRITE_ONLY = r"""
import sys
import nccl_lossy
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False)
integ.enable()
integ.step()
print(integ.write_stats())
"""


def test_write_stats_uses_the_environments_directory_with_apply_env_false(tmp_path):
    stats = tmp_path / "stats"
    stats.mkdir()
    proc = run_python(WRITE_ONLY, env=clean_env(NCCL_LOSSY_STATS=stats, RANK=4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = proc.stdout.strip().splitlines()[-1]
    assert written != "None", "write_stats() ignored NCCL_LOSSY_STATS"
    assert written.startswith(str(stats)) and "lossy-steps-rank4-" in written
    assert len(list(stats.glob("lossy-stats-rank4-*.json"))) == 1  # the plugin's own file


ENABLE = r"""
import json, os, sys
import nccl_lossy
kwargs = json.loads(sys.argv[1])
try:
    nccl_lossy.LossyMegatronIntegration(patch_megatron=False, **kwargs).enable()
except (nccl_lossy.LossyConfigError, nccl_lossy.NcclAlreadyInitializedError) as err:
    print(json.dumps({"error": type(err).__name__, "message": str(err)}))
else:
    print(json.dumps({"env": {k: os.environ.get(k) for k in %r}}))
""" % (VARS,)


def enable_in_child(env, **kwargs):
    proc = run_python(ENABLE, env=env, args=(json.dumps(kwargs),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_explicit_value_that_differs_from_the_environment_is_refused(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text(HALF)
    theirs = tmp_path / "theirs.toml"
    theirs.write_text(HALF)
    out = enable_in_child(clean_env(NCCL_LOSSY_PROFILE=theirs), profile=str(mine))
    assert out.get("error") == "LossyConfigError", out
    msg = out["message"]
    assert "NCCL_LOSSY_PROFILE" in msg and str(theirs) in msg and str(mine) in msg, msg
    assert "unset NCCL_LOSSY_PROFILE" in msg and "apply_env=False" in msg, msg

    out = enable_in_child(clean_env(NCCL_LOSSY_STATS=tmp_path / "a"), stats_dir=str(tmp_path / "b"))
    assert out.get("error") == "LossyConfigError", out
    assert "NCCL_LOSSY_STATS" in out["message"] and str(tmp_path / "a") in out["message"], out
    assert str(tmp_path / "b") in out["message"], out

    out = enable_in_child(clean_env(NCCL_LOSSY_SET="seed=3"), set={"seed": 4})
    assert out.get("error") == "LossyConfigError", out
    assert "NCCL_LOSSY_SET" in out["message"] and "seed=3" in out["message"], out
    assert "seed=4" in out["message"], out

    # the same value both ways is no conflict
    out = enable_in_child(clean_env(NCCL_LOSSY_PROFILE=mine, NCCL_LOSSY_SET="seed=4"),
                          profile=str(mine), set={"seed": 4})
    assert out.get("env", {}).get("NCCL_LOSSY_PROFILE") == str(mine), out


def test_a_foreign_network_or_plugin_in_the_environment_is_refused(tmp_path):
    out = enable_in_child(clean_env(NCCL_NET="Socket"))
    assert out.get("error") == "LossyConfigError", out
    assert "NCCL_NET=Socket" in out["message"] and "lossy" in out["message"], out
    assert "apply_env=False" in out["message"], out

    other = tmp_path / "libnccl-net-other.so"
    other.write_bytes(b"")
    out = enable_in_child(clean_env(NCCL_NET_PLUGIN=other))
    assert out.get("error") == "LossyConfigError", out
    assert f"NCCL_NET_PLUGIN={other}" in out["message"], out
    assert "apply_env=False" in out["message"], out

    # a copy of this plugin under another name is this plugin: kept
    renamed = tmp_path / "libnccl-net.so"
    renamed.write_bytes(nccl_lossy.library_path().read_bytes())
    out = enable_in_child(clean_env(NCCL_NET_PLUGIN=renamed))
    assert out.get("env", {}).get("NCCL_NET_PLUGIN") == str(renamed), out


def test_missing_variables_are_filled_in_around_the_inherited_ones(tmp_path):
    # The shell set a corrupting profile and a statistics directory; the code adds overrides.
    prof = tmp_path / "zero.toml"
    prof.write_text(ZERO_1PCT)
    stats = tmp_path / "stats"
    out = enable_in_child(clean_env(NCCL_LOSSY_PROFILE=prof, NCCL_LOSSY_STATS=stats),
                          set={"seed": 11})
    env = out.get("env")
    assert env is not None, out
    assert env["NCCL_LOSSY_PROFILE"] == str(prof) and env["NCCL_LOSSY_STATS"] == str(stats)
    assert env["NCCL_LOSSY_SET"] == "seed=11"
    assert env["NCCL_NET"] == "lossy"
    assert env["NCCL_NET_PLUGIN"] == str(nccl_lossy.library_path())
    # the protocol guard follows the profile in force (the inherited one corrupts data)
    assert env["NCCL_PROTO"] == "Simple"

    # a bare NCCL_NET_PLUGIN=lossy names this plugin: kept
    out = enable_in_child(clean_env(NCCL_NET_PLUGIN="lossy"))
    assert out.get("env", {}).get("NCCL_NET_PLUGIN") == "lossy", out


AFTER_NCCL = r"""
import ctypes, json, sys
import nccl_lossy
ctypes.CDLL(sys.argv[1])   # what NCCL does when it initialises: the plugin is loaded
try:
    nccl_lossy.LossyMegatronIntegration(patch_megatron=False).enable()
except nccl_lossy.NcclAlreadyInitializedError as err:
    print(json.dumps({"error": str(err)}))
else:
    print(json.dumps({"enabled": True}))
"""


def test_enable_after_nccl_started_needs_no_change_when_the_launcher_set_everything(lib_path):
    ready = clean_env(NCCL_NET="lossy", NCCL_NET_PLUGIN=lib_path)
    proc = run_python(AFTER_NCCL, env=ready, args=(str(lib_path),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"enabled": True}
    # The launcher left NCCL's transports between GPUs of one node on: too late to turn them
    # off, and the loss does not reach that traffic, which the log says.
    assert "goes over NCCL's own transports" in proc.stderr, proc.stderr[-3000:]

    # something missing (NCCL_NET): too late to set it, and the error says what to do
    proc = run_python(AFTER_NCCL, env=clean_env(NCCL_NET_PLUGIN=lib_path), args=(str(lib_path),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1]).get("error", "")
    assert "already loaded in this process" in err and "NCCL_NET" in err, err
    assert "apply_env=False" in err, err


def test_the_same_overrides_in_another_order_or_spelling_are_no_clash(tmp_path):
    # `lossy run --set` wrote them in its order; the keywords give them in another
    out = enable_in_child(clean_env(NCCL_LOSSY_SET="seed=7;model.rate=0.020"),
                          set={"model.rate": 0.02, "seed": 7})
    assert out.get("env", {}).get("NCCL_LOSSY_SET") == "seed=7;model.rate=0.020", out
    # a key given twice counts as its last value, as the plugin applies them in order
    out = enable_in_child(clean_env(NCCL_LOSSY_SET="seed=3;seed=7"), set={"seed": 7})
    assert "env" in out, out
    # a different value, or an integer where the other says a float, still clashes
    for theirs in ("seed=7;model.rate=0.03", "seed=7.0"):
        out = enable_in_child(clean_env(NCCL_LOSSY_SET=theirs), set={"seed": 7, "model.rate": 0.02}
                              if "rate" in theirs else {"seed": 7})
        assert out.get("error") == "LossyConfigError", (theirs, out)


def test_malformed_overrides_in_the_environment_are_named_as_the_environments(tmp_path):
    # With set= in the code, NCCL_LOSSY_SET="seed" from the shell was refused as "override 'seed'
    # has no '='", which names neither the variable nor where the text came from: the
    # researcher looked for it in the set= of the code.
    for theirs, why in (("seed", "has no '='"), ("seed='7", "unterminated ' quote")):
        out = enable_in_child(clean_env(NCCL_LOSSY_SET=theirs), set={"seed": 7})
        assert out.get("error") == "LossyConfigError", (theirs, out)
        msg = out["message"]
        assert f"NCCL_LOSSY_SET={theirs} (in the environment)" in msg and why in msg, msg
        assert "unset NCCL_LOSSY_SET" in msg, msg


def test_a_profile_named_by_two_spellings_of_one_path_is_one_profile(tmp_path):
    (tmp_path / "configs").mkdir()
    prof = tmp_path / "configs" / "half.toml"
    prof.write_text(HALF)
    code = (
        "import sys, nccl_lossy\n"
        "i = nccl_lossy.LossyMegatronIntegration(sys.argv[1], profile=sys.argv[2], apply_env=False,"
        " patch_megatron=False)\n"
        "print(i.network.profile)\n"
    )
    other = tmp_path / "configs" / ".." / "configs" / "half.toml"
    proc = run_python(code, args=(str(prof), str(other)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(prof), proc.stdout


def test_write_stats_says_when_the_plugins_file_cannot_land_in_stats_dir(tmp_path):
    # apply_env=False leaves NCCL_LOSSY_STATS unset: the plugin writes nothing, and the
    # directory would hold the per-step file alone without a word
    code = (
        "import sys, nccl_lossy\n"
        "i = nccl_lossy.LossyMegatronIntegration(stats_dir=sys.argv[1], apply_env=False,"
        " patch_megatron=False).enable()\n"
        "i.step()\n"
        "print(i.write_stats())\n"
    )
    stats = tmp_path / "stats"
    proc = run_python(code, args=(str(stats),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lossy-steps-rank" in proc.stdout  # the per-step file is still written
    assert "NCCL_LOSSY_STATS" in proc.stderr and str(stats) in proc.stderr, proc.stderr
    assert "apply_env=False" in proc.stderr, proc.stderr
    # set elsewhere: the two files would land in different directories
    elsewhere = tmp_path / "elsewhere"
    proc = run_python(code, env=clean_env(NCCL_LOSSY_STATS=elsewhere), args=(str(stats),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"NCCL_LOSSY_STATS={elsewhere}" in proc.stderr and str(stats) in proc.stderr, proc.stderr


def test_a_refused_step_leaves_the_integration_as_it_was():
    code = (
        "import nccl_lossy\n"
        "i = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()\n"
        "i.step(5)\n"
        "for bad in (2**64, 1.5, True, -1):\n"
        "    try:\n"
        "        i.step_number = bad\n"
        "    except nccl_lossy.LossyConfigError as err:\n"
        "        print('refused', bad)\n"
        "print(i.step_number)\n"
        "i.disable(); i.enable()\n"
        "print('enabled again at', i.step_number)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:4] == ["refused 18446744073709551616", "refused 1.5", "refused True", "refused -1"]
    assert lines[4:] == ["5", "enabled again at 5"], proc.stdout


# The environment's paths as the plugin reads them: it does not expand "~" (only a shell
# does, and not in quotes or in an env dict a Python launcher builds); relative paths count
# from the process's working directory.
TILDE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link
try:
    net = nccl_lossy.LossyNetwork().resolved()
except nccl_lossy.LossyConfigError as err:
    print(json.dumps({"error": str(err)}))
    sys.exit(0)
integ = nccl_lossy.LossyMegatronIntegration(patch_megatron=False)
integ.enable()
link = Link(1 << 16)
link.send()
link.close()
print(json.dumps({"stats_dir": str(net.stats_dir), "integ_stats_dir": str(integ.stats_dir()),
                  "rows": len(nccl_lossy.read_stats(integ.stats_dir()))}))
"""


def test_environment_paths_with_a_tilde_are_read_as_the_plugin_reads_them(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "p.toml").write_text(ZERO_1PCT)

    def run(**env):
        proc = subprocess.run([sys.executable, "-c", TILDE, str(TESTS)], cwd=work,
                              env=clean_env(HOME=home, NCCL_SOCKET_IFNAME="lo", **env),
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # the plugin would look for ./~/p.toml: refused here, naming the variable
    out = run(NCCL_LOSSY_PROFILE="~/p.toml")
    assert "NCCL_LOSSY_PROFILE=~/p.toml" in out.get("error", ""), out
    # the plugin writes into ./~/stats: that is the directory the integration reads
    out = run(NCCL_LOSSY_STATS="~/stats")
    assert out["stats_dir"] == out["integ_stats_dir"] == str(work / "~" / "stats"), out
    assert out["rows"] >= 1
