"""Error messages echo what the user gave cut, as the plugin's do (``src/error.rs``, ``echo``):
a value of a megabyte (from an environment variable, a generated argument) made an error of a
megabyte, which every rank printed. Past 60 characters (a path: 4096) a message shows the
first ones, "…", and how long the whole was."""

import json
import os

import pytest

import nccl_lossy
from nccl_lossy import LossyMegatronIntegration, LossyNetwork, LossyProfiler, ProfilerConfig
from conftest import clean_env, run_python

BIG = "x" * 1_000_000
QUIET = {"apply_env": False, "patch_megatron": False}
#: Longest message allowed: the fixed text around the values, and a path or two (a path shows
#: up to 4096 characters, longer than PATH_MAX).
LIMIT = 10_000


def integration():
    return LossyMegatronIntegration(**QUIET)


def assign(obj, name, value):
    setattr(obj, name, value)


CASES = {
    "check_bool": lambda: LossyMegatronIntegration(patch_megatron=BIG),
    "loss_rate": lambda: LossyMegatronIntegration(loss_rate=BIG, **QUIET),
    "effect": lambda: LossyMegatronIntegration(effect=BIG, **QUIET),
    "config key": lambda: LossyMegatronIntegration({BIG: 1}, **QUIET),
    "config value": lambda: LossyMegatronIntegration({"typo": BIG}, **QUIET),
    "config clash": lambda: LossyMegatronIntegration({"effect": BIG}, effect="zero", **QUIET),
    "keyword": lambda: LossyMegatronIntegration(typo=BIG),
    "first argument": lambda: LossyMegatronIntegration([BIG], **QUIET),
    "set_phase": lambda: nccl_lossy.set_phase(BIG),
    "set_step": lambda: nccl_lossy.set_step(BIG),
    "set_enabled": lambda: nccl_lossy.set_enabled(BIG),
    "phase =": lambda: assign(integration(), "phase", BIG),
    "step_number =": lambda: assign(integration(), "step_number", BIG),
    "set no '='": lambda: LossyNetwork(set=BIG),
    "set key": lambda: LossyNetwork(set={BIG + ";": 1}),
    "set quote": lambda: LossyNetwork(set="seed='" + BIG),
    "intra_node": lambda: LossyNetwork(intra_node=BIG),
    "library kind": lambda: LossyNetwork(library=[BIG]),
    "profile": lambda: LossyNetwork(profile="/nonexistent/" + "x/" * 3000),
    "base": lambda: LossyNetwork().resolved([BIG]),
    "NCCL_NET": lambda: LossyNetwork().resolved({"NCCL_NET": BIG}),
    "NCCL_NET_PLUGIN": lambda: LossyNetwork().resolved({"NCCL_NET_PLUGIN": BIG}),
    "NCCL_NET_PLUGIN path": lambda: LossyNetwork().resolved({"NCCL_NET_PLUGIN": "/" + "x/" * 3000}),
    "NCCL_LOSSY_PROFILE": lambda: LossyNetwork().resolved({"NCCL_LOSSY_PROFILE": "/nonexistent/" + "x/" * 3000}),
    "NCCL_LOSSY_SET": lambda: LossyNetwork().resolved({"NCCL_LOSSY_SET": BIG}),
    "NCCL_LOSSY_SET clash": lambda: LossyNetwork(set="seed=3").resolved({"NCCL_LOSSY_SET": "seed=" + BIG}),
    "NCCL_LOSSY_TRACE_EVENTS": lambda: LossyNetwork().env({"NCCL_LOSSY_TRACE_EVENTS": BIG}),
    "NCCL_LOSSY_INNER": lambda: LossyNetwork(set={"transport": "socket"}).env({"NCCL_LOSSY_INNER": BIG}),
    "NCCL_PROTO": lambda: LossyNetwork(set={"effect": "zero"}).env({"NCCL_PROTO": "LL," + BIG}),
    "profiler setting": lambda: ProfilerConfig(wait=BIG).check(),
    "profiler activity": lambda: LossyProfiler(activities=[BIG]),
    "profiler keyword": lambda: LossyProfiler(**{BIG: 1}),
    "read_stats table": lambda: nccl_lossy.read_stats(".", table=BIG),
    "read_stats dataframe": lambda: nccl_lossy.read_stats(".", dataframe=BIG),
    "read_stats path kind": lambda: nccl_lossy.read_stats([BIG]),
    "read_stats path": lambda: nccl_lossy.read_stats("/nonexistent/" + "x/" * 3000),
    "summarize by": lambda: nccl_lossy.summarize([{"step": 1}], by=[BIG]),
    "monitor count": lambda: nccl_lossy.performance_monitor(batch_size=BIG),
    "monitor output": lambda: nccl_lossy.performance_monitor([BIG]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_long_value_is_cut_in_the_error(case):
    with pytest.raises(Exception) as err:
        CASES[case]()
    message = str(err.value)
    assert len(message) < LIMIT, (case, type(err.value).__name__, message[:300])
    assert "in all)" in message, (case, message[:300])


def test_a_long_library_variable_is_cut_in_the_error(monkeypatch):
    monkeypatch.setenv("NCCL_LOSSY_LIBRARY", "/nonexistent/" + "x/" * 3000)
    with pytest.raises(nccl_lossy.LibraryNotFoundError) as err:
        nccl_lossy.library_path()
    assert len(str(err.value)) < LIMIT and "in all)" in str(err.value), str(err.value)[:300]


# The control API found through a long NCCL_NET_PLUGIN (an environment variable carries at most
# 128 KiB to a child): the loader's reason names the path once more.
PLUGIN = r"""
import json
import nccl_lossy
try:
    nccl_lossy.set_enabled(True)
except nccl_lossy.ControlError as err:
    print(json.dumps(str(err)))
"""


def test_a_long_plugin_variable_is_cut_in_the_control_error():
    proc = run_python(PLUGIN, env=clean_env(NCCL_NET_PLUGIN="/nonexistent/" + "x" * 100_000))
    assert proc.returncode == 0, proc.stderr[-2000:]
    message = json.loads(proc.stdout)
    assert len(message) < LIMIT and "in all)" in message, message[:300]


def test_echo_cuts_as_the_plugin_does():
    # src/error.rs: the first 60 characters, "…", and the whole's length in UTF-8 bytes
    from nccl_lossy._echo import echo

    assert echo("seed") == "'seed'"
    exact = "é" * 60
    assert echo(exact) == repr(exact)
    assert echo(exact + "x") == f"'{exact}…' ({len((exact + 'x').encode())} bytes in all)"
    assert echo(["a"] * 100).endswith("… (a repr of 500 characters in all)")


def test_a_long_kept_intra_node_setting_is_cut_in_the_warning():
    import warnings

    net = LossyNetwork()
    key = next(iter(net.intra_node_through_net))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.env({key: BIG})
    messages = [str(w.message) for w in caught if key in str(w.message)]
    assert messages and all(len(m) < LIMIT and "in all)" in m for m in messages), [m[:300] for m in messages]
