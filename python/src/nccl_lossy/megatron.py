"""Compatibility patches that make megatron-core run on plain PyTorch + NCCL.

:func:`apply_megatron_core_patch` rebinds module-level names that megatron-core chose at import
time, in every module that holds its own copy (a global replaced only where it was defined
would leave the copies in other modules untouched):

1. distributed functions: ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` become
   ``torch.distributed._all_gather_base`` / ``_reduce_scatter_base`` (or, on a torch without
   those, their successors ``all_gather_into_tensor`` / ``reduce_scatter_tensor``);
2. multi-tensor functions: megatron-core's local implementations from ``megatron.core.utils``
   (``local_multi_tensor_applier``, ``local_multi_tensor_l2_norm``, ``local_multi_tensor_scale``)
   instead of Transformer Engine's or apex's kernels, in ``optimizer.clip_grads``,
   ``optimizer.optimizer`` and Megatron-FSDP's ``mixed_precision``;
3. optimizer: what megatron-core itself binds when neither Transformer Engine nor apex is
   installed: ``Adam`` becomes ``torch.optim.Adam`` in ``optimizer.distrib_optimizer`` (the class
   its "Only Adam ... supported" check accepts; torch's ``AdamW`` subclasses it, so both pass)
   and ``torch.optim.AdamW`` in ``optimizer`` (with ``SGD``), together with the flags that tell
   those modules they run PyTorch's optimizers. With ``USING_PYTORCH_OPTIMIZER`` set,
   ``get_megatron_optimizer`` builds ``torch.optim.AdamW`` when
   ``OptimizerConfig.decoupled_weight_decay`` is True and ``torch.optim.Adam`` when it is False,
   so every optimizer configuration that runs without the patch runs with it, with the weight
   decay the user asked for.

Every target is reported (and logged at INFO) as exactly one of:

- ``applied``: the name was rebound, from the value shown to the replacement;
- ``already in place``: the name already held the replacement (a CPU install of megatron-core
  binds most of them itself; a second call finds its own earlier work);
- ``missing``: this megatron-core version has no such name, or the module cannot be imported;
- ``kept``: deliberately left alone (megatron-core's own fp32-accumulating reduce-scatter).

A bug in a replacement raises; it is never reported as anything else. The patch is idempotent
and :func:`revert_megatron_core_patch` restores what it changed (a name that something else
rebound after the patch is left alone, and the log says so). Without megatron-core or torch
installed, nothing is patched and a warning says why.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

log = logging.getLogger("nccl_lossy.megatron")

APPLIED = "applied"
IN_PLACE = "already in place"
MISSING = "missing"
KEPT = "kept"
REVERTED = "reverted"
LEFT = "left as is"
#: Every status :func:`apply_megatron_core_patch` reports, in the order the summary lists them.
APPLY_STATUSES = (APPLIED, IN_PLACE, MISSING, KEPT)


@dataclass(frozen=True)
class PatchResult:
    """What happened to one (module, attribute) target."""

    module: str
    attribute: str
    status: str  # one of APPLY_STATUSES, or "reverted" / "left as is" from a revert
    reason: str = ""

    def __str__(self) -> str:
        text = f"{self.module}.{self.attribute}: {self.status}"
        return f"{text} ({self.reason})" if self.reason else text


@dataclass
class _Record:
    module: Any
    attribute: str
    original: Any
    replacement: Any


# A target: module, attribute, the group it belongs to, and a function that returns
# (replacement, note), or raises _Skip (status "kept") or _Missing (status "missing").
@dataclass(frozen=True)
class _Target:
    module: str
    attribute: str
    group: str
    replacement: Callable[[Any], Tuple[Any, str]]


class _Missing(Exception):
    """Raised by a replacement picker when this megatron-core version lacks what it needs."""


class _Skip(Exception):
    """Raised by a replacement picker to leave a name deliberately as it is (status ``kept``)."""


_lock = threading.RLock()
_records: Dict[Tuple[str, str], _Record] = {}


def _fresh_lock_in_child() -> None:
    # A forked child (a DataLoader worker) has one thread: the lock, held at the fork by
    # another thread of the parent applying or reverting the patch, would stay held forever
    # and the child's first call here would hang. A fork in the middle of an apply or a revert
    # leaves the child with the targets done so far (one caught between rebinding a name and
    # recording it stays rebound, unrecorded: a revert in the child leaves it).
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)

# Modules that bind their own copy of each name (megatron-core 0.16.1's sources; the tests
# scan the installed sources for bindings missing from this list).
_ALL_GATHER_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.timers",
    "megatron.core.utils",
    "megatron.core.transformer.multi_token_prediction",
)
_REDUCE_SCATTER_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.distributed.param_and_grad_buffer",
)


def _torch_collective(base_name: str, successor: str) -> Callable[[Any], Tuple[Any, str]]:
    def pick(current: Any) -> Tuple[Any, str]:
        import torch.distributed as dist

        collectives = {getattr(dist, n, None) for n in (base_name, successor)} - {None}
        if current not in collectives:
            raise _Skip(
                f"bound to {_describe(current)}, not a torch.distributed collective "
                "(megatron-core's own choice, e.g. its fp32-accumulating reduce-scatter)"
            )
        if hasattr(dist, base_name):
            return getattr(dist, base_name), f"torch.distributed.{base_name}"
        return (
            getattr(dist, successor),
            f"torch.distributed.{successor} (this torch has no {base_name}; "
            f"{successor} is its documented successor)",
        )

    return pick


def _local_multi_tensor(name: str) -> Callable[[Any], Tuple[Any, str]]:
    def pick(current: Any) -> Tuple[Any, str]:
        utils = importlib.import_module("megatron.core.utils")
        if not hasattr(utils, name):
            raise _Missing(f"megatron.core.utils has no {name} in this megatron-core version")
        return getattr(utils, name), f"megatron.core.utils.{name}"

    return pick


def _constant(value: Any, text: Optional[str] = None) -> Callable[[Any], Tuple[Any, str]]:
    return lambda current: (value, text or repr(value))


def _torch_optim(name: str) -> Callable[[Any], Tuple[Any, str]]:
    def pick(current: Any) -> Tuple[Any, str]:
        import torch.optim

        return getattr(torch.optim, name), f"torch.optim.{name}"

    return pick


def _targets() -> List[_Target]:
    dist = "distributed functions"
    mt = "multi-tensor functions"
    opt = "optimizer"
    targets = [
        _Target(m, "dist_all_gather_func", dist, _torch_collective("_all_gather_base", "all_gather_into_tensor"))
        for m in _ALL_GATHER_MODULES
    ]
    targets += [
        _Target(m, "dist_reduce_scatter_func", dist, _torch_collective("_reduce_scatter_base", "reduce_scatter_tensor"))
        for m in _REDUCE_SCATTER_MODULES
    ]
    clip = "megatron.core.optimizer.clip_grads"
    optim = "megatron.core.optimizer.optimizer"
    fsdp_mp = "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"
    targets += [
        _Target(clip, "multi_tensor_applier", mt, _local_multi_tensor("local_multi_tensor_applier")),
        _Target(clip, "l2_norm_impl", mt, _local_multi_tensor("local_multi_tensor_l2_norm")),
        _Target(clip, "multi_tensor_scale_impl", mt, _local_multi_tensor("local_multi_tensor_scale")),
        # megatron-core 0.17+: a non-None value sends clipping down Transformer Engine's path.
        _Target(clip, "multi_tensor_scale_tensor_impl", mt, _constant(None)),
        _Target(optim, "multi_tensor_applier", mt, _local_multi_tensor("local_multi_tensor_applier")),
        _Target(optim, "multi_tensor_scale_impl", mt, _local_multi_tensor("local_multi_tensor_scale")),
        # Megatron-FSDP's FP8 fallback (these names exist only when TE lacks its FP8 cast).
        _Target(fsdp_mp, "multi_tensor_applier", mt, _local_multi_tensor("local_multi_tensor_applier")),
        _Target(fsdp_mp, "multi_tensor_scale_impl", mt, _local_multi_tensor("local_multi_tensor_scale")),
    ]
    dopt = "megatron.core.optimizer.distrib_optimizer"
    oinit = "megatron.core.optimizer"
    targets += [
        # torch.optim.Adam: the distributed optimizer's isinstance check accepts it and its
        # subclass AdamW; AdamW here would reject the torch.optim.Adam that
        # get_megatron_optimizer builds for decoupled_weight_decay=False.
        _Target(dopt, "Adam", opt, _torch_optim("Adam")),
        _Target(dopt, "HAVE_APEX_OR_TE", opt, _constant(False)),
        _Target(dopt, "USING_TE_OPTIMIZER", opt, _constant(False)),
        _Target(dopt, "USING_APEX_OPTIMIZER", opt, _constant(False)),
        _Target(oinit, "Adam", opt, _torch_optim("AdamW")),
        _Target(oinit, "SGD", opt, _torch_optim("SGD")),
        _Target(oinit, "USING_PYTORCH_OPTIMIZER", opt, _constant(True)),
    ]
    return targets


def patch_targets() -> List[Tuple[str, str]]:
    """Every (module, attribute) the patch may replace."""
    return [(t.module, t.attribute) for t in _targets()]


def _describe(value: Any) -> str:
    module = getattr(value, "__module__", None)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if module and name:
        return f"{module}.{name}"
    return repr(value)


def _megatron_missing_reason() -> Optional[str]:
    try:
        importlib.import_module("torch")
    except ImportError as err:
        return f"torch is not installed ({err})"
    try:
        importlib.import_module("megatron.core")
    except ImportError as err:
        return f"megatron-core is not installed ({err})"
    return None


def _import(name: str, failures: Dict[str, str]) -> Optional[Any]:
    """The module, or None (with the reason in ``failures``) when it cannot be imported.

    Only ImportError counts as "missing" (an optional dependency of that one module, or a
    module this version does not have); any other exception is a bug and propagates."""
    if name in failures:
        return None
    try:
        return importlib.import_module(name)
    except ImportError as err:
        failures[name] = f"{type(err).__name__}: {err}"
        return None


def apply_megatron_core_patch() -> List[PatchResult]:
    """Applies the patches; returns what happened to each target (also logged at INFO).

    Each result's status is one of :data:`APPLY_STATUSES` (see the module's docstring). Safe
    to call again (every target then reports ``already in place``) and safe without
    megatron-core installed (returns an empty list after a warning). A replacement that fails
    raises: a bug is never reported as a status."""
    with _lock:
        missing = _megatron_missing_reason()
        if missing:
            _warn(
                f"megatron-core compatibility patch not applied: {missing}. Nothing to patch; "
                "install megatron-core (and torch) in this environment to use it."
            )
            return []
        results: List[PatchResult] = []
        failures: Dict[str, str] = {}
        targets = _targets()
        for target in targets:
            results.append(_apply_one(target, failures))
        _warn_missing_groups(targets, results)
        counts = patch_summary(results)
        log.info(
            "megatron-core patch: %s",
            ", ".join(f"{counts[status]} {status}" for status in APPLY_STATUSES),
        )
        return results


def _warn_missing_groups(targets: List[_Target], results: List[PatchResult]) -> None:
    """Warns for each group none of whose names this megatron-core has: a single missing name
    is expected across versions (INFO), a whole group missing means the patch does not know
    this version's layout for that part, which then runs unpatched."""
    groups: Dict[str, List[PatchResult]] = {}
    for target, res in zip(targets, results):
        groups.setdefault(target.group, []).append(res)
    version = _megatron_version()
    for group, members in groups.items():
        if all(r.status == MISSING for r in members):
            names = ", ".join(f"{r.module}.{r.attribute}" for r in members[:3])
            _warn(
                f"megatron-core patch: none of its {len(members)} names for the {group} exists in "
                f"megatron-core {version} ({names}{', ...' if len(members) > 3 else ''}): this "
                "version is laid out in a way the patch does not know, and that part of it runs "
                "unpatched (the patch was written against megatron-core 0.16.1)",
                stacklevel=4,  # the caller of apply_megatron_core_patch
            )


