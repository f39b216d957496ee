"""Megatron / PyTorch training integration: :class:`LossyMegatronIntegration`."""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from ._echo import SHOWN_CHARS, echo, echo_path
from . import control as _control
from .config import LossyConfigError, check_bool, check_config_keys
from .megatron import apply_megatron_core_patch, is_patched, revert_megatron_core_patch
from .network import LossyNetwork, SetLike, format_overrides, same_overrides
from .profiler import profiler_active
from .statsfile import STEP_OP_COUNTERS, as_table, loss_rates
from .steps import RECORDER

log = logging.getLogger("nccl_lossy")

#: The phases by code (:data:`nccl_lossy.PHASE_ANY`, ``PHASE_FORWARD``, ``PHASE_BACKWARD``).
PHASES = ("any", "forward", "backward")

#: Keys a config dict given as the first argument may hold.
CONFIG_KEYS = (
    "loss_rate",
    "burst_length",
    "effect",
    "enable_on_forward",
    "enable_on_backward",
    "profile",
    "set",
    "stats_dir",
)
#: Keywords the constructor takes (named in the error for a misspelt one).
KEYWORDS = CONFIG_KEYS + ("network", "patch_megatron", "apply_env", "record_steps", "profile_ranges")
#: Names of the ``record_function`` ranges: ``lossy:step 12``, ``lossy:forward``, ...
RANGE_PREFIX = "lossy:"
#: The integrations of this process now enabled: the plugin's switch, phase and step are
#: process-wide, so a second one enabled beside the first overwrites what the first set.
_ENABLED: "weakref.WeakSet[LossyMegatronIntegration]" = weakref.WeakSet()
#: The integrations that share the megatron-core patches now in place, which an integration
#: applied (the first to find them missing) or took up (finding an integration's in place): any
#: of them may revert them, once no enabled integration needs them (``patch_megatron``).
_PATCH_OWNERS: "weakref.WeakSet[LossyMegatronIntegration]" = weakref.WeakSet()
#: Held while an integration applies, takes up or reverts the patches.
_PATCH_LOCK = threading.RLock()
#: The plugin's counters per step of this process (see :data:`steps.RECORDER`).
_RECORDER = RECORDER

class _Default:
    """A switch keyword left at its default ``value``, told apart from that value given: a
    config dict may then set the key, which it may not against a keyword given."""

    def __init__(self, value: bool):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


_ON = _Default(True)


