#!/usr/bin/env python3
"""Tables and plots from a megatron sweep (examples/megatron_sweep.sh).

    python examples/megatron_results.py SWEEP_DIR [--md docs/RESULTS.md] [--plots docs/results]

Reads every ``SWEEP_DIR/<model>_<rate>_<scope>/`` (``train.jsonl`` from the training script,
``stats/`` from the plugin, via ``nccl_lossy.read_stats``) and writes a markdown page with:

- one table of runs: final loss, mean loss of the last 10 steps, tokens/s and its ratio to the
  lossless plugin run, and per collective (AllReduce, AllGather, ReduceScatter) lost/sent
  packets summed over both ranks;
- loss curves per scope (all traffic, then one collective kind at a time), one line per
  setting (``loss_curves.png``);
- the burst-length distribution of every run that lost packets (``bursts.png``).

Plots need matplotlib; without it the page says so and keeps the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python" / "src"))
import nccl_lossy  # noqa: E402

OPS = ("AllReduce", "AllGather", "ReduceScatter")
SCOPES = ("all",) + OPS


def parse_name(name: str) -> Dict[str, Any]:
    """``uniform_0.01_AllGather`` -> model, rate, scope (names the sweep gives its runs)."""
    parts = name.split("_")
    if len(parts) != 3:
        return {"model": name, "rate": None, "scope": "all"}
    model, rate, scope = parts
    try:
        r: Optional[float] = float(rate)
    except ValueError:
        r = None
    return {"model": model, "rate": r, "scope": scope}


def read_run(run: Path) -> Optional[Dict[str, Any]]:
    log = run / "train.jsonl"
    if not log.is_file():
        return None
    start, end, steps = {}, {}, []
    for line in log.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("event") == "start":
            start = rec
        elif rec.get("event") == "end":
            end = rec
        elif rec.get("event") == "step":
            steps.append(rec)
    info = {"name": run.name, **parse_name(run.name), "start": start, "end": end, "steps": steps,
            "complete": bool(end), "ops": {}, "bursts": {}}
    stats_dir = run / "stats"
    if stats_dir.is_dir():
        rows = nccl_lossy.read_stats(stats_dir)
        for s in nccl_lossy.summarize(rows, by=("op",)):
            info["ops"][s["op"]] = {"packets": s["packets"], "lost_packets": s["lost_packets"]}
        for s in nccl_lossy.summarize(nccl_lossy.read_stats(stats_dir, table="bursts"), by=("burst_length",)):
            info["bursts"][int(s["burst_length"])] = s["count"]
    return info


def read_sweep(sweep: Path) -> List[Dict[str, Any]]:
    runs = [read_run(d) for d in sorted(sweep.iterdir()) if d.is_dir()]
    runs = [r for r in runs if r is not None]
    order = {"none": 0, "socket": 1, "uniform": 2, "ge8": 3}
    runs.sort(key=lambda r: (SCOPES.index(r["scope"]) if r["scope"] in SCOPES else 9,
                             order.get(r["model"], 9), r["rate"] or 0))
    return runs


def fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def table(runs: List[Dict[str, Any]]) -> List[str]:
    base = next((r for r in runs if r["model"] == "none"), None)
    base_tps = base["end"].get("tokens_per_s") if base and base["end"] else None
    lines = [
        "| run | model | loss rate | scope | steps | final loss | mean loss, last 10 | tokens/s | vs lossless | "
        + " | ".join(f"{op} lost / packets" for op in OPS) + " | all ops lost / packets |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|" + "---:|" * (len(OPS) + 1),
    ]
    for r in runs:
        end = r["end"]
        tps = end.get("tokens_per_s") if end else None
        cells = [
            r["name"], r["model"], fmt(r["rate"], "g"), r["scope"], str(len(r["steps"])),
            fmt(end.get("final_loss") if end else None, ".4f"),
            fmt(end.get("mean_loss_last10") if end else None, ".4f"),
            fmt(tps, ".0f"),
            fmt(tps / base_tps if tps and base_tps else None, ".3f"),
        ]
        for op in OPS:
            c = r["ops"].get(op)
            cells.append(f"{c['lost_packets']} / {c['packets']}" if c and c["packets"] else "-")
        lost = sum(c["lost_packets"] for c in r["ops"].values())
        sent = sum(c["packets"] for c in r["ops"].values())
        cells.append(f"{lost} / {sent}" if sent else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plots(runs: List[Dict[str, Any]], out: Path) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    written = []
    scopes = [s for s in SCOPES if any(r["scope"] == s for r in runs)]
    fig, axes = plt.subplots(1, len(scopes), figsize=(5 * len(scopes), 4), squeeze=False, sharey=True)
    for ax, scope in zip(axes[0], scopes):
        for r in runs:
            if r["scope"] != scope and r["model"] not in ("none", "socket"):
                continue
            xs = [s["step"] for s in r["steps"] if s.get("loss") is not None]
            ys = [s["loss"] for s in r["steps"] if s.get("loss") is not None]
            style = "k-" if r["model"] == "none" else ("k:" if r["model"] == "socket" else "-")
            ax.plot(xs, ys, style, label=r["name"], linewidth=1)
        ax.set_title(f"loss on: {scope}")
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("training loss")
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)
    written.append("loss_curves.png")
    lossy = [r for r in runs if r["bursts"]]
    if lossy:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in lossy:
            xs = sorted(r["bursts"])
            total = sum(r["bursts"].values())
            ax.plot(xs, [r["bursts"][x] / total for x in xs], marker=".", linewidth=1, label=r["name"])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("burst length (packets)")
        ax.set_ylabel("fraction of bursts")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "bursts.png", dpi=120)
        plt.close(fig)
        written.append("bursts.png")
    return written


def build(sweep: Path, md: Path, plots_dir: Path) -> str:
    runs = read_sweep(sweep)
    if not runs:
        raise SystemExit(f"no runs (*/train.jsonl) under {sweep}")
    head = next((r["start"] for r in runs if r["start"]), {})
    lines = ["# Megatron-core GPT under packet loss", ""]
    lines.append(
        f"megatron-core GPT, {head.get('layers')} layers, hidden {head.get('hidden')}, {head.get('heads')} heads, "
        f"sequence {head.get('seq')}, micro-batch {head.get('micro_batch')}, tensor-parallel {head.get('world')} "
        f"(sequence parallel: {head.get('sequence_parallel')}), {head.get('steps')} steps, data: {head.get('data')}; "
        f"torch {head.get('torch')}, NCCL {head.get('nccl')}{', CPU/gloo dry run' if head.get('cpu') else ''}. "
        "Lost packets arrive as zeros; packet counts are the senders', both ranks summed. "
        f"Generated by `examples/megatron_results.py` from `{sweep.name}`."
    )
    lines.append("")
    lines += table(runs)
    lines.append("")
    incomplete = [r["name"] for r in runs if not r["complete"]]
    if incomplete:
        lines.append(f"Incomplete runs (no end record): {', '.join(incomplete)}.")
        lines.append("")
    written = plots(runs, plots_dir)
    rel = os.path.relpath(plots_dir, md.parent)
    if written:
        for name in written:
            lines.append(f"![{name}]({rel}/{name})")
            lines.append("")
    else:
        lines.append("(Plots need matplotlib, which is not installed here.)")
        lines.append("")
    text = "\n".join(lines)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    (plots_dir if written else md.parent).mkdir(parents=True, exist_ok=True)
    summary = [{k: r[k] for k in ("name", "model", "rate", "scope", "end", "ops")} for r in runs]
    (md.with_suffix(".json")).write_text(json.dumps(summary, indent=1))
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="tables and plots from a megatron sweep")
    p.add_argument("sweep", type=Path)
    p.add_argument("--md", type=Path, default=Path("docs/RESULTS.md"))
    p.add_argument("--plots", type=Path, default=None, help="default: results/ beside --md")
    a = p.parse_args(argv)
    text = build(a.sweep, a.md, a.plots or a.md.parent / "results")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
