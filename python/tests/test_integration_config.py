"""LossyMegatronIntegration and LossyNetwork as a researcher writes them: a network, a profile
or a config dict first, the loss keywords, every value checked at construction (by the plugin
library itself for the profile), and disable() leaving the megatron-core patches alone."""

import pytest

import nccl_lossy
from nccl_lossy import LossyConfigError, LossyMegatronIntegration, LossyNetwork
from conftest import clean_env, run_python

QUIET = {"apply_env": False, "patch_megatron": False}  # nothing outside the object is touched


def summary(obj):
    net = obj.network if isinstance(obj, LossyMegatronIntegration) else obj
    return net.check()["summary"]


def test_a_lossy_network_first():
    net = LossyNetwork(loss_rate=0.02)
    integ = LossyMegatronIntegration(net, enable_on_forward=False, **QUIET)
    assert integ.network is net and not integ.enable_on_forward and integ.enable_on_backward
    assert "default: uniform(rate=0.02)" in summary(integ)
    assert LossyMegatronIntegration(network=net, **QUIET).network is net


def test_a_config_dict_first_as_the_seed_wrote_it():
    integ = LossyMegatronIntegration(
        {"loss_rate": 0.01, "burst_length": 4, "enable_on_forward": False, "enable_on_backward": True},
        **QUIET,
    )
    assert (integ.enable_on_forward, integ.enable_on_backward) == (False, True)
    assert "default: gilbert_elliott(" in summary(integ) and "mean burst 4" in summary(integ)
    assert integ.network.overrides == 'model={ kind = "gilbert_elliott", rate = 0.01, mean_burst = 4 }'


def test_loss_keywords_build_the_model():
    uniform = LossyMegatronIntegration(loss_rate=0.05, burst_length=1, effect="zero", **QUIET)
    assert "default: uniform(rate=0.05), effect zero" in summary(uniform)
    assert uniform.network.corrupts_data  # zero: the protocol guard applies
    assert "default: uniform(rate=0.01)" in summary(LossyMegatronIntegration(loss_rate=0.01, **QUIET))
    bursty = LossyNetwork(loss_rate=0.01, burst_length=8)
    assert "gilbert_elliott(" in summary(bursty) and "mean burst 8" in summary(bursty)
    assert "default: none" in summary(LossyNetwork(loss_rate=0))
    assert LossyNetwork(loss_rate=0.02, set={"seed": 9}).overrides == 'seed=9;model={ kind = "uniform", rate = 0.02 }'


def test_numpy_numbers_are_loss_keywords_as_python_numbers_are():
    # A sweep's values come out of numpy: np.arange gives np.int64, a float32 array np.float32.
    # Neither is a Python int or float subclass, yet each is a number the model takes.
    np = pytest.importorskip("numpy")
    for rate, burst in ((np.float32(0.25), np.int64(4)), (np.float64(0.25), np.int32(4)),
                        (np.float16(0.25), np.float32(4.0))):
        net = LossyNetwork(loss_rate=rate, burst_length=burst)
        assert net.overrides == 'model={ kind = "gilbert_elliott", rate = 0.25, mean_burst = 4 }', (rate, burst)
    assert "default: uniform(rate=0.5)" in summary(LossyNetwork(loss_rate=np.float32(0.5), burst_length=np.int8(1)))
    # numpy's bool is no number, as Python's is not
    with pytest.raises(LossyConfigError, match=r"loss_rate=np.True_: must be a number; allowed: a fraction in \[0, 1\]"):
        LossyNetwork(loss_rate=np.bool_(True))
    with pytest.raises(LossyConfigError, match=r"burst_length=np.float32\(nan\): must be finite"):
        LossyNetwork(loss_rate=0.1, burst_length=np.float32("nan"))


