"""megatron-core's tensor-parallel mappings, patched, in a real 2-process gloo group on CPU."""

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from conftest import run_ranks  # noqa: E402

WORKER = Path(__file__).resolve().parent / "gloo_worker.py"


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(WORKER, 2)


def test_patch_is_in_place_in_the_workers(ranks):
    """Every target this megatron-core has is applied or already in place in each worker (not
    "some patch applied"); only names this version lacks are missing."""
    import importlib

    from nccl_lossy.megatron import patch_targets

    present = {(m, a) for m, a in patch_targets() if hasattr(importlib.import_module(m), a)}
    for out in ranks:
        assert out["bound"] == "_all_gather_base"
        statuses = {(m, a): s for m, a, s in out["patch"]}
        assert list(statuses) == patch_targets()
        for key, status in statuses.items():
            if key in present:
                assert status in ("applied", "already in place"), (key, status)
            else:
                assert status == "missing", (key, status)
        assert sum(s == "applied" for s in statuses.values()) >= 10  # the collective bindings


def test_all_gather_along_last_dim(ranks):
    x = [[[0.0 + 100 * r, 1.0 + 100 * r], [2.0 + 100 * r, 3.0 + 100 * r], [4.0 + 100 * r, 5.0 + 100 * r]] for r in range(2)]
    want = [a + b for a, b in zip(x[0], x[1])]
    for out in ranks:
        r = out["gather_last"]
        assert r["value"] == want
        assert any("_all_gather_base" in w for w in r["warnings"])  # the _base function ran


def test_all_gather_along_first_dim(ranks):
    want = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [100.0, 101.0], [102.0, 103.0], [104.0, 105.0]]
    for out in ranks:
        r = out["gather_first"]
        assert r["value"] == want
        assert any("_all_gather_base" in w for w in r["warnings"])


def test_reduce_scatter_along_first_dim(ranks):
    # Rank r contributes arange(8).reshape(4, 2) * (r + 1); the sum is 3x; rank r keeps rows 2r, 2r+1.
    full = [[3.0 * (2 * i), 3.0 * (2 * i + 1)] for i in range(4)]
    for out in ranks:
        r = out["reduce_scatter_first"]
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
