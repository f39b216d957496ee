"""The plugin's run-time control API (``nccl_headers/nccl_lossy_control.h``) through ctypes.

Every call goes to the copy of the library NCCL loaded in this process, so that switches set
here are the ones NCCL's network threads read. The library is found, in order:

1. already mapped into this process (``/proc/self/maps``): opened again with ``RTLD_NOLOAD``,
   which hands back that very copy;
2. the library ``NCCL_NET_PLUGIN`` names, resolved the way NCCL resolves it; when it names a
   path that cannot be opened (or has no control API) :class:`ControlError` says so, naming
   the variable and the loader's reason, since NCCL would not use any other copy;
3. :func:`nccl_lossy.library_path` (also when ``NCCL_NET_PLUGIN`` is a bare name such as
   ``lossy`` that the loader's search path does not find).

Loading it early (before NCCL) is harmless: when NCCL later opens the same file the dynamic
loader returns the copy already loaded, with the switches already set.
"""

from __future__ import annotations

import ctypes
import json
import logging
import operator
import os
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ._echo import echo, echo_path
from ._library import (
    LIBRARY_ENV,
    NCCL_DEFAULT_NAME,
    LibraryNotFoundError,
    library_path,
    mapped_library_paths,
    nccl_plugin_candidates,
)

log = logging.getLogger("nccl_lossy")

#: Version of the control API this module speaks (``NCCL_LOSSY_CONTROL_VERSION``).
CONTROL_VERSION = 3

PHASE_ANY = 0
PHASE_FORWARD = 1
PHASE_BACKWARD = 2
_PHASES = {"any": PHASE_ANY, "forward": PHASE_FORWARD, "backward": PHASE_BACKWARD}


class ControlError(RuntimeError):
    """A control call failed, or the library does not offer the control API."""


def phase_code(phase: Any) -> int:
    """The numeric code of a phase given as a name (``"forward"``), a code, or None (any)."""
    if phase is None:
        return PHASE_ANY
    if isinstance(phase, str) and phase.lower() in _PHASES:
        return _PHASES[phase.lower()]
    code = _integer(phase)
    if code is not None and code in _PHASES.values():
        return code
    raise ValueError(
        f"phase {echo(phase)}: allowed: any, forward, backward (or their codes 0, 1, 2), or None for any"
    )


#: Steps the plugin takes: its ``ncclLossySetStep`` reads an unsigned 64-bit integer.
STEP_LIMIT = 2**64


def step_value(step: Any) -> int:
    """``step`` when the plugin can take it as it is, else ValueError naming it (ctypes would
    wrap 2**64 to 0, truncate 1.5 to 1 and take True as 1)."""
    value = _integer(step)
    if value is None or not 0 <= value < STEP_LIMIT:
        raise ValueError(f"step {echo(step)}: allowed: an integer from 0 to 2**64 - 1")
    return value


def switch_value(enabled: Any) -> bool:
    """``enabled`` as a bool when it is one (numpy's too) or the integer 0 or 1, else ValueError
    naming it: a truth test would take ``"false"``, ``"off"`` or ``2`` as on, and None as off."""
    if isinstance(enabled, bool):
        return enabled
    if type(enabled).__name__ in ("bool_", "bool") and type(enabled).__module__ == "numpy":
        return bool(enabled)
    # A 0-d numpy bool array (np.asarray(flag)), or a one-element torch bool tensor.
    if (type(enabled).__name__ == "ndarray" and type(enabled).__module__ == "numpy"
            and enabled.ndim == 0 and enabled.dtype.kind == "b"):
        return bool(enabled)
    if _torch_bool(enabled) and enabled.numel() == 1:
        return bool(enabled)
    if _integer(enabled) in (0, 1):
        return _integer(enabled) == 1
    raise ValueError(f"enabled {echo(enabled)}: allowed: True or False (or 1, 0)")