def test_the_profile_first_keyword_form_still_works(tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text('model = { kind = "uniform", rate = 0.03 }\n')
    integ = LossyMegatronIntegration(str(profile), enable_on_forward=False, enable_on_backward=True,
                                     set={"seed": 4}, stats_dir=tmp_path / "s", **QUIET)
    assert integ.network.profile == profile.resolve() and integ.network.overrides == "seed=4"
    assert integ.network.stats_dir == (tmp_path / "s").resolve()
    assert "seed 4" in summary(integ) and not integ.enable_on_forward
    assert LossyMegatronIntegration(profile=profile, **QUIET).network.profile == profile.resolve()
    assert LossyMegatronIntegration(**QUIET).network.profile is None  # the embedded default


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_rate": -0.1}, "loss_rate=-0.1: allowed: a fraction in [0, 1]"),
        ({"loss_rate": 1.5}, "loss_rate=1.5: allowed: a fraction in [0, 1]"),
        ({"loss_rate": "1%"}, "loss_rate='1%': must be a number; allowed: a fraction in [0, 1]"),
        ({"loss_rate": 0.1, "burst_length": 0.5}, "burst_length=0.5: allowed: a number >= 1"),
        ({"burst_length": 4}, "burst_length=4 needs loss_rate"),
        ({"loss_rate": 0.9, "burst_length": 4}, "allowed: loss_rate <= B/(B+1) = 0.8"),
        ({"effect": "drop"}, "effect='drop': allowed: 'zero', 'stale', 'retransmit', 'bitflip'"),
        ({"enable_on_forward": "no"}, "enable_on_forward='no': allowed: True or False"),
        ({"los_rate": 0.1}, "unknown keyword 'los_rate' (value 0.1); allowed: loss_rate, burst_length"),
        ({"set": {"model.rat": 0.1}}, "model.rat"),  # the plugin's own check, at construction
        ({"set": {"model.rate": 0.1}, "loss_rate": 0.2}, "overrides 'model.rate', which loss_rate= sets too"),
    ],
)
def test_bad_keywords_are_refused_at_construction(kwargs, message):
    with pytest.raises(LossyConfigError) as err:
        LossyMegatronIntegration(**kwargs, **QUIET)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"loss_rate": 2}, "loss_rate=2: allowed: a fraction in [0, 1]"),
        ({"los_rate": 0.1}, "unknown key 'los_rate' (value 0.1); allowed: loss_rate, burst_length, effect"),
        ({"enable_on_backward": 1}, "enable_on_backward=1: allowed: True or False"),
    ],
)
def test_bad_config_dicts_are_refused_at_construction(config, message):
    with pytest.raises(LossyConfigError) as err:
        LossyMegatronIntegration(config, **QUIET)
    assert message in str(err.value)


def test_conflicting_and_misplaced_values_are_refused():
    with pytest.raises(LossyConfigError, match="loss_rate: the config says 0.1, the keyword 0.2"):
        LossyMegatronIntegration({"loss_rate": 0.1}, loss_rate=0.2, **QUIET)
    with pytest.raises(LossyConfigError, match="loss_rate=0.1 next to a LossyNetwork"):
        LossyMegatronIntegration(LossyNetwork(), loss_rate=0.1, **QUIET)
    with pytest.raises(LossyConfigError, match="first argument 3"):
        LossyMegatronIntegration(3, **QUIET)
    with pytest.raises(LossyConfigError, match="loss_rate=1.2"):
        LossyNetwork(loss_rate=1.2)
    assert LossyMegatronIntegration({"loss_rate": 0.1}, loss_rate=0.1, **QUIET)  # agreeing is fine
    assert nccl_lossy.LossyConfigError is nccl_lossy.config.LossyConfigError


def test_a_key_in_the_config_and_as_a_keyword_must_mean_the_same(tmp_path):
    # A switch keyword given as its default value (True) lost to the config's False without a
    # word, and the same directory or overrides written two ways were refused as two values.
    for key in ("enable_on_forward", "enable_on_backward"):
        with pytest.raises(LossyConfigError, match=f"{key}: the config says False, the keyword True"):
            LossyMegatronIntegration({key: False}, **{key: True}, **QUIET)
        assert getattr(LossyMegatronIntegration({key: False}, **QUIET), key) is False
        assert getattr(LossyMegatronIntegration({key: True}, **{key: True}, **QUIET), key) is True
    stats = tmp_path / "s"
    integ = LossyMegatronIntegration({"stats_dir": str(stats), "set": {"seed": 7}},
                                     stats_dir=stats, set="seed=7", **QUIET)
    assert integ.network.stats_dir == stats.resolve() and "seed 7" in summary(integ)
    with pytest.raises(LossyConfigError, match="set: the config says"):
        LossyMegatronIntegration({"set": {"seed": 7}}, set="seed=8", **QUIET)
    with pytest.raises(LossyConfigError, match="stats_dir: the config says"):
        LossyMegatronIntegration({"stats_dir": str(stats)}, stats_dir=tmp_path / "t", **QUIET)


DISABLE_SCRIPT = r"""
import torch.distributed as dist
import nccl_lossy
from megatron.core.tensor_parallel import mappings
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False)
integ.enable()
assert mappings.dist_all_gather_func is dist._all_gather_base
integ.disable()
print("after disable():", mappings.dist_all_gather_func.__name__)
with integ:
    pass
print("after the with block:", mappings.dist_all_gather_func.__name__)
integ.enable()
integ.disable(revert_patches=True)
print("after disable(revert_patches=True):", mappings.dist_all_gather_func.__name__)
"""


