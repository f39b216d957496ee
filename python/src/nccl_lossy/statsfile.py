"""Statistics: the plugin's per-rank JSON files as plain rows.

A file (``lossy-stats-rank{R}-{host}-{pid}.json``, written by the plugin into
``NCCL_LOSSY_STATS``) holds ``format_version``, ``rank``, ``host``, ``pid``,
``written_at_unix_ms``, the resolved ``profile``, ``total`` counts and per-connection
``connections`` (``comm_id``, ``index``, ``total``, ``by_op`` cells per collective and phase,
``histograms``). :func:`read_stats` turns a run's files into one row per
(file, connection, collective, phase).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Iterable, List, Union

log = logging.getLogger("nccl_lossy")

#: Newest statistics file layout this module knows.
FORMAT_VERSION = 1
#: Counters every row carries.
COUNTERS = ("messages", "bytes", "packets", "lost_packets", "loss_events", "retransmit_delay_ns")
#: Columns of a row, in order.
COLUMNS = (
    "file",
    "rank",
    "host",
    "pid",
    "written_at_unix_ms",
    "comm_id",
    "connection",
    "op",
    "phase",
) + COUNTERS + ("loss_rate",)

FILE_GLOB = "lossy-stats-rank*.json"


class StatsFormatError(ValueError):
    """A file is not a statistics file this module can read."""


def _check(doc: Any, where: str) -> Dict[str, Any]:
    if not isinstance(doc, dict) or "format_version" not in doc or "connections" not in doc:
        raise StatsFormatError(f"{where} is not a nccl-net-lossy statistics file")
    version = doc["format_version"]
    if not isinstance(version, int) or version < 1:
        raise StatsFormatError(f"{where}: bad format_version {version!r}")
    if version > FORMAT_VERSION:
        log.warning(
            "%s has statistics format %d, newer than this package's %d: reading the fields it knows",
            where,
            version,
            FORMAT_VERSION,
        )
    return doc


def rows_from_stats(doc: Dict[str, Any], file: str = "") -> List[Dict[str, Any]]:
    """One row per (connection, collective, phase) of one statistics document."""
    doc = _check(doc, file or "statistics document")
    rows = []
    for conn in doc.get("connections", []):
        for cell in conn.get("by_op", []):
            row: Dict[str, Any] = {
                "file": file,
                "rank": doc.get("rank"),
                "host": doc.get("host"),
                "pid": doc.get("pid"),
                "written_at_unix_ms": doc.get("written_at_unix_ms"),
                "comm_id": conn.get("comm_id"),
                "connection": conn.get("index"),
                "op": cell.get("op"),
                "phase": cell.get("phase"),
            }
            for counter in COUNTERS:
                row[counter] = int(cell.get(counter, 0))
            row["loss_rate"] = row["lost_packets"] / row["packets"] if row["packets"] else 0.0
            rows.append(row)
    return rows


def stats_files(path: Union[str, Path]) -> List[Path]:
    """The statistics files of a run directory (or the one file ``path`` names), sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such statistics file or directory")
    return sorted(p for p in path.glob(FILE_GLOB) if p.is_file())


def load_stats_files(path: Union[str, Path]) -> List[Dict[str, Any]]:
    """The parsed documents of a run's statistics files (each with a ``file`` key added)."""
    docs = []
    for file in stats_files(path):
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise StatsFormatError(f"{file} is not valid JSON: {err}") from err
        doc = dict(_check(doc, str(file)))
        doc["file"] = str(file)
        docs.append(doc)
    return docs


def read_stats(path: Union[str, Path], dataframe: bool = False) -> Any:
    """A run's statistics as a list of row dicts (see :data:`COLUMNS`).

    ``path`` is a directory given as ``NCCL_LOSSY_STATS`` (or one file). With
    ``dataframe=True`` the rows come as a pandas DataFrame (pandas must be installed)."""
    rows: List[Dict[str, Any]] = []
    for doc in load_stats_files(path):
        rows.extend(rows_from_stats(doc, doc["file"]))
    if dataframe:
        return to_dataframe(rows)
    return rows


def to_dataframe(rows: Iterable[Dict[str, Any]]) -> Any:
    """Rows as a pandas DataFrame with :data:`COLUMNS`."""
    try:
        import pandas as pd
    except ImportError as err:
        raise ImportError("dataframe=True needs pandas: pip install pandas") from err
    return pd.DataFrame(list(rows), columns=list(COLUMNS))


def summarize(rows: Iterable[Dict[str, Any]], by: Iterable[str] = ("op", "phase")) -> List[Dict[str, Any]]:
    """Sums the counters of ``rows`` grouped by the ``by`` columns (with a loss rate)."""
    keys = tuple(by)
    groups: Dict[tuple, Dict[str, Any]] = {}
    for row in rows:
        group = tuple(row.get(k) for k in keys)
        acc = groups.setdefault(group, {**dict(zip(keys, group)), **{c: 0 for c in COUNTERS}})
        for c in COUNTERS:
            acc[c] += row[c]
    out = []
    for acc in groups.values():
        acc["loss_rate"] = acc["lost_packets"] / acc["packets"] if acc["packets"] else 0.0
        out.append(acc)
    return out