def _integer(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer (numpy's and torch's integer scalars too), not a
    bool (a torch bool tensor neither: operator.index takes it as 0 or 1), a float or text; else
    None."""
    if isinstance(value, bool) or _torch_bool(value):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _torch_bool(value: Any) -> bool:
    """Whether ``value`` is a torch tensor of bools (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.dtype == torch.bool


class Control:
    """ctypes bindings of the control functions of one loaded copy of the library."""

    def __init__(self, lib: ctypes.CDLL, path: str, source: str):
        self.lib = lib
        self.path = path
        #: How the library was found: ``mapped``, ``NCCL_NET_PLUGIN`` or ``package``.
        self.source = source
        lib.ncclLossyControlVersion.restype = ctypes.c_int
        lib.ncclLossyControlVersion.argtypes = []
        lib.ncclLossySetEnabled.restype = ctypes.c_int
        lib.ncclLossySetEnabled.argtypes = [ctypes.c_int]
        lib.ncclLossySetPhase.restype = ctypes.c_int
        lib.ncclLossySetPhase.argtypes = [ctypes.c_int]
        lib.ncclLossySetStep.restype = ctypes.c_int
        lib.ncclLossySetStep.argtypes = [ctypes.c_uint64]
        lib.ncclLossyStatsJson.restype = ctypes.c_int64
        lib.ncclLossyStatsJson.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.ncclLossyWriteStats.restype = ctypes.c_int
        lib.ncclLossyWriteStats.argtypes = []
        version = self.version()
        if version != CONTROL_VERSION:
            raise ControlError(
                f"{path} speaks control API version {version}; this package speaks "
                f"{CONTROL_VERSION}: install matching versions"
            )
        lib.ncclLossyWriteTrace.restype = ctypes.c_int64
        lib.ncclLossyWriteTrace.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

    def version(self) -> int:
        return int(self.lib.ncclLossyControlVersion())

    def set_enabled(self, enabled: bool) -> None:
        on = switch_value(enabled)
        self._check("ncclLossySetEnabled", self.lib.ncclLossySetEnabled(1 if on else 0))

    def set_phase(self, phase: Any) -> None:
        code = phase_code(phase)
        self._check("ncclLossySetPhase", self.lib.ncclLossySetPhase(code), f"phase {code}")

    def set_step(self, step: int) -> None:
        self._check("ncclLossySetStep", self.lib.ncclLossySetStep(step_value(step)))

    def stats_json(self) -> str:
        """This process's statistics document as JSON text."""
        cap = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = int(self.lib.ncclLossyStatsJson(buf, cap))
            if n < 0:
                raise ControlError("ncclLossyStatsJson failed (see the plugin's log on stderr)")
            if n < cap:
                return buf.raw[:n].decode("utf-8")
            cap = n + 1  # the document grew past the buffer: retry with its full size

    def stats(self) -> Dict[str, Any]:
        """This process's statistics as a dict (the layout of a statistics file)."""
        return json.loads(self.stats_json())

    def write_stats(self) -> bool:
        """Writes the statistics file into ``NCCL_LOSSY_STATS`` now.

        Returns False when ``NCCL_LOSSY_STATS`` is not set in this process."""
        rc = int(self.lib.ncclLossyWriteStats())
        if rc == 1:
            return False
        where = os.environ.get("NCCL_LOSSY_STATS", "")
        self._check("ncclLossyWriteStats", rc, f"NCCL_LOSSY_STATS={echo_path(where)}; the plugin's reason is on stderr")
        return True

    def write_trace(self) -> Optional[Path]:
        """Writes this process's trace file now (the messages recorded so far) and returns its
        path, wherever ``NCCL_LOSSY_TRACE`` or the profile's ``trace`` put it; None when this
        process traces nothing (no trace directory, or NCCL has made no communicator yet)."""
        buf = ctypes.create_string_buffer(4096)
        n = int(self.lib.ncclLossyWriteTrace(buf, len(buf)))
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            n = int(self.lib.ncclLossyWriteTrace(buf, len(buf)))
        self._check("ncclLossyWriteTrace", min(n, 0), "the plugin's reason is on stderr")
        return Path(os.fsdecode(buf.raw[:n])) if n > 0 else None

    @staticmethod
    def _check(name: str, rc: int, what: str = "") -> None:
        if rc != 0:
            detail = f" ({what})" if what else ""
            raise ControlError(f"{name} returned {rc}{detail}")


_lock = threading.Lock()
_control: Optional[Control] = None

#: Held while the plugin's process-wide switch, phase or step changes together with the Python
#: state that mirrors it (an integration's phase, the step recorder): a change is several steps
#: (a phase push is two control calls), and two threads interleaving them (a forward hook in the
#: training thread, a gradient hook in one of autograd's) left the plugin injecting in a phase
#: the integration keeps lossless, or counting traffic under another step than the recorder's.
STATE_LOCK = threading.RLock()


def _fresh_locks_in_child() -> None:
    # A forked child (a DataLoader worker) has one thread: a lock another thread of the parent
    # held at the fork would stay held forever, and the child's first control call would hang.
    global _lock, STATE_LOCK
    _lock = threading.Lock()
    STATE_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)


def _open(path: str, mode: int) -> Tuple[Optional[ctypes.CDLL], str]:
    """The library at ``path`` when it has the control API, else None and why not (the
    dynamic loader's own message when it cannot be loaded)."""
    try:
        lib = ctypes.CDLL(path, mode=mode)
    except OSError as err:
        return None, str(err)
    if hasattr(lib, "ncclLossyControlVersion"):
        return lib, ""
    return None, f"{path} has no control API (ncclLossyControlVersion): not this plugin, or a build that predates it"


def _locate() -> Control:
    noload = getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_NOW", 2)
    # Any net plugin file NCCL may have opened (libnccl-net.so, its default name, included):
    # the one with the control API is this plugin, whatever it is called.
    for path in mapped_library_paths(any_net_plugin=True):
        lib, _ = _open(path, noload)
        if lib is not None:
            return Control(lib, path, "mapped")
    global_mode = getattr(os, "RTLD_NOW", 2) | getattr(os, "RTLD_GLOBAL", ctypes.RTLD_GLOBAL)
    plugin = os.environ.get("NCCL_NET_PLUGIN")
    names = nccl_plugin_candidates(plugin)
    reasons = []
    for name in names:
        lib, why = _open(name, global_mode)
        if lib is not None:
            return Control(lib, name, "NCCL_NET_PLUGIN")
        reasons.append(why)
    if any("/" in name for name in names):
        # NCCL loads that path or nothing: binding to the packaged copy instead would set
        # switches NCCL's copy never reads.
        raise ControlError(
            f"NCCL_NET_PLUGIN={echo_path(plugin)} cannot serve the control API "
            f"({'; '.join(echo_path(why) for why in reasons)}); NCCL "
            "would not use the packaged copy either, so switches set there would not reach it. "
            "Allowed: the path of this plugin's library, or lossy; or unset NCCL_NET_PLUGIN"
        )
    from .network import torch_nccl_reason

    started = torch_nccl_reason()
    if started is not None and not plugin:
        # NCCL_NET_PLUGIN unset: NCCL will open its default name when it makes its first
        # communicator (torch makes them lazily); when that is this plugin, bind to it now.
        lib, _ = _open(NCCL_DEFAULT_NAME, global_mode)
        if lib is not None:
            return Control(lib, NCCL_DEFAULT_NAME, "NCCL_NET_PLUGIN")
    if started is not None:
        # NCCL runs and NCCL_NET_PLUGIN leads it to no copy of this plugin: a packaged copy
        # loaded now would take switches that NCCL never reads.
        raise ControlError(
            f"{started}, but NCCL_NET_PLUGIN={echo_path(plugin) if plugin else '(unset)'} does not lead "
            "NCCL to this plugin, so switches set here would not reach it. Set NCCL_NET_PLUGIN "
            "to this plugin's library and NCCL_NET=lossy before torch.distributed starts NCCL "
            "(`lossy run`, or LossyNetwork().apply() first)"
        )
    try:
        path = str(library_path())
    except LibraryNotFoundError as err:
        raise ControlError(f"cannot reach the plugin's control API: {err}") from err
    lib, why = _open(path, global_mode)
    if lib is None:
        named = f" ({LIBRARY_ENV}={echo_path(os.environ[LIBRARY_ENV])})" if os.environ.get(LIBRARY_ENV) else ""
        raise ControlError(f"{echo_path(path)}{named} could not be loaded or has no control API: {echo_path(why)}")
    return Control(lib, path, "package")


def control() -> Control:
    """The control bindings of the plugin library in this process (loaded on first use)."""
    global _control
    with _lock:
        if _control is None:
            _control = _locate()
            log.debug("control API: %s (%s)", _control.path, _control.source)
        return _control


def set_enabled(enabled: bool) -> None:
    """Turns loss injection on or off in this process (``True`` / ``False``; anything else is a
    ValueError naming it)."""
    switch_value(enabled)  # a bad value is named before any library is looked for
    with STATE_LOCK:
        control().set_enabled(enabled)


def set_phase(phase: Any) -> None:
    """Sets the training phase profile rules match: ``"any"``, ``"forward"``, ``"backward"``."""
    phase_code(phase)  # a bad value is named before any library is looked for
    with STATE_LOCK:
        control().set_phase(phase)


def set_step(step: int) -> None:
    """Sets the training step that rules with a ``steps`` window match, and that the plugin
    counts traffic under. While an integration records per-step statistics, its recorder
    moves with it: the traffic before goes to the step in force until now, as in the plugin's
    own series."""
    value = step_value(step)  # a bad value is named before any library is looked for
    from .steps import RECORDER  # reads the plugin through this module: imported here

    with STATE_LOCK:
        RECORDER.move_to(value, control().set_step)


def stats() -> Dict[str, Any]:
    """Live statistics of this process, in the layout of a statistics file."""
    return control().stats()


def write_stats() -> bool:
    """Writes this process's statistics file into ``NCCL_LOSSY_STATS`` now."""
    return control().write_stats()
