"""The plugin's counters per training step x collective x phase.

The plugin itself keeps per-step totals (``by_step``: packets and lost packets) and per
(collective, phase) totals over the whole run. :class:`StepRecorder` joins the two: at every
step boundary it reads the plugin's live counters (``ncclLossyStatsJson``) and keeps what each
(collective, phase) cell grew by during the step that ended. The numbers are the plugin's own;
only a message still being handed to the plugin in the microseconds between reading the
counters and setting the next step can land in the neighbouring step.

:meth:`StepRecorder.write` leaves them next to the plugin's statistics file as
``lossy-steps-rank{R}-{host}-{pid}.json``, which ``read_stats(dir, table="step_ops")`` reads.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._echo import echo_path
from ._files import not_a_directory, write_atomically
from .config import LossyConfigError
from .statsfile import STEP_FORMAT_VERSION, STEP_OP_COUNTERS

_COUNTERS = STEP_OP_COUNTERS
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")

Cells = Dict[Tuple[str, str], Dict[str, int]]


def cell_totals(doc: Dict[str, Any]) -> Cells:
    """(collective, phase) -> counters, summed over the connections of a statistics document."""
    totals: Cells = {}
    for conn in doc.get("connections", []):
        for cell in conn.get("by_op", []):
            acc = totals.setdefault((cell["op"], cell["phase"]), {c: 0 for c in _COUNTERS})
            for c in _COUNTERS:
                acc[c] += int(cell.get(c, 0))
    return totals


class StepRecorder:
    """Keeps the growth of the plugin's (collective, phase) counters per training step.

    ``read`` returns the plugin's statistics document (the live one by default)."""

    def __init__(self, read: Callable[[], Dict[str, Any]]):
        self._read = read
        self._last: Optional[Cells] = None
        self._cells: Dict[Tuple[int, str, str], Dict[str, int]] = {}
        #: The step the plugin counts traffic under, as last set through :meth:`move_to`.
        self.step = 0

    @property
    def started(self) -> bool:
        """Whether :meth:`start` took the counters' starting point."""
        return self._last is not None

    @property
    def rows(self) -> List[Dict[str, Any]]:
        """One dict per (step, collective, phase) that saw traffic, in step order: a step
        ended more than once (set twice, set again after a later one, as after a resume from
        a checkpoint) adds to its rows, as the plugin adds to its per-step series."""
        return [{"step": s, "op": op, "phase": ph, **c} for (s, op, ph), c in sorted(self._cells.items())]

    def start(self) -> None:
        """Takes the counters as they are now as the start of the current step."""
        self._last = cell_totals(self._read())

    def move_to(self, step: int, set_step: Callable[[int], None]) -> None:
        """Ends the step in force (once started) and moves the plugin to ``step`` with
        ``set_step``: the plugin's step is process-wide, so every step change of the process
        goes through here."""
        if self.started:
            self.end_step(self.step)
        set_step(step)
        self.step = step

    def end_step(self, step: int) -> None:
        """Adds what each cell grew by since the last call to step ``step``."""
        now = cell_totals(self._read())
        last = self._last or {}
        for (op, phase), counts in now.items():
            before = last.get((op, phase), {})
            grown = {c: counts[c] - before.get(c, 0) for c in _COUNTERS}
            if grown["messages"] or grown["packets"]:
                acc = self._cells.setdefault((step, op, phase), {c: 0 for c in _COUNTERS})
                for c in _COUNTERS:
                    acc[c] += grown[c]
        self._last = now

    def document(self) -> Dict[str, Any]:
        """The per-step file's content."""
        return {
            "format_version": STEP_FORMAT_VERSION,
            "rank": launcher_rank(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "written_at_unix_ms": int(time.time() * 1000),
            "steps": self.rows,
        }

    def write(self, directory: Path) -> Path:
        """Writes ``lossy-steps-rank{R}-{host}-{pid}.json`` into ``directory`` (atomically)."""
        doc = self.document()
        rank = "x" if doc["rank"] is None else str(doc["rank"])
        host = file_name_host(doc["host"])
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            # A FIFO or a file under that name read "[Errno 17] File exists" for a path that
            # does exist, only not as a directory.
            why = not_a_directory(directory) or err.strerror or str(err)
            raise LossyConfigError(
                f"{echo_path(directory)}: cannot write the per-step statistics file there: {why}; allowed: a "
                "directory this user can create and write (stats_dir, else NCCL_LOSSY_STATS)"
            ) from err
        path = directory / f"lossy-steps-rank{rank}-{host}-{doc['pid']}.json"
        write_atomically(path, json.dumps(doc, indent=1))
        return path


def file_name_host(host: str) -> str:
    """``host`` as the plugin writes it in file names: ASCII letters and digits, ``-``, ``_``
    and ``.`` kept, every other character (``str.isalnum`` also takes non-ASCII letters) ``_``."""
    return "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in host)


def launcher_rank() -> Optional[int]:
    """The rank the launcher gave this process (as the plugin reads it), if any."""
    for name in _RANK_VARIABLES:
        rank = _unsigned(os.environ.get(name))
        if rank is not None:
            return rank
    return None


def _unsigned(value: Optional[str]) -> Optional[int]:
    """``value`` as the plugin's Rust ``u64`` parse of the trimmed text reads it: an optional
    ``+`` and ASCII digits, at most 2**64 - 1 (Python's ``int()`` also takes ``-1``, ``1_0``
    and non-ASCII digits, which the plugin skips for the next variable)."""
    if value is None:
        return None
    text = value.strip()
    digits = text[1:] if text.startswith("+") else text
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    number = int(digits)
    return number if number < 1 << 64 else None


def _live_stats() -> Dict[str, Any]:
    from . import control  # the plugin's live counters; control itself moves this recorder

    return control.control().stats()


#: The plugin's counters per step of this process: one for every integration and for
#: :func:`nccl_lossy.set_step`, since the plugin's step and counters are process-wide and the
#: per-step file is named by process (a second recorder wrote over the first one's file, and a
#: step set past the recorder left its traffic in the step before).
RECORDER = StepRecorder(_live_stats)
