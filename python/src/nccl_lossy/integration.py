"""Megatron / PyTorch training integration: :class:`LossyMegatronIntegration`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, List, Optional, Union

from . import control as _control
from .megatron import apply_megatron_core_patch, is_patched, revert_megatron_core_patch
from .network import LossyNetwork, SetLike

log = logging.getLogger("nccl_lossy")

PHASES = ("any", "forward", "backward")


class LossyMegatronIntegration:
    """Turns the lossy network on for a training run and tells the plugin where training is.

    ``enable()`` (or entering the ``with`` block) puts the :class:`LossyNetwork` environment in
    place when NCCL has not started yet (``apply_env``), applies the megatron-core patches
    (``patch_megatron``) and switches injection on. :meth:`attach` hooks a model so that the
    plugin sees ``forward`` while the model runs forward and ``backward`` once gradients flow
    back through its outputs; with an optimizer it also advances the training step after each
    optimizer step (and marks the optimizer's own traffic as phase ``any``). The same can be
    done by hand with :meth:`mark_forward`, :meth:`mark_backward`, :meth:`mark_any` and
    :meth:`step`.

    ``enable_on_forward`` / ``enable_on_backward``: whether loss is injected during that phase
    (traffic outside both phases is always subject to the profile while enabled). Profile rules
    on ``phase`` and ``steps`` see the phase and step in any case.
    """

    def __init__(
        self,
        profile: Optional[Union[str, Path]] = None,
        enable_on_forward: bool = True,
        enable_on_backward: bool = True,
        *,
        set: SetLike = None,  # noqa: A002 - mirrors NCCL_LOSSY_SET
        stats_dir: Optional[Union[str, Path]] = None,
        network: Optional[LossyNetwork] = None,
        patch_megatron: bool = True,
        apply_env: bool = True,
    ):
        self.network = network if network is not None else LossyNetwork(profile, set, stats_dir)
        self.enable_on_forward = enable_on_forward
        self.enable_on_backward = enable_on_backward
        self.patch_megatron = patch_megatron
        self.apply_env = apply_env
        self.phase = "any"
        self.step_number = 0
        self.enabled = False
        self.patch_results: List[Any] = []
        self._patched_here = False
        self._detachers: List[Callable[[], None]] = []

    # -- switching ------------------------------------------------------------------------

    def enable(self) -> "LossyMegatronIntegration":
        if self.apply_env:
            wanted = self.network.env()
            if all(os.environ.get(k) == v for k, v in wanted.items()):
                log.info("lossy network environment already in place")
            else:
                self.network.apply()
        if self.patch_megatron and not self._patched_here:
            already = is_patched()
            self.patch_results = apply_megatron_core_patch()
            self._patched_here = not already and is_patched()
        self.enabled = True
        self._push()
        log.info(
            "lossy injection enabled (forward: %s, backward: %s)",
            self.enable_on_forward,
            self.enable_on_backward,
        )
        return self

    def disable(self) -> None:
        self.enabled = False
        self.phase = "any"
        self._push()
        if self._patched_here:
            revert_megatron_core_patch()
            self._patched_here = False
        log.info("lossy injection disabled")

    def __enter__(self) -> "LossyMegatronIntegration":
        return self.enable()

    def __exit__(self, *exc: Any) -> None:
        self.detach()
        self.disable()

    # -- phases and steps -----------------------------------------------------------------

    def injecting(self) -> bool:
        """Whether loss is injected right now, given the phase and the switches."""
        if not self.enabled:
            return False
        if self.phase == "forward":
            return self.enable_on_forward
        if self.phase == "backward":
            return self.enable_on_backward
        return True

    def _push(self) -> None:
        ctl = _control.control()
        ctl.set_phase(self.phase)
        ctl.set_enabled(self.injecting())

    def _set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; allowed: {', '.join(PHASES)}")
        if phase != self.phase:
            self.phase = phase
            self._push()

    def mark_forward(self) -> None:
        self._set_phase("forward")

    def mark_backward(self) -> None:
        self._set_phase("backward")

    def mark_any(self) -> None:
        self._set_phase("any")

    def step(self, step: Optional[int] = None) -> int:
        """Sets the training step (default: the next one) and returns it."""
        self.step_number = self.step_number + 1 if step is None else int(step)
        _control.control().set_step(self.step_number)
        return self.step_number

    # -- hooks ----------------------------------------------------------------------------

    def attach(self, model: Any, optimizer: Any = None) -> "LossyMegatronIntegration":
        """Hooks ``model`` (a module or a list of modules, e.g. virtual pipeline chunks) and,
        when given, ``optimizer`` (a torch optimizer or anything with a ``step`` method)."""
        modules = list(model) if isinstance(model, (list, tuple)) else [model]
        for module in modules:
            pre = module.register_forward_pre_hook(self._on_forward_pre)
            post = module.register_forward_hook(self._on_forward_post)
            self._detachers += [pre.remove, post.remove]
        if optimizer is not None:
            self._attach_optimizer(optimizer)
        return self

    def detach(self) -> None:
        """Removes every hook :meth:`attach` installed."""
        while self._detachers:
            self._detachers.pop()()

    def _on_forward_pre(self, module: Any, args: Any) -> None:
        self.mark_forward()

    def _on_forward_post(self, module: Any, args: Any, output: Any) -> None:
        tensors = [t for t in _tensors(output) if getattr(t, "requires_grad", False)]
        if not tensors:
            return
        fired = [False]

        def on_grad(grad: Any) -> None:
            if not fired[0]:
                fired[0] = True
                self.mark_backward()

        for tensor in tensors:
            tensor.register_hook(on_grad)

    def _attach_optimizer(self, optimizer: Any) -> None:
        if hasattr(optimizer, "register_step_pre_hook") and hasattr(optimizer, "register_step_post_hook"):
            pre = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.mark_any())
            post = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step())
            self._detachers += [pre.remove, post.remove]
            return
        original = optimizer.step  # e.g. megatron-core's MegatronOptimizer, not a torch one

        def step(*args: Any, **kwargs: Any) -> Any:
            self.mark_any()
            result = original(*args, **kwargs)
            self.step()
            return result

        optimizer.step = step

        def restore() -> None:
            if optimizer.step is step:
                del optimizer.step  # the class's method shows through again
                if getattr(optimizer, "step", None) != original:
                    optimizer.step = original

        self._detachers.append(restore)

    # -- statistics -----------------------------------------------------------------------

    def stats(self) -> Any:
        """Live statistics of this process (see :func:`nccl_lossy.stats`)."""
        return _control.control().stats()


def _tensors(value: Any) -> List[Any]:
    if hasattr(value, "register_hook") and hasattr(value, "requires_grad"):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
