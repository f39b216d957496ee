"""Statistics: the plugin's per-rank JSON files as plain rows (tables).

A file (``lossy-stats-rank{R}-{host}-{pid}.json``, written by the plugin into
``NCCL_LOSSY_STATS``) holds ``format_version``, ``rank``, ``host``, ``pid``,
``written_at_unix_ms``, the resolved ``profile``, ``total`` counts, per-connection
``connections`` (``comm_id``, ``index``, ``total``, ``by_op`` cells per collective and phase,
``histograms`` of burst lengths and message latencies per collective) and ``by_step``
(packets and lost packets per training step). Next to it,
:class:`~nccl_lossy.LossyMegatronIntegration` writes ``lossy-steps-rank{R}-{host}-{pid}.json``:
the plugin's counters per step x collective x phase (see :mod:`nccl_lossy.steps`).

:func:`read_stats` turns a run's files into the rows of one table (:data:`TABLES`):

- ``ops``: one row per (file, connection, collective, phase), the counters of :data:`COUNTERS`;
- ``steps``: one row per (file, step): ``packets``, ``lost_packets``,
  ``packets_injection_off``, ``loss_rate``, ``loss_rate_injecting``;
- ``step_ops``: one row per (file, step, collective, phase): ``messages``, ``bytes``,
  ``packets``, ``lost_packets``, ``loss_events`` (bursts of consecutive lost packets within a
  message), ``packets_injection_off``, ``loss_rate``, ``loss_rate_injecting``;
- ``bursts``: one row per (file, connection, collective, burst length): ``count``;
- ``latency``: one row per (file, connection, collective, latency bin in ns): ``count``.

``loss_rate`` is lost packets over every packet sent; ``loss_rate_injecting`` over the packets
sent with injection on (:func:`loss_rates`), the rate to hold against the loss model when a
phase was kept lossless.

Rows are flat dicts: ``pandas.DataFrame(rows)`` takes them as they are, and
``dataframe=True`` (or ``"auto"``: when pandas is installed) returns that DataFrame.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

from ._echo import SHOWN_CHARS, echo, echo_path
from ._files import read_regular_file

log = logging.getLogger("nccl_lossy")

#: Newest statistics file layout this module knows.
FORMAT_VERSION = 1
#: Counters every row carries.
COUNTERS = (
    "messages",
    "bytes",
    "packets",
    "lost_packets",
    "loss_events",
    "retransmit_delay_ns",
    "packets_injection_off",
)
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
) + COUNTERS + ("loss_rate", "loss_rate_injecting")

FILE_GLOB = "lossy-stats-rank*.json"
#: Format of the per-step files (``format_version``) this package writes and reads.
STEP_FORMAT_VERSION = 1
#: The files :class:`~nccl_lossy.LossyMegatronIntegration` writes (per step x collective x phase).
STEP_FILE_GLOB = "lossy-steps-rank*.json"

_FILE_COLUMNS = ("file", "rank", "host", "pid")
#: Counters of a ``step_ops`` row.
STEP_OP_COUNTERS = (
    "messages",
    "bytes",
    "packets",
    "lost_packets",
    "loss_events",
    "packets_injection_off",
)
#: The columns of each table, in order.
TABLES = {
    "ops": COLUMNS,
    "steps": _FILE_COLUMNS + ("step", "packets", "lost_packets", "packets_injection_off", "loss_rate",
                              "loss_rate_injecting"),
    "step_ops": _FILE_COLUMNS + ("step", "op", "phase") + STEP_OP_COUNTERS + ("loss_rate", "loss_rate_injecting"),
    "bursts": _FILE_COLUMNS + ("comm_id", "connection", "op", "burst_length", "count"),
    "latency": _FILE_COLUMNS + ("comm_id", "connection", "op", "latency_ns", "count"),
}
#: Columns :func:`summarize` adds up (those a row has).
SUMMED = COUNTERS + ("count",)


def loss_rates(counts: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """``loss_rate``: lost packets over every packet sent (0.0 when none was);
    ``loss_rate_injecting``: lost packets over the packets sent with injection on, those the
    loss model saw (``packets - packets_injection_off``; a phase kept lossless does not dilute
    it), the rate to hold against the model, as ``lossy report`` gives it; None when no packet
    was sent with injection on."""
    packets, lost = int(counts["packets"]), int(counts["lost_packets"])
    injecting = packets - int(counts.get("packets_injection_off", 0))
    return {"loss_rate": lost / packets if packets else 0.0,
            "loss_rate_injecting": lost / injecting if injecting > 0 else None}


class StatsFormatError(ValueError):
    """A file is not a statistics file this module can read."""


def _check(doc: Any, where: str) -> Dict[str, Any]:
    if not isinstance(doc, dict) or "format_version" not in doc or "connections" not in doc:
        raise StatsFormatError(f"{where} is not a nccl-net-lossy statistics file")
    _check_version(doc, where, FORMAT_VERSION)
    _check_identity(doc, where)
    for i, conn in enumerate(_objects(doc["connections"], where, "connections")):
        _check_connection(conn, where, i)
    return doc


def _check_connection(conn: Dict[str, Any], file: str, i: int) -> None:
    """The connection's ``comm_id`` and ``index`` (integers as the plugin writes them; a name
    is taken too) and each cell's ``phase`` (a name), which the rows carry as they are and
    :func:`summarize` groups by; another kind is StatsFormatError naming it."""
    for key in ("comm_id", "index"):
        value = conn.get(key)
        if value is not None and not isinstance(value, str):
            _count(value, file, f"connections.{i}", key)
    for j, cell in enumerate(_objects(conn.get("by_op", []), file, f"connections.{i}.by_op")):
        _optional_text(cell, "phase", file, f"connections.{i}.by_op.{j}")
    _check_bursts(conn, file, i)


def _check_bursts(conn: Dict[str, Any], file: str, i: int) -> None:
    """What the burst-length histograms of connection ``i`` always hold, as ``lossy report``
    checks them: bursts of at least one packet; per collective, no more bursts than the
    packets it lost on the connection (a burst is counted under the collective of the message
    it ends in, which lost at least its last packet); in all, no more lost packets than the
    connection lost, with the 1/128 the histogram's two significant digits may add."""
    lost_by: Dict[Optional[str], int] = {}
    for j, cell in enumerate(_objects(conn.get("by_op", []), file, f"connections.{i}.by_op")):
        where = f"connections.{i}.by_op.{j}"
        lost = _count(cell.get("lost_packets", 0), file, where, "lost_packets")
        op = _optional_text(cell, "op", file, where)
        lost_by[op] = lost_by.get(op, 0) + lost
    hists = _objects(conn.get("histograms", []), file, f"connections.{i}.histograms")
    bursts_by: Dict[Optional[str], int] = {}
    burst_packets = 0
    for j, hist in enumerate(hists):
        op = _optional_text(hist, "op", file, f"connections.{i}.histograms.{j}")
        where = f"connections.{i}.histograms.{j}.burst_lengths"
        for length, n in _bins(hist.get("burst_lengths", []), "burst_length", file, where):
            if length == 0:
                raise StatsFormatError(f"{file}: {where}: a burst of length 0 ({n} of them): a "
                                       "burst is at least one lost packet")
            bursts_by[op] = bursts_by.get(op, 0) + n
            burst_packets += length * n
    for op, bursts in bursts_by.items():
        if bursts > lost_by.get(op, 0):
            raise StatsFormatError(
                f"{file}: connections.{i}.histograms ({op}): {bursts} bursts, but {op} lost "
                f"{lost_by.get(op, 0)} packets on this connection (connections.{i}.by_op): "
                "each burst holds at least one of them")
    lost = sum(lost_by.values())
    if burst_packets * 128 > lost * 129:
        raise StatsFormatError(
            f"{file}: connections.{i}.histograms: bursts of {burst_packets} packets in all, but "
            f"the connection lost {lost} packets (connections.{i}.by_op)")