def test_disable_leaves_the_megatron_patches_in_place():
    pytest.importorskip("megatron.core")
    proc = run_python(DISABLE_SCRIPT, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "after disable(): _all_gather_base",
        "after the with block: _all_gather_base",
        "after disable(revert_patches=True): all_gather_into_tensor",
    ]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"profile": 123}, "profile=123: allowed: a path (str or os.PathLike) or None"),
        ({"stats_dir": 5}, "stats_dir=5: allowed: a path (str or os.PathLike) or None"),
        ({"library": ["x.so"]}, "library=['x.so']: allowed: a path (str or os.PathLike) or None"),
        ({"set": 5}, "set=5: allowed: None, 'key=value;...' text, a dict or (key, value) pairs"),
        ({"set": ["model.rate"]}, "set=['model.rate']: allowed: None, 'key=value;...' text"),
    ],
)
def test_a_network_value_of_the_wrong_type_is_refused_naming_the_keyword(kwargs, message):
    # These raised TypeError "expected str, bytes or os.PathLike object, not int" (or "'int'
    # object is not iterable"), naming neither the keyword nor what it takes.
    with pytest.raises(LossyConfigError) as err:
        LossyNetwork(**kwargs)
    assert message in str(err.value), str(err.value)


# enable() when the plugin's control API cannot be reached (NCCL_NET_PLUGIN names another
# library): the ControlError came after the integration had marked itself enabled, so it said
# injecting() True for a plugin it never reached, and the next integration was warned about
# this one as "another LossyMegatronIntegration enabled".
UNREACHABLE = r"""
import os, warnings
import nccl_lossy
from nccl_lossy.control import ControlError
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False)
os.environ["NCCL_NET_PLUGIN"] = os.environ["OTHER_LIBRARY"]
for enter in (integ.enable, integ.__enter__):
    try:
        enter()
    except ControlError as err:
        print("refused:", "cannot serve the control API" in str(err))
    print("enabled:", integ.enabled, "injecting:", integ.injecting())
del os.environ["NCCL_NET_PLUGIN"]
with warnings.catch_warnings():
    warnings.simplefilter("error")
    other = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
print("other enabled:", other.enabled)
"""


