"""Writes a trace file in the plugin's trace format (docs/timeline.md) from measured transfers,
for the merge tests until the plugin writes its own traces: each transfer's timestamps are
CLOCK_MONOTONIC readings taken around it (``time.monotonic_ns``, the clock the plugin records
on), its counters the growth of the plugin's live statistics during it."""

import json
import os
import socket
import time

from nccl_lossy.steps import cell_totals, launcher_rank


def counters_delta(before, after):
    """The (collective, phase) cells that grew between two statistics documents."""
    a, b = cell_totals(before), cell_totals(after)
    out = []
    for (op, phase), counts in sorted(b.items()):
        prev = a.get((op, phase), {})
        grown = {c: counts[c] - prev.get(c, 0) for c in counts}
        if grown["messages"]:
            out.append({"op": op, "phase": phase, **grown})
    return out


def write_plugin_trace(directory, transfers, effect="zero"):
    """``transfers``: dicts with ``t0_ns``, ``t1_ns`` (monotonic), ``step`` and ``cells``
    (from :func:`counters_delta`). Returns the file's path."""
    pid = os.getpid()
    rank = launcher_rank()
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"nccl-net-lossy rank {rank}"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1,
         "args": {"name": "comm 0 conn 0 send -> peer 0"}},
    ]
    lost_total = 0
    for i, t in enumerate(transfers):
        for cell in t["cells"]:
            lost_total += cell["lost_packets"]
            events.append({
                "ph": "X", "cat": "lossy", "name": cell["op"], "pid": pid, "tid": 1,
                "ts": t["t0_ns"] / 1000.0, "dur": (t["t1_ns"] - t["t0_ns"]) / 1000.0,
                "args": {"message": i, "collective": cell["op"], "comm_id": 0, "connection": 0,
                         "peer": 0, "direction": "send", "phase": cell["phase"], "step": t["step"],
                         "bytes": cell["bytes"], "packets": cell["packets"],
                         "lost_packets": cell["lost_packets"], "loss_events": cell["loss_events"],
                         "effect": effect, "retransmit_delay_ns": 0},
            })
            events.append({"ph": "C", "name": "lost_packets", "pid": pid, "ts": t["t1_ns"] / 1000.0,
                           "args": {"lost_packets": lost_total}})
    mono, epoch = time.monotonic_ns(), time.time_ns()
    doc = {
        "displayTimeUnit": "ns",
        "traceEvents": events,
        "lossy_trace": {
            "format_version": 1, "rank": rank, "host": socket.gethostname(), "pid": pid,
            "clock": "CLOCK_MONOTONIC", "monotonic_to_epoch_ns": epoch - mono,
            "clock_sample": {"monotonic_ns": mono, "epoch_ns": epoch},
            "ring_capacity": 65536, "recorded": len(transfers), "dropped": 0,
            "written_at_unix_ms": epoch // 1_000_000,
        },
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"lossy-trace-rank{'x' if rank is None else rank}-{host}-{pid}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return path