def _check_identity(doc: Dict[str, Any], where: str) -> None:
    """The file's own ``rank`` (null: no launcher rank), ``pid`` and ``host``, as the plugin
    and the per-step recorder write them; another kind is StatsFormatError naming it."""
    for key in ("rank", "pid"):
        value = doc.get(key)
        if value is not None:
            _count(value, where, "file", key)
    host = doc.get("host")
    if host is not None and not isinstance(host, str):
        raise StatsFormatError(f"{where}: file: host = {_short(host)}: allowed: text")


def _check_version(doc: Dict[str, Any], where: str, known: int) -> None:
    version = doc["format_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StatsFormatError(f"{where}: bad format_version {echo(version)}")
    if version > known:
        # Said where it is seen: this package's logger has no handler unless the application
        # adds one (`lossy report` refuses such a file; this reads the fields it knows).
        message = (f"{where} has format {version}, newer than this package's {known}: reading "
                   "the fields it knows (install matching versions)")
        log.warning("%s", message)
        warnings.warn(message, stacklevel=3)


_COUNT_ALLOWED = "allowed: an integer >= 0"


def _items(value: Any, file: str, where: str) -> List[Any]:
    """``value`` when it is a list (a field the plugin writes as a JSON array), else
    StatsFormatError naming the file and the field."""
    if not isinstance(value, list):
        raise StatsFormatError(f"{file}: {where} = {_short(value)}: allowed: a list")
    return value


def _objects(value: Any, file: str, where: str) -> List[Dict[str, Any]]:
    """``value`` when it is a list of JSON objects, else StatsFormatError naming the entry."""
    for i, item in enumerate(_items(value, file, where)):
        if not isinstance(item, dict):
            raise StatsFormatError(f"{file}: {where}.{i} = {_short(item)}: allowed: an object")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _count(value: Any, file: str, where: str, key: str) -> int:
    """A counter as the plugin writes it, a non-negative integer; anything else (a float that
    would be truncated, text, a bool, a negative number) is StatsFormatError naming it."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise StatsFormatError(f"{file}: {where}: {key} = {_short(value)}: {_COUNT_ALLOWED}")


def _counters(cell: Dict[str, Any], names: Iterable[str], file: str, where: str) -> Dict[str, int]:
    """The counters ``names`` of ``cell`` (a missing one is 0), checked: counts, and no part of
    the packets (lost, sent with injection off) larger than the packets."""
    counts = {name: _count(cell.get(name, 0), file, where, name) for name in names}
    for part in ("lost_packets", "packets_injection_off"):
        if part in counts and "packets" in counts and counts[part] > counts["packets"]:
            raise StatsFormatError(
                f"{file}: {where}: {part} = {counts[part]} is more than packets = "
                f"{counts['packets']}; {part} must be at most packets"
            )
    return counts


def _required(cell: Dict[str, Any], key: str, file: str, where: str) -> Any:
    if key not in cell:
        raise StatsFormatError(f"{file}: {where}: no {key}")
    return cell[key]


def _text(cell: Dict[str, Any], key: str, file: str, where: str) -> str:
    value = _required(cell, key, file, where)
    if not isinstance(value, str):
        raise StatsFormatError(f"{file}: {where}: {key} = {_short(value)}: allowed: a name (text)")
    return value


def _optional_text(cell: Dict[str, Any], key: str, file: str, where: str) -> Optional[str]:
    """``cell[key]`` when it is text or missing (None); another kind is StatsFormatError."""
    value = cell.get(key)
    if value is not None and not isinstance(value, str):
        raise StatsFormatError(f"{file}: {where}: {key} = {_short(value)}: allowed: a name (text)")
    return value


def rows_from_stats(doc: Dict[str, Any], file: str = "") -> List[Dict[str, Any]]:
    """One row per (connection, collective, phase) of one statistics document."""
    return _op_rows(_check(doc, file or "statistics document"), file)


# The rows of a document :func:`_check` took (as :func:`load_stats_files` does): checked once,
# so a newer format is warned about once per file and read.
def _op_rows(doc: Dict[str, Any], file: str) -> List[Dict[str, Any]]:
    name = file or "statistics document"
    rows = []
    for i, conn in enumerate(_objects(doc.get("connections", []), name, "connections")):
        cells = _objects(conn.get("by_op", []), name, f"connections.{i}.by_op")
        for j, cell in enumerate(cells):
            where = f"connections.{i}.by_op.{j}"
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
            row.update(_counters(cell, COUNTERS, name, where))
            row.update(loss_rates(row))
            rows.append(row)
    return rows


def _file_fields(doc: Dict[str, Any], file: str) -> Dict[str, Any]:
    return {"file": file, "rank": doc.get("rank"), "host": doc.get("host"), "pid": doc.get("pid")}


def step_rows_from_stats(doc: Dict[str, Any], file: str = "") -> List[Dict[str, Any]]:
    """The ``steps`` table of one statistics document: the plugin's per-step counters."""
    return _step_rows(_check(doc, file or "statistics document"), file)


def _step_rows(doc: Dict[str, Any], file: str) -> List[Dict[str, Any]]:
    name = file or "statistics document"
    rows = []
    for i, cell in enumerate(_objects(doc.get("by_step", []), name, "by_step")):
        where = f"by_step.{i}"
        step = _count(_required(cell, "step", name, where), name, where, "step")
        counts = _counters(cell, ("packets", "lost_packets", "packets_injection_off"), name, where)
        rows.append({**_file_fields(doc, file), "step": step, **counts, **loss_rates(counts)})
    return rows


def histogram_rows_from_stats(doc: Dict[str, Any], kind: str, file: str = "") -> List[Dict[str, Any]]:
    """The ``bursts`` (``kind="bursts"``) or ``latency`` table of one statistics document: one
    row per histogram bin of each connection and collective."""
    return _histogram_rows(_check(doc, file or "statistics document"), kind, file)


def _histogram_rows(doc: Dict[str, Any], kind: str, file: str) -> List[Dict[str, Any]]:
    name = file or "statistics document"
    field, column = {"bursts": ("burst_lengths", "burst_length"), "latency": ("latency_ns", "latency_ns")}[kind]
    rows = []
    for i, conn in enumerate(_objects(doc.get("connections", []), name, "connections")):
        hists = _objects(conn.get("histograms", []), name, f"connections.{i}.histograms")
        for j, hist in enumerate(hists):
            where = f"connections.{i}.histograms.{j}.{field}"
            for value, count in _bins(hist.get(field, []), column, name, where):
                rows.append({**_file_fields(doc, file), "comm_id": conn.get("comm_id"),
                             "connection": conn.get("index"), "op": hist.get("op"),
                             column: value, "count": count})
    return rows


def _bins(value: Any, column: str, file: str, where: str) -> List[Tuple[int, int]]:
    """The ``[value, count]`` bins of a histogram field, each checked (two counts)."""
    bins = []
    for k, pair in enumerate(_items(value, file, where)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise StatsFormatError(f"{file}: {where}.{k} = {_short(pair)}: allowed: a "
                                   f"[{column}, count] pair")
        bins.append((_count(pair[0], file, f"{where}.{k}", column),
                     _count(pair[1], file, f"{where}.{k}", "count")))
    return bins


def step_op_rows_from_doc(doc: Dict[str, Any], file: str = "") -> List[Dict[str, Any]]:
    """The ``step_ops`` table of one per-step document (``lossy-steps-rank*.json``)."""
    if not isinstance(doc, dict) or "steps" not in doc or "format_version" not in doc:
        raise StatsFormatError(f"{file or 'document'} is not a nccl-lossy per-step file")
    name = file or "per-step document"
    _check_version(doc, name, STEP_FORMAT_VERSION)
    _check_identity(doc, name)
    rows = []
    for i, cell in enumerate(_objects(doc["steps"], name, "steps")):
        where = f"steps.{i}"
        step = _count(_required(cell, "step", name, where), name, where, "step")
        row = {**_file_fields(doc, file), "step": step, "op": _text(cell, "op", name, where),
               "phase": _text(cell, "phase", name, where)}
        row.update(_counters(cell, STEP_OP_COUNTERS, name, where))
        row.update(loss_rates(row))
        rows.append(row)
    return rows


#: Largest statistics or per-step file read (the plugin's own reader stops there too): a
#: stray file of gigabytes under such a name is refused before it is read.
MAX_FILE_BYTES = 256 << 20

def read_file(file: Path) -> bytes:
    """The bytes of ``file``, which must be a regular file of at most :data:`MAX_FILE_BYTES`;
    StatsFormatError saying what it is otherwise (a FIFO, ``/dev/zero``: neither is read)."""
    allowed = f"a statistics file must be a regular file of at most {MAX_FILE_BYTES >> 20} MiB"
    return read_regular_file(file, MAX_FILE_BYTES, allowed, StatsFormatError)


def load_json(file: Path) -> Any:
    """The JSON document in ``file``; StatsFormatError naming it when it is not UTF-8 JSON
    (or not a regular file of at most :data:`MAX_FILE_BYTES`)."""
    data = read_file(file)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError as err:
        raise StatsFormatError(f"{file} is not a statistics file: JSON nested deeper than Python's "
                               "json reads (the plugin writes a few levels)") from err
    except ValueError as err:
        # JSONDecodeError, UnicodeDecodeError, and the ValueError of an integer of more
        # digits than int() converts (sys.get_int_max_str_digits())
        raise StatsFormatError(f"{file} is not valid UTF-8 JSON: {err}") from err


def stats_files(path: Union[str, Path], glob: str = FILE_GLOB) -> List[Path]:
    """The entries matching ``glob`` in a run directory, sorted (one that is no regular file is
    refused when read, not skipped); for a path naming one file, that file, unless its name is
    that of the other kind of file (a per-step file holds none of the plugin's tables, and the
    plugin's file none of the per-step table). A directory that cannot be listed is an error,
    not a run without files."""
    path = Path(path)
    if path.is_dir():
        try:
            names = os.listdir(path)
        except OSError as err:
            raise type(err)(
                err.errno,
                f"{path}: cannot list the statistics directory: {err.strerror}; allowed: a "
                "directory this user may read",
            ) from err
        return sorted(path / name for name in names if fnmatch.fnmatch(name, glob))
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{echo_path(path)}: no such statistics file or directory")
    other = STEP_FILE_GLOB if glob == FILE_GLOB else FILE_GLOB
    if not fnmatch.fnmatch(path.name, glob) and fnmatch.fnmatch(path.name, other):
        return []
    return [path]


def load_stats_files(path: Union[str, Path]) -> List[Dict[str, Any]]:
    """The parsed documents of a run's statistics files (each with a ``file`` key added)."""
    _check_path(path)
    docs = []
    for file in stats_files(path):
        doc = dict(_check(load_json(file), str(file)))
        doc["file"] = str(file)
        docs.append(doc)
    return docs


def _warn_mixed_runs(path: Union[str, Path], docs: List[Dict[str, Any]], profiles: bool) -> None:
    """Warns (Python's :mod:`warnings`) when ``docs`` do not look like one run, as ``lossy
    report`` does: a rank number written by several processes (several runs in one directory,
    or a launcher that gave several processes one rank), or, with ``profiles``, files of
    different profiles. Their rows are still returned, summed by whoever reads them."""
    writers: Dict[int, List[str]] = {}
    for doc in docs:
        rank = doc.get("rank")
        if isinstance(rank, int) and not isinstance(rank, bool):
            writers.setdefault(rank, []).append(f"{doc.get('host')}:{doc.get('pid')}")
    repeated = {rank: who for rank, who in sorted(writers.items()) if len(who) > 1}
    if repeated:
        rank, who = next(iter(repeated.items()))
        warnings.warn(
            f"{path}: rank {rank} is in {len(who)} files (processes {', '.join(who)}; ranks in "
            f"several files: {', '.join(map(str, repeated))}): either several runs wrote into "
            "this directory and their counts are read as one run, or the launcher gave several "
            "processes one rank number (set RANK for each process); give each run its own "
            "NCCL_LOSSY_STATS directory",
            stacklevel=4,
        )
    if profiles:
        _warn_missing_ranks(path, docs, set(writers))
        seen: Dict[str, Any] = {}
        for doc in docs:
            seen.setdefault(json.dumps(doc.get("profile"), sort_keys=True), doc.get("profile"))
        if len(seen) > 1:
            described = []
            for profile in seen.values():
                p = profile if isinstance(profile, dict) else {}
                described.append(f"{p.get('origin', '?')} (overrides `{p.get('overrides', '')}`, "
                                 f"seed {p.get('seed', '?')})")
            warnings.warn(
                f"{path}: these files come from {len(seen)} different profiles and are read as "
                f"one run: {'; '.join(described)}; give each run its own NCCL_LOSSY_STATS "
                "directory",
                stacklevel=4,
            )


def _warn_steps_beyond(doc: Dict[str, Any]) -> None:
    """Warns when the plugin summed traffic of steps it does not keep one by one (65,536 and
    later) in ``steps_beyond``: the ``steps`` table has no rows for them."""
    beyond = doc.get("steps_beyond")
    name, where = doc["file"], "steps_beyond"
    if beyond is None:
        return  # a file of a plugin that predates it
    if not isinstance(beyond, dict):
        raise StatsFormatError(f"{name}: {where} = {_short(beyond)}: allowed: an object")
    counts = _counters(beyond, ("packets", "lost_packets"), name, where)
    first = beyond.get("step", "?")
    if first != "?":
        _count(first, name, where, "step")
    if counts["packets"] > 0:
        warnings.warn(
            f"{name}: {counts['packets']} packets ({counts['lost_packets']} lost) at steps from "
            f"{first} on are not broken down by step (the plugin keeps that many steps one by "
            "one and sums the rest in steps_beyond): the steps table has no rows for them",
            stacklevel=4,
        )


def _warn_missing_ranks(path: Union[str, Path], docs: List[Dict[str, Any]], ranks: Set[int]) -> None:
    """Warns about the ranks of the run that left no statistics file, as ``lossy report`` does:
    below the number of ranks the launcher started (``world_size``, the largest a file says),
    or in files that do not say it, below the highest rank found. A rank stopped before its
    first write leaves none, and the rows would pass for the whole run."""
    if not Path(path).is_dir():
        return  # one file asked for: the other ranks' files were not
    sizes = [d.get("world_size") for d in docs]
    sizes = [n for n in sizes if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    if sizes:
        end, of = max(sizes), f"of the {max(sizes)} ranks the launcher started"
    elif ranks:
        end, of = max(ranks), f"below the highest rank found, {max(ranks)}"
    else:
        return
    missing = []
    for rank in range(end):
        if rank not in ranks:
            missing.append(rank)
            if len(missing) > 16:
                break
    if not missing:
        return
    shown = ", ".join(map(str, missing[:16]))
    # Counted, not listed: a world of millions (a broken environment) is no list of millions.
    more = end - sum(1 for r in ranks if r < end) - 16 if len(missing) > 16 else 0
    warnings.warn(
        f"{path}: no statistics file from rank {shown}{f' and {more} more' if more else ''} {of}: "
        "a rank stopped before it wrote its statistics (they are written when its communicators "
        "close, and every stats_interval) leaves none, and the rows leave its traffic out",
        stacklevel=5,
    )


def _writer(doc: Any) -> Tuple[Any, Any]:
    """The process that wrote a document: (host, pid)."""
    return (doc.get("host"), doc.get("pid")) if isinstance(doc, dict) else (None, None)


def _same_process(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two documents come from one process: one pid, and the same host or (should the
    two writers read the host name differently) the same rank."""
    return (a.get("pid") == b.get("pid")
            and (a.get("host") == b.get("host") or (a.get("rank") is not None and a.get("rank") == b.get("rank"))))


def _warn_missing_step_files(path: Union[str, Path], step_docs: List[Dict[str, Any]]) -> None:
    """Warns when processes of the run left the plugin's statistics file but no per-step file
    (the integration writes it at ``disable()`` / ``write_stats()``, the plugin its file as it
    goes: a rank killed before the end): the ``step_ops`` rows leave their traffic out."""
    if not step_docs or not Path(path).is_dir():
        return
    missing = []
    for file in stats_files(path):
        try:
            doc = load_json(file)
        except (OSError, StatsFormatError):
            continue  # the plugin's tables refuse it; the step_ops rows do not depend on it
        if not isinstance(doc, dict) or not any(_same_process(doc, step) for step in step_docs
                                                if isinstance(step, dict)):
            host, pid = _writer(doc)
            rank = doc.get("rank") if isinstance(doc, dict) else None
            missing.append(f"rank {'?' if rank is None else rank} ({host}:{pid})")
    if missing:
        warnings.warn(
            f"{path}: {len(missing)} process(es) of the run wrote a statistics file and no per-step "
            f"file: {', '.join(missing)}; the step_ops rows leave their traffic out (the "
            "integration writes the per-step file at disable() or write_stats(): a process killed "
            "before that writes none); the plugin's own per-step series (table='steps') has them",
            stacklevel=4,
        )


def _warn_no_files(path: Union[str, Path]) -> None:
    """A directory holding neither the plugin's files nor the per-step files is no run: say so
    (as ``lossy report`` refuses it) instead of returning tables as empty as a run that sent
    nothing."""
    if Path(path).is_dir() and not stats_files(path) and not stats_files(path, STEP_FILE_GLOB):
        warnings.warn(
            f"{path} holds no statistics files ({FILE_GLOB}, {STEP_FILE_GLOB}): was "
            "NCCL_LOSSY_STATS (lossy run --stats DIR, LossyNetwork(stats_dir=...)) set for the "
            "run, and is this the directory it named?",
            stacklevel=4,
        )


def read_stats(path: Union[str, Path], dataframe: Union[bool, str] = False, table: str = "ops") -> Any:
    """A run's statistics as the rows of ``table`` (one of :data:`TABLES`, columns in order).

    ``path`` is a directory given as ``NCCL_LOSSY_STATS`` (or one file). ``dataframe=True``
    returns a pandas DataFrame (pandas must be installed), ``"auto"`` a DataFrame when pandas
    is installed and the list of row dicts otherwise, False the list."""
    _check_path(path)
    if not isinstance(table, str) or table not in TABLES:
        raise ValueError(f"table={echo(table)}: allowed: {', '.join(TABLES)}")
    return _read_tables(path, dataframe, (table,))[table]


def read_all(path: Union[str, Path], dataframe: Union[bool, str] = False) -> Dict[str, Any]:
    """Every table of :data:`TABLES` for a run, by name (see :func:`read_stats`); each file is
    read, and warned about, once."""
    _check_path(path)
    return _read_tables(path, dataframe, tuple(TABLES))


def _read_tables(path: Union[str, Path], dataframe: Union[bool, str], tables: Tuple[str, ...]) -> Dict[str, Any]:
    """The ``tables`` of a run, each file read and checked once (a warning about a file, a
    newer format or a mixed run, is said once however many tables are read)."""
    _warn_no_files(path)
    out: Dict[str, Any] = {}
    docs: Optional[List[Dict[str, Any]]] = None
    for table in tables:
        rows: List[Dict[str, Any]] = []
        if table == "step_ops":
            step_docs = []
            for file in stats_files(path, STEP_FILE_GLOB):
                doc = load_json(file)
                rows.extend(step_op_rows_from_doc(doc, str(file)))
                step_docs.append(doc)
            _warn_mixed_runs(path, step_docs, profiles=False)
            _warn_missing_step_files(path, step_docs)
        else:
            if docs is None:
                docs = load_stats_files(path)  # checked here, the rows below take them as they are
                _warn_mixed_runs(path, docs, profiles=True)
            for doc in docs:
                if table == "ops":
                    rows.extend(_op_rows(doc, doc["file"]))
                elif table == "steps":
                    rows.extend(_step_rows(doc, doc["file"]))
                    _warn_steps_beyond(doc)
                else:
                    rows.extend(_histogram_rows(doc, table, doc["file"]))
        out[table] = as_table(rows, TABLES[table], dataframe)
    return out


def _check_path(path: Any) -> None:
    """Refuses a ``path`` that names no directory or file: None (``integ.stats_dir()`` without
    a statistics directory), another type, or "" (an unset variable read as text), which
    ``Path`` would take as the working directory."""
    allowed = "allowed: a statistics directory (NCCL_LOSSY_STATS) or one statistics file, as str or os.PathLike"
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={echo(path, SHOWN_CHARS)}: {allowed}")
    if not os.fspath(path):
        raise ValueError(f"path={echo(path, SHOWN_CHARS)}: names no directory or file; {allowed}")
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:  # said here: every later look would raise it whole
            raise FileNotFoundError(err.errno, f"{echo_path(path)}: no such statistics file or "
                                    f"directory ({err.strerror})") from None


def as_table(rows: List[Dict[str, Any]], columns: Iterable[str], dataframe: Union[bool, str]) -> Any:
    """``rows`` as they are (``dataframe=False``), as a DataFrame with ``columns`` (True), or
    as a DataFrame when pandas is installed and as they are otherwise (``"auto"``)."""
    if dataframe == "auto":
        try:
            import pandas  # noqa: F401
        except ImportError:
            return rows
        dataframe = True
    elif not isinstance(dataframe, bool):
        raise ValueError(f"dataframe={echo(dataframe)}: allowed: True, False, 'auto'")
    return to_dataframe(rows, columns) if dataframe else rows


def to_dataframe(rows: Iterable[Dict[str, Any]], columns: Iterable[str] = COLUMNS) -> Any:
    """Rows as a pandas DataFrame with ``columns`` (default: the ``ops`` table's)."""
    try:
        import pandas as pd
    except ImportError as err:
        raise ImportError("dataframe=True needs pandas: pip install pandas") from err
    return pd.DataFrame(list(rows), columns=list(columns))


def _group_key(value: Any) -> Any:
    """A ``by`` value as a group key: a missing value is None, also where a DataFrame holds it
    as NaN (a float column with gaps, e.g. ``rank`` of files written without a launcher rank);
    NaN equals nothing, not even itself, so each such row would be a group of its own."""
    return None if isinstance(value, float) and math.isnan(value) else value


def summarize(rows: Iterable[Dict[str, Any]], by: Union[str, Iterable[str]] = ("op", "phase")) -> List[Dict[str, Any]]:
    """Sums the counters of ``rows`` (those of :data:`SUMMED` the rows have) grouped by the
    ``by`` columns (one column may be given as its name), with ``loss_rate`` where packets are
    counted and ``loss_rate_injecting`` where packets sent with injection off are too (both
    from the summed counters, see :func:`loss_rates`). Works on every table of :func:`read_stats` (a DataFrame too):
    ``summarize(read_stats(d, table="step_ops"), by=("step", "op"))``,
    ``summarize(read_stats(d, table="bursts"), by=("op", "burst_length"))``. A ``by`` column
    that no row has (a typo) is a ValueError naming it and the columns the rows have."""
    if hasattr(rows, "to_dict"):
        rows = rows.to_dict("records")
    rows = list(rows)
    try:
        keys = (by,) if isinstance(by, str) else tuple(by)
    except TypeError:
        keys = (None,)  # None, a number: no column names
    if not all(isinstance(k, str) for k in keys):
        raise TypeError(f"summarize: by={echo(by)}: allowed: a column name or a sequence of column names (str)")
    if rows:
        columns: Dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(row))
        for key in keys:
            if key not in columns:
                raise ValueError(
                    f"summarize: by column {echo(key)} is in none of the rows; allowed: "
                    f"{', '.join(columns)}"
                )
    groups: Dict[tuple, Dict[str, Any]] = {}
    for row in rows:
        group = tuple(_group_key(row.get(k)) for k in keys)
        acc = groups.get(group)
        if acc is None:
            acc = {**dict(zip(keys, group)), **{c: 0 for c in SUMMED if c in row}}
            groups[group] = acc
        for c in SUMMED:
            if c in acc:
                acc[c] += int(row.get(c, 0))
    out = []
    for acc in groups.values():
        if "packets" in acc and "lost_packets" in acc:
            rates = loss_rates(acc)
            acc["loss_rate"] = rates["loss_rate"]
            if "packets_injection_off" in acc:
                acc["loss_rate_injecting"] = rates["loss_rate_injecting"]
        out.append(acc)
    return out