def _warn(message: str, stacklevel: int = 3) -> None:
    """Says ``message`` through :mod:`warnings`, which shows by default (this package's logger
    has no handler unless the application adds one), and into the log."""
    log.warning("%s", message)
    warnings.warn(message, stacklevel=stacklevel)


def _megatron_version() -> str:
    try:
        return str(getattr(importlib.import_module("megatron.core"), "__version__", "unknown"))
    except ImportError:
        return "unknown"


def patch_summary(results: List[PatchResult]) -> Dict[str, int]:
    """How many results have each status (every status of :data:`APPLY_STATUSES` present)."""
    counts = {status: 0 for status in APPLY_STATUSES}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


def _apply_one(target: _Target, failures: Dict[str, str]) -> PatchResult:
    key = (target.module, target.attribute)

    def result(status: str, reason: str = "") -> PatchResult:
        res = PatchResult(target.module, target.attribute, status, reason)
        log.info("megatron-core patch [%s] %s", target.group, res)
        return res

    module = _import(target.module, failures)
    if module is None:
        return result(MISSING, f"module cannot be imported: {failures[target.module]}")
    if not hasattr(module, target.attribute):
        return result(MISSING, "this megatron-core version has no such attribute")
    current = getattr(module, target.attribute)
    record = _records.get(key)
    if record is not None and current is record.replacement:
        return result(IN_PLACE, f"bound to {_describe(current)} by this patch earlier")
    try:
        replacement, text = target.replacement(current)
    except _Missing as err:
        return result(MISSING, str(err))
    except _Skip as skip:
        return result(KEPT, str(skip))
    if current is replacement:
        return result(IN_PLACE, f"megatron-core already binds {text}")
    setattr(module, target.attribute, replacement)
    # A target re-patched after something else rebound it keeps its first original.
    original = record.original if record is not None else current
    _records[key] = _Record(module, target.attribute, original, replacement)
    return result(APPLIED, f"{_describe(current)} -> {text}")