def test_enable_that_cannot_reach_the_plugin_leaves_the_integration_disabled():
    libc = next(line.split()[-1] for line in open("/proc/self/maps") if "/libc.so" in line)
    proc = run_python(UNREACHABLE, env=clean_env(OTHER_LIBRARY=libc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "refused: True", "enabled: False injecting: False",
        "refused: True", "enabled: False injecting: False",
        "other enabled: True",
    ]


# disable(revert_patches="yes") checked the flag last: it raised only after injection was off
# and the per-step file written, so the caller's retry found a disabled integration.
BAD_DISABLE = r"""
import nccl_lossy
from nccl_lossy.config import LossyConfigError
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
try:
    integ.disable(revert_patches="yes")
except LossyConfigError as err:
    print("refused:", "revert_patches" in str(err))
print("enabled:", integ.enabled, "injecting:", integ.injecting())
"""


def test_a_bad_disable_flag_is_refused_before_anything_changes():
    proc = run_python(BAD_DISABLE, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["refused: True", "enabled: True injecting: True"], proc.stdout


# attach() with what is no module (None from a builder that returned nothing, an optimizer in
# the model's place) failed with "'NoneType' object has no attribute
# 'register_forward_pre_hook'" after noting the object as attached, so attaching the same
# object again later was silently skipped; a torch.nn.ModuleList of model chunks (which has no
# forward of its own, so its hooks never run) was hooked without a word and no phase was ever
# marked.
ATTACH = r"""
import torch, nccl_lossy
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for args in ((None,), (3,), ([model, None],), (model, 3), (model, object()), (opt,)):
    try:
        integ.attach(*args)
    except TypeError as err:
        print("refused:", err)
    else:
        print("attached", args)
chunks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
integ.attach(chunks, opt)
integ.mark_any()
out = chunks[0](torch.ones(1, 2, requires_grad=True))
print("after a chunk's forward:", integ.phase)
out.sum().backward()
print("after backward:", integ.phase)
opt.step()
print("after the optimizer step:", integ.phase, integ.step_number)
"""


def test_attach_refuses_what_is_no_module_and_hooks_the_chunks_of_a_module_list():
    pytest.importorskip("torch")
    proc = run_python(ATTACH, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    module = "allowed: a torch.nn.Module (one with a forward) or a list or tuple of them"
    assert proc.stdout.splitlines() == [
        f"refused: attach: model=None is no module; {module}",
        f"refused: attach: model=3 is no module; {module}",
        f"refused: attach: model[1]=None is no module; {module}",
        "refused: attach: optimizer=3 has no step(); allowed: a torch optimizer, megatron-core's "
        "MegatronOptimizer, or anything with a step method",
        "refused: attach: optimizer=<object> has no step(); allowed: a torch optimizer, "
        "megatron-core's MegatronOptimizer, or anything with a step method",
        "refused: attach: model=<SGD> is no module; " + module,
        "after a chunk's forward: forward",
        "after backward: backward",
        "after the optimizer step: any 1",
    ]


def test_a_stats_dir_that_is_no_directory_is_refused_at_construction_with_apply_env_off(tmp_path):
    # With apply_env=False nothing looked at it: disable() then failed writing the per-step
    # file with a bare "[Errno 17] File exists" for a path that does exist, only not as a
    # directory.
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(LossyConfigError) as err:
        LossyMegatronIntegration(stats_dir=fifo, **QUIET)
    assert f"stats_dir={fifo}" in str(err.value) and "a FIFO" in str(err.value), str(err.value)
    assert "allowed: a directory" in str(err.value)


# NCCL_LOSSY_STATS (lossy run --stats) naming what is no directory, with apply_env=False: the
# per-step file cannot go there, and disable() says so naming the variable's path and what it is.
STATS_NOT_A_DIRECTORY = r"""
import os, sys
import nccl_lossy
from nccl_lossy.config import LossyConfigError
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
integ.step()
try:
    integ.disable()
except LossyConfigError as err:
    print("refused:", str(err))
print("enabled:", integ.enabled)
"""


def test_a_statistics_variable_naming_no_directory_is_a_clear_error_at_disable(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = run_python(STATS_NOT_A_DIRECTORY, env=clean_env(NCCL_LOSSY_STATS=fifo))
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused, enabled = proc.stdout.splitlines()
    assert str(fifo) in refused and "a FIFO" in refused and "per-step" in refused, refused
    assert enabled == "enabled: False"


def test_leaving_a_with_block_never_entered_is_refused_and_counts_nothing():
    # An __exit__ without its __enter__ drove the count of open blocks to -1: the next real
    # `with integ:` block then ended at 0 and never detached nor disabled, leaving loss on
    # after the block.
    integ = LossyMegatronIntegration(**QUIET)
    with pytest.raises(RuntimeError, match="no `with` block"):
        integ.__exit__(None, None, None)
    assert integ._depth == 0



# A one-element numpy array of "forward" passed `value not in PHASES` (its == is elementwise,
# one True), was stored as the integration's phase and failed in the plugin call after it with
# a bare ValueError, leaving the integration's phase an array.
PHASE_NOT_TEXT = r"""
import numpy as np
import nccl_lossy
from nccl_lossy import LossyConfigError
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
try:
    integ.phase = np.array(["forward"])
except LossyConfigError as err:
    print("refused:", "allowed: any, forward, backward" in str(err))
print("phase:", repr(integ.phase), type(integ.phase).__name__)
integ.phase = np.str_("backward")  # text (a str subclass) is a phase
print("phase:", repr(integ.phase), type(integ.phase).__name__)
integ.disable()
"""


def test_a_phase_that_is_no_text_is_refused_before_anything_changes():
    pytest.importorskip("numpy")
    proc = run_python(PHASE_NOT_TEXT, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["refused: True", "phase: 'any' str", "phase: 'backward' str"]


# The same through the attributes and the phase: `integ.enabled = True`, a switch attribute or
# mark_forward() stored the new value and then failed to reach the plugin, so the integration
# said injecting() True (or phase forward) for a plugin it never told; the next assignment
# compared against a state that was never in force.
UNREACHABLE_SETTERS = r"""
import os
import nccl_lossy
from nccl_lossy.control import ControlError
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False,
                                            enable_on_forward=False)
os.environ["NCCL_NET_PLUGIN"] = os.environ["OTHER_LIBRARY"]
for name, value in (("enabled", True), ("phase", "forward"), ("enable_on_forward", True),
                    ("enable_on_backward", False)):
    try:
        setattr(integ, name, value)
    except ControlError:
        print(name, "refused, still", getattr(integ, name))
print("injecting:", integ.injecting())
"""


def test_an_assignment_that_cannot_reach_the_plugin_leaves_the_integration_as_it_was():
    libc = next(line.split()[-1] for line in open("/proc/self/maps") if "/libc.so" in line)
    proc = run_python(UNREACHABLE_SETTERS, env=clean_env(OTHER_LIBRARY=libc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "enabled refused, still False",
        "phase refused, still any",
        "enable_on_forward refused, still False",
        "enable_on_backward refused, still True",
        "injecting: False",
    ]


# `nccl_lossy.set_phase("FORWARD")` was taken (names ignore case, as profile rules' `phase`
# does) while `integ.phase = "FORWARD"` was refused, and the two refused a wrong phase in
# messages of different shapes: one package, two rules for one value. Both take what the
# other takes and refuse what the other refuses, in the same words.
PHASE_ONE_RULE = r"""
import nccl_lossy
from nccl_lossy import LossyConfigError
integ = nccl_lossy.LossyMegatronIntegration(apply_env=False, patch_megatron=False).enable()
for value in ("FORWARD", "Backward", "any", nccl_lossy.PHASE_FORWARD, 2, None, "forwards", 3, 1.0, True, ["forward"]):
    said = []
    try:
        nccl_lossy.set_phase(value)
        said.append("taken")
    except ValueError as err:
        said.append(str(err))
    try:
        integ.phase = value
        said.append("taken " + integ.phase)
    except LossyConfigError as err:
        said.append(str(err) + " / still " + integ.phase)
    print(repr(value), "|", " | ".join(said))
integ.disable()
"""


def test_a_phase_is_taken_or_refused_alike_by_set_phase_and_the_integration():
    proc = run_python(PHASE_ONE_RULE, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    allowed = "allowed: any, forward, backward (or their codes 0, 1, 2), or None for any"
    assert proc.stdout.splitlines() == [
        "'FORWARD' | taken | taken forward",
        "'Backward' | taken | taken backward",
        "'any' | taken | taken any",
        "1 | taken | taken forward",
        "2 | taken | taken backward",
        "None | taken | taken any",
        f"'forwards' | phase 'forwards': {allowed} | phase 'forwards': {allowed} / still any",
        f"3 | phase 3: {allowed} | phase 3: {allowed} / still any",
        f"1.0 | phase 1.0: {allowed} | phase 1.0: {allowed} / still any",
        f"True | phase True: {allowed} | phase True: {allowed} / still any",
        f"['forward'] | phase ['forward']: {allowed} | phase ['forward']: {allowed} / still any",
    ]


# The megatron-core patches are process-wide: `A.disable(revert_patches=True)` reverted them
# under an integration B still enabled that relied on them (B found them in place, applied by
# A), so B's model went on with megatron-core's own functions. They are reverted when no
# enabled integration needs them any more: by the last one's disable(revert_patches=True).
SHARED_PATCHES = r"""
import warnings
import torch.distributed as dist
import nccl_lossy
from megatron.core.tensor_parallel import mappings

def say(label):
    print(label + ":", mappings.dist_all_gather_func.__name__, nccl_lossy.megatron.is_patched())

def integration():
    return nccl_lossy.LossyMegatronIntegration(apply_env=False)

with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    a, b = integration(), integration()
    a.enable(); a.disable(); b.enable()
    say("A applied, disabled; B enabled")
    a.disable(revert_patches=True)
    say("A reverts, B enabled")
    b.disable(revert_patches=True)
    say("B reverts, none enabled")
    a.enable(); b.enable()
    say("both enabled")
    a.disable(revert_patches=True)
    say("A reverts, B enabled")
    b.disable()
    say("B disabled")
    b.disable(revert_patches=True)
    say("B reverts, none enabled")
for w in seen:
    if "revert" in str(w.message):
        print("warned:", w.message)
"""


def test_the_patches_are_not_reverted_under_another_enabled_integration():
    pytest.importorskip("megatron.core")
    proc = run_python(SHARED_PATCHES, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:7] == [
        "A applied, disabled; B enabled: _all_gather_base True",
        "A reverts, B enabled: _all_gather_base True",
        "B reverts, none enabled: all_gather_into_tensor False",
        "both enabled: _all_gather_base True",
        "A reverts, B enabled: _all_gather_base True",
        "B disabled: _all_gather_base True",
        "B reverts, none enabled: all_gather_into_tensor False",
    ], proc.stdout
    # each revert left undone is said, naming why
    assert len(lines) == 9 and all("another enabled LossyMegatronIntegration" in w for w in lines[7:]), proc.stdout
