"""The multi-GPU TP scripts (tests/gpu/tp_multi.py, tests/gpu/tp_multiprocess.py) dry-run on CPU.

Both scripts run on the H200 machines of several GPUs (tests/gpu/h200x_tp.sh); here they run end
to end at the tiny shape (D=64, V_pad=1024) with the reference backend, so that they cannot rot:
tp_multi.py on 8 host CPU devices (TP 1, 2, 4, 8, TP2xDP2, TP4xDP2; forward bytes, the timed
pieces of a TP call, gradients) and tp_multiprocess.py with two JAX processes of one CPU device
each (both weight layouts). The two subprocesses start together and overlap; each asserts on the
JSON its script writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPU_DIR = os.path.join(HERE, "gpu")
TIMEOUT = 600

# The slow tier: the sweeps over TP degrees and meshes (a two-device TP run is tests/test_tp_fast.py).
pytestmark = pytest.mark.slow


def _env(n_devices):
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={n_devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    for k in list(env):
        if k.startswith("TPM_"):  # the scripts' defaults come from these
            del env[k]
    return env


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_scripts")
    runs = {
        "tp_multi": [
            os.path.join(GPU_DIR, "tp_multi.py"),
            "--backend=reference",
            "--shape=tiny",
            "--layouts=vd",
            "--m=64",
            "--grad_m=64",
            "--pieces_m=64",
            "--tp=1,2,4,8",
            "--tp_dp=2x2,4x2",
            "--mode=all",
            "--iters=1",
            "--warmup=1",
            "--time_budget_s=0.2",
            "--compile_workers=1",
            f"--out={tmp / 'tp_multi.json'}",
        ],
        "tp_multiprocess": [
            os.path.join(GPU_DIR, "tp_multiprocess.py"),
            "--n=2",
            "--platform=cpu",
            "--backend=reference",
            "--shape=tiny",
            "--layouts=vd,dv",
            "--m=64",
            "--iters=2",
            "--timeout_s=300",
            f"--workdir={tmp / 'mp'}",
            f"--out={tmp / 'tp_multiprocess.json'}",
        ],
    }
    procs = {}
    for name, cmd in runs.items():
        log = open(tmp / f"{name}.log", "w")
        n_dev = 8 if name == "tp_multi" else 1
        procs[name] = (
            subprocess.Popen([sys.executable] + cmd, env=_env(n_dev), stdout=log, stderr=subprocess.STDOUT),
            log,
        )
    out = {}
    for name, (p, log) in procs.items():
        try:
            p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        text = open(log.name).read()
        path = tmp / f"{name}.json"
        out[name] = (p.returncode, json.load(open(path)) if path.exists() else None, text)
    return out


def _get(dry_runs, name):
    rc, doc, text = dry_runs[name]
    assert doc is not None, f"{name} wrote no JSON (rc={rc}):\n{text[-6000:]}"
    assert rc == 0, f"{name} exited {rc}:\n{text[-6000:]}"
    return doc


def test_tp_multi_dry_run_bytes_every_mesh(dry_runs):
    doc = _get(dry_runs, "tp_multi")
    assert doc["pass"] and doc["complete"], doc["skipped"]
    fwd = [r for r in doc["rows"] if r["kind"] == "fwd"]
    assert {r["config"] for r in fwd} == {"tp1", "tp2", "tp4", "tp8", "tp2xdp2", "tp4xdp2"}
    assert doc["entropy"] is True  # the reference backend declares it: every forward compares its bytes too
    for r in fwd:
        assert r["status"] == "ok", r
        assert r["logp_rows_differ"] == 0 and r["lse_rows_differ"] == 0 and r["entropy_rows_differ"] == 0, r
        assert r["max_abs_diff"] == 0.0 and r["backend"] == "reference" and not r["fallback"], r
        assert r["ms"]["median"] > 0 and r["efficiency"] > 0, r
    assert [r["kind"] for r in doc["rows"]].count("ref") == 1  # the single-device reference, computed once


def test_tp_multi_dry_run_pieces_chain_to_the_same_bytes(dry_runs):
    doc = _get(dry_runs, "tp_multi")
    pieces = {r["config"]: r for r in doc["rows"] if r["kind"] == "pieces"}
    assert set(pieces) == {"tp1", "tp2", "tp4", "tp8"}
    for r in pieces.values():
        assert r["status"] == "ok" and r["pieces_rows_differ"] == 0, r
        assert all(r[k]["median"] > 0 for k in ("local_ms", "gather_ms", "fold_ms")), r


def test_tp_multi_dry_run_gradients_within_tolerance(dry_runs):
    doc = _get(dry_runs, "tp_multi")
    grads = [r for r in doc["rows"] if r["kind"] == "fwd_bwd"]
    assert {r["config"] for r in grads} == {"tp1", "tp2", "tp4", "tp8", "tp2xdp2", "tp4xdp2"}
    for r in grads:
        assert r["status"] == "ok" and r["repeat_bitwise"] and r["within_tol"], r
        assert r["tol_kind"] == "rel_fro" and r["tol"] == 1e-2  # bf16 operands
        for g in ("dhidden", "dweight"):
            assert np.isfinite(r[g]["rel_fro"]) and r[g]["rel_fro"] < 1e-2, (r["config"], g, r[g])
    tp1 = next(r for r in grads if r["config"] == "tp1")
    assert tp1["dhidden"]["bitwise_equal_single"] and tp1["dweight"]["bitwise_equal_single"]


def test_multiprocess_dry_run_two_processes(dry_runs):
    doc = _get(dry_runs, "tp_multiprocess")
    assert doc["pass"] and doc["n_processes"] == 2 and doc["platform"] == "cpu"
    assert {(r["layout"], r["m"]) for r in doc["rows"]} == {("vd", 64), ("dv", 64)}
    assert doc["entropy"] is True  # the reference backend declares it: the entropy's bytes are compared too
    for r in doc["rows"]:
        assert r["logp_rows_differ"] == 0 and r["lse_rows_differ"] == 0 and r["shard_list_rows_differ"] == 0, r
        assert r["entropy_rows_differ"] == 0, r
        assert r["backend"] == "reference" and len(r["ms_all_processes"]) == 2
    assert sorted(rep["rank"] for rep in doc["reports"]) == [0, 1]


def test_per_rank_weight_shards_are_slices_of_the_weight():
    """The multi-process workers generate only their own shard: it must be the reference's rows."""
    sys.path.insert(0, GPU_DIR)
    try:
        import tp_multi as T
    finally:
        sys.path.remove(GPU_DIR)
    from benchmarks.shapes import get

    shape = get("tiny")
    w = T.weight_rows(shape, 0, T.N_BLOCKS, "float32")
    assert w.shape == (shape.v_rows, shape.d)
    for tp in (1, 2, 4, 8):
        rows = shape.v_rows // tp
        for r in range(tp):
            np.testing.assert_array_equal(T.weight_shard(shape, "vd", tp, r, "float32"), w[r * rows : (r + 1) * rows])
            np.testing.assert_array_equal(T.weight_shard(shape, "dv", tp, r, "float32"), w[r * rows : (r + 1) * rows].T)
    edges = T.edge_targets(get("qwen3_8b"))
    assert {0, 76031, 76032, 151935, -100} <= set(edges)
    assert all(k * 19008 - 1 in edges and k * 19008 in edges for k in range(1, 8))  # every TP-8 shard edge
    t = T.targets_host(shape, 64)
    assert t[: len(T.edge_targets(shape))].tolist() == T.edge_targets(shape)