class LossyMegatronIntegration:
    """Turns the lossy network on for a training run and tells the plugin where training is.

    The first argument is a :class:`LossyNetwork`, a profile path, or a config dict with the
    keys of :data:`CONFIG_KEYS`; the keywords say the same (a key given both ways must agree)::

        LossyMegatronIntegration(LossyNetwork("my-profile.toml"))
        LossyMegatronIntegration("my-profile.toml", enable_on_forward=False)
        LossyMegatronIntegration({"loss_rate": 0.01, "burst_length": 4, "enable_on_forward": False})
        LossyMegatronIntegration(loss_rate=0.01, burst_length=4, effect="zero")

    ``loss_rate`` + ``burst_length`` set the default loss model (burst length 1: independent
    loss; longer: Gilbert-Elliott with that mean burst), ``effect`` what a lost packet does.
    Everything is checked at construction, ``apply_env=False`` included: a wrong value raises
    :class:`LossyConfigError` naming the key, the value and what is allowed.

    ``enable()`` (or entering the ``with`` block) puts the :class:`LossyNetwork` environment in
    place (``apply_env``, see below), applies the megatron-core patches (``patch_megatron``)
    and switches injection on. :meth:`attach` hooks a model so that the
    plugin sees ``forward`` while the model runs forward and ``backward`` once gradients flow
    back through its outputs; with an optimizer it also advances the training step after each
    optimizer step (and marks the optimizer's own traffic as phase ``any``). The same can be
    done by hand with :meth:`mark_forward`, :meth:`mark_backward`, :meth:`mark_any` and
    :meth:`step`.

    ``apply_env`` (default True): ``enable()`` sets the variables NCCL needs that the
    environment lacks (:meth:`LossyNetwork.apply`). Variables a launcher already set (``lossy
    run --profile P --stats D``, the user's shell) are kept where this object leaves the value
    at its default; a value given here that differs from the environment's raises
    :class:`LossyConfigError` naming the variable and both values; ``NCCL_NET`` must be
    ``lossy``. After ``enable()``, :attr:`network` describes the configuration in force, the
    environment's values included. Once NCCL has started it is too late to set anything: with
    every variable already in place ``enable()`` goes on, with one missing it raises
    :class:`NcclAlreadyInitializedError`. ``apply_env=False`` leaves the environment alone
    (:attr:`network` then holds only the values given here).

    ``enable_on_forward`` / ``enable_on_backward``: whether loss is injected during that phase
    (traffic outside both phases is always subject to the profile while enabled). Profile rules
    on ``phase`` and ``steps`` see the phase and step in any case.

    ``record_steps`` (default True): at every step boundary, read the plugin's counters and
    keep their growth per collective and phase (:meth:`step_table`; :meth:`write_stats` and
    :meth:`disable` write them next to the plugin's statistics file, in :meth:`stats_dir`, for
    ``read_stats(dir, table="step_ops")``). It costs one read of the plugin's statistics per
    step. From the first ``enable()`` on, every message counts towards the step it was sent
    in, as in the plugin's own per-step series: those sent while disabled too, and a step set
    again (twice, or after a later one) adds to its rows.

    ``profile_ranges`` (default True): while a torch profiler records (e.g.
    :class:`nccl_lossy.profiler.LossyProfiler`), each step is a ``record_function`` range
    ``lossy:step N`` and each phase within it a range ``lossy:forward``, ``lossy:backward`` or
    ``lossy:any``, so that the profiler's timeline (and the plugin's loss events merged into
    it) shows which section of training a transfer belonged to. Without torch or a recording
    profiler nothing is recorded.

    Every change (``enable()``, ``disable()``, the phase, the step, and assigning
    ``enable_on_forward``, ``enable_on_backward``, ``enabled``, ``phase`` or ``step_number``)
    is pushed to the plugin at once: a message the plugin is handed after the change gets the
    new state. On a GPU the plugin is handed a message when the kernel has filled its buffer
    (NCCL's proxy, ``src/transport/net.cc``), which may be after the CPU moved on to the next
    phase or step; ``torch.cuda.synchronize()`` before a boundary makes its attribution exact
    (see the README).
    """

    def __init__(
        self,
        network_or_profile_or_config: Union[None, LossyNetwork, str, Path, Mapping[str, Any]] = None,
        *,
        loss_rate: Optional[float] = None,
        burst_length: Optional[float] = None,
        effect: Optional[str] = None,
        enable_on_forward: bool = _ON,  # type: ignore[assignment]  # True, unless the config says
        enable_on_backward: bool = _ON,  # type: ignore[assignment]
        profile: Optional[Union[str, Path]] = None,
        set: SetLike = None,  # noqa: A002 - mirrors NCCL_LOSSY_SET
        stats_dir: Optional[Union[str, Path]] = None,
        network: Optional[LossyNetwork] = None,
        patch_megatron: bool = True,
        apply_env: bool = True,
        record_steps: bool = True,
        profile_ranges: bool = True,
        **unknown: Any,
    ):
        if unknown:
            key = next(iter(unknown))
            raise LossyConfigError(
                f"LossyMegatronIntegration: unknown keyword {echo(key)} (value {echo(unknown[key])}); "
                f"allowed: {', '.join(KEYWORDS)}"
            )
        given = {
            "loss_rate": loss_rate,
            "burst_length": burst_length,
            "effect": effect,
            "enable_on_forward": enable_on_forward,
            "enable_on_backward": enable_on_backward,
            "profile": profile,
            "set": set,
            "stats_dir": stats_dir,
        }
        first = network_or_profile_or_config
        if isinstance(first, LossyNetwork):
            if network is not None and network is not first:
                raise LossyConfigError("network= and a positional LossyNetwork: allowed: one of the two")
            network = first
        elif isinstance(first, (str, os.PathLike)):
            if profile is not None and _same_file(profile) != _same_file(first):
                raise LossyConfigError(
                    f"profile={echo(profile, SHOWN_CHARS)} and a positional profile {echo(first, SHOWN_CHARS)}: allowed: one of the two"
                )
            given["profile"] = first
        elif isinstance(first, Mapping):
            given = _merge_config(first, given)
        elif first is not None:
            raise LossyConfigError(
                f"first argument {echo(first)}: allowed: a LossyNetwork, a profile path, or a config "
                f"dict with keys {', '.join(CONFIG_KEYS)}"
            )
        self.patch_megatron = check_bool("patch_megatron", patch_megatron)
        self.apply_env = check_bool("apply_env", apply_env)
        self.record_steps = check_bool("record_steps", record_steps)
        self.profile_ranges = check_bool("profile_ranges", profile_ranges)
        for key in ("enable_on_forward", "enable_on_backward"):
            if isinstance(given[key], _Default):
                given[key] = given[key].value
        self._enable_on_forward = check_bool("enable_on_forward", given["enable_on_forward"])
        self._enable_on_backward = check_bool("enable_on_backward", given["enable_on_backward"])
        network_keys = ("loss_rate", "burst_length", "effect", "profile", "set", "stats_dir")
        if network is not None:
            if not isinstance(network, LossyNetwork):
                raise LossyConfigError(f"network={echo(network)}: allowed: a LossyNetwork")
            extra = [k for k in network_keys if given[k] is not None]
            if extra:
                raise LossyConfigError(
                    f"{extra[0]}={echo(given[extra[0]])} next to a LossyNetwork, which carries its own: "
                    f"allowed: give {extra[0]} to the LossyNetwork"
                )
            self.network = network
            network.check()  # the plugin's own reading: a wrong profile fails here
        else:
            self.network = LossyNetwork(
                given["profile"],
                given["set"],
                given["stats_dir"],
                loss_rate=given["loss_rate"],
                burst_length=given["burst_length"],
                effect=given["effect"],
            )
        self._phase = "any"
        self._step = 0
        self._enabled = False
        self.patch_results: List[Any] = []
        self._detachers: List[Callable[[], None]] = []
        self._attached: List[Callable[[], Any]] = []  # what attach() hooked, until detach()
        self._recorder = _RECORDER
        self._step_range: Any = None
        self._phase_range: Any = None
        self._range_thread: Optional[int] = None
        self._depth = 0  # `with` blocks of this object now open

    # -- state, pushed to the plugin on every change --------------------------------------

    @property
    def enable_on_forward(self) -> bool:
        """Whether loss is injected while the phase is ``forward`` (assigning pushes it)."""
        return self._enable_on_forward

    @enable_on_forward.setter
    def enable_on_forward(self, value: bool) -> None:
        self._assign("_enable_on_forward", check_bool("enable_on_forward", value))

    @property
    def enable_on_backward(self) -> bool:
        """Whether loss is injected while the phase is ``backward`` (assigning pushes it)."""
        return self._enable_on_backward

    @enable_on_backward.setter
    def enable_on_backward(self, value: bool) -> None:
        self._assign("_enable_on_backward", check_bool("enable_on_backward", value))

    @property
    def enabled(self) -> bool:
        """The master switch (assigning pushes it; :meth:`enable` also sets up env and patches)."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._assign("_enabled", check_bool("enabled", value))

    @property
    def phase(self) -> str:
        """The training phase the plugin was told: ``any``, ``forward`` or ``backward``.
        Assigning takes what :func:`nccl_lossy.set_phase` takes (a name in any case, as
        profile rules' ``phase``, a code such as :data:`nccl_lossy.PHASE_FORWARD`, or None
        for ``any``) and refuses the rest in the same words; it reads back as the name."""
        return self._phase

    @phase.setter
    def phase(self, value: Any) -> None:
        try:
            code = _control.phase_code(value)  # the rule (and the message) of set_phase
        except ValueError as err:
            raise LossyConfigError(str(err)) from None
        with _control.STATE_LOCK:
            self._assign("_phase", PHASES[code])
            self._mark_ranges(new_step=False)

    @property
    def step_number(self) -> int:
        """The training step the plugin was told (assigning pushes it). While enabled, that is
        the process's step, also when :func:`nccl_lossy.set_step` set it (a resume from a
        checkpoint): the next :meth:`step` counts on from there."""
        with _control.STATE_LOCK:
            return self._recorder.step if self._enabled else self._step

    @step_number.setter
    def step_number(self, value: int) -> None:
        try:
            value = _control.step_value(value)  # checked before anything changes
        except ValueError:
            raise LossyConfigError(
                f"step_number={echo(value)}: allowed: an integer from 0 to 2**64 - 1"
            ) from None
        with _control.STATE_LOCK:
            self._recorder.move_to(value, _control.control().set_step)
            self._step = value
            self._mark_ranges(new_step=True)

    # -- profiler ranges ------------------------------------------------------------------

    def _mark_ranges(self, new_step: bool) -> None:
        """Ends the phase range (and the step range at a new step) and, while enabled and a
        torch profiler records, opens the ranges of the current step and phase."""
        if not self.profile_ranges:
            return
        if self._step_range is not None and threading.get_ident() != self._range_thread:
            # A hook in another thread (autograd runs backward hooks of CUDA tensors in its
            # own threads): torch drops a range ended in another thread than it began, so the
            # ranges of the training thread stay; the backward pass gets a range of its own in
            # this thread, ended when the backward pass ends.
            if self._phase == "backward" and self._enabled and profiler_active():
                _backward_range(f"{RANGE_PREFIX}{self._phase}")
            return
        active = self._enabled and profiler_active()
        self._close_ranges(step_too=new_step or not active)
        if not active:
            return
        from torch.profiler import record_function

        if self._step_range is None:
            self._step_range = record_function(f"{RANGE_PREFIX}step {self._step}")
            self._step_range.__enter__()
            self._range_thread = threading.get_ident()
        self._phase_range = record_function(f"{RANGE_PREFIX}{self._phase}")
        self._phase_range.__enter__()

    def _close_ranges(self, step_too: bool) -> None:
        if self._range_thread is not None and threading.get_ident() != self._range_thread:
            return  # ended in another thread, torch would drop them
        if self._phase_range is not None:
            self._phase_range.__exit__(None, None, None)
            self._phase_range = None
        if step_too and self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def injecting(self) -> bool:
        """Whether loss is injected right now, given the phase and the switches."""
        if not self._enabled:
            return False
        if self._phase == "forward":
            return self._enable_on_forward
        if self._phase == "backward":
            return self._enable_on_backward
        return True

    def _assign(self, attribute: str, value: Any) -> None:
        """Sets ``attribute`` and pushes the state to the plugin; when the plugin cannot be
        reached (ControlError) the attribute is as it was, so that the integration never says
        a state the plugin was not told."""
        with _control.STATE_LOCK:
            before = getattr(self, attribute)
            setattr(self, attribute, value)
            try:
                self._push()
            except BaseException:
                setattr(self, attribute, before)
                raise

    def _push(self) -> None:
        # Two calls, and the proxy may post a message between them: switch injection off
        # before moving to a phase kept lossless, and on only after moving to one that is
        # not, so no message sees a lossless phase with injection on (the plugin reads the
        # phase and the switch together, in one word).
        ctl = _control.control()
        if self.injecting():
            ctl.set_phase(self._phase)
            ctl.set_enabled(True)
        else:
            ctl.set_enabled(False)
            ctl.set_phase(self._phase)

    # -- switching ------------------------------------------------------------------------

    def enable(self) -> "LossyMegatronIntegration":
        """Environment (when ``apply_env``: the variables it lacks, see
        :meth:`LossyNetwork.apply`; :attr:`network` then describes what is in force),
        megatron-core patches (when ``patch_megatron``), then injection on."""
        if self.apply_env:
            network = self.network.resolved()
            network.apply()
            self.network = network  # describes what is in force, the environment's values too
        if self.patch_megatron:
            self._take_up_patches()
        others = [other for other in _ENABLED if other is not self]
        if others:
            warnings.warn(
                f"nccl_lossy: another LossyMegatronIntegration is enabled in this process (at step "
                f"{others[0]._step}, phase {others[0].phase}); the plugin's switch, phase and "
                f"step are process-wide, so this one (step {self._step}) and that one overwrite "
                "each other's and both step tables count the same traffic; disable() the other "
                "first, or drive both models through one integration (attach() takes a list)",
                stacklevel=2,
            )
        with _control.STATE_LOCK:
            # The control API first: when it cannot be reached (ControlError) this integration
            # stays disabled, instead of saying injecting() for a plugin it never told.
            _control.control()
            if self._enabled:
                # Enabled again (a `with` block inside its own, or enable() called twice): the
                # step in force is the process's, also one set_step() moved it to since (a
                # resume), not the integration's last own; taking that one moved the plugin back.
                self._step = self._recorder.step
            _ENABLED.add(self)
            self._enabled = True
            # The plugin's step is process-wide and may be another integration's (or an earlier
            # set_step()); from here on this integration's step is the one traffic counts under.
            self._recorder.move_to(self._step, _control.control().set_step)
            self._push()
            self._mark_ranges(new_step=False)
            if self.record_steps and not self._recorder.started:
                # Once only: what is sent while disabled (an evaluation) counts towards its
                # step, as the plugin's per-step series counts it.
                self._recorder.start()
        log.info(
            "lossy injection enabled (forward: %s, backward: %s)",
            self._enable_on_forward,
            self._enable_on_backward,
        )
        return self

    def disable(self, revert_patches: bool = False) -> None:
        """Injection off (phase ``any``). The megatron-core patches stay in place, so the
        communication functions under a running model do not change; ``revert_patches=True``
        also reverts the patches this object applied, or took up from another integration that
        applied them, unless another enabled integration (``patch_megatron``) still uses them:
        then they stay, with a warning, for the last one's ``disable(revert_patches=True)``.
        Patches the application applied itself are left to it. The step being recorded ends here, and
        with a statistics directory the per-step file is written (:meth:`write_stats`).

        An integration that is not enabled (never enabled, or disabled
        already) leaves the plugin alone, as :meth:`LossyProfiler.stop` of a profiler not
        started does: the switch, phase and step are process-wide, and turning them off here
        would turn off another integration's injection (a cleanup in a ``finally`` block, a
        second ``disable()``). ``revert_patches=True`` still reverts the patches as above."""
        revert = check_bool("revert_patches", revert_patches)  # before anything changes
        with _control.STATE_LOCK:
            # enable()d and not disable()d since, or switched on through ``enabled = True``
            on = self in _ENABLED or self._enabled
            if on:
                self._switch_off()
        reverted = self._revert_patches(revert)
        if on:
            log.info("lossy injection disabled%s", " and megatron-core patches reverted" if reverted else "")

    def _switch_off(self) -> None:
        self._step = self.step_number  # the step in force, wherever it was set
        self._enabled = False
        _ENABLED.discard(self)
        self._phase = "any"
        self._push()
        self._close_ranges(step_too=True)
        if self._recorder.started:
            self._recorder.end_step(self._recorder.step)
            stats_dir = self.stats_dir()
            if stats_dir is not None:
                self._recorder.write(stats_dir)

    def _take_up_patches(self) -> None:
        """Applies the megatron-core patches, or takes up those another integration applied."""
        with _PATCH_LOCK:
            if self in _PATCH_OWNERS and is_patched():
                return  # enabled again: its patches are in place
            already = is_patched()
            if not already:
                _PATCH_OWNERS.clear()  # reverted behind their back (revert_megatron_core_patch())
            self.patch_results = apply_megatron_core_patch()
            # Patches the application applied itself (apply_megatron_core_patch(), a
            # megatron_core_patch() block) are its own to revert, not an integration's.
            if is_patched() and (not already or len(_PATCH_OWNERS) > 0):
                _PATCH_OWNERS.add(self)

    def _revert_patches(self, revert: bool) -> bool:
        """Reverts the patches when ``revert``, this object shares them, and no enabled
        integration needs them; says why when another does. True when they were reverted."""
        with _PATCH_LOCK:
            if not revert or self not in _PATCH_OWNERS:
                return False
            if not is_patched():
                _PATCH_OWNERS.clear()
                return False
            users = [other for other in _ENABLED if other is not self and other.patch_megatron]
            if users:
                warnings.warn(
                    "nccl_lossy: disable(revert_patches=True) leaves the megatron-core patches in "
                    "place: another enabled LossyMegatronIntegration uses them (the patches are "
                    "process-wide); the disable(revert_patches=True) of the last one enabled "
                    "reverts them",
                    stacklevel=3,
                )
                return False
            revert_megatron_core_patch()
            _PATCH_OWNERS.clear()
            return True

    def __enter__(self) -> "LossyMegatronIntegration":
        # A block entered again inside itself (a helper wrapping its work in ``with integ:``)
        # is counted: only the outermost block's end detaches and disables, else the rest of
        # the outer block would run lossless, without phases or steps.
        self.enable()
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._depth == 0:
            # Counted below zero, the next real block would end above it and never disable.
            raise RuntimeError(
                "nccl_lossy: __exit__ of a LossyMegatronIntegration that no `with` block entered "
                "(call disable() to switch injection off outside a `with` block)"
            )
        self._depth -= 1
        if self._depth == 0:
            self.detach()
            self.disable()

    # -- phases and steps -----------------------------------------------------------------

    def mark_forward(self) -> None:
        """Phase ``forward`` (pushed even when it already was)."""
        self.phase = "forward"

    def mark_backward(self) -> None:
        """Phase ``backward`` (pushed even when it already was)."""
        self.phase = "backward"

    def mark_any(self) -> None:
        """Phase ``any`` (pushed even when it already was)."""
        self.phase = "any"

    def step(self, step: Optional[int] = None) -> int:
        """Sets the training step (default: the next one) and returns it."""
        with _control.STATE_LOCK:
            self.step_number = self.step_number + 1 if step is None else step
            return self._step

    # -- hooks ----------------------------------------------------------------------------

    def attach(self, model: Any, optimizer: Any = None) -> "LossyMegatronIntegration":
        """Hooks ``model`` (a module or a list of modules, e.g. virtual pipeline chunks) and,
        when given, ``optimizer`` (a torch optimizer or anything with a ``step`` method). A
        module or optimizer already attached (and not detached since) is not hooked again, so
        attaching each chunk with the same optimizer advances the step once per optimizer step.
        A ``torch.nn.ModuleList`` / ``ModuleDict`` stands for its modules (it has no forward, so
        hooks on it would never run); anything else that is no module is a TypeError."""
        modules = _modules(model, "model")
        if optimizer is not None and not callable(getattr(optimizer, "step", None)):
            raise TypeError(
                f"attach: optimizer={_what(optimizer)} has no step(); allowed: a torch optimizer, "
                "megatron-core's MegatronOptimizer, or anything with a step method"
            )
        for module in modules:
            if self._remember(module):
                pre = module.register_forward_pre_hook(self._on_forward_pre)
                post = module.register_forward_hook(self._on_forward_post)
                self._detachers += [pre.remove, post.remove]
        if optimizer is not None and self._remember(optimizer):
            self._attach_optimizer(optimizer)
        return self

    def _remember(self, obj: Any) -> bool:
        """False when ``obj`` is attached already; else notes it as attached, True."""
        if any(ref() is obj for ref in self._attached):
            return False
        try:
            self._attached.append(weakref.ref(obj))
        except TypeError:  # no weak references to it: held until detach()
            self._attached.append(lambda: obj)
        return True

    def detach(self) -> None:
        """Removes every hook :meth:`attach` installed."""
        while self._detachers:
            self._detachers.pop()()
        self._attached.clear()

    def _on_forward_pre(self, module: Any, args: Any) -> None:
        self.mark_forward()

    def _on_forward_post(self, module: Any, args: Any, output: Any) -> None:
        self._close_ranges(step_too=False)  # the forward section ends here on the timeline
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

    def step_table(self, dataframe: Union[bool, str] = False) -> Any:
        """The plugin's counters per step x collective x phase recorded so far in this process, by
        every integration of it, as the plugin's counters are process-wide (the ``step_ops``
        table of :func:`nccl_lossy.read_stats`, without the file columns): one row per
        (step, op, phase) that saw traffic, with ``messages``, ``bytes``, ``packets``,
        ``lost_packets``, ``loss_events`` (bursts within a message), ``packets_injection_off``,
        ``loss_rate`` and ``loss_rate_injecting`` (see :func:`nccl_lossy.statsfile.loss_rates`).
        Steps end at :meth:`step` (and :meth:`disable`)."""
        with _control.STATE_LOCK:
            recorded = self._recorder.rows
        rows = [{**r, **loss_rates(r)} for r in recorded]
        columns = ("step", "op", "phase") + STEP_OP_COUNTERS + ("loss_rate", "loss_rate_injecting")
        return as_table(rows, columns, dataframe)

    def stats_dir(self) -> Optional[Path]:
        """The statistics directory: the integration's own (``stats_dir``), else the one the
        plugin writes to (``NCCL_LOSSY_STATS`` in the environment, e.g. from ``lossy run
        --stats``); None when neither is set."""
        if self.network.stats_dir is not None:
            return self.network.stats_dir
        from_env = os.environ.get("NCCL_LOSSY_STATS", "")
        return Path(from_env).resolve() if from_env.strip() else None

    def write_stats(self) -> Optional[Path]:
        """Asks the plugin to write its statistics file into the statistics directory now and
        writes the per-step file next to it (:meth:`stats_dir`); returns the per-step file's
        path (None without a statistics directory)."""
        with _control.STATE_LOCK:
            if self._recorder.started:
                # The step under way so far, as the plugin's file written now holds it (its
                # rest adds to the same rows when the step ends).
                self._recorder.end_step(self._recorder.step)
        wrote = _control.control().write_stats()
        stats_dir = self.stats_dir()
        if stats_dir is None:
            return None
        plugin_dir = os.environ.get("NCCL_LOSSY_STATS", "")
        # A configuration the caller can fix: said through warnings, which show by default
        # (this package's log has no handler unless the application adds one).
        if not wrote:
            warnings.warn(
                "nccl_lossy: the plugin wrote no statistics file: NCCL_LOSSY_STATS is not set in "
                f"this process (apply_env=False leaves the environment as it is), so {echo_path(stats_dir)} "
                f"gets the per-step file alone; set NCCL_LOSSY_STATS={echo_path(stats_dir)} before NCCL "
                "starts, or leave apply_env on",
                stacklevel=2,
            )
        elif Path(plugin_dir).resolve() != _same_file(stats_dir):
            warnings.warn(
                f"nccl_lossy: the plugin wrote its statistics file into NCCL_LOSSY_STATS={echo_path(plugin_dir)}, "
                f"the per-step file goes to stats_dir {echo_path(stats_dir)}: read_all() on one directory "
                "sees half of the run",
                stacklevel=2,
            )
        with _control.STATE_LOCK:
            return self._recorder.write(stats_dir)


_MODULE_ALLOWED = "allowed: a torch.nn.Module (one with a forward) or a list or tuple of them"


def _what(obj: Any) -> str:
    """``obj`` as an error message names it: a plain value as itself, another by its type."""
    return repr(obj) if obj is None or isinstance(obj, (int, float, str)) else f"<{type(obj).__name__}>"


def _modules(model: Any, name: str) -> List[Any]:
    """The modules ``attach`` hooks for ``model``, checked before anything is hooked: a
    container without a forward of its own (``torch.nn.ModuleList``, ``ModuleDict``), whose
    hooks would never run, stands for the modules it holds."""
    if isinstance(model, (list, tuple)):
        return [m for i, item in enumerate(model) for m in _modules(item, f"{name}[{i}]")]
    hooks = ("register_forward_pre_hook", "register_forward_hook")
    if not all(callable(getattr(model, hook, None)) for hook in hooks):
        raise TypeError(f"attach: {name}={_what(model)} is no module; {_MODULE_ALLOWED}")
    forward = getattr(type(model), "forward", None)
    if getattr(forward, "__name__", "") == "_forward_unimplemented":
        children = list(model.children()) if callable(getattr(model, "children", None)) else []
        if not children:
            raise TypeError(f"attach: {name}={_what(model)} has no forward and holds no module; {_MODULE_ALLOWED}")
        return [m for i, child in enumerate(children) for m in _modules(child, f"{name}[{i}]")]
    return [model]


def _same_file(path: Union[str, "os.PathLike[str]"]) -> Path:
    """``path`` as one spelling of the file it names (``~``, ``..`` and links resolved)."""
    return Path(path).expanduser().resolve()


def _merge_config(config: Mapping[str, Any], given: Dict[str, Any]) -> Dict[str, Any]:
    """The config dict's values with the keywords; a key set both ways must agree."""
    check_config_keys(config, CONFIG_KEYS, "LossyMegatronIntegration config")
    merged = dict(given)
    for key, value in config.items():
        keyword = given[key]
        if keyword is not None and not isinstance(keyword, _Default) and not _same_value(key, keyword, value):
            raise LossyConfigError(
                f"{key}: the config says {echo(value)}, the keyword {echo(keyword)}; allowed: one value"
            )
        merged[key] = value
    return merged


