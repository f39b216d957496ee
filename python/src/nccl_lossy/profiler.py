"""Loss on the training timeline: a ``torch.profiler`` wrapper and the merge of the plugin's
trace with the torch profiler's, one timeline per rank (see ``docs/timeline.md``).

:class:`LossyProfiler` runs ``torch.profiler.profile`` with a wait/warmup/active/repeat
schedule and, each time a cycle's trace is ready, writes into ``output_dir``:

- ``torch-trace-rank{R}-{host}-{pid}-{n}.json``: the torch profiler's Chrome trace
  (``export_chrome_trace``);
- ``tensorboard/``: the same trace for TensorBoard's profiler plugin, named as
  ``torch.profiler.tensorboard_trace_handler`` names it (``export_tensorboard``);
- ``merged-trace-rank{R}-{host}-{pid}-{n}.json``: the torch trace with the events of the
  plugin's trace file of this process (``lossy-trace-rank{R}-{host}-{pid}.json`` in
  ``trace_dir``, default ``NCCL_LOSSY_TRACE``) moved onto the torch trace's clock
  (:func:`merge_traces`), when that file exists. Perfetto and ``chrome://tracing`` open it.

torch is imported only when a profiler is built: the rest of the package never needs it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ._echo import SHOWN_CHARS, echo
from ._files import read_regular_file, write_atomically
from .steps import file_name_host, launcher_rank

log = logging.getLogger("nccl_lossy")

#: Environment variable naming the directory the plugin writes its trace files into.
TRACE_DIR_ENV = "NCCL_LOSSY_TRACE"
#: Key of the plugin's metadata in its trace file.
PLUGIN_META_KEY = "lossy_trace"
#: Newest plugin trace layout this module reads.
PLUGIN_TRACE_VERSION = 1
#: Merged files put the plugin's tracks at this thread id plus the plugin's track number, so
#: that they never share a row with one of the torch trace's threads.
MERGED_TID_BASE = 1 << 30
#: Activities by name.
ACTIVITIES = ("cpu", "cuda")


class TraceFormatError(ValueError):
    """A file is not a trace this module can read."""


@dataclass
class ProfilerConfig:
    """What :class:`LossyProfiler` records and writes.

    The schedule is torch's: ``wait`` steps idle, ``warmup`` steps recorded and discarded,
    ``active`` steps recorded, the cycle repeated ``repeat`` times (0: until stopped)."""

    output_dir: Union[str, Path] = "profiler"
    activities: Sequence[str] = ("cpu", "cuda")
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = False
    with_stack: bool = False
    export_chrome_trace: bool = True
    export_tensorboard: bool = False
    #: Where to read the plugin's trace file when the plugin in this process cannot be asked
    #: to write it at export (default: ``NCCL_LOSSY_TRACE``); a plugin that can be asked says
    #: where it writes.
    trace_dir: Optional[Union[str, Path]] = None
    #: Write the merged trace when the plugin's trace file of this process is there.
    merge: bool = True
    extra: Dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Refuses a setting of the wrong kind or out of range, naming it: text for
        ``activities`` was iterated as activity names, ``"no"`` for a switch taken as true,
        and ``extra=None`` failed only at ``start()``."""
        for name in ("output_dir", "trace_dir"):
            value = getattr(self, name)
            if not (isinstance(value, (str, os.PathLike)) or (value is None and name == "trace_dir")):
                raise ValueError(f"{name}={echo(value, SHOWN_CHARS)}: allowed: a directory (str or os.PathLike)"
                                 f"{' or None' if name == 'trace_dir' else ''}")
        for name in ("record_shapes", "with_stack", "export_chrome_trace", "export_tensorboard", "merge"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={echo(getattr(self, name))}: allowed: True or False")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra={echo(self.extra)}: allowed: a dict of torch.profiler.profile "
                             "keywords")
        if isinstance(self.activities, (str, bytes)) or not isinstance(self.activities, Iterable):
            raise ValueError(f"activities={echo(self.activities)}: allowed: a list or tuple of "
                             f"{', '.join(ACTIVITIES)}")
        for name in ("wait", "warmup", "active", "repeat"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={echo(value)}: allowed: an integer >= 0")
        if self.active < 1:
            raise ValueError(f"active={echo(self.active)}: allowed: an integer >= 1")
        for a in self.activities:
            if a not in ACTIVITIES:
                raise ValueError(f"activity {echo(a)}: allowed: {', '.join(ACTIVITIES)}")


class LossyProfiler:
    """``torch.profiler.profile`` with :class:`ProfilerConfig`'s schedule and exports, and
    the plugin's trace merged in on export. ``start()``, ``step()`` once per training step,
    ``stop()``; or ``with LossyProfiler(cfg) as prof: ... prof.step()``."""

    def __init__(self, config: Optional[ProfilerConfig] = None, **overrides: Any):
        if config is not None and not isinstance(config, ProfilerConfig):
            raise TypeError(f"LossyProfiler: config={echo(config)}: allowed: a ProfilerConfig or None "
                            "(settings as keywords: LossyProfiler(output_dir=...))")
        config = config or ProfilerConfig()
        for key in overrides:
            if key not in {f.name for f in fields(ProfilerConfig)}:
                raise ValueError(
                    f"LossyProfiler: unknown setting {echo(key)}; allowed: "
                    f"{', '.join(f.name for f in fields(ProfilerConfig))}"
                )
        config = replace(config, **overrides)  # a copy: the caller's config stays as it was
        config.check()
        self.config = config
        self.output_dir = Path(config.output_dir)
        #: Paths written so far, by kind (``torch``, ``merged``).
        self.written: Dict[str, List[Path]] = {"torch": [], "merged": []}
        self._profile: Any = None
        self._cycles = 0

    def _activities(self) -> List[Any]:
        import torch
        from torch.profiler import ProfilerActivity

        wanted = []
        for name in self.config.activities:
            if name == "cuda" and not torch.cuda.is_available():
                log.info("profiler: no CUDA device, recording CPU activity only")
                continue
            wanted.append(ProfilerActivity.CPU if name == "cpu" else ProfilerActivity.CUDA)
        return wanted or [ProfilerActivity.CPU]

    def start(self) -> "LossyProfiler":
        """Builds the torch profiler and starts it (its schedule starts at step 0). A profiler
        already started must be stopped first: a second torch profiler over the first would lose
        the first one's recording cycle."""
        if self._profile is not None:
            raise RuntimeError("LossyProfiler.start(): already started; stop() it first")
        import torch.profiler as tp

        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._profile = tp.profile(
            activities=self._activities(),
            schedule=tp.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
            on_trace_ready=self._on_trace_ready,
            record_shapes=cfg.record_shapes,
            with_stack=cfg.with_stack,
            **cfg.extra,
        )
        self._profile.start()
        return self

    def step(self) -> None:
        """Ends one training step in the profiler's schedule. At the end of a recording window
        the ranges of enabled integrations (``lossy:step N``, ``lossy:forward`` ...) end with
        it, and open again when the next window begins: torch warns about a range open
        across a window's end and exports it with an end it makes up."""
        if self._profile is None:
            return
        from torch.profiler import ProfilerAction

        from .integration import end_ranges, reopen_ranges

        if self._profile.current_action == ProfilerAction.RECORD_AND_SAVE:
            end_ranges()
        self._profile.step()
        # A window that begins here (after the last one, or after the wait steps) gets the
        # ranges of the step and phase in force, not only those of the next change.
        reopen_ranges()

    def stop(self) -> None:
        """Stops the profiler (a cycle still recording is exported, the ranges of enabled
        integrations ended with it)."""
        if self._profile is not None:
            from .integration import end_ranges

            end_ranges()
            self._profile.stop()
            self._profile = None

    def __enter__(self) -> "LossyProfiler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _next_tag(self) -> str:
        """``rank{R}-{host}-{pid}-{n}`` with the next cycle number ``n`` whose files are not
        there yet: another profiler of this process (an earlier profiling window) may have
        written into the same directory, and its files are kept."""
        while True:
            self._cycles += 1
            tag = f"{_file_tag()}-{self._cycles}"
            if not any((self.output_dir / f"{kind}-trace-{tag}.json").exists()
                       for kind in ("torch", "merged")):
                return tag

    def _on_trace_ready(self, prof: Any) -> None:
        cfg = self.config
        if not (cfg.export_chrome_trace or cfg.export_tensorboard or cfg.merge):
            return
        tag = self._next_tag()
        # torch exports a trace once: export it here, copy it where TensorBoard looks.
        torch_path = self.output_dir / f"torch-trace-{tag}.json"
        prof.export_chrome_trace(str(torch_path))
        if cfg.export_tensorboard:
            board = self.output_dir / "tensorboard"
            board.mkdir(parents=True, exist_ok=True)
            # the name torch.profiler.tensorboard_trace_handler gives: WORKER.MILLIS.pt.trace.json
            shutil.copyfile(torch_path, board / f"{_file_tag()}.{int(time.time() * 1000)}.pt.trace.json")
        if self.config.export_chrome_trace:
            self.written["torch"].append(torch_path)
        if self.config.merge:
            plugin, traces_nothing = self._plugin_trace_now()
            if traces_nothing:
                given = self.plugin_trace_path()
                if given is not None:
                    _warn(f"profiler: the plugin in this process traces nothing, so no merged "
                          f"trace is written (trace_dir names {given.parent}, but the plugin "
                          f"writes trace files only where {TRACE_DIR_ENV} or the profile's "
                          f"`trace` key tells it): set {TRACE_DIR_ENV} for the training "
                          f"processes before NCCL starts")
                else:
                    log.info("profiler: the plugin traces nothing (%s, profile key `trace`), "
                             "no merge", TRACE_DIR_ENV)
            elif plugin is None:
                log.info("profiler: no trace directory (trace_dir, %s), no merge", TRACE_DIR_ENV)
            elif not plugin.is_file():
                later = (f" (or merge later: merge_trace_files({str(torch_path)!r}, "
                         f"{str(plugin)!r}, OUT))" if cfg.export_chrome_trace else "")
                _warn(f"profiler: the plugin's trace file of this process, {plugin}, is not there "
                      f"at this export, so no merged trace is written: the plugin writes it "
                      f"every stats_interval (profile key; none by default), soon after its "
                      f"connections close and at the end of the run; set stats_interval{later}, "
                      f"and check that {TRACE_DIR_ENV} is set for the training processes")
            else:
                self._merge(torch_path, plugin, tag)
        if not self.config.export_chrome_trace:
            torch_path.unlink()

    def _merge(self, torch_path: Path, plugin: Path, tag: str) -> None:
        """Writes the merged trace of one export; a plugin file it cannot read (cut short,
        another layout) is a warning: it costs this merge, not the run calling ``step()``."""
        torch_trace = load_trace(torch_path)
        try:
            # its metadata and events, as merge_traces reads them
            plugin_trace = load_trace(plugin)
            text = json.dumps(merge_traces(torch_trace, plugin_trace))
        except TraceFormatError as err:
            _warn(f"profiler: no merged trace for this export, the plugin's trace file {plugin} "
                  f"cannot be read: {err}")
            return
        merged = self.output_dir / f"merged-trace-{tag}.json"
        write_atomically(merged, text)
        self.written["merged"].append(merged)
        log.info("profiler: wrote %s (torch + plugin trace %s)", merged, plugin)
        missing = messages_not_in_trace(plugin_trace)
        if missing is not None and missing > 0:
            _warn(f"profiler: {merged} lacks the plugin's last {missing} sent message(s): its "
                  f"trace file {plugin} was written before they completed. The plugin writes "
                  f"its trace every stats_interval (profile key; none by default), soon after "
                  f"its connections close and at the end of the run; a shorter stats_interval "
                  f"narrows the gap")

    def _plugin_trace_now(self) -> Tuple[Optional[Path], bool]:
        """The plugin's trace file of this process, which the plugin in this process is asked
        to write now (so that it holds every message sent so far, wherever the profile or
        ``NCCL_LOSSY_TRACE`` put it), and whether the plugin answered that it traces nothing.
        When the plugin cannot be asked, the file :meth:`plugin_trace_path` names, as it is."""
        from . import control as _control

        try:
            plugin = _control.control()
        except (_control.ControlError, OSError) as err:
            log.debug("profiler: the plugin cannot be asked for its trace now: %s", err)
            return self.plugin_trace_path(), False
        try:
            written = plugin.write_trace()
        except _control.ControlError as err:
            _warn(f"profiler: the plugin could not write its trace file now ({err}); merging "
                  f"what its last write left, if anything")
            return self.plugin_trace_path(), False
        return written, written is None

    def plugin_trace_path(self) -> Optional[Path]:
        """The plugin trace file of this process (it may not exist yet)."""
        directory = self.config.trace_dir or os.environ.get(TRACE_DIR_ENV)
        if not directory:
            return None
        return Path(directory) / f"lossy-trace-{_file_tag()}.json"


def _warn(message: str) -> None:
    """Says ``message`` through :mod:`warnings` (shown by default) and the log."""
    log.warning("%s", message)
    warnings.warn(message, stacklevel=2)


def messages_not_in_trace(plugin_trace: Dict[str, Any]) -> Optional[int]:
    """How many messages this process's plugin has sent (its live counters) that the trace
    file does not hold (its ``recorded``): those sent after the file was written, and any
    still in flight then. None when the live counters cannot be read."""
    from . import control as _control

    recorded = (plugin_trace.get(PLUGIN_META_KEY) or {}).get("recorded")
    try:
        sent = _control.control().stats()["total"]["messages"]
    except (_control.ControlError, OSError, KeyError, TypeError) as err:
        log.debug("profiler: no live counters to compare the trace file with: %s", err)
        return None
    if not isinstance(recorded, int) or not isinstance(sent, int):
        return None
    return sent - recorded


def _file_tag() -> str:
    """``rank{R}-{host}-{pid}``, as the plugin names its files."""
    rank = launcher_rank()
    host = file_name_host(socket.gethostname())
    return f"rank{'x' if rank is None else rank}-{host}-{os.getpid()}"


def profiler_active() -> bool:
    """Whether a torch profiler is recording in this process (False while torch is not
    imported: then none can be; cheap enough to ask at every phase change)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.autograd._profiler_enabled())
    except AttributeError:
        return False


# -- traces -------------------------------------------------------------------------------


#: Largest trace read: torch's traces of long profiled windows run to hundreds of MiB; a
#: stray file beyond this is refused before it is read.
MAX_TRACE_BYTES = 4 << 30


def load_trace(path: Union[str, Path]) -> Dict[str, Any]:
    """A Chrome trace file as a dict with ``traceEvents`` (the bare-list form is wrapped).
    TraceFormatError naming the file when it is no regular file of at most
    :data:`MAX_TRACE_BYTES` (a FIFO is not waited on) or not UTF-8 JSON."""
    allowed = f"a trace must be a regular file of at most {MAX_TRACE_BYTES >> 30} GiB"
    data = read_regular_file(path, MAX_TRACE_BYTES, allowed, TraceFormatError)
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError as err:
        raise TraceFormatError(f"{path} is not a Chrome trace: JSON nested deeper than Python's "
                               "json reads") from err
    except ValueError as err:
        # JSONDecodeError, UnicodeDecodeError, and the ValueError of an integer of more
        # digits than int() converts (sys.get_int_max_str_digits())
        raise TraceFormatError(f"{path} is not valid UTF-8 JSON: {err}") from err
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceFormatError(f"{path} is not a Chrome trace (no traceEvents)")
    return doc


def plugin_epoch_offset_ns(plugin: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
    """(ns to add to a plugin timestamp in ns to get Unix epoch ns, the metadata)."""
    meta = plugin.get(PLUGIN_META_KEY)
    if not isinstance(meta, dict):
        raise TraceFormatError(f"not a nccl-net-lossy trace: no {PLUGIN_META_KEY!r} metadata")
    version = meta.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise TraceFormatError(f"plugin trace: bad format_version {echo(version)}")
    if version > PLUGIN_TRACE_VERSION:
        _warn(f"plugin trace format {version} is newer than this package's {PLUGIN_TRACE_VERSION}: "
              "merged as far as this package reads it; install matching versions")
    clock = meta.get("clock")
    if clock == "CLOCK_MONOTONIC":
        offset = meta.get("monotonic_to_epoch_ns")
        if not isinstance(offset, int):
            raise TraceFormatError("plugin trace: CLOCK_MONOTONIC without an integer monotonic_to_epoch_ns")
        return offset, meta
    if clock == "CLOCK_REALTIME":
        return 0, meta
    raise TraceFormatError(f"plugin trace: clock {echo(clock)}: allowed: CLOCK_MONOTONIC, CLOCK_REALTIME")


def torch_epoch_base_ns(trace: Dict[str, Any]) -> int:
    """Epoch ns of the torch trace's ``ts`` 0: its ``baseTimeNanoseconds`` (Kineto writes
    ``ts`` in microseconds after it); 0 for traces that write epoch microseconds."""
    base = trace.get("baseTimeNanoseconds", 0)
    return int(base) if isinstance(base, (int, float)) else 0


def merge_traces(torch_trace: Dict[str, Any], plugin_trace: Dict[str, Any]) -> Dict[str, Any]:
    """The torch trace with the plugin trace's events converted onto its clock.

    A plugin timestamp ``ts`` (microseconds on the clock its metadata names) becomes epoch
    nanoseconds ``ts * 1000 + monotonic_to_epoch_ns``, then the torch trace's microseconds
    after its ``baseTimeNanoseconds``. Plugin tracks move to thread ids
    ``MERGED_TID_BASE + track`` in the plugin process's pid; the plugin's metadata is kept
    under ``lossy_trace`` with the shift applied (``merged_shift_us``)."""
    offset_ns, meta = plugin_epoch_offset_ns(plugin_trace)
    base_ns = torch_epoch_base_ns(torch_trace)
    shift_us = (offset_ns - base_ns) / 1000.0
    merged = dict(torch_trace)
    events = list(torch_trace["traceEvents"])
    for i, event in enumerate(plugin_trace.get("traceEvents", [])):
        if not isinstance(event, dict):
            continue
        event = dict(event)
        if "ts" in event:
            ts = event["ts"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)):
                raise TraceFormatError(f"plugin trace: traceEvents.{i}: ts = {echo(ts)}: allowed: a "
                                       "number (microseconds on the clock its lossy_trace names)")
            event["ts"] = float(ts) + shift_us
        if "tid" in event and isinstance(event["tid"], int):
            event["tid"] = MERGED_TID_BASE + event["tid"]
        events.append(event)
    merged["traceEvents"] = events
    merged[PLUGIN_META_KEY] = {**meta, "merged_shift_us": shift_us}
    return merged


def merge_trace_files(torch_path: Union[str, Path], plugin_path: Union[str, Path],
                      out_path: Union[str, Path]) -> Path:
    """:func:`merge_traces` of two files, written to ``out_path`` (atomically)."""
    torch_trace, plugin_trace = load_trace(torch_path), load_trace(plugin_path)
    try:
        merged = merge_traces(torch_trace, plugin_trace)
    except TraceFormatError as err:
        raise TraceFormatError(f"{plugin_path}: {err}") from err
    out = Path(out_path)
    write_atomically(out, json.dumps(merged))
    return out


#: Fields each event phase needs (the Chrome trace event format).
_REQUIRED = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "B": ("name", "ts", "pid", "tid"),
    "E": ("ts", "pid", "tid"),
    "i": ("name", "ts", "pid"),
    "I": ("name", "ts", "pid"),
    "C": ("name", "ts", "pid", "args"),
    "M": ("name", "pid", "args"),
}


def check_trace_events(trace: Dict[str, Any]) -> List[str]:
    """Problems of a trace against the Chrome trace event format (empty when none): every
    event of a known phase has that phase's fields with the right types (``ts`` and ``dur``
    numbers, ``dur`` >= 0, counter ``args`` numeric). Phases outside :data:`_REQUIRED` (flows,
    async events, which torch also writes) are only checked for ``ts``."""
    problems = []
    for i, event in enumerate(trace.get("traceEvents", [])):
        if not isinstance(event, dict) or "ph" not in event:
            problems.append(f"event {i}: not an object with ph")
            continue
        ph = event["ph"]
        for key in _REQUIRED.get(ph, ()):
            if key not in event:
                problems.append(f"event {i} ({ph} {event.get('name')!r}): no {key}")
        for key in ("ts", "dur"):
            if key in event and not isinstance(event[key], (int, float)):
                problems.append(f"event {i}: {key} is not a number")
        if ph == "X" and isinstance(event.get("dur"), (int, float)) and event["dur"] < 0:
            problems.append(f"event {i}: negative dur")
        if ph == "C":
            for k, v in (event.get("args") or {}).items():
                if not isinstance(v, (int, float)):
                    problems.append(f"event {i}: counter {k} is not a number")
    return problems
