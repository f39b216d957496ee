"""CPU dry runs of the GPU-session tools: bench/gpu/nccl_bench.py (input design, loss
accounting, report) and the megatron-core example, sweep results and their page.

The GPU parts themselves (NCCL, the plugin on a real data path) need a GPU machine; here the
same code runs over gloo, and the accounting is checked against a simulated two-rank ring."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import clean_env  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "gpu" / "nccl_bench.py"
EXAMPLE = REPO / "examples" / "megatron_gpt_lossy.py"
RESULTS = REPO / "examples" / "megatron_results.py"


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = load(BENCH, "nccl_bench")


def test_sizes_and_iterations():
    assert bench.parse_sizes("1M:1G") == [1 << k for k in range(20, 31)]
    assert bench.parse_sizes("64K,1M") == [65536, 1 << 20]
    assert bench.iterations(1 << 20, 512 << 20) == 20
    assert bench.iterations(1 << 30, 512 << 20) == 3
    assert bench.fmt_size(256 << 20) == "256 MiB"


@pytest.mark.parametrize("coll", bench.COLLECTIVES)
def test_inputs_never_zero_and_expected_is_exact(coll):
    n = 1 << 14
    for rank in range(2):
        x, out, expected = bench.buffers(torch, coll, n, rank, 2, "cpu")
        assert bool((x != 0).all()) and bool((expected != 0).all())
        # the fp32 two-rank sum equals the exact (float64) one: any order gives the same bits
        if coll != "allgather":
            parts = [bench.buffers(torch, coll, n, r, 2, "cpu")[0].double() for r in range(2)]
            exact = parts[0] + parts[1]
            if coll == "reducescatter":
                exact = exact[rank * n // 2:(rank + 1) * n // 2]
            assert torch.equal(expected.double(), exact)


def zero_packets(t, p, gen, per_packet=1024):
    """Zeroes whole packets of ``t`` with probability ``p``; returns (lost, packets)."""
    packets = t.numel() // per_packet
    lost = torch.rand(packets, generator=gen) < p
    t.view(packets, per_packet)[lost] = 0
    return int(lost.sum()), packets


def test_allgather_and_reducescatter_accounting_on_a_simulated_ring():
    gen = torch.Generator().manual_seed(1)
    p, n = 0.02, 1 << 22
    # all-gather, rank 1's view: its own chunk is local, rank 0's crossed once.
    x0, out, expected = bench.buffers(torch, "allgather", n, 1, 2, "cpu")
    out.copy_(expected)
    lost, packets = zero_packets(out[: n // 2], p, gen)
    d = bench.count_damage(torch, out, expected)
    assert d["wrong"] == d["zero"] == lost * 1024
    pred = bench.predicted_wrong("allgather", bench.received_elements("allgather", n, 2), lost / packets)
    assert d["wrong"] == pytest.approx(pred, rel=1e-9)
    # reduce-scatter: a lost packet leaves only the local contribution (never zero).
    x, out, expected = bench.buffers(torch, "reducescatter", n, 0, 2, "cpu")
    remote = bench.buffers(torch, "reducescatter", n, 1, 2, "cpu")[0][: n // 2].clone()
    lost, packets = zero_packets(remote, p, gen)
    out.copy_(x[: n // 2] + remote)
    d = bench.count_damage(torch, out, expected)
    assert d["zero"] == 0 and d["wrong"] == lost * 1024
    assert d["wrong"] == pytest.approx(bench.predicted_wrong("reducescatter", n // 2, lost / packets), rel=1e-9)


def test_allreduce_amplification_on_a_simulated_ring():
    """Two-rank ring all-reduce with zeroed packets on both crossings: the wrong fraction of
    outputs follows (3p - p^2)/2 of the per-crossing packet loss, as predicted_wrong says."""
    gen = torch.Generator().manual_seed(2)
    p, n = 0.02, 1 << 22
    xs = [bench.buffers(torch, "allreduce", n, r, 2, "cpu")[0] for r in range(2)]
    expected = xs[0] + xs[1]
    outs = [torch.empty(n), torch.empty(n)]
    lost_all = packets_all = 0
    half = n // 2
    for owner in range(2):  # chunk `owner` is reduced on rank `owner`
        other = 1 - owner
        sl = slice(owner * half, (owner + 1) * half)
        incoming = xs[other][sl].clone()  # crossing 1: other -> owner
        lost, packets = zero_packets(incoming, p, gen)
        lost_all, packets_all = lost_all + lost, packets_all + packets
        outs[owner][sl] = xs[owner][sl] + incoming
        back = outs[owner][sl].clone()  # crossing 2: owner -> other, the sum
        lost, packets = zero_packets(back, p, gen)
        lost_all, packets_all = lost_all + lost, packets_all + packets
        outs[other][sl] = back
    wrong = sum(bench.count_damage(torch, o, expected)["wrong"] for o in outs)
    pred = bench.predicted_wrong("allreduce", 2 * n, lost_all / packets_all)
    assert wrong == pytest.approx(pred, rel=0.05)
    assert wrong / (lost_all * 1024) == pytest.approx(1.5, rel=0.05)  # the amplification


def fake_rank(raw, name, rank, busbw_time, hashes, wrong=0, sent=None):
    rows = []
    for coll in bench.COLLECTIVES:
        size = 256 << 20
        rows.append({"coll": coll, "size": size, "rank": rank, "iters": 3, "time_s": busbw_time,
                     "hash": hashes, "received": size // 4 // (1 if coll == "allreduce" else 2),
                     "wrong": wrong, "zero": wrong, "elements": size // 4, "sent": sent, "sent_all_ops": sent})
    doc = {"rank": rank, "world": 2, "torch": "t", "nccl": "n", "device": "d", "env": {}, "results": rows}
    (raw / f"{name}.rank{rank}.json").write_text(json.dumps(doc))


def test_report_ratios_goals_and_accounting(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for r in range(2):
        fake_rank(raw, "socket", r, 1.0, f"h{r}")
        fake_rank(raw, "lossless", r, 0.25, f"h{r}")
        fake_rank(raw, "uniform-1pct", r, 0.26, f"bad{r}", wrong=1024 * 10,
                  sent={"messages": 1, "bytes": 0, "packets": 65536, "lost_packets": 640, "loss_events": 600})
    summary = bench.write_report(tmp_path)
    goals = {g["goal"]: g for g in summary["goals"]}
    assert goals["allreduce 256 MiB: (b) >= 2.5x (a)"]["value"] == pytest.approx(4.0)
    assert goals["allreduce 256 MiB: (b) >= 2.5x (a)"]["met"]
    within = goals["allreduce 256 MiB: (c) plugin 1% uniform, zero within 5% of (b)"]
    assert within["value"] == pytest.approx(0.25 / 0.26, abs=1e-3) and within["met"]
    assert goals["(b) plugin lossless: every output bit-identical to (a)"]["met"] is True
    checks = {(c["config"], c["coll"]): c for c in summary["checks"]}
    assert checks[("lossless", "allgather")]["same_as_baseline"] == "yes"
    assert checks[("uniform-1pct", "allgather")]["same_as_baseline"] == "no"
    c = checks[("uniform-1pct", "allgather")]  # two ranks: 2 x 1280 lost of 2 x 65536 packets
    assert c["loss_fraction"] == pytest.approx(1280 / 131072)
    assert c["predicted_wrong"] == pytest.approx(2 * (64 << 20) / 2 * 1280 / 131072)
    md = (tmp_path / "results.md").read_text()
    assert "| 256 MiB |" in md and "(4.00x)" in md
    assert json.loads((tmp_path / "results.json").read_text())["ratios"]["lossless"]["allreduce"]


def run_env(tmp_path, lib_path):
    return clean_env(PYTHONPATH=str(REPO / "python" / "src"), NCCL_LOSSY_LIBRARY=lib_path)


def test_bench_dry_run_on_gloo(tmp_path, lib_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "run", "--cpu", "--configs", "socket,lossless,uniform-1pct",
         "--sizes", "64K,256K", "--budget", "1M", "--warmup", "1", "--out", str(out)],
        env=run_env(tmp_path, lib_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res["configs"]) == {"socket", "lossless", "uniform-1pct"}
    rows = res["configs"]["lossless"]["rows"]
    assert {(r["coll"], r["size"]) for r in rows} == {(c, s) for c in bench.COLLECTIVES for s in (65536, 262144)}
    assert all(r["wrong"] == 0 and r["busbw_GBps"] > 0 for r in rows)
    # gloo carries no plugin traffic: every configuration's output equals (a)'s, bit for bit
    assert all(c["same_as_baseline"] in ("yes", "-") for c in res["checks"])
    # plugin configurations got their own environment: NCCL_NET=lossy, a stats directory
    env = res["configs"]["uniform-1pct"]["env_rank0"]
    assert env["NCCL_NET"] == "lossy" and env["NCCL_PROTO"] == "Simple"
    assert env["NCCL_LOSSY_STATS"].endswith("stats/uniform-1pct")
    assert res["configs"]["socket"]["env_rank0"]["NCCL_NET"] == "Socket"
    assert res["configs"]["socket"]["env_rank0"]["NCCL_HOSTID"] == "fakehost0"


def check_patch_report(end):
    """Every patch target this megatron-core has was applied or already in place; only names
    this version lacks are missing (never a module that failed, never "1 of N applied")."""
    import importlib

    from nccl_lossy.megatron import patch_targets

    counts = end["megatron_patch"]
    assert counts["kept"] == 0
    assert sum(counts.values()) == len(patch_targets())
    present = [(m, a) for m, a in patch_targets() if hasattr(importlib.import_module(m), a)]
    assert counts["applied"] + counts["already in place"] == len(present)
    assert counts["applied"] >= 10  # at least the ten collective bindings change on a CPU install
    assert end["megatron_patch_missing"] == [f"{m}.{a}" for m, a in patch_targets() if (m, a) not in present]


def test_megatron_example_tp2_dp2_on_cpu_and_results_page(tmp_path, lib_path):
    """Four ranks, tensor-parallel 2 x data-parallel 2, with the seed script's flags, then the
    sweep's results page."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "sweep" / "uniform_0.01_all"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--cpu", "--steps", "2", "--setting", run.name, "--nproc", "4",
         "--tensor-model-parallel-size", "2", "--no-loss-on-forward",
         "--profile", str(REPO / "configs" / "uniform-1pct.toml"), "--set", "model.rate=0.01",
         "--log", str(run / "train.jsonl"), "--stats", str(run / "stats")],
        env=run_env(tmp_path, lib_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in (run / "train.jsonl").read_text().splitlines()]
    head = recs[0]
    assert head["event"] == "start" and head["sequence_parallel"]
    assert (head["world"], head["tensor_parallel"], head["data_parallel"]) == (4, 2, 2)
    assert head["loss_on"] == "backward"
    assert head["optimizer"] == ["AdamW"]  # megatron-core's get_megatron_optimizer, decoupled
    steps = [r for r in recs if r["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(4.0 < s["loss"] < 6.5 and s["tokens_per_s"] > 0 for s in steps)  # ~ln(256) at start
    assert all(s["update_ok"] and s["grad_norm"] > 0 for s in steps)  # clip_grads computed the norm
    end = recs[-1]
    assert end["event"] == "end" and end["integration_step"] == 2  # optimizer hook advanced steps
    check_patch_report(end)
    md = tmp_path / "page" / "RESULTS.md"
    proc = subprocess.run([sys.executable, str(RESULTS), str(tmp_path / "sweep"), "--md", str(md)],
                          env=run_env(tmp_path, lib_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = md.read_text()
    assert "| uniform_0.01_all | uniform | 0.01 | all | 2 |" in text
    assert "CPU/gloo dry run" in text


def test_megatron_example_flags_build_the_integration(tmp_path):
    example = load(EXAMPLE, "megatron_gpt_lossy")
    args = example.parse_args(["--loss-rate", "0.01", "--burst-length", "8", "--no-loss-on-forward",
                               "--effect", "zero", "--stats", str(tmp_path)])
    integ = example.integration(args)
    assert (integ.enable_on_forward, integ.enable_on_backward) == (False, True)
    summary = integ.network.check()["summary"]
    assert "default: gilbert_elliott(" in summary and "mean burst 8" in summary and "effect zero" in summary
    assert integ.network.stats_dir == tmp_path.resolve()
    args = example.parse_args(["--no-loss-on-backward"])
    assert (args.loss_on_forward, args.loss_on_backward) == (True, False)
    from nccl_lossy import LossyConfigError

    with pytest.raises(LossyConfigError, match="loss_rate=1.5"):
        example.integration(example.parse_args(["--loss-rate", "1.5"]))


def test_megatron_example_refuses_a_set_without_a_value(capsys):
    # "--set foo" used to pass the command line and fail later with a bare unpacking error.
    example = load(EXAMPLE, "megatron_gpt_lossy")
    for bad in ("foo", "=x"):
        with pytest.raises(SystemExit) as exit_:
            example.parse_args(["--set", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--set" in err and "KEY=VALUE" in err and repr(bad) in err, err
    assert example.parse_args(["--set", "model.rate=0.02"]).set == ["model.rate=0.02"]


CHECKS = REPO / "bench" / "gpu" / "nccl_checks.py"


def test_nccl_checks_dry_run_on_gloo(tmp_path, lib_path):
    # gloo carries no plugin traffic, so this exercises the checks' data conditions (an
    # all-gather-only rule must leave all-reduce and reduce-scatter exact, the local part of the
    # all-gather must be the input) and the report, not the plugin.
    out = tmp_path / "checks"
    proc = subprocess.run(
        [sys.executable, str(CHECKS), "--cpu", "--only", "isolation,forced-ll", "--out", str(out)],
        env=run_env(tmp_path, lib_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads((out / "checks.json").read_text())}
    assert rows["isolation"]["passed"] is True and rows["isolation"]["exit_codes"] == [0, 0]
    assert rows["isolation"]["ranks"][0]["allgather_received_zero_fraction"] == 0.0
    assert rows["forced-ll"]["passed"] is None  # needs NCCL
    assert "| isolation | pass |" in (out / "checks.md").read_text()
    # the forced-LL check hands the plugin a zero profile with NCCL_PROTO=LL
    assert 'effect = "zero"' in (out / "forced-ll.toml").read_text()


def test_checks_count_growth_per_op_across_connections():
    sys.path.insert(0, str(CHECKS.parent))  # nccl_checks imports nccl_bench by name
    checks = load(CHECKS, "nccl_checks")

    def doc(*conns):
        return {"connections": [{"by_op": [{"op": op, "messages": m, "lost_packets": lost} for op, m, lost in c]}
                                for c in conns]}

    before = doc([("AllReduce", 4, 1)], [("AllReduce", 2, 0), ("AllGather", 1, 0)])
    after = doc([("AllReduce", 4, 1), ("SendRecv", 3, 0)], [("AllReduce", 5, 2), ("AllGather", 1, 0)])
    assert checks.grown_by_op(after, before, "messages") == {"AllReduce": 3, "SendRecv": 3}
    assert checks.grown_by_op(after, before, "lost_packets") == {"AllReduce": 2}
    assert checks.grown_by_op(after, None, "messages") == {"AllGather": 1, "AllReduce": 9, "SendRecv": 3}


def test_attribution_expects_nothing_from_a_rank_that_only_receives():
    # Run on NCCL 2.28.9 (two ranks on one GPU), the check failed "rank 1: Broadcast alone:
    # the plugin saw {}": the counts are the sender's, and a broadcast from rank 0 over two
    # ranks has rank 1 only receive. Every other kind must show on every rank, alone.
    sys.path.insert(0, str(CHECKS.parent))  # nccl_checks imports nccl_bench by name
    checks = load(CHECKS, "nccl_checks")
    fail = checks.attribution_failure
    assert fail("Broadcast", {}, 1, 2) is None
    assert fail("Broadcast", {"Broadcast": 8}, 0, 2) is None
    assert fail("Broadcast", {}, 0, 2) is not None
    assert fail("Broadcast", {"Broadcast": 8}, 1, 2) is not None
    assert fail("AllReduce", {}, 1, 2) is not None
    assert fail("AllReduce", {"AllReduce": 8, "AllGather": 1}, 0, 2) is not None
    assert fail("SendRecv", {"Send": 32}, 1, 2) is None