def revert_megatron_core_patch() -> List[PatchResult]:
    """Restores every name the patch replaced; returns what happened to each."""
    with _lock:
        results = []
        for (module_name, attribute), record in reversed(list(_records.items())):
            current = getattr(record.module, attribute, None)
            if current is record.replacement:
                setattr(record.module, attribute, record.original)
                res = PatchResult(module_name, attribute, REVERTED, f"back to {_describe(record.original)}")
            else:
                res = PatchResult(
                    module_name,
                    attribute,
                    LEFT,
                    f"rebound to {_describe(current)} after the patch; not overwriting it",
                )
            log.info("megatron-core patch %s", res)
            results.append(res)
        _records.clear()
        if not results:
            log.info("megatron-core patch: nothing to revert")
        return results


def is_patched() -> bool:
    """True while patches applied by this module are in place."""
    with _lock:
        return bool(_records)


def applied_patches() -> Dict[Tuple[str, str], Tuple[Any, Any]]:
    """(module, attribute) -> (original, replacement) for every patch in place."""
    with _lock:
        return {k: (r.original, r.replacement) for k, r in _records.items()}


@contextlib.contextmanager
def megatron_core_patch() -> Iterator[List[PatchResult]]:
    """Applies the patches for the duration of a ``with`` block, then reverts them (unless they
    were already applied when the block started)."""
    already = is_patched()
    results = apply_megatron_core_patch()
    try:
        yield results
    finally:
        if not already:  # a patch applied before the block outlives it
            revert_megatron_core_patch()
