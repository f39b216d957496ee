"""The megatron-core patches on the real, installed megatron-core and torch."""

import ast
import importlib
import logging
import pathlib

import pytest

torch = pytest.importorskip("torch")
megatron_core = pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402

from nccl_lossy import megatron as patch  # noqa: E402
from conftest import clean_env, run_python  # noqa: E402

VERSION = getattr(megatron_core, "__version__", "unknown")
UTILS = importlib.import_module("megatron.core.utils")

# What each target must be bound to while the patch is in place.
EXPECTED = {
    "dist_all_gather_func": dist._all_gather_base,
    "dist_reduce_scatter_func": dist._reduce_scatter_base,
    "l2_norm_impl": UTILS.local_multi_tensor_l2_norm,
    "multi_tensor_scale_tensor_impl": None,
    "HAVE_APEX_OR_TE": False,
    "USING_TE_OPTIMIZER": False,
    "USING_APEX_OPTIMIZER": False,
    "USING_PYTORCH_OPTIMIZER": True,
    "Adam": torch.optim.AdamW,
    "SGD": torch.optim.SGD,
}


def expected(module, attribute):
    if (module, attribute) == ("megatron.core.optimizer.distrib_optimizer", "Adam"):
        return torch.optim.Adam  # the base class its isinstance check accepts (AdamW included)
    if attribute == "multi_tensor_applier":
        return UTILS.local_multi_tensor_applier
    if attribute == "multi_tensor_scale_impl":
        return UTILS.local_multi_tensor_scale
    return EXPECTED[attribute]


