#!/usr/bin/env python3
"""nccl-tests-style benchmark from torch.distributed: two ranks on one GPU, through the network.

    python bench/gpu/nccl_bench.py run --out bench-out            # every configuration, then report
    python bench/gpu/nccl_bench.py run --out bench-out --configs socket,lossless
    python bench/gpu/nccl_bench.py report --out bench-out         # tables from what is there
    python bench/gpu/nccl_bench.py run --cpu --sizes 64K:256K --out /tmp/b   # gloo dry run

Configurations (``--configs``, default all, in this order):

====================  =====================================================================
``socket``            (a) NCCL's internal Socket transport, no plugin (``NCCL_NET=Socket``)
``lossless``          (b) our plugin, ``configs/lossless.toml``
``uniform-1pct``      (c) our plugin, 1% uniform loss, lost packets arrive as zeros
``bursty-ge-1pct``    (d) our plugin, 1% Gilbert-Elliott loss in bursts of 8, zeros
``retransmit-1pct``   (e) our plugin, 1% uniform loss repaired by retransmission
====================  =====================================================================

Each configuration is one pair of processes (this script, ``worker`` subcommand), both on
``cuda:0`` with their own ``NCCL_HOSTID`` (``fakehost0``/``fakehost1``) and
``NCCL_SOCKET_IFNAME=lo``, so NCCL treats them as two hosts and all data crosses the network.
Plugin configurations get their environment from ``nccl_lossy.LossyNetwork`` (which sets
``NCCL_NET=lossy``: a plugin that fails to load stops the run instead of falling back) and
their own ``NCCL_LOSSY_STATS`` directory. ``NCCL_PROTO=Simple`` is set for every
configuration by default (``--proto native`` leaves NCCL's choice), so all run one protocol.

Per collective (all-reduce, all-gather, reduce-scatter) and size (total buffer, as nccl-tests:
the all-gather output, the reduce-scatter input), it times ``iters`` back-to-back operations
after ``warmup`` ones and reports nccl-tests' algbw = size / time and busbw = algbw x 2(n-1)/n
(all-reduce) or x (n-1)/n (all-gather, reduce-scatter); the slower rank's time counts.

Correctness (one extra, untimed operation per collective and size): inputs are
``1 + ((7 i + 13 r + 5) mod 1024) / 1024`` in fp32 for element ``i`` on rank ``r``: never zero, and
with 10 fractional bits the two-rank sum is exact, so every correct output is bit-identical to
the analytic expectation whatever NCCL's algorithm or order. The worker counts wrong elements
(``!= expected``) and zero elements, and hashes the output (BLAKE2b) so configurations can be
compared bit for bit. For plugin configurations it reads ``nccl_lossy.stats()`` before and after
that operation (around CPU-side gloo barriers, so the other rank's sends are counted) and so
gets the packets and lost packets of exactly that operation. See :func:`predicted_wrong` for how
lost packets turn into wrong elements (all-reduce amplifies: each element crosses twice).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger("nccl_bench")

REPO = Path(__file__).resolve().parent.parent.parent

#: name -> (label, profile relative to the repository or None for NCCL's Socket transport)
CONFIGS: Dict[str, tuple] = {
    "socket": ("(a) NCCL Socket", None),
    "lossless": ("(b) plugin lossless", "configs/lossless.toml"),
    "uniform-1pct": ("(c) plugin 1% uniform, zero", "configs/uniform-1pct.toml"),
    "bursty-ge-1pct": ("(d) plugin 1% GE burst 8, zero", "configs/bursty-ge-1pct.toml"),
    "retransmit-1pct": ("(e) plugin 1% retransmit", "configs/retransmit-1pct.toml"),
}
BASELINE = "socket"
COLLECTIVES = ("allreduce", "allgather", "reducescatter")
#: The collective names the plugin's statistics use.
NCCL_OP = {"allreduce": "AllReduce", "allgather": "AllGather", "reducescatter": "ReduceScatter"}
ELEM = 4  # fp32

# -- sizes and iteration counts ----------------------------------------------------------------

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


def parse_sizes(text: str) -> List[int]:
    """``1M:1G`` (powers of two between, inclusive) or a list ``1M,4M,256M``."""
    if ":" in text:
        lo, hi = (parse_size(t) for t in text.split(":", 1))
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= 2
        return sizes
    return [parse_size(t) for t in text.split(",") if t.strip()]


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def iterations(size: int, budget: int, lo: int = 3, hi: int = 20) -> int:
    """Timed iterations for a size: about ``budget`` bytes in all, between ``lo`` and ``hi``."""
    return max(lo, min(hi, budget // max(size, 1)))


def bus_factor(coll: str, nranks: int) -> float:
    if coll == "allreduce":
        return 2.0 * (nranks - 1) / nranks
    return (nranks - 1) / nranks


# -- inputs and correctness accounting ---------------------------------------------------------


def pattern(torch, start: int, count: int, rank: int, device) -> Any:
    """Deterministic fp32 input: 1 + ((7 i + 13 r + 5) mod 1024) / 1024 for i in [start, start+count)."""
    idx = torch.arange(start, start + count, dtype=torch.int64 if start + count >= (1 << 28) else torch.int32,
                       device=device)
    v = torch.remainder(idx * 7 + (13 * rank + 5), 1024).to(torch.float32)
    return v.div_(1024.0).add_(1.0)


def buffers(torch, coll: str, n: int, rank: int, world: int, device):
    """(input, output, expected output) for ``n`` elements of total buffer on rank ``rank``."""
    if coll == "allreduce":
        x = pattern(torch, 0, n, rank, device)
        expected = sum(pattern(torch, 0, n, r, device) for r in range(world))
        return x, x, expected  # in place, as torch's all_reduce
    chunk = n // world
    if coll == "allgather":
        x = pattern(torch, rank * chunk, chunk, rank, device)
        out = torch.empty(n, dtype=torch.float32, device=device)
        expected = torch.cat([pattern(torch, r * chunk, chunk, r, device) for r in range(world)])
        return x, out, expected
    if coll == "reducescatter":
        x = pattern(torch, 0, n, rank, device)
        out = torch.empty(chunk, dtype=torch.float32, device=device)
        expected = sum(pattern(torch, rank * chunk, chunk, r, device) for r in range(world))
        return x, out, expected
    raise ValueError(coll)


def received_elements(coll: str, n: int, world: int) -> int:
    """Output elements of one rank that depend on data that crossed the network."""
    chunk = n // world
    if coll == "allreduce":
        return n
    return chunk * (world - 1) if coll == "allgather" else chunk


def predicted_wrong(coll: str, received: int, p: float) -> float:
    """Expected wrong output elements (both ranks together) for a packet-loss fraction ``p``
    under the ``zero`` effect, two ranks, whole packets of whole elements.

    - all-gather: each element of the other rank's chunk crosses the network once; a lost
      packet arrives as zeros, so a fraction ``p`` of received elements is wrong (zero).
    - reduce-scatter: each output element adds one contribution that crossed once; a lost
      packet leaves the local contribution alone: fraction ``p`` wrong (none zero).
    - all-reduce (ring or tree, two ranks): each element crosses twice, once to the rank that
      reduces it (crossing 1) and once back with the sum (crossing 2). The reducing rank's copy
      is wrong iff crossing 1 was lost; the other's iff crossing 1 or 2 was: expected wrong
      copies per element ``p + 1 - (1 - p)^2 = 3p - p^2`` out of 2, so a fraction
      ``(3p - p^2) / 2`` of output elements, about 1.5x the packet-loss fraction. The
      statistics' ``p`` counts both crossings' packets, so it is still the per-crossing rate.
    """
    if coll == "allreduce":
        return received * (3 * p - p * p) / 2
    return received * p


def tensor_hash(t) -> str:
    data = t.detach().contiguous().cpu().view(-1).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def count_damage(torch, out, expected) -> Dict[str, int]:
    return {
        "wrong": int((out != expected).sum().item()),
        "zero": int((out == 0).sum().item()),
        "elements": int(out.numel()),
    }


def op_counters(doc: Optional[Dict[str, Any]], op: Optional[str]) -> Dict[str, int]:
    """Sums a statistics document's counters over every connection (for one collective, or all)."""
    keys = ("messages", "bytes", "packets", "lost_packets", "loss_events")
    acc = {k: 0 for k in keys}
    if not doc:
        return acc
    for conn in doc.get("connections", []):
        for cell in conn.get("by_op", []):
            if op is None or cell.get("op") == op:
                for k in keys:
                    acc[k] += int(cell.get(k, 0))
    return acc


def delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


# -- worker ------------------------------------------------------------------------------------


def worker(args) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(0)  # both ranks on the one GPU
        device = torch.device("cuda", 0)
        dist.init_process_group("nccl", rank=rank, world_size=world)
    meta = dist.new_group(backend="gloo")  # CPU-side barriers and gathers: never through NCCL
    plugin = (not args.cpu) and os.environ.get("NCCL_NET") == "lossy"
    stats = None
    if plugin:
        import nccl_lossy

        stats = nccl_lossy.stats
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize

    def run(coll, x, out):
        if coll == "allreduce":
            dist.all_reduce(x)
        elif coll == "allgather":
            dist.all_gather_into_tensor(out, x)
        else:
            dist.reduce_scatter_tensor(out, x)

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=meta)
        return float(t.item())

    results = []
    sizes = parse_sizes(args.sizes)
    for coll in args.collectives.split(","):
        for size in sizes:
            n = size // ELEM
            n -= n % world
            x, out, expected = buffers(torch, coll, n, rank, world, device)
            iters = iterations(size, parse_size(args.budget))
            for _ in range(args.warmup):
                run(coll, x, out)
            sync()
            dist.barrier(group=meta)
            t0 = time.perf_counter()
            for _ in range(iters):
                run(coll, x, out)
            sync()
            elapsed = slowest((time.perf_counter() - t0) / iters)
            # The correctness operation: fresh inputs, counters around it.
            x, out, expected = buffers(torch, coll, n, rank, world, device)
            sync()
            dist.barrier(group=meta)
            before = stats() if stats else None
            run(coll, x, out)
            sync()
            dist.barrier(group=meta)  # the other rank's sends to us are counted by now
            after = stats() if stats else None
            damage = count_damage(torch, out, expected)
            row = {
                "coll": coll,
                "size": n * ELEM,
                "rank": rank,
                "iters": iters,
                "time_s": elapsed,
                "algbw_GBps": n * ELEM / elapsed / 1e9,
                "busbw_GBps": n * ELEM / elapsed / 1e9 * bus_factor(coll, world),
                "hash": tensor_hash(out),
                "received": received_elements(coll, n, world),
                **damage,
                "sent": delta(op_counters(after, NCCL_OP[coll]), op_counters(before, NCCL_OP[coll])) if stats else None,
                "sent_all_ops": delta(op_counters(after, None), op_counters(before, None)) if stats else None,
            }
            results.append(row)
            log.info("%s %s: %.3f GB/s busbw, %d wrong, %d zero", coll, fmt_size(n * ELEM),
                     row["busbw_GBps"], damage["wrong"], damage["zero"])
            del x, out, expected
            if not args.cpu:
                torch.cuda.empty_cache()
    info = {
        "rank": rank,
        "world": world,
        "torch": torch.__version__,
        "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version())),
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        "results": results,
    }
    if plugin:
        import nccl_lossy

        nccl_lossy.write_stats()
    Path(args.result).write_text(json.dumps(info, indent=1))
    dist.destroy_process_group()


