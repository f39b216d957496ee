#!/usr/bin/env python3
"""Real-NCCL checks of attribution and of the protocol guard: two ranks on one GPU, via the plugin.

    python bench/gpu/nccl_checks.py --out checks-out            # every check, then checks-out/checks.md
    python bench/gpu/nccl_checks.py --out checks-out --only hang
    python bench/gpu/nccl_checks.py --out /tmp/c --cpu          # gloo dry run of the scripts' logic

Checks (each one pair of processes, ``NCCL_HOSTID`` per rank, ``NCCL_SOCKET_IFNAME=lo``):

``attribution``
    Lossless profile. Each collective kind (all-reduce, all-gather, reduce-scatter, broadcast,
    send/recv) runs alone between statistics snapshots; the messages the plugin counted in that
    window must all carry that kind's name (``setNetAttr`` told the plugin the right op). Then
    all-reduce, all-gather and reduce-scatter are launched back to back without a sync between
    them, and the window must hold exactly those three kinds.
``isolation``
    A rule that loses every packet (``rate = 1``, ``zero``) of all-gather only. All-reduce,
    all-gather and reduce-scatter are launched back to back: all-reduce and reduce-scatter must
    be bit-exact, all-gather's received half must be all zeros, and the statistics must show
    lost packets for AllGather only. This is attribution under load, judged by the data.
``hang``
    5% uniform loss as zeros with every NCCL protocol allowed (``NCCL_PROTO`` unset): 100
    all-reduces of mixed sizes (4 KiB to 4 MiB, where NCCL would pick LL/LL128) must complete
    within ``--timeout``; the plugin's tuner is what keeps NCCL on Simple.
``forced-ll``
    The same profile with ``NCCL_PROTO=LL``: the plugin must refuse to initialise, loudly (its
    message names NCCL_PROTO), and with ``NCCL_NET=lossy`` the run must stop rather than fall
    back to a lossless network.

With ``--cpu`` the checks run on gloo: no NCCL, so the plugin carries nothing and every
statistics condition is skipped; the data conditions still hold. It exists to test this script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nccl_bench import op_counters, run_ranks  # noqa: E402

CHECKS = ("attribution", "isolation", "hang", "forced-ll")
P2P_NAMES = {"SendRecv", "Send", "Recv"}

PROFILES = {
    "attribution": 'model = { kind = "none" }\n',
    "isolation": (
        'model = { kind = "none" }\n'
        "[[rules]]\n"
        'collective = "AllGather"\n'
        'effect = "zero"\n'
        'model = { kind = "uniform", rate = 1.0 }\n'
    ),
    "hang": 'effect = "zero"\nmodel = { kind = "uniform", rate = 0.05 }\n',
    "forced-ll": 'effect = "zero"\nmodel = { kind = "uniform", rate = 0.05 }\n',
}


def attribution_failure(name: str, seen: Dict[str, int], rank: int, world: int) -> Optional[str]:
    """What is wrong with the op names the plugin counted on ``rank`` while collective ``name``
    ran alone (``seen``: messages per op name), or None. The counts are the sender's
    (docs/statistics.md): a broadcast from rank 0 over two ranks has rank 1 only receive (the
    ring stops before the root), so its window must stay empty; every other window must hold
    that kind, and only that kind."""
    names = set(seen)
    if name == "Broadcast" and world == 2 and rank != 0:
        return None if not names else f"{name} alone: rank {rank} sends nothing, but the plugin saw {seen}"
    want = P2P_NAMES if name == "SendRecv" else {name}
    return None if names and names <= want else f"{name} alone: the plugin saw {seen}"


def grown_by_op(after: Dict[str, Any], before: Dict[str, Any], key: str) -> Dict[str, int]:
    """How much counter ``key`` grew per op name between two statistics documents (every
    connection of this rank, so both directions of its traffic); ops that did not grow are left
    out."""
    names = set()
    for doc in (after, before):
        for conn in (doc or {}).get("connections", []):
            names.update(cell.get("op") for cell in conn.get("by_op", []))
    grown = {name: op_counters(after, name)[key] - op_counters(before, name)[key] for name in names if name}
    return {name: n for name, n in sorted(grown.items()) if n}


# -- worker ------------------------------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        dist.init_process_group("nccl", rank=rank, world_size=world)
    meta = dist.new_group(backend="gloo")
    plugin = (not args.cpu) and os.environ.get("NCCL_NET") == "lossy"
    if plugin:
        import nccl_lossy

        snapshot = nccl_lossy.stats
    else:
        snapshot = lambda: None  # noqa: E731
    sync = (lambda: None) if args.cpu else torch.cuda.synchronize
    n = (4 << 20) // 4

    def values(seed: int, count: int):
        # Never zero, exact in fp32 when two ranks' values are summed.
        i = torch.arange(count, dtype=torch.float64, device=device)
        return (1 + torch.remainder(7 * i + 13 * seed + 5, 1024) / 1024).to(torch.float32)

    def window(body):
        sync()
        dist.barrier(group=meta)
        before = snapshot()
        body()
        sync()
        dist.barrier(group=meta)  # the peer's sends to us are counted by now
        return before, snapshot()

    result: Dict[str, Any] = {"rank": rank, "check": args.check, "failures": []}

    def expect(cond: bool, text: str) -> None:
        if not cond:
            result["failures"].append(text)

    if args.check == "attribution":
        x = values(rank, n)
        gathered = torch.empty(n * world, dtype=torch.float32, device=device)
        scattered = torch.empty(n // world, dtype=torch.float32, device=device)
        peer = 1 - rank
        kinds = {
            "AllReduce": lambda: dist.all_reduce(x.clone()),
            "AllGather": lambda: dist.all_gather_into_tensor(gathered, x),
            "ReduceScatter": lambda: dist.reduce_scatter_tensor(scattered, x),
            "Broadcast": lambda: dist.broadcast(x.clone(), src=0),
            "SendRecv": lambda: [
                w.wait()
                for w in dist.batch_isend_irecv(
                    [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, x.clone(), peer)]
                )
            ],
        }
        seen = {}
        for name, body in kinds.items():
            before, after = window(body)
            if plugin:
                seen[name] = grown_by_op(after, before, "messages")
                failure = attribution_failure(name, seen[name], rank, world)
                expect(failure is None, failure or "")

        def back_to_back():
            dist.all_reduce(x.clone())
            dist.all_gather_into_tensor(gathered, x)
            dist.reduce_scatter_tensor(scattered, x)

        before, after = window(back_to_back)
        if plugin:
            seen["back-to-back"] = grown_by_op(after, before, "messages")
            expect(
                set(seen["back-to-back"]) == {"AllReduce", "AllGather", "ReduceScatter"},
                f"back to back: the plugin saw {seen['back-to-back']}",
            )
        result["seen"] = seen
    elif args.check == "isolation":
        x = values(rank, n)
        reduced = x.clone()
        gathered = torch.empty(n * world, dtype=torch.float32, device=device)
        scattered = torch.empty(n // world, dtype=torch.float32, device=device)

        def back_to_back():
            dist.all_reduce(reduced)
            dist.all_gather_into_tensor(gathered, x)
            dist.reduce_scatter_tensor(scattered, x)

        before, after = window(back_to_back)
        total = sum(values(r, n) for r in range(world))
        expect(torch.equal(reduced, total), "all-reduce was damaged by an all-gather-only rule")
        expect(
            torch.equal(scattered, total[rank * (n // world):(rank + 1) * (n // world)]),
            "reduce-scatter was damaged by an all-gather-only rule",
        )
        mine = gathered[rank * n:(rank + 1) * n]
        others = torch.cat([gathered[r * n:(r + 1) * n] for r in range(world) if r != rank])
        expect(torch.equal(mine, x), "all-gather's local part changed")
        zeros = int((others == 0).sum())
        result["allgather_received_zero_fraction"] = zeros / others.numel()
        if plugin:
            result["lost"] = grown_by_op(after, before, "lost_packets")
            expect(zeros == others.numel(), f"all-gather: {zeros} of {others.numel()} received elements zero")
            expect(set(result["lost"]) == {"AllGather"}, f"lost packets by op: {result['lost']}")
    elif args.check == "hang":
        sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
        started = time.perf_counter()
        for i in range(100):
            t = values(rank + i, sizes[i % len(sizes)] // 4)
            dist.all_reduce(t)
        sync()
        result["seconds"] = time.perf_counter() - started
        result["all_reduces"] = 100
    elif args.check == "forced-ll":
        # NCCL starts lazily: the first collective is what loads the network (and must fail).
        dist.all_reduce(values(rank, 1024))
        sync()
    if plugin:
        nccl_lossy.write_stats()
    dist.destroy_process_group()
    Path(args.result).write_text(json.dumps(result, indent=1))


# -- driver ------------------------------------------------------------------------------------


def check_env(check: str, out: Path, cpu: bool) -> Dict[str, str]:
    """Environment shared by both ranks of one check."""
    from nccl_lossy import LossyNetwork

    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_") or k == "NCCL_DEBUG"}
    env["NCCL_SOCKET_IFNAME"] = "lo"
    env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    profile = out / f"{check}.toml"
    profile.write_text(PROFILES[check])
    stats = out / "stats" / check
    stats.mkdir(parents=True, exist_ok=True)
    if check == "forced-ll":
        env["NCCL_PROTO"] = "LL"
        # LossyNetwork refuses this combination itself; build the environment by hand so the
        # plugin's own refusal is what gets tested.
        base = LossyNetwork(profile=REPO / "configs" / "lossless.toml").env(base={})
        env.update(base)
        env["NCCL_LOSSY_PROFILE"] = str(profile)
    else:
        env.update(LossyNetwork(profile=profile, stats_dir=stats).env(base=env))
    if cpu:
        env.pop("NCCL_NET", None)
    return env


def run_check(check: str, args) -> Dict[str, Any]:
    out = Path(args.out)
    env = check_env(check, out, args.cpu)
    if check == "forced-ll" and args.cpu:
        return {"check": check, "seconds": 0, "exit_codes": [], "timed_out": False, "passed": None,
                "detail": "skipped on the CPU (needs NCCL)"}
    for r in range(2):
        (out / f"{check}.rank{r}.json").unlink(missing_ok=True)  # no result from an earlier run

    def command(r: int) -> List[str]:
        return [sys.executable, str(Path(__file__).resolve()), "worker", "--check", check,
                "--result", str(out / f"{check}.rank{r}.json")] + (["--cpu"] if args.cpu else [])

    started = time.time()
    codes, timed_out = run_ranks(2, env, command, lambda r: out / f"{check}.rank{r}.log", args.timeout)
    logs = [(out / f"{check}.rank{r}.log").read_text(errors="replace") for r in range(2)]
    row: Dict[str, Any] = {"check": check, "seconds": round(time.time() - started, 1),
                           "exit_codes": codes, "timed_out": timed_out}
    if check == "forced-ll":
        refused = any("NCCL_PROTO" in text for text in logs)
        row["passed"] = all(c != 0 for c in codes) and refused and not timed_out
        row["detail"] = "refused at init, naming NCCL_PROTO" if row["passed"] else "not refused as expected"
        return row
    ranks = []
    for r in range(2):
        path = out / f"{check}.rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.is_file() else None)
    failures = [f"rank {r}: {f}" for r, doc in enumerate(ranks) if doc for f in doc["failures"]]
    if timed_out:
        failures.append(f"timed out after {args.timeout} s (a hang)")
    if any(c != 0 for c in codes) and not timed_out:
        failures.append(f"exit codes {codes}; rank 0 log tail: {logs[0][-1500:]}")
    row["passed"] = not failures
    row["failures"] = failures
    row["ranks"] = ranks
    return row


def write_report(out: Path, rows: List[Dict[str, Any]], cpu: bool) -> str:
    lines = [
        f"# Real-NCCL checks ({'CPU dry run: gloo, no NCCL' if cpu else 'GPU'})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; see bench/gpu/nccl_checks.py for what each check does.",
        "",
        "| check | result | seconds | detail |",
        "|---|---|---|---|",
    ]
    for row in rows:
        verdict = {True: "pass", False: "FAIL", None: "skipped"}[row["passed"]]
        detail = row.get("detail") or "; ".join(row.get("failures", [])) or ""
        if row["check"] == "attribution" and row.get("ranks") and row["ranks"][0]:
            detail = detail or json.dumps(row["ranks"][0].get("seen", {}))
        if row["check"] == "hang" and row.get("ranks") and row["ranks"][0]:
            detail = detail or f"{row['ranks'][0].get('all_reduces')} all-reduces in {row['ranks'][0].get('seconds', 0):.1f} s"
        lines.append(f"| {row['check']} | {verdict} | {row['seconds']} | {detail.replace('|', '/')} |")
    text = "\n".join(lines) + "\n"
    (out / "checks.md").write_text(text)
    (out / "checks.json").write_text(json.dumps(rows, indent=1))
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="real-NCCL attribution and protocol-guard checks")
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--check", required=True, choices=CHECKS)
    w.add_argument("--result", required=True)
    w.add_argument("--cpu", action="store_true")
    p.add_argument("--out", default="checks-out")
    p.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of " + ", ".join(CHECKS))
    p.add_argument("--timeout", type=float, default=300, help="seconds per check before it counts as a hang")
    p.add_argument("--cpu", action="store_true", help="gloo dry run (no NCCL, no plugin traffic)")
    args = p.parse_args(argv)
    if args.cmd == "worker":
        worker(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checks = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        p.error(f"unknown checks {unknown}; allowed: {', '.join(CHECKS)}")
    rows = [run_check(check, args) for check in checks]
    print(write_report(out, rows, args.cpu))
    return 0 if all(r["passed"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
