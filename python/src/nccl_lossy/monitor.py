"""A decorator for the training step: time, throughput, lost packets, FLOPs, per step.

::

    @performance_monitor("perf.jsonl", batch_size=8, seq_length=2048, integration=integ)
    def train_step(batch):
        ...
        return loss

Each call appends one JSON line (:data:`RECORD_KEYS`): the step, the launcher's rank (every
rank of a job may append to one file; ``lossy report`` takes the lowest rank's metric), wall
time, samples/s and tokens/s (when told the batch size), the plugin's packets and lost packets during the call by
collective and phase (from its live counters, :func:`nccl_lossy.stats`), the FLOP count
(``count_flops=True``, ``torch.utils.flop_counter``) and the training loss when the step
returns it (a number, a one-element tensor, or a dict with ``"loss"``). The JSONL is a
training log ``lossy report RUN --per-step --metric loss --train-log FILE`` reads; it is strict
JSON: a number that is not finite (a diverged loss) is written as the string ``"inf"``,
``"-inf"`` or ``"nan"`` (:attr:`PerformanceMonitor.records` keeps the float).
TensorBoard (``tensorboard_dir``) and wandb (``use_wandb``) get the same scalars when they are
installed; when they are not, the monitor warns once (Python's :mod:`warnings`, and the log)
and goes on without them. When the plugin's counters cannot be read (no plugin library
reachable, see :mod:`nccl_lossy.control`) it warns once with the reason and records
``packets``, ``lost_packets`` and ``by_op`` as null.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from ._echo import SHOWN_CHARS, echo
from . import control as _control
from .steps import cell_totals, launcher_rank

log = logging.getLogger("nccl_lossy")

#: Keys of every JSONL record, in order.
RECORD_KEYS = (
    "step",
    "rank",
    "wall_s",
    "samples_per_s",
    "tokens_per_s",
    "packets",
    "lost_packets",
    "by_op",
    "flops",
    "loss",
)


class PerformanceMonitor:
    """The state behind :func:`performance_monitor` (also usable as ``monitor(fn)``).

    ``output``: the JSONL file (appended to; None: records only in :attr:`records`).
    ``batch_size`` (samples per step) and ``seq_length`` (tokens per sample): throughput.
    ``integration``: a :class:`~nccl_lossy.LossyMegatronIntegration` whose step numbers the
    records carry (else ``first_step``, ``first_step + 1``, ...): the step the plugin counted
    most of the call's packets under, whether the call sets its step first or last (the
    integration's step at the call's start when it sent nothing). ``profiler``: stepped after
    each call. ``count_flops``: count with ``torch.utils.flop_counter.FlopCounterMode`` (the
    step then runs under it: its ``wall_s`` and throughput include the counting).
    ``tensorboard_dir``, ``use_wandb``: optional sinks. ``stats_source``: where the plugin's
    statistics document comes from (default: the live counters of this process)."""

    def __init__(
        self,
        output: Optional[Union[str, Path]] = None,
        *,
        batch_size: Optional[int] = None,
        seq_length: Optional[int] = None,
        integration: Any = None,
        profiler: Any = None,
        count_flops: bool = False,
        tensorboard_dir: Optional[Union[str, Path]] = None,
        use_wandb: bool = False,
        first_step: int = 0,
        stats_source: Optional[Callable[[], Dict[str, Any]]] = None,
    ):
        # Checked here: a wrong one failed only after the first training step had run.
        batch_size = _count("batch_size", batch_size, 1, "samples per step", optional=True)
        seq_length = _count("seq_length", seq_length, 1, "tokens per sample", optional=True)
        first_step = _count("first_step", first_step, 0, "the first record's step", optional=False)
        if integration is not None and not hasattr(integration, "step_number"):
            raise TypeError(f"performance_monitor: integration={echo(integration)}: allowed: a "
                            "LossyMegatronIntegration (anything with step_number) or None")
        if profiler is not None and not callable(getattr(profiler, "step", None)):
            raise TypeError(f"performance_monitor: profiler={echo(profiler)}: allowed: a "
                            "LossyProfiler or torch profiler (anything with step()) or None")
        for name, value in (("count_flops", count_flops), ("use_wandb", use_wandb)):
            if not isinstance(value, bool):  # "no" would be true
                raise ValueError(f"performance_monitor: {name}={echo(value)}: allowed: True or False")
        if output is not None and (not isinstance(output, (str, os.PathLike)) or not os.fspath(output)
                                   or os.path.isdir(output)):
            # Said here: a directory failed only at the first record, after the step had run.
            shown = os.fspath(output) if isinstance(output, os.PathLike) else output
            raise ValueError(f"performance_monitor: output={echo(shown, SHOWN_CHARS)}: allowed: the path of a "
                             "JSONL file (appended to), or None")
        self.output = Path(output) if output is not None else None
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.integration = integration
        self.profiler = profiler
        self.count_flops = count_flops
        self._read = stats_source or (lambda: _control.control().stats())
        self._next_step = first_step
        #: The launcher's rank of this process (None: not launched with one), in every record:
        #: the ranks of a job may all append to one file, each with its own counters.
        self.rank = launcher_rank()
        self._stats_ok = True
        #: Every record written, in order.
        self.records: List[Dict[str, Any]] = []
        self._tb: Any = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tensorboard_dir))
            except ImportError as err:
                _warn(f"performance_monitor: TensorBoard not installed ({err}); not logging to it")
        self._wandb: Any = None
        if use_wandb:
            try:
                import wandb

                self._wandb = wandb
            except ImportError:
                _warn("performance_monitor: wandb not installed; not logging to it")

    def _document(self) -> Optional[Dict[str, Any]]:
        """The plugin's statistics document now (None once it could not be read)."""
        if not self._stats_ok:
            return None
        try:
            return self._read()
        except (_control.ControlError, OSError) as err:
            _warn(f"performance_monitor: no plugin counters ({err}); packets and lost packets "
                  "are not recorded (null) from here on", stacklevel=4)
            self._stats_ok = False
            return None

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.integration is not None:
                step = int(self.integration.step_number)
            else:
                step = self._next_step
            self._next_step = step + 1
            before = self._document()
            flops = None
            start = time.perf_counter()
            if self.count_flops:
                from torch.utils.flop_counter import FlopCounterMode

                counter = FlopCounterMode(display=False)
                with counter:
                    result = fn(*args, **kwargs)
                flops = int(counter.get_total_flops())
            else:
                result = fn(*args, **kwargs)
            wall = time.perf_counter() - start
            after = self._document() if before is not None else None
            if self.integration is not None and after is not None:
                step = _traffic_step(before, after, step)
            cells = (cell_totals(before), cell_totals(after)) if after is not None else (None, None)
            self._record(step, wall, *cells, flops, result)
            if self.profiler is not None:
                self.profiler.step()
            return result

        wrapper.monitor = self  # type: ignore[attr-defined]
        return wrapper

    def _record(self, step: int, wall: float, before: Any, after: Any, flops: Optional[int],
                result: Any) -> None:
        record: Dict[str, Any] = {"step": step, "rank": self.rank, "wall_s": wall}
        samples = self.batch_size
        record["samples_per_s"] = samples / wall if samples and wall > 0 else None
        tokens = samples * self.seq_length if samples and self.seq_length else None
        record["tokens_per_s"] = tokens / wall if tokens and wall > 0 else None
        if before is not None and after is not None:
            by_op = []
            for (op, phase), counts in sorted(after.items()):
                prev = before.get((op, phase), {})
                grown = {c: counts[c] - prev.get(c, 0) for c in ("messages", "packets", "lost_packets")}
                if grown["messages"] or grown["packets"]:
                    by_op.append({"op": op, "phase": phase, **grown})
            record["packets"] = sum(r["packets"] for r in by_op)
            record["lost_packets"] = sum(r["lost_packets"] for r in by_op)
            record["by_op"] = by_op
        else:
            record.update(packets=None, lost_packets=None, by_op=None)
        record["flops"] = flops
        record["loss"] = _loss_value(result)
        self.records.append(record)
        if self.output is not None:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            with self.output.open("a", encoding="utf-8") as out:
                out.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        scalars = {k: record[k] for k in ("wall_s", "samples_per_s", "tokens_per_s", "packets",
                                          "lost_packets", "flops", "loss") if record[k] is not None}
        for row in record["by_op"] or []:
            scalars[f"lost_packets/{row['op']}/{row['phase']}"] = row["lost_packets"]
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"lossy/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None and getattr(self._wandb, "run", None) is not None:
            self._wandb.log({f"lossy/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        """Closes the TensorBoard writer (if any)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _count(name: str, value: Any, least: int, what: str, optional: bool) -> Any:
    """``value`` as an int when it is an integer (numpy's too, not a bool) of at least
    ``least`` (None as None when ``optional``); else ValueError naming it and what is allowed."""
    if value is None and optional:
        return None
    number = None if isinstance(value, bool) else _control._integer(value)
    if number is None or number < least:
        raise ValueError(f"performance_monitor: {name}={echo(value)}: allowed: an integer >= {least} "
                         f"({what}){' or None' if optional else ''}")
    return number


def _traffic_step(before: Dict[str, Any], after: Dict[str, Any], default: int) -> int:
    """The step the plugin counted most of the call's packets under (its ``by_step``), so that
    the record names the step its traffic belongs to whether the training step sets its step
    first (``integ.step(it)``) or last (the optimizer's hook); ``default`` (the step at the
    call's start) when no step below the plugin's per-step limit grew."""
    was = {s["step"]: s["packets"] for s in before.get("by_step", [])}
    grown = {s["step"]: s["packets"] - was.get(s["step"], 0) for s in after.get("by_step", [])}
    grown = {s: n for s, n in grown.items() if n > 0}
    if not grown:
        return default
    return int(min(grown, key=lambda s: (-grown[s], s)))


def _warn(message: str, stacklevel: int = 3) -> None:
    """Says ``message`` through :mod:`warnings`, which shows by default (this package's logger
    has no handler unless the application adds one), and into the log."""
    log.warning("%s", message)
    warnings.warn(message, stacklevel=stacklevel)


def performance_monitor(output: Optional[Union[str, Path]] = None, **options: Any) -> Callable[..., Any]:
    """Decorator factory: ``@performance_monitor("perf.jsonl", batch_size=8, ...)`` (options of
    :class:`PerformanceMonitor`). The wrapped function has the monitor as ``.monitor``."""
    return PerformanceMonitor(output, **options)


def _json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite as ``"inf"``, ``"-inf"`` or ``"nan"``:
    ``json.dumps`` would write the bare ``Infinity``/``NaN``, which is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _loss_value(result: Any) -> Optional[float]:
    if isinstance(result, dict):
        result = result.get("loss")
    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if isinstance(result, bool) or result is None:
        return None
    if isinstance(result, (int, float)):
        return float(result)
    item = getattr(result, "item", None)
    numel = getattr(result, "numel", None)
    if callable(item) and (numel is None or numel() == 1):
        try:
            return float(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None
