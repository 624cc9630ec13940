"""Tensor/context parallelism (`sharding/`): bitwise TP invariance on 8 host CPU devices.

The multi-device checks need XLA_FLAGS=--xla_force_host_platform_device_count=8
before JAX starts, so they run in subprocesses (`tests/sharding_cases.py`),
launched together on first use so that they overlap; the tests here assert on
the JSON they write. Validation errors are checked in-process.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = os.path.join(HERE, "sharding_cases.py")
TIMEOUT = 1500

# The slow tier: the sweeps over TP degrees and meshes (a two-device TP run is tests/test_tp_fast.py).
pytestmark = pytest.mark.slow

_RUNS: dict = {}


def _env(n_devices: int | None):
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if n_devices:
        flags.append(f"--xla_force_host_platform_device_count={n_devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_all():
    """Starts every subprocess once (they overlap on the 2 CI cores)."""
    if _RUNS:
        return
    tmp = tempfile.mkdtemp(prefix="detlogp_tp_")
    _RUNS["tmp"] = tmp
    atexit.register(_cleanup)
    for suite in ("qwen", "other"):
        out = os.path.join(tmp, f"{suite}.json")
        log = open(os.path.join(tmp, f"{suite}.log"), "w")
        p = subprocess.Popen(
            [sys.executable, CASES, "suite", suite, out], env=_env(8), stdout=log, stderr=subprocess.STDOUT
        )
        _RUNS[suite] = (p, out, log.name)
    _RUNS["mp"] = _launch_mp(tmp)


def _cleanup():
    procs = [v[0] for k, v in _RUNS.items() if k in ("qwen", "other")]
    procs += [p for p, _ in _RUNS.get("mp", ([], None))[0]]
    for p in procs:
        if p.poll() is None:
            p.kill()
    shutil.rmtree(_RUNS.get("tmp", ""), ignore_errors=True)


def _launch_mp(tmp):
    mp_dir = os.path.join(tmp, "mp")
    os.makedirs(mp_dir, exist_ok=True)
    port = _free_port()
    procs = []
    for pid in (0, 1):
        log = open(os.path.join(mp_dir, f"worker{pid}.log"), "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, CASES, "mp-worker", str(pid), str(port), mp_dir],
                    env=_env(1),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log.name,
            )
        )
    return procs, mp_dir


def _suite(name):
    _launch_all()
    p, out, log = _RUNS[name]
    try:
        p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"sharding suite {name} timed out; log: {open(log).read()[-4000:]}")
    assert p.returncode == 0 and os.path.exists(out), f"suite {name} crashed:\n{open(log).read()[-6000:]}"
    res = json.load(open(out))
    assert res["ok"], res.get("error")
    assert res["n_devices"] == 8
    return res["result"]


@pytest.fixture(scope="module")
def qwen():
    return _suite("qwen")


@pytest.fixture(scope="module")
def other():
    return _suite("other")


def _assert_identical(r, what):
    assert r["logp_rows_differ"] == 0, f"{what}: logp bytes differ in {r['logp_rows_differ']} rows"
    assert r["lse_rows_differ"] == 0, f"{what}: lse bytes differ in {r['lse_rows_differ']} rows"
    if "entropy_rows_differ" in r:
        assert r["entropy_rows_differ"] == 0, f"{what}: entropy bytes differ in {r['entropy_rows_differ']} rows"
        assert r["entropy_nonnegative"], f"{what}: negative entropy"
    if "logits_rows_differ" in r:
        assert r["logits_rows_differ"] == 0, f"{what}: concatenated logits shards differ from single device"
        assert r["padded_logits_all_neginf"], f"{what}: padded logits columns are not -inf"


def _assert_sweep(res, expected_configs):
    assert set(res["configs"]) == {f"tp{t}_rows{r}" for t, r in expected_configs}
    assert all("entropy_rows_differ" in r for r in res["configs"].values())  # the entropy is swept too
    sem_ref = res["ref_semantics"]
    assert sem_ref["n_padded_target_rows"] >= 1 and sem_ref["n_ignore_rows"] >= 1
    for name, r in res["configs"].items():
        _assert_identical(r, f"{res['case']} {name}")
        sem = r["semantics"]
        assert sem["padded_target_rows_nan"], f"{name}: target in the padded range must give NaN logp (row-local)"
        assert sem["ignore_rows_zero"], f"{name}: ignore_index rows must give +0.0"
        assert sem["real_rows_finite"] and sem["lse_finite"], f"{name}: NaN leaked out of its row"


# --- multi-device (subprocess) ----------------------------------------------------------


def test_tp_rows_sweep_qwen_like_vocab(qwen):
    """TP in {1,2,4,8} x row shards in {1,2}: byte-identical to single-device reference."""
    _assert_sweep(qwen["invariance"], [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1)])


def test_tp_rows_sweep_llama_like_vocab(other):
    _assert_sweep(other["llama"], [(1, 2), (2, 1), (4, 2), (8, 1)])


def test_tp_full_size_vocab(other):
    """V_pad = 152064 (Qwen3 151936 real), D = 16, bf16, shard edges as targets."""
    assert other["full"]["vpad"] == 152064
    _assert_sweep(other["full"], [(8, 1), (2, 2)])


def test_padded_rows_garbage_changes_nothing(qwen):
    for name, r in qwen["dirty_padding"].items():
        _assert_identical(r, f"dirty padding {name}")


def test_weight_given_as_shard_list(qwen):
    _assert_identical(qwen["shard_list"], "per-rank shard list")


def test_return_logits_false_same_bytes(qwen):
    _assert_identical(qwen["no_logits"], "return_logits=False")


def test_return_entropy_false_same_bytes(qwen):
    r = qwen["no_entropy"]
    assert r["entropy_is_none"] and "entropy_rows_differ" not in r
    _assert_identical(r, "return_entropy=False")


def test_negative_control_naive_merge_is_not_tp_invariant(qwen):
    """psum/logaddexp of per-shard logsumexps changes bytes with TP; our gather + fold does not."""
    nc = qwen["negative_control"]
    assert nc["naive_rows_differ_tp1_vs_tp8"] >= 1, nc
    assert nc["ours_rows_differ_tp1_vs_tp8"] == 0, nc


def test_gradients_match_single_device(qwen):
    """logp/lse/logits cotangents at TP=4 x 2 row shards; the entropy and the per-row
    temperature (a mixed logp + lse + entropy loss) at TP=8 and TP=2 x 2."""
    assert {"tp4_rows2", "tp8_rows1_entropy_temperature", "tp2_rows2_entropy_temperature"} <= set(qwen["grads"])
    for cfg, grads in qwen["grads"].items():
        for name, g in grads.items():
            assert g["finite"], f"{cfg} d{name} not finite"
            assert g["repeat_bitwise"], f"{cfg} d{name} not deterministic run to run"
            tol = 1e-5 * max(1.0, g["scale"])
            assert g["max_abs_diff"] <= tol, f"{cfg} d{name}: {g['max_abs_diff']} > {tol}"


def test_local_api_inside_user_shard_map(other):
    r = other["local_api"]
    assert r["logp_rows_differ"] == 0, r
    tol = 1e-5 * max(1.0, r["scale"])
    assert r["dh_max_abs_diff"] <= tol and r["dw_max_abs_diff"] <= tol, r


def test_local_api_inside_vma_typed_shard_map(other):
    """check_vma=True (the default): forward bytes and gradients as with check_vma=False."""
    r = other["local_api_vma"]
    assert r["logp_rows_differ"] == 0 and r["partials_fold_rows_differ"] == 0, r
    assert r["partials_fold_entropy_rows_differ"] == 0 and r["local_entropy_rows_differ"] == 0, r
    tol = 1e-5 * max(1.0, r["scale"])
    assert r["dh_max_abs_diff"] <= tol and r["dw_max_abs_diff"] <= tol, r


def test_two_processes_tp2_match_single_process():
    """Two JAX processes on 127.0.0.1 (gloo CPU collectives), TP=2 across them."""
    _launch_all()
    procs, mp_dir = _RUNS["mp"]
    for p, log in procs:
        try:
            p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            pytest.fail(f"multi-process worker timed out:\n{open(log).read()[-4000:]}")
        assert p.returncode == 0, f"worker failed:\n{open(log).read()[-6000:]}"

    from sharding_cases import MP_CASE, make_case

    from detlogp_jax import linear_logp

    case = make_case(MP_CASE)
    ref = linear_logp(
        case["h"],
        case["w"],
        case["t"],
        bias=case["b"],
        temperature=case["temp"],
        vocab_size=case["vocab"],
        padded_vocab_size=case["vpad"],
        backend="reference",
    )
    for pid in (0, 1):
        for name, want in (("logp", ref.logp), ("lse", ref.lse)):
            got = np.load(os.path.join(mp_dir, f"{name}_{pid}.npy"))
            assert got.shape == np.shape(want)
            np.testing.assert_array_equal(
                got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32), err_msg=f"process {pid} {name}"
            )


# --- validation (in-process, trace-time errors; no compile) --------------------------------


def _abstract_mesh(**axes):
    from jax.sharding import AbstractMesh

    return AbstractMesh(tuple(axes.values()), tuple(axes))


def _inputs(vpad=5120, d=4, n=4, vocab=None):
    rng = np.random.default_rng(0)
    h = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal((vpad, d)).astype(np.float32)
    t = np.zeros(n, np.int32)
    return h, w, t


def test_canonical_padded_vocab_aligned_for_all_tp():
    from detlogp_jax import contract as C
    from sharding import check_tp_geometry

    assert C.TILE_V * C.TP_MAX == 512
    for vocab in (4736, 17664, 32000, 50257, 128256, 151936):
        vpad = C.canonical_padded_vocab(vocab)
        assert vpad % 512 == 0 and vpad - vocab < 512
        plan = C.split_bounds(vpad)
        assert set((1, 2, 4, 8)) <= set(plan.aligned_tp_degrees())
        for tp in (1, 2, 4, 8):
            shard = check_tp_geometry(vpad, tp, vocab)
            assert shard * tp == vpad
            edges = {s * C.TILE_V for s in plan.starts} | {vpad}
            assert all(r * shard in edges for r in range(tp + 1))
    assert C.canonical_padded_vocab(151936) == 152064 and C.canonical_padded_vocab(128256) == 128512


def test_error_vpad_not_divisible_by_tp():
    from sharding import check_tp_geometry, linear_logp_tp

    with pytest.raises(ValueError, match="not divisible"):
        check_tp_geometry(5120, 3, 4736)
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="not divisible"):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(tp=3), vocab_size=4736)


def test_error_shards_not_on_split_boundaries():
    from detlogp_jax.contract import ContractError
    from sharding import check_tp_geometry, linear_logp_tp

    # 4864 = 76 tiles: 4 groups; TP=8 shards of 608 columns cut tiles.
    with pytest.raises(ContractError, match="split"):
        check_tp_geometry(4864, 8, 4736)
    # 2048 = 32 tiles, 8 groups: TP=16 shards of 128 columns are tile- but not group-aligned.
    with pytest.raises(ContractError, match="aligned TP degrees"):
        check_tp_geometry(2048, 16)
    h, w, t = _inputs(vpad=4864)
    with pytest.raises(ContractError, match="canonical"):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(tp=8), vocab_size=4736)


def test_error_weight_rows_not_vpad():
    from sharding import linear_logp_tp

    h, w, t = _inputs(vpad=4736)
    with pytest.raises(ValueError, match="V_pad rows|padded_vocab_size"):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(tp=2), vocab_size=4736, padded_vocab_size=5120)


def test_error_mismatched_canonical_vocab_between_ranks():
    from detlogp_jax.contract import ContractError
    from sharding import assemble_shards

    shards = [np.zeros((640, 4), np.float32)] * 7 + [np.zeros((576, 4), np.float32)]
    with pytest.raises(ContractError, match="mismatched canonical vocab"):
        assemble_shards(shards, _abstract_mesh(tp=8), "tp")
    with pytest.raises(ValueError, match="shards for a TP degree"):
        assemble_shards(shards[:4], _abstract_mesh(tp=8), "tp")


def test_checked_mode_rejects_padded_range_targets():
    from sharding import linear_logp_tp

    h, w, t = _inputs()
    t[1] = 4800  # inside [vocab, V_pad): row-local NaN unchecked, an error when checked
    with pytest.raises(ValueError, match="outside"):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(tp=2), vocab_size=4736, checked=True)


def test_error_axes_and_overrides():
    from detlogp_jax.contract import ContractError
    from sharding import linear_logp_tp

    h, w, t = _inputs()
    with pytest.raises(ValueError, match="no axis"):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(dp=2), vocab_size=4736)
    with pytest.raises(ValueError, match="must not contain the TP axis"):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(dp=1, tp=2), row_axes=("tp",), vocab_size=4736)
    with pytest.raises(ContractError):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(tp=2), vocab_size=4736, tuning={"TILE_V": 128})
    with pytest.raises(ValueError, match="not contract-bearing"):
        linear_logp_tp(h, w, t, mesh=_abstract_mesh(tp=2), vocab_size=4736, backend="xla")