class Sentinel:
    """Stands for a Transformer Engine / apex binding that megatron-core would have chosen."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Sentinel({self.name})"


@pytest.fixture(autouse=True)
def reverted():
    patch.revert_megatron_core_patch()
    yield
    patch.revert_megatron_core_patch()


def present_targets():
    out = []
    for module_name, attribute in patch.patch_targets():
        module = importlib.import_module(module_name)
        if hasattr(module, attribute):
            out.append((module, module_name, attribute))
    return out


def test_every_target_present_is_replaced_and_restored(caplog):
    originals = {(m, a): getattr(mod, a) for mod, m, a in present_targets()}
    # On this CPU install the multi-tensor and flag targets already hold the plain-PyTorch
    # values; bind stand-ins first, as a TE/apex install would, so each replacement shows.
    for mod, m, a in present_targets():
        if not a.startswith("dist_"):
            setattr(mod, a, Sentinel(f"{m}.{a}"))
    try:
        with caplog.at_level(logging.INFO, logger="nccl_lossy.megatron"):
            results = patch.apply_megatron_core_patch()
        by_key = {(r.module, r.attribute): r for r in results}
        assert len(by_key) == len(patch.patch_targets())
        for mod, m, a in present_targets():
            assert by_key[(m, a)].status == "applied", by_key[(m, a)]
            assert getattr(mod, a) is expected(m, a), (m, a)
            assert f"{m}.{a}: applied" in caplog.text
        for r in results:
            if (r.module, r.attribute) not in originals:
                assert r.status == "missing" and r.reason, r
                assert f"{r.module}.{r.attribute}: missing" in caplog.text
        reverted = patch.revert_megatron_core_patch()
        assert {r.status for r in reverted} == {"reverted"}
        for mod, m, a in present_targets():
            if not a.startswith("dist_"):
                assert isinstance(getattr(mod, a), Sentinel), (m, a)
            else:
                assert getattr(mod, a) is originals[(m, a)]
    finally:
        for (m, a), value in originals.items():
            setattr(importlib.import_module(m), a, value)


def test_the_targets_design_names_exist_in_this_version():
    names = {(m, a) for _, m, a in present_targets()}
    for m in (
        "megatron.core.tensor_parallel.mappings",
        "megatron.core.tensor_parallel.layers",
        "megatron.core.distributed.param_and_grad_buffer",
    ):
        assert (m, "dist_all_gather_func") in names and (m, "dist_reduce_scatter_func") in names
    assert ("megatron.core.timers", "dist_all_gather_func") in names
    for a in ("multi_tensor_applier", "l2_norm_impl", "multi_tensor_scale_impl"):
        assert ("megatron.core.optimizer.clip_grads", a) in names
    assert ("megatron.core.optimizer.distrib_optimizer", "Adam") in names


def test_distributed_functions_are_forced_to_the_base_collectives():
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    dopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    assert mappings.dist_all_gather_func is dist.all_gather_into_tensor  # torch >= 1.13 choice
    original_adam = dopt.Adam
    patch.apply_megatron_core_patch()
    assert mappings.dist_all_gather_func is dist._all_gather_base
    assert mappings.dist_reduce_scatter_func is dist._reduce_scatter_base
    assert dopt.Adam is torch.optim.Adam
    patch.revert_megatron_core_patch()
    assert mappings.dist_all_gather_func is dist.all_gather_into_tensor
    assert mappings.dist_reduce_scatter_func is dist.reduce_scatter_tensor
    assert dopt.Adam is original_adam


def test_patch_is_idempotent():
    first = patch.apply_megatron_core_patch()
    state = {k: v[1] for k, v in patch.applied_patches().items()}
    originals = {k: v[0] for k, v in patch.applied_patches().items()}
    second = patch.apply_megatron_core_patch()
    applied = {(r.module, r.attribute) for r in first if r.status == "applied"}
    assert applied and {r.status for r in second} <= {"already in place", "missing"}
    assert {(r.module, r.attribute) for r in second if r.status == "already in place"} >= applied
    assert [r.reason for r in second if (r.module, r.attribute) in applied] == [
        f"bound to {patch._describe(state[(r.module, r.attribute)])} by this patch earlier"
        for r in second
        if (r.module, r.attribute) in applied
    ]
    assert {k: v[1] for k, v in patch.applied_patches().items()} == state
    assert {k: v[0] for k, v in patch.applied_patches().items()} == originals
    patch.revert_megatron_core_patch()
    for (m, a), original in originals.items():
        assert getattr(importlib.import_module(m), a) is original
    assert not patch.is_patched()


def test_context_manager_reverts_and_keeps_an_outer_patch():
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    with patch.megatron_core_patch() as results:
        assert results and mappings.dist_all_gather_func is dist._all_gather_base
    assert mappings.dist_all_gather_func is dist.all_gather_into_tensor
    patch.apply_megatron_core_patch()
    with patch.megatron_core_patch():
        pass
    assert mappings.dist_all_gather_func is dist._all_gather_base  # the outer patch stays


def test_fp32_accumulating_reduce_scatter_is_not_undone():
    pgb = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
    if not hasattr(pgb, "reduce_scatter_with_fp32_accumulation"):
        pytest.skip(f"megatron-core {VERSION} has no fp32-accumulating reduce-scatter")
    fp32 = pgb.reduce_scatter_with_fp32_accumulation
    original = pgb.dist_reduce_scatter_func
    try:
        pgb.dist_reduce_scatter_func = fp32  # what a DDP config with the option does
        results = patch.apply_megatron_core_patch()
        [r] = [r for r in results if (r.module, r.attribute) == (pgb.__name__, "dist_reduce_scatter_func")]
        assert r.status == "kept" and "not a torch.distributed collective" in r.reason
        assert pgb.dist_reduce_scatter_func is fp32
        patch.revert_megatron_core_patch()
        pgb.dist_reduce_scatter_func = original
        patch.apply_megatron_core_patch()
        pgb.dist_reduce_scatter_func = fp32  # the option is switched on after the patch
        reverted = patch.revert_megatron_core_patch()
        [r] = [r for r in reverted if (r.module, r.attribute) == (pgb.__name__, "dist_reduce_scatter_func")]
        assert r.status == "left as is" and pgb.dist_reduce_scatter_func is fp32
    finally:
        pgb.dist_reduce_scatter_func = original


def _module_level_names(body):
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(st, ast.Assign):
            yield from (t.id for t in st.targets if isinstance(t, ast.Name))
        if isinstance(st, ast.ImportFrom):
            yield from (a.asname or a.name for a in st.names)
        for field in ("body", "orelse", "finalbody", "handlers"):
            sub = getattr(st, field, None)
            if isinstance(sub, list):
                yield from _module_level_names(sub)


def test_no_module_binding_a_patched_name_is_missed():
    """Scans the installed megatron-core for module-level copies of the patched names."""
    watched = {
        "dist_all_gather_func",
        "dist_reduce_scatter_func",
        "multi_tensor_applier",
        "l2_norm_impl",
        "multi_tensor_scale_impl",
        "multi_tensor_scale_tensor_impl",
        "HAVE_APEX_OR_TE",
        "USING_TE_OPTIMIZER",
        "USING_APEX_OPTIMIZER",
        "USING_PYTORCH_OPTIMIZER",
    }
    root = pathlib.Path(megatron_core.__file__).resolve().parent.parent.parent
    targets = set(patch.patch_targets())
    missed = []
    for path in sorted((root / "megatron" / "core").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        module = module[: -len(".__init__")] if module.endswith(".__init__") else module
        names = set(_module_level_names(ast.parse(path.read_text(encoding="utf-8")).body))
        missed += [(module, n) for n in sorted(names & watched) if (module, n) not in targets]
    assert missed == [], f"megatron-core {VERSION} binds patched names the patch misses: {missed}"


def test_without_megatron_nothing_crashes():
    code = (
        "import sys, logging\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'megatron' or name.startswith('megatron.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (blocked)')\n"
        "sys.meta_path.insert(0, Block())\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from nccl_lossy.megatron import apply_megatron_core_patch, revert_megatron_core_patch, megatron_core_patch\n"
        "print('results', apply_megatron_core_patch())\n"
        "with megatron_core_patch() as r:\n"
        "    print('in context', r)\n"
        "print('reverted', revert_megatron_core_patch())\n"
    )
    proc = run_python(code, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "results []" in proc.stdout and "in context []" in proc.stdout
    assert "megatron-core compatibility patch not applied: megatron-core is not installed" in proc.stderr


def test_the_report_says_exactly_what_changed(caplog):
    """On this install every target is reported as what really happened to it: "applied" only
    where the binding changed, "already in place" where megatron-core already bound the
    replacement, "missing" only where the name does not exist."""
    before = {(m, a): getattr(mod, a) for mod, m, a in present_targets()}
    with caplog.at_level(logging.INFO, logger="nccl_lossy.megatron"):
        results = patch.apply_megatron_core_patch()
    assert [(r.module, r.attribute) for r in results] == patch.patch_targets()
    for r in results:
        key = (r.module, r.attribute)
        if key not in before:
            assert r.status == "missing" and "no such attribute" in r.reason, r
            continue
        now = getattr(importlib.import_module(r.module), r.attribute)
        assert now is expected(*key), r
        if before[key] is now:
            assert r.status == "already in place" and "already binds" in r.reason, r
        else:
            assert r.status == "applied", r
            assert r.reason.startswith(patch._describe(before[key]) + " -> "), r
    counts = patch.patch_summary(results)
    changed = sum(before[k] is not getattr(importlib.import_module(k[0]), k[1]) for k in before)
    assert counts["applied"] == changed
    assert counts["applied"] + counts["already in place"] == len(before)
    assert counts["missing"] == len(patch.patch_targets()) - len(before)
    assert counts["kept"] == 0
    assert (
        f"megatron-core patch: {counts['applied']} applied, {counts['already in place']} already in "
        f"place, {counts['missing']} missing, 0 kept" in caplog.text
    )
    if VERSION == "0.16.1" and not torch.cuda.is_available():
        # CPU install of 0.16.1: the 10 collective bindings change (all_gather_into_tensor /
        # reduce_scatter_tensor -> the _base functions) and Megatron-FSDP's two copies of the
        # local multi-tensor functions become megatron.core.utils' own; megatron-core already
        # binds the PyTorch optimizers, their flags and the other local multi-tensor functions
        # (12); multi_tensor_scale_tensor_impl arrives in 0.17 (25 targets in all).
        assert counts == {"applied": 12, "already in place": 12, "missing": 1, "kept": 0}


def test_a_bug_in_a_replacement_raises(monkeypatch):
    targets = patch._targets()

    def broken(current):
        raise ZeroDivisionError("a bug in a replacement")

    bad = patch._Target(targets[1].module, targets[1].attribute, "test", broken)
    monkeypatch.setattr(patch, "_targets", lambda: [targets[0], bad] + targets[2:])
    with pytest.raises(ZeroDivisionError, match="a bug in a replacement"):
        patch.apply_megatron_core_patch()


def test_a_whole_group_of_targets_missing_is_warned_about(monkeypatch, caplog):
    # Each target may be missing in some megatron-core version (they are patched where they
    # exist), so a missing one is logged at INFO. But when none of a group's names exists, the
    # patch does not know this version's layout for that part (its collectives or its
    # optimizer would run unpatched), and only INFO said so.
    for module, attribute in patch.patch_targets():
        if module.startswith("megatron.core.optimizer.distrib_optimizer") or (
            module == "megatron.core.optimizer" and attribute in ("Adam", "SGD", "USING_PYTORCH_OPTIMIZER")
        ):
            monkeypatch.delattr(importlib.import_module(module), attribute, raising=False)
    with caplog.at_level(logging.INFO, logger="nccl_lossy.megatron"):
        patch.apply_megatron_core_patch()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "optimizer" in warnings[0] and VERSION in warnings[0], warnings[0]
    assert "none of its 7 names" in warnings[0], warnings[0]


def test_this_version_gets_no_warning(caplog):
    with caplog.at_level(logging.INFO, logger="nccl_lossy.megatron"):
        patch.apply_megatron_core_patch()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_layout_the_patch_does_not_know_is_said_through_warnings(monkeypatch):
    # The package's logger has no handler (a NullHandler, so not even Python's last-resort
    # one): a training script that configures no logging saw nothing when the patch did not
    # know this megatron-core's layout, or found no megatron-core at all.
    for module, attribute in patch.patch_targets():
        if module.startswith("megatron.core.optimizer.distrib_optimizer") or (
            module == "megatron.core.optimizer" and attribute in ("Adam", "SGD", "USING_PYTORCH_OPTIMIZER")
        ):
            monkeypatch.delattr(importlib.import_module(module), attribute, raising=False)
    with pytest.warns(UserWarning, match="laid out in a way the patch does not know") as caught:
        patch.apply_megatron_core_patch()
    (mine,) = [w for w in caught if "megatron-core patch" in str(w.message)]  # megatron's own aside
    assert VERSION in str(mine.message)
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'megatron' or name.startswith('megatron.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (blocked)')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from nccl_lossy.megatron import apply_megatron_core_patch\n"
        "print('results', apply_megatron_core_patch())\n"
    )
    proc = run_python(code, env=clean_env())  # no logging configured, as in a training script
    assert proc.returncode == 0, proc.stderr
    assert "megatron-core compatibility patch not applied: megatron-core is not installed" in proc.stderr