# -- driver ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_INHERITED = ("NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_LOSSY_PROFILE", "NCCL_LOSSY_SET", "NCCL_LOSSY_STATS",
              "NCCL_PROTO", "NCCL_HOSTID", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def config_env(name: str, out: Path, proto: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment shared by both ranks of one configuration."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _INHERITED}
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # NCCL 2.30+; older versions ignore it
    if proto != "native":
        env["NCCL_PROTO"] = proto
    profile = CONFIGS[name][1]
    if profile is None:
        env["NCCL_NET"] = "Socket"
        env["NCCL_NET_PLUGIN"] = "none"
        return env
    from nccl_lossy import LossyNetwork

    stats_dir = out / "stats" / name
    stats_dir.mkdir(parents=True, exist_ok=True)
    for old in stats_dir.glob("lossy-stats-*.json"):
        old.unlink()
    env.update(LossyNetwork(profile=REPO / profile, stats_dir=stats_dir).env(base=env))
    return env


def run_ranks(nproc: int, env: Dict[str, str], command, log_of, timeout: float) -> tuple:
    """Starts ``nproc`` ranks on one GPU (``command(r)``, output to ``log_of(r)``) and waits.

    A rank that fails stops the others (they would wait for it forever), after a moment to
    report their own error; so does the deadline. The rendezvous port is picked free and then
    bound by rank 0: another process may take it in between, so a run whose logs say
    EADDRINUSE is started again on another port (up to three times).
    Returns (exit codes, timed out)."""
    for _attempt in range(3):
        port = free_port()
        procs = []
        for r in range(nproc):
            renv = dict(env, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_HOSTID=f"fakehost{r}")
            log = open(log_of(r), "w")
            procs.append((subprocess.Popen(command(r), env=renv, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.time() + timeout
        timed_out = False
        while any(p.poll() is None for p, _ in procs):
            failed = any(p.returncode not in (None, 0) for p, _ in procs)
            timed_out = time.time() > deadline
            if failed or timed_out:
                time.sleep(0 if timed_out else 2)
                for p, _ in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
        for p, log in procs:
            p.wait()
            log.close()
        if not any("EADDRINUSE" in Path(log_of(r)).read_text(errors="replace") for r in range(nproc)):
            break
    return [p.returncode for p, _ in procs], timed_out


def run_config(name: str, args) -> Dict[str, Any]:
    out = Path(args.out)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    env = config_env(name, out, args.proto)
    started = time.time()

    def command(r: int) -> List[str]:
        return [sys.executable, str(Path(__file__).resolve()), "worker", "--result", str(raw / f"{name}.rank{r}.json"),
                "--sizes", args.sizes, "--collectives", args.collectives, "--warmup", str(args.warmup),
                "--budget", args.budget] + (["--cpu"] if args.cpu else [])

    codes, timed_out = run_ranks(args.nproc, env, command, lambda r: raw / f"{name}.rank{r}.log", args.timeout)
    if timed_out or any(codes):
        rc = 124 if timed_out else next(c for c in codes if c)
        tail = (raw / f"{name}.rank0.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"configuration {name} failed (rc {rc}); rank 0 log tail:\n{tail}")
    print(f"{name}: done in {time.time() - started:.1f} s", file=sys.stderr)
    return merge_ranks(name, raw)


def merge_ranks(name: str, raw: Path) -> Dict[str, Any]:
    """One record per configuration: per (collective, size) the slowest rank's time, both
    ranks' hashes, damage and sent counters summed."""
    docs = [json.loads(p.read_text()) for p in sorted(raw.glob(f"{name}.rank*.json"))]
    if not docs:
        raise FileNotFoundError(f"no results for {name} in {raw}")
    rows: Dict[tuple, Dict[str, Any]] = {}
    for doc in docs:
        for r in doc["results"]:
            key = (r["coll"], r["size"])
            acc = rows.setdefault(key, {"coll": r["coll"], "size": r["size"], "iters": r["iters"], "time_s": 0.0,
                                        "hashes": {}, "wrong": 0, "zero": 0, "elements": 0, "received": 0,
                                        "sent": None})
            acc["time_s"] = max(acc["time_s"], r["time_s"])
            acc["hashes"][str(r["rank"])] = r["hash"]
            for k in ("wrong", "zero", "elements", "received"):
                acc[k] += r[k]
            sent = r.get("sent")
            if sent is not None:
                if not sent.get("packets") and r.get("sent_all_ops"):
                    sent = r["sent_all_ops"]  # an NCCL that does not name collectives: all ops
                acc["sent"] = {k: (acc["sent"] or {}).get(k, 0) + v for k, v in sent.items()}
    world = docs[0]["world"]
    out_rows = []
    for (coll, size), acc in sorted(rows.items(), key=lambda kv: (COLLECTIVES.index(kv[0][0]), kv[0][1])):
        acc["algbw_GBps"] = size / acc["time_s"] / 1e9
        acc["busbw_GBps"] = acc["algbw_GBps"] * bus_factor(coll, world)
        acc.update(accounting(coll, acc))
        out_rows.append(acc)
    d0 = docs[0]
    return {"config": name, "label": CONFIGS[name][0], "profile": CONFIGS[name][1], "world": world,
            "torch": d0["torch"], "nccl": d0["nccl"], "device": d0["device"], "env_rank0": d0["env"],
            "rows": out_rows}


def accounting(coll: str, acc: Dict[str, Any]) -> Dict[str, Any]:
    """Measured damage next to what the plugin's counters predict (see predicted_wrong)."""
    sent = acc.get("sent")
    measured = acc["wrong"] / acc["elements"] if acc["elements"] else 0.0
    if not sent or not sent.get("packets"):
        return {"wrong_fraction": measured, "loss_fraction": None, "predicted_wrong": None, "wrong_vs_predicted": None}
    p = sent["lost_packets"] / sent["packets"]
    pred = predicted_wrong(coll, acc["received"], p)
    return {"wrong_fraction": measured, "loss_fraction": p, "predicted_wrong": pred,
            "wrong_vs_predicted": acc["wrong"] / pred if pred else None}


# -- report ------------------------------------------------------------------------------------


def load_results(out: Path) -> Dict[str, Dict[str, Any]]:
    res = {}
    for name in CONFIGS:
        try:
            res[name] = merge_ranks(name, out / "raw")
        except FileNotFoundError:
            continue
    return res


def report(results: Dict[str, Dict[str, Any]], goal_size: int = 256 << 20) -> Dict[str, Any]:
    """Tables (markdown) and a JSON document from the merged per-configuration results."""
    base = results.get(BASELINE)
    names = [n for n in CONFIGS if n in results]

    def row_of(name, coll, size):
        for r in results[name]["rows"]:
            if r["coll"] == coll and r["size"] == size:
                return r
        return None

    lines = []
    any_res = results[names[0]] if names else {}
    lines.append("# GPU collective benchmark: NCCL Socket vs the lossy plugin")
    lines.append("")
    lines.append(f"torch {any_res.get('torch')}, NCCL {any_res.get('nccl')}, device {any_res.get('device')}, "
                 f"{any_res.get('world')} ranks. busbw in GB/s (nccl-tests' definition); ratio to (a) in brackets.")
    lines.append("")
    summary: Dict[str, Any] = {"configs": {n: results[n] for n in names}, "ratios": {}, "checks": [], "goals": []}
    for coll in COLLECTIVES:
        sizes = sorted({r["size"] for n in names for r in results[n]["rows"] if r["coll"] == coll})
        if not sizes:
            continue
        lines.append(f"## {coll}")
        lines.append("")
        lines.append("| size | " + " | ".join(CONFIGS[n][0] for n in names) + " |")
        lines.append("|---:|" + "---:|" * len(names))
        for size in sizes:
            cells = []
            b = row_of(BASELINE, coll, size) if base else None
            for n in names:
                r = row_of(n, coll, size)
                if r is None:
                    cells.append("-")
                    continue
                text = f"{r['busbw_GBps']:.2f}"
                if b is not None and n != BASELINE:
                    ratio = r["busbw_GBps"] / b["busbw_GBps"]
                    summary["ratios"].setdefault(n, {}).setdefault(coll, {})[str(size)] = ratio
                    text += f" ({ratio:.2f}x)"
                cells.append(text)
            lines.append(f"| {fmt_size(size)} | " + " | ".join(cells) + " |")
        lines.append("")

    # Correctness.
    lines.append("## Correctness")
    lines.append("")
    lines.append("Bit-exact: the output hash of both ranks equals (a)'s (and the analytic result: `wrong` = 0). "
                 "Under loss: wrong elements (both ranks) against the prediction from the plugin's own counters "
                 "for that operation (`p` = lost / sent packets; all-reduce predicts (3p - p^2)/2 of outputs, "
                 "all-gather and reduce-scatter p of received elements).")
    lines.append("")
    lines.append("| config | collective | size | same as (a) | wrong | zero | lost / packets | p | predicted wrong | wrong / predicted |")
    lines.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        for r in results[n]["rows"]:
            b = row_of(BASELINE, r["coll"], r["size"]) if base else None
            same = "-" if b is None or n == BASELINE else ("yes" if r["hashes"] == b["hashes"] else "no")
            sent = r.get("sent") or {}
            check = {"config": n, "coll": r["coll"], "size": r["size"], "same_as_baseline": same, "wrong": r["wrong"],
                     "zero": r["zero"], "loss_fraction": r["loss_fraction"], "predicted_wrong": r["predicted_wrong"],
                     "wrong_vs_predicted": r["wrong_vs_predicted"]}
            summary["checks"].append(check)
            lines.append(
                f"| {CONFIGS[n][0]} | {r['coll']} | {fmt_size(r['size'])} | {same} | {r['wrong']} | {r['zero']} | "
                + (f"{sent.get('lost_packets', 0)} / {sent.get('packets', 0)}" if sent else "-") + " | "
                + (f"{r['loss_fraction']:.4%}" if r["loss_fraction"] is not None else "-") + " | "
                + (f"{r['predicted_wrong']:.0f}" if r["predicted_wrong"] is not None else "-") + " | "
                + (f"{r['wrong_vs_predicted']:.3f}" if r["wrong_vs_predicted"] is not None else "-") + " |"
            )
    lines.append("")

    # Goals.
    goals = []

    def goal(text, value, ok):
        goals.append({"goal": text, "value": value, "met": ok})

    for coll in COLLECTIVES:
        a = row_of(BASELINE, coll, goal_size) if BASELINE in results else None
        b = row_of("lossless", coll, goal_size) if "lossless" in results else None
        if a and b:
            v = b["busbw_GBps"] / a["busbw_GBps"]
            goal(f"{coll} {fmt_size(goal_size)}: (b) >= 2.5x (a)", round(v, 3), v >= 2.5)
        for n in ("uniform-1pct", "bursty-ge-1pct"):
            c = row_of(n, coll, goal_size) if n in results else None
            if b and c:
                v = c["busbw_GBps"] / b["busbw_GBps"]
                goal(f"{coll} {fmt_size(goal_size)}: {CONFIGS[n][0]} within 5% of (b)", round(v, 3), v >= 0.95)
    for n in ("lossless", "retransmit-1pct"):
        if n in results and base:
            exact = all(row_of(BASELINE, r["coll"], r["size"]) is None
                        or r["hashes"] == row_of(BASELINE, r["coll"], r["size"])["hashes"] for r in results[n]["rows"])
            goal(f"{CONFIGS[n][0]}: every output bit-identical to (a)", exact, exact)
    summary["goals"] = goals
    if goals:
        lines.append("## Goals")
        lines.append("")
        lines.append("| goal | measured | met |")
        lines.append("|---|---|---|")
        for g in goals:
            lines.append(f"| {g['goal']} | {g['value']} | {'yes' if g['met'] else 'NO'} |")
        lines.append("")
    summary["markdown"] = "\n".join(lines)
    return summary


def write_report(out: Path) -> Dict[str, Any]:
    results = load_results(out)
    if not results:
        raise SystemExit(f"no results under {out / 'raw'}")
    summary = report(results)
    (out / "results.md").write_text(summary["markdown"] + "\n")
    (out / "results.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "markdown"}, indent=1))
    return summary


# -- command line ------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="nccl-tests-style benchmark: NCCL Socket vs the lossy plugin")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run configurations, then write the report")
    r.add_argument("--out", default="bench-out")
    r.add_argument("--configs", default=",".join(CONFIGS))
    r.add_argument("--sizes", default="1M:1G")
    r.add_argument("--collectives", default=",".join(COLLECTIVES))
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--budget", default="512M", help="bytes per size for the timed iterations (3..20 iterations)")
    r.add_argument("--proto", default="Simple", help="NCCL_PROTO for every configuration, or 'native'")
    r.add_argument("--nproc", type=int, default=2)
    r.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    r.add_argument("--cpu", action="store_true", help="gloo on the CPU (dry run: no NCCL, no plugin traffic)")
    w = sub.add_parser("worker", help="one rank (started by run)")
    w.add_argument("--result", required=True)
    w.add_argument("--sizes", required=True)
    w.add_argument("--collectives", required=True)
    w.add_argument("--warmup", type=int, default=2)
    w.add_argument("--budget", default="512M")
    w.add_argument("--cpu", action="store_true")
    rep = sub.add_parser("report", help="tables and JSON from the results under --out")
    rep.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    if args.cmd == "worker":
        worker(args)
        return 0
    if args.cmd == "run":
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
        for name in names:
            run_config(name, args)
    summary = write_report(Path(args.out))
    print(summary["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