def _same_value(key: str, a: Any, b: Any) -> bool:
    """Whether two spellings of a config value mean the same: paths naming one file, overrides
    setting the same keys to the same values, else equal values."""
    paths = (str, os.PathLike)
    if key in ("profile", "stats_dir") and isinstance(a, paths) and isinstance(b, paths):
        return _same_file(a) == _same_file(b)
    if key == "set" and a is not None and b is not None:
        return same_overrides(format_overrides(a), format_overrides(b))
    return bool(a == b)


def _tensors(value: Any) -> List[Any]:
    if hasattr(value, "register_hook") and hasattr(value, "requires_grad"):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def end_ranges() -> None:
    """Ends the open ``record_function`` ranges of every enabled integration (those this
    thread opened): a torch profiler's window is about to end, and a range open across its
    end is one torch warns about and exports with an end it makes up."""
    with _control.STATE_LOCK:
        for integ in list(_ENABLED):
            integ._close_ranges(step_too=True)


def reopen_ranges() -> None:
    """Opens the ranges of the current step and phase again for every enabled integration,
    when a torch profiler records (the next window of :func:`end_ranges`)."""
    with _control.STATE_LOCK:
        for integ in list(_ENABLED):
            if integ._step_range is None and integ._phase_range is None:
                integ._mark_ranges(new_step=False)


def _backward_range(name: str) -> None:
    """A ``record_function`` range from now to the end of the running backward pass (in the
    calling thread); outside a backward pass, an empty one."""
    import torch
    from torch.profiler import record_function

    rng = record_function(name)
    rng.__enter__()
    try:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: rng.__exit__(None, None, None))
    except RuntimeError:
        rng.__exit__(None, None, None)
