"""megatron-core's tensor-parallel mappings, patched, in a real 2-process gloo group on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from conftest import clean_env, free_port  # noqa: E402

WORKER = Path(__file__).resolve().parent / "gloo_worker.py"


@pytest.fixture(scope="module")
def ranks():
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=clean_env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(outs, key=lambda o: o["rank"])


def result(out, name):
    r = out[name]
    if "error" in r:
        pytest.skip(f"gloo cannot run {name}: {r['error']}")
    return r


def test_patch_is_in_place_in_the_workers(ranks):
    for out in ranks:
        assert out["bound"] == "_all_gather_base" and out["patched"] > 0


def test_all_gather_along_last_dim(ranks):
    x = [[[0.0 + 100 * r, 1.0 + 100 * r], [2.0 + 100 * r, 3.0 + 100 * r], [4.0 + 100 * r, 5.0 + 100 * r]] for r in range(2)]
    want = [a + b for a, b in zip(x[0], x[1])]
    for out in ranks:
        r = result(out, "gather_last")
        assert r["value"] == want
        assert any("_all_gather_base" in w for w in r["warnings"])  # the _base function ran


def test_all_gather_along_first_dim(ranks):
    want = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [100.0, 101.0], [102.0, 103.0], [104.0, 105.0]]
    for out in ranks:
        r = result(out, "gather_first")
        assert r["value"] == want
        assert any("_all_gather_base" in w for w in r["warnings"])


def test_reduce_scatter_along_first_dim(ranks):
    # Rank r contributes arange(8).reshape(4, 2) * (r + 1); the sum is 3x; rank r keeps rows 2r, 2r+1.
    full = [[3.0 * (2 * i), 3.0 * (2 * i + 1)] for i in range(4)]
    for out in ranks:
        r = result(out, "reduce_scatter_first")
        assert r["value"] == full[2 * out["rank"] : 2 * out["rank"] + 2]
        assert any("_reduce_scatter_base" in w for w in r["warnings"])


def test_phase_hooks_mark_forward_backward_and_steps(ranks):
    for out in ranks:
        # (what ran, the phase the plugin had been told) for two training steps
        assert out["seen"] == [["forward", "forward"], ["backward", "backward"]] * 2
        # enable_on_forward=False: no injection while forward runs, injection in backward.
        assert out["injecting"] == [["forward", False], ["backward", True]] * 2
        assert out["after_steps"] == {"step": 2, "phase": "any"}
        assert out["after_exit"] == {"enabled": False, "phase": "any"}
