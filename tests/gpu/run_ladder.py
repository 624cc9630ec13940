#!/usr/bin/env python
"""GPU ladder for the pallas_sm90 backend: ONE process on an H200.

Stages (each catches its own exceptions, so one failure does not hide the rest):
  A  correctness vs oracle: oracle.logp_lse(kernel's own FP32 logits) must equal
     the kernel's logp/lse bit for bit on every checked row; trainer entry
     (no logits) and serving entry (return_logits=True) must give identical
     m/S/z_t/logp/lse bytes. Qwen3-8B lm_head shape at M=1/300/4096 (oracle
     on up to 256 rows per M; rows are independent) and small odd shapes with
     bias, per-row temperature and a weight row count not a multiple of 8.
  B  batch invariance: probe rows alone (M=1) vs at positions
     0/63/64/127/128/4095 of a 4096-row batch (every bucket forced), and inside
     batches of M in {1,2,3,7,8,63,64,65,127,128,129,255,256,257,1024,4096,16384}
     (natural bucket; all buckets forced at M=1/65/4096): m, S, logp, lse bytes.
  C  unpadded weight (151936 rows) + padded_vocab_size == padded weight
     (152064 rows) bytes; TP=2 column shards concatenated == unsharded.
  D  first timings at M=1, 64, 4096 (CUPTI kernel time): trainer entry
     (forward + fold), forward kernel alone, vs XLA materialized logits +
     logsumexp + gather.
  E  weight_layout="dv" (the Flax/Tunix [D, V] kernel K = W.T, materialized
     once, read in place): E1 oracle.logp_lse on the dv kernel's own logits,
     dv trainer == dv serving, dv == vd (m/S/z_t/owned/logp/lse and the logits)
     at M=1/300/4096 and with bias + per-row T; E2 batch invariance with dv:
     probe rows alone (dv, M=1) vs inside batches (every bucket at 4096, an M
     sweep), and the dv probes alone == the vd probes alone.
  F  the entropy statistic (linear-logp-entropy-v1; the kernels called directly with
     return_entropy=True / fold(a=A); the validation the registry entry's entropy rests on):
     F1 (m, S, A) per split and (logp, lse, entropy) == the oracle's from the kernel's
     own logits at M=1/300/4096 and with bias + per-row T at M=65; return_entropy off
     changes no m/S/z_t/logp/lse/logits byte; trainer == serving; F2 batch invariance of
     A and the entropy: probe rows alone (M=1) vs inside batches of the B2 M sweep
     1..16384 (natural bucket; every bucket forced at 1/65/4096).

Run (repository root, H200):  python tests/gpu/run_ladder.py
Env: OUT=<dir> writes $OUT/pallas_ladder.json (+ ptxas reports);
     LADDER_BUDGET_S (default 540) total wall budget, later stages are skipped
     past it; LADDER_STAGE_TIMEOUT_S (default 240) per-stage watchdog (a hung
     kernel ends the process after writing what was collected);
     LADDER_STAGES=ABCDEF to select stages (default: A-E; F, the entropy, only when
     named); LADDER_DUMP=0 disables the
     MOSAIC_GPU_DUMP_TO ptxas report collection.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

OUT = os.environ.get("OUT")
DUMP_DIR = None
if os.environ.get("LADDER_DUMP", "1") != "0":
    DUMP_DIR = tempfile.mkdtemp(prefix="mosaic_dump_")
    os.environ.setdefault("MOSAIC_GPU_DUMP_TO", DUMP_DIR)

T_START = time.time()
BUDGET = float(os.environ.get("LADDER_BUDGET_S", "540"))
STAGE_TIMEOUT = float(os.environ.get("LADDER_STAGE_TIMEOUT_S", "240"))
STAGES = os.environ.get("LADDER_STAGES", "ABCDE")

RESULTS: dict = {"stages": {}, "summary": [], "env": {}}
_current = {"name": None, "t0": None}
_lock = threading.Lock()


def log(*a):
    print(f"[{time.time() - T_START:7.1f}s]", *a, flush=True)


def write_results():
    RESULTS["elapsed_s"] = round(time.time() - T_START, 1)
    if not OUT:
        return
    try:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "pallas_ladder.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
        if DUMP_DIR and os.path.isdir(DUMP_DIR):
            names = sorted(os.listdir(DUMP_DIR))
            RESULTS["dump_files"] = [(n, os.path.getsize(os.path.join(DUMP_DIR, n))) for n in names][:400]
            dst = os.path.join(OUT, "ptxas")
            os.makedirs(dst, exist_ok=True)
            for n in names:
                p = os.path.join(DUMP_DIR, n)
                if "ptxas" in n and os.path.getsize(p) < 256 * 1024:
                    shutil.copy(p, dst)
            with open(os.path.join(OUT, "pallas_ladder.json"), "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)
    except Exception as e:  # pragma: no cover
        print("could not write results:", e)


def print_summary():
    print("\n==================== pallas_sm90 ladder summary ====================")
    for row in RESULTS["summary"]:
        print(row)
    print(f"elapsed {time.time() - T_START:.1f}s")


def _watchdog():
    while True:
        time.sleep(2)
        with _lock:
            name, t0 = _current["name"], _current["t0"]
        if name is not None and time.time() - t0 > STAGE_TIMEOUT:
            RESULTS["stages"].setdefault(name, {})["status"] = f"TIMEOUT after {STAGE_TIMEOUT}s (process ended)"
            RESULTS["summary"].append(f"{name:<44} TIMEOUT (> {STAGE_TIMEOUT:.0f}s): likely hang; process ended")
            print_summary()
            write_results()
            os._exit(3)


threading.Thread(target=_watchdog, daemon=True).start()


def stage(name):
    """Runs a check; records PASS/FAIL/ERROR/SKIP and its details."""

    def deco(fn):
        @functools.wraps(fn)
        def run(*a, **k):
            if time.time() - T_START > BUDGET:
                RESULTS["stages"][name] = {"status": "SKIP (budget)"}
                RESULTS["summary"].append(f"{name:<44} SKIP (budget)")
                log("SKIP", name)
                return None
            with _lock:
                _current.update(name=name, t0=time.time())
            t0 = time.time()
            rec = {}
            try:
                ok = fn(rec, *a, **k)
                status = "PASS" if ok in (True, None) else "FAIL"
            except Exception as e:
                status = "ERROR"
                rec["error"] = f"{type(e).__name__}: {e}"[:4000]
                rec["traceback"] = traceback.format_exc()[-6000:]
                traceback.print_exc()
            finally:
                with _lock:
                    _current.update(name=None, t0=None)
            rec["status"] = status
            rec["seconds"] = round(time.time() - t0, 1)
            RESULTS["stages"][name] = rec
            brief = rec.get("brief", rec.get("error", ""))
            RESULTS["summary"].append(f"{name:<44} {status:<5} {rec['seconds']:6.1f}s  {str(brief)[:150]}")
            log(status, name, brief)
            write_results()
            return rec

        return run

    return deco


# ----------------------------------------------------------------------------------------------
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from detlogp_jax import contract as C  # noqa: E402
from detlogp_jax import oracle  # noqa: E402
from pallas_kernels import tuning  # noqa: E402

# LADDER_DRY=1: the same script at toy sizes in Mosaic GPU interpret mode on CPU
# (checks the script itself; no GPU, no timings worth reading).
DRY = os.environ.get("LADDER_DRY") == "1"
D, V, VP = (128, 328, 512) if DRY else (4096, 151936, 152064)
POOL_N = 300 if DRY else 16384
BIG_M = 130 if DRY else 4096  # the "4096-row batch" of B1 / A1 / D1
BUCKETS = sorted(tuning.BUCKETS)
RESULTS["env"] = {
    "jax": jax.__version__,
    "devices": [str(d) for d in jax.devices()],
    "device_kind": jax.devices()[0].device_kind,
    "compute_capability": str(getattr(jax.devices()[0], "compute_capability", None)),
    "is_available": pk.is_available(),
    "buckets": {k: tuning.describe(c) for k, c in tuning.BUCKETS.items()},
}
log("devices", RESULTS["env"]["devices"], "is_available", RESULTS["env"]["is_available"])


def u32(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def n_diff_rows(a, b):
    """Rows whose bytes differ (NaN == NaN regardless of payload)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    same = (u32(a) == u32(b)) | (np.isnan(a) & np.isnan(b))
    same = same.reshape(same.shape[0], -1).all(axis=1) if same.ndim > 1 else same
    return int((~same).sum())


def entry_fn(
    *,
    vocab_size,
    padded_vocab_size,
    bucket=None,
    return_logits=False,
    col_offset=0,
    shard_cols=None,
    fold=True,
    weight_layout="vd",
    return_entropy=False,
):
    """The backend called eagerly (as a training/serving step would call it outside
    an outer jit): pk.partials / pk.fold jit their kernels on the padded row count,
    so batch sizes that pad to the same row blocks share compiled kernels."""

    def f(h, w, b, t, it):
        extra = dict(interpret=True, num_ctas=2) if DRY else {}
        m, s, zt, own, lg, *out_a = pk.partials(
            h,
            w,
            b,
            t,
            it,
            vocab_size=vocab_size,
            padded_vocab_size=padded_vocab_size,
            col_offset=col_offset,
            shard_cols=shard_cols,
            return_logits=return_logits,
            bucket=bucket,
            weight_layout=weight_layout,
            **({"return_entropy": True} if return_entropy else {}),
            **extra,
        )
        if return_entropy:  # (m, s, zt, own, lg, a, [logp, lse, entropy])
            a = out_a[0]
            if not fold:
                return m, s, zt, own, lg, a
            return (m, s, zt, own, lg, a) + tuple(pk.fold(m, s, zt, t, it, vocab_size, a=a, interpret=DRY))
        if not fold:
            return m, s, zt, own, lg
        logp, lse = pk.fold(m, s, zt, t, it, vocab_size, interpret=DRY)
        return m, s, zt, own, lg, logp, lse

    return f


def run(h, w, b, t, it, **kw):
    out = jax.block_until_ready(entry_fn(**kw)(h, w, b, t, it))
    names = ("m", "s", "z_t", "owned", "logits", "logp", "lse")
    if kw.get("return_entropy"):
        names = ("m", "s", "z_t", "owned", "logits", "a", "logp", "lse", "entropy")
    return dict(zip(names, out))


_KEY = [jax.random.key(20260130)]


def rnd(shape, dtype=jnp.bfloat16, scale=1.0):
    _KEY[0], k = jax.random.split(_KEY[0])
    return (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)


def targets_for(n, v, seed):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, v, n).astype(np.int32)
    if n >= 8:
        t[1], t[3], t[5] = C.IGNORE_INDEX, v - 1, 0
    return jnp.asarray(t)


@functools.lru_cache(maxsize=None)
def qwen_weight():
    # std 2.5/sqrt(D): logits with std ~2.5 plus a few strong columns (a peaked softmax).
    w = rnd((VP, D), scale=2.5 / np.sqrt(D))
    hot = jnp.arange(0, V, 997)
    w = w.at[hot].multiply(4.0)
    return w.at[V:].set(0)  # canonical padded weight: zero rows past the real vocab


@functools.lru_cache(maxsize=None)
def qwen_w():
    """The rollout's unpadded lm_head [151936, 4096] (declared with padded_vocab_size=152064)."""
    return qwen_weight()[:V]


@functools.lru_cache(maxsize=None)
def qwen_k():
    """The Flax/Tunix kernel K = W.T [4096, 151936] as its own buffer, made once (unpadded; a
    [D, V] kernel needs V % 64 == 0, so the DRY run's V=328 uses the padded weight's transpose)."""
    w = qwen_w() if V % 64 == 0 else qwen_weight()
    return jax.block_until_ready(jax.jit(jnp.transpose)(w))


@jax.jit
def _rows_with_diff(a, b):
    ua, ub = (jax.lax.bitcast_convert_type(x, jnp.uint32) for x in (a, b))
    return jnp.sum(jnp.any(ua != ub, axis=1))


def logits_rows_differing(a, b, cols):
    """Rows of two [N, >= cols] f32 logits whose first `cols` columns differ in bytes (on device)."""
    return int(_rows_with_diff(a[:, :cols], b[:, :cols]))


@functools.lru_cache(maxsize=None)
def pool():
    return rnd((POOL_N, D))


def check_vs_oracle(rec, tag, out, t, inv_t, temp, v, vp, rows):
    """oracle.logp_lse on the kernel's own logits for `rows` vs the kernel's logp/lse."""
    lg = np.asarray(out["logits"][jnp.asarray(rows)])
    tt = np.asarray(t)[rows]
    tmp = temp if np.ndim(temp) == 0 else np.asarray(temp)[rows]
    rl, rs = oracle.logp_lse(lg, tt, temperature=tmp, vocab_size=v, padded_vocab_size=vp)
    mo, so = oracle.split_partials(oracle.ftz(lg), v, vp, np.asarray(inv_t)[rows])
    bad = {
        "logp": n_diff_rows(np.asarray(out["logp"])[rows], rl),
        "lse": n_diff_rows(np.asarray(out["lse"])[rows], rs),
        "m": n_diff_rows(np.asarray(out["m"])[rows], mo),
        "s": n_diff_rows(np.asarray(out["s"])[rows], so),
    }
    own = np.asarray(out["owned"])[rows]
    zt = np.asarray(out["z_t"])[rows]
    idx = np.where(own)[0]
    bad["z_t"] = n_diff_rows(zt[idx], lg[idx, tt[idx]]) if idx.size else 0
    rec[tag] = {"rows_checked": len(rows), "rows_differing": bad}
    return all(v_ == 0 for v_ in bad.values())


def entries_identical(rec, tag, a, b):
    diff = {
        k: n_diff_rows(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32))
        for k in ("m", "s", "z_t", "owned", "logp", "lse")
    }
    rec[tag] = diff
    return all(v_ == 0 for v_ in diff.values())


# ----------------------------------------------------------------------------------------------
# A: correctness
@stage("A1 qwen oracle + trainer==serving")
def stage_a1(rec):
    w = qwen_w()
    ok = True
    for m_rows in (1, 70) if DRY else (1, 300, BIG_M):
        h = pool()[:m_rows]
        t = targets_for(m_rows, V, m_rows)
        temp = np.float32(0.7)
        it = jnp.asarray(oracle.inv_temperature(temp, m_rows))
        srv = run(h, w, None, t, it, vocab_size=V, padded_vocab_size=VP, return_logits=True)
        trn = run(h, w, None, t, it, vocab_size=V, padded_vocab_size=VP, return_logits=False)
        rows = np.unique(np.linspace(0, m_rows - 1, min(m_rows, 256)).astype(int))
        ok &= check_vs_oracle(rec, f"M{m_rows}_oracle", srv, t, it, temp, V, VP, rows)
        ok &= entries_identical(rec, f"M{m_rows}_trainer_vs_serving", srv, trn)
        ref = np.asarray(jnp.dot(h[:8], w.T, preferred_element_type=jnp.float32))
        rec[f"M{m_rows}_logits_maxabs_vs_xla"] = float(np.abs(np.asarray(srv["logits"][:8]) - ref).max())
        rec[f"M{m_rows}_lse_sample"] = np.asarray(srv["lse"])[:3].tolist()
    rec["brief"] = "; ".join(f"{k}: {v_}" for k, v_ in rec.items() if k.endswith("_oracle"))[:300]
    return ok


SMALL = [
    # (name, N, D, V, VP, bias, per-row T)
    ("odd_v1001_bias_rowT", 7, 192, 1001, C.canonical_padded_vocab(1001), True, True),
    ("n130_d320_v50000", 130, 320, 50000, C.canonical_padded_vocab(50000), False, False),
    ("qwen_bias_n65", 65, D, V, VP, True, True),
]
if DRY:
    SMALL = [SMALL[0], ("n130_d128_v600", 130, 128, 600, 1024, False, False), SMALL[2]]


@stage("A2 small odd shapes (bias, rowT, V%8)")
def stage_a2(rec):
    ok = True
    for name, n, d, v, vp, bias, row_t in SMALL:
        w = qwen_w() if (d, v) == (D, V) else rnd((v, d), scale=2.0 / np.sqrt(d))
        b = rnd((v,), jnp.float32) if bias else None
        h = rnd((n, d))
        t = targets_for(n, v, n + v)
        rng = np.random.default_rng(n)
        temp = rng.uniform(0.5, 1.5, n).astype(np.float32) if row_t else np.float32(1.0)
        it = jnp.asarray(oracle.inv_temperature(temp, n))
        srv = run(h, w, b, t, it, vocab_size=v, padded_vocab_size=vp, return_logits=True)
        trn = run(h, w, b, t, it, vocab_size=v, padded_vocab_size=vp)
        ok &= check_vs_oracle(rec, name, srv, t, it, temp, v, vp, np.arange(n))
        ok &= entries_identical(rec, name + "_trainer_vs_serving", srv, trn)
    rec["brief"] = "; ".join(
        f"{k}: {v_['rows_differing']}" for k, v_ in rec.items() if isinstance(v_, dict) and "rows_differing" in v_
    )[:300]
    return ok


# ----------------------------------------------------------------------------------------------
# B: batch invariance
PROBES = np.array([11, 5000, 12345, 777, 16000, 42]) % POOL_N
M_LIST = [1, 2, 3, 7, 8, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024, 4096, 16384]
FORCE_ALL_AT = (1, 65, 4096)
B1_POSITIONS = [0, 63, 64, 127, 128, 4095]
if DRY:
    M_LIST, FORCE_ALL_AT, B1_POSITIONS = [1, 3, 65, 130], (1,), [0, 64, 129]
    PROBES = PROBES[:3]
TEMP_B = np.float32(0.7)


@functools.lru_cache(maxsize=None)
def probe_refs():
    """Each probe row alone (M=1, natural = decode bucket)."""
    w = qwen_w()
    tall = targets_for(POOL_N, V, 7)
    refs = []
    for p in PROBES:
        h = pool()[p : p + 1]
        it = jnp.asarray(oracle.inv_temperature(TEMP_B, 1))
        out = run(h, w, None, tall[p : p + 1], it, vocab_size=V, padded_vocab_size=VP)
        refs.append({k: np.asarray(out[k]) for k in ("m", "s", "logp", "lse")})
    return tall, refs


def compare_probes(batch_out, placed, refs):
    """placed: list of (probe index k, row position). Returns #mismatching probe rows per field."""
    bad = {"m": 0, "s": 0, "logp": 0, "lse": 0}
    for k, pos in placed:
        for f in bad:
            a = np.asarray(batch_out[f])[pos : pos + 1]
            if n_diff_rows(a, refs[k][f]):
                bad[f] += 1
    return bad


def build_batch(m_rows, positions, tall):
    """pool rows [0, m_rows) with probe rows written at `positions`."""
    idx = (np.arange(m_rows) + 3616) % POOL_N  # filler rows (wrapping into the pool)
    placed = []
    for k, pos in enumerate(positions):
        idx[pos] = PROBES[k]
        placed.append((k, pos))
    ii = jnp.asarray(idx)
    return pool()[ii], tall[ii], placed


@stage("B1 probe rows at 0/63/64/127/128/4095, all buckets")
def stage_b1(rec):
    tall, refs = probe_refs()
    h, t, placed = build_batch(BIG_M, B1_POSITIONS, tall)
    it = jnp.asarray(oracle.inv_temperature(TEMP_B, BIG_M))
    ok = True
    for bucket in BUCKETS:
        out = run(h, qwen_w(), None, t, it, vocab_size=V, padded_vocab_size=VP, bucket=bucket)
        bad = compare_probes(out, placed, refs)
        rec[bucket] = bad
        ok &= not any(bad.values())
    rec["brief"] = str({k: sum(v_.values()) for k, v_ in rec.items()})
    return ok


@stage("B2 M sweep (natural; all buckets at 1/65/4096)")
def stage_b2(rec):
    tall, refs = probe_refs()
    ok = True
    for m_rows in M_LIST:
        if time.time() - T_START > BUDGET - 60:
            rec[f"M{m_rows}"] = "skipped (budget)"
            continue
        n_p = min(len(PROBES), m_rows)
        positions = sorted({(k * 997 + m_rows // 2) % m_rows for k in range(n_p)})
        h, t, placed = build_batch(m_rows, positions, tall)
        it = jnp.asarray(oracle.inv_temperature(TEMP_B, m_rows))
        buckets = BUCKETS if m_rows in FORCE_ALL_AT else [None]
        for bucket in buckets:
            out = run(h, qwen_w(), None, t, it, vocab_size=V, padded_vocab_size=VP, bucket=bucket)
            bad = compare_probes(out, placed, refs)
            name = tuning.select_bucket(m_rows, bucket).name
            rec[f"M{m_rows}_{name}"] = bad
            ok &= not any(bad.values())
    fails = [k for k, v_ in rec.items() if isinstance(v_, dict) and any(v_.values())]
    n_runs = sum(isinstance(v_, dict) for v_ in rec.values())
    rec["brief"] = f"{n_runs} runs, failing: {fails}"
    if n_runs == 0:  # nothing checked is not a pass
        raise RuntimeError("no M of the sweep ran within the budget (raise LADDER_BUDGET_S)")
    return ok


# ----------------------------------------------------------------------------------------------
# C: unpadded weight, shards
@stage("C1 unpadded W == padded W; TP=2 shards")
def stage_c1(rec):
    wp = qwen_weight()
    wu = qwen_w()
    ok = True
    for m_rows in (64,) if DRY else (64, 300):
        h = pool()[:m_rows]
        t = targets_for(m_rows, V, 3)
        it = jnp.asarray(oracle.inv_temperature(np.float32(1.0), m_rows))
        a = run(h, wp, None, t, it, vocab_size=V, padded_vocab_size=VP, return_logits=True)
        b = run(h, wu, None, t, it, vocab_size=V, padded_vocab_size=VP, return_logits=True)
        ok &= entries_identical(rec, f"M{m_rows}_padded_vs_unpadded", a, b)
        lg_diff = n_diff_rows(np.asarray(a["logits"][:, :V]), np.asarray(b["logits"]))
        rec[f"M{m_rows}_logits_rows_differing"] = lg_diff
        ok &= lg_diff == 0
        if m_rows == 64:
            full = b
    # TP=2: shard r holds padded columns [r*76032, (r+1)*76032) (its weight rows
    # are the padded weight's rows there).
    m_rows = 64
    h = pool()[:m_rows]
    t = targets_for(m_rows, V, 3)
    it = jnp.asarray(oracle.inv_temperature(np.float32(1.0), m_rows))
    width = VP // 2
    parts = []
    for r in range(2):
        parts.append(
            run(
                h,
                wp[r * width : (r + 1) * width],
                None,
                t,
                it,
                vocab_size=V,
                padded_vocab_size=VP,
                col_offset=r * width,
                shard_cols=width,
                fold=False,
            )
        )
    m_cat = np.concatenate([np.asarray(p["m"]) for p in parts], 1)
    s_cat = np.concatenate([np.asarray(p["s"]) for p in parts], 1)
    zt = np.where(np.asarray(parts[0]["owned"]), np.asarray(parts[0]["z_t"]), np.asarray(parts[1]["z_t"]))
    rec["tp2"] = {
        "m": n_diff_rows(m_cat, full["m"]),
        "s": n_diff_rows(s_cat, full["s"]),
        "z_t": n_diff_rows(zt, full["z_t"]),
    }
    ok &= not any(rec["tp2"].values())
    rec["brief"] = str({k: v_ for k, v_ in rec.items() if k != "brief"})[:300]
    return ok


# ----------------------------------------------------------------------------------------------
# D: timing
def gpu_time_ms(f, *args, iterations=10):
    """Median CUPTI GPU time (ms) of all kernels of one call, plus a per-kernel breakdown."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, per_iter = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
        totals = [sum(t for _, t in it) for it in per_iter]
        breakdown = {}
        for name, t in per_iter[-1]:
            breakdown[name[:60]] = round(breakdown.get(name[:60], 0.0) + t, 4)
        return float(np.median(totals)), breakdown
    except Exception as e:  # fall back to wall clock
        jax.block_until_ready(f(*args))
        t0 = time.perf_counter()
        for _ in range(iterations):
            out = f(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iterations * 1e3, {"wall_clock_fallback": str(e)[:200]}


@stage("D1 timing M=1/64/4096 vs XLA")
def stage_d1(rec):
    wu = qwen_w()
    table = []

    @jax.jit
    def xla_ref(h, w, t, it):
        z = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
        y = z * it[:, None]
        lse = jax.nn.logsumexp(y, axis=1)
        return jnp.take_along_axis(y, t[:, None], axis=1)[:, 0] - lse, lse

    for m_rows in (1,) if DRY else (1, 64, BIG_M):
        h = pool()[:m_rows]
        t = targets_for(m_rows, V, 9)
        it = jnp.asarray(oracle.inv_temperature(np.float32(1.0), m_rows))
        flops = 2.0 * m_rows * VP * D
        row = {"M": m_rows}
        trainer = entry_fn(vocab_size=V, padded_vocab_size=VP)
        fwd = entry_fn(vocab_size=V, padded_vocab_size=VP, fold=False)
        serving = entry_fn(vocab_size=V, padded_vocab_size=VP, return_logits=True)
        for name, f, args in (
            ("trainer", trainer, (h, wu, None, t, it)),
            ("forward", fwd, (h, wu, None, t, it)),
            ("serving", serving, (h, wu, None, t, it)),
            ("xla", xla_ref, (h, wu, t, it)),
        ):
            ms, br = gpu_time_ms(f, *args, iterations=1 if DRY else 10)
            row[name + "_ms"] = round(ms, 4)
            row[name + "_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
            row[name + "_kernels"] = br
        table.append(row)
        log("timing", {k: v_ for k, v_ in row.items() if not k.endswith("_kernels")})
    rec["table"] = table
    rec["brief"] = " | ".join(
        f"M={r['M']}: trainer {r['trainer_ms']}ms ({r['trainer_tflops']} TF/s), fwd {r['forward_ms']}ms, "
        f"serving {r['serving_ms']}ms, xla {r['xla_ms']}ms"
        for r in table
    )
    return True


# ----------------------------------------------------------------------------------------------
# E: weight_layout="dv" (a [D, V] kernel read in place)
@stage("E1 dv kernel: oracle, trainer==serving, ==vd")
def stage_e1(rec):
    k, wu = qwen_k(), qwen_w()
    ok = True
    cases = [(m_rows, False) for m_rows in ((1, 70) if DRY else (1, 300, BIG_M))] + [(65, True)]
    for m_rows, rich in cases:
        h = pool()[:m_rows]
        t = targets_for(m_rows, V, m_rows + 11)
        rng = np.random.default_rng(m_rows)
        temp = rng.uniform(0.5, 1.5, m_rows).astype(np.float32) if rich else np.float32(0.7)
        it = jnp.asarray(oracle.inv_temperature(temp, m_rows))
        b = rnd((k.shape[1],), jnp.float32) if rich else None
        tag = f"M{m_rows}" + ("_bias_rowT" if rich else "")
        kw = dict(vocab_size=V, padded_vocab_size=VP)
        srv = run(h, k, b, t, it, return_logits=True, weight_layout="dv", **kw)
        trn = run(h, k, b, t, it, weight_layout="dv", **kw)
        vd = run(h, wu, None if b is None else b[:V], t, it, return_logits=True, **kw)
        rows = np.unique(np.linspace(0, m_rows - 1, min(m_rows, 256)).astype(int))
        ok &= check_vs_oracle(rec, f"{tag}_dv_oracle", srv, t, it, temp, V, VP, rows)
        ok &= entries_identical(rec, f"{tag}_dv_trainer_vs_serving", srv, trn)
        ok &= entries_identical(rec, f"{tag}_dv_vs_vd", srv, vd)
        lg_bad = logits_rows_differing(srv["logits"], vd["logits"], V)
        rec[f"{tag}_dv_vs_vd_logits_rows_differing"] = lg_bad
        ok &= lg_bad == 0
        del srv, trn, vd
    rec["brief"] = "; ".join(
        f"{key}: {val}" for key, val in rec.items() if key.endswith(("_dv_vs_vd", "_logits_rows_differing"))
    )[:300]
    return ok


@stage("E2 dv batch invariance (probes, all buckets)")
def stage_e2(rec):
    tall, refs = probe_refs()  # vd rows alone
    k = qwen_k()
    refs_dv = []
    for p in PROBES:
        it = jnp.asarray(oracle.inv_temperature(TEMP_B, 1))
        out = run(
            pool()[p : p + 1], k, None, tall[p : p + 1], it, vocab_size=V, padded_vocab_size=VP, weight_layout="dv"
        )
        refs_dv.append({f: np.asarray(out[f]) for f in ("m", "s", "logp", "lse")})
    rec["alone_dv_vs_vd"] = {f: sum(n_diff_rows(a[f], c[f]) for a, c in zip(refs_dv, refs)) for f in refs[0]}
    ok = not any(rec["alone_dv_vs_vd"].values())
    h, t, placed = build_batch(BIG_M, B1_POSITIONS, tall)
    it = jnp.asarray(oracle.inv_temperature(TEMP_B, BIG_M))
    for bucket in BUCKETS:
        out = run(h, k, None, t, it, vocab_size=V, padded_vocab_size=VP, bucket=bucket, weight_layout="dv")
        rec[f"M{BIG_M}_{bucket}_forced"] = bad = compare_probes(out, placed, refs_dv)
        ok &= not any(bad.values())
    for m_rows in [1, 3, 65, 130] if DRY else [1, 7, 64, 65, 129, 257, 1024]:
        if time.time() - T_START > BUDGET - 60:
            rec[f"M{m_rows}"] = "skipped (budget)"
            continue
        n_p = min(len(PROBES), m_rows)
        positions = sorted({(j * 997 + m_rows // 2) % m_rows for j in range(n_p)})
        h, t, placed = build_batch(m_rows, positions, tall)
        it = jnp.asarray(oracle.inv_temperature(TEMP_B, m_rows))
        out = run(h, k, None, t, it, vocab_size=V, padded_vocab_size=VP, weight_layout="dv")
        rec[f"M{m_rows}_{tuning.select_bucket(m_rows).name}"] = bad = compare_probes(out, placed, refs_dv)
        ok &= not any(bad.values())
    fails = [key for key, val in rec.items() if isinstance(val, dict) and any(val.values())]
    rec["brief"] = f"{sum(isinstance(v_, dict) for v_ in rec.values())} checks, failing: {fails}"
    return ok


# ----------------------------------------------------------------------------------------------
# F: the entropy statistic (linear-logp-entropy-v1), the kernels called directly
ENTROPY_FIELDS = ("m", "s", "a", "logp", "lse", "entropy")


def zero_sign_only(a, b):
    """Entries whose bytes differ only in the sign of a zero (the sign of a zero A never reaches
    the entropy: CONTRACT.md section 9)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (u32(a) != u32(b)) & (a == 0) & (b == 0)


def check_entropy_vs_oracle(rec, tag, out, t, inv_t, temp, v, vp, rows):
    """(m, S, A) per split and (logp, lse, entropy) vs the oracle on the kernel's own logits."""
    lg = np.asarray(out["logits"][jnp.asarray(rows)])
    tt = np.asarray(t)[rows]
    tmp = temp if np.ndim(temp) == 0 else np.asarray(temp)[rows]
    mo, so, ao = oracle.split_partials(oracle.ftz(lg), v, vp, np.asarray(inv_t)[rows], return_entropy=True)
    rl, rs, rh = oracle.logp_lse_entropy(lg, tt, temperature=tmp, vocab_size=v, padded_vocab_size=vp)
    a = np.asarray(out["a"])[rows]
    zs = zero_sign_only(a, ao)
    bad = {
        "m": n_diff_rows(np.asarray(out["m"])[rows], mo),
        "s": n_diff_rows(np.asarray(out["s"])[rows], so),
        "a": n_diff_rows(np.where(zs, ao, a), ao),
        "logp": n_diff_rows(np.asarray(out["logp"])[rows], rl),
        "lse": n_diff_rows(np.asarray(out["lse"])[rows], rs),
        "entropy": n_diff_rows(np.asarray(out["entropy"])[rows], rh),
    }
    ent = np.asarray(out["entropy"])[rows]
    rec[tag] = {
        "rows_checked": len(rows),
        "rows_differing": bad,
        "a_zero_sign_only_entries": int(zs.sum()),
        "entropy_min_max": [float(np.nanmin(ent)), float(np.nanmax(ent))],
    }
    return all(v_ == 0 for v_ in bad.values())


def fields_identical(rec, tag, a, b, fields):
    diff = {k: n_diff_rows(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)) for k in fields}
    rec[tag] = diff
    return all(v_ == 0 for v_ in diff.values())


@stage("F1 entropy: oracle, on/off, trainer==serving")
def stage_f1(rec):
    w = qwen_w()
    ok = True
    cases = [(m_rows, False) for m_rows in ((1, 70) if DRY else (1, 300, BIG_M))] + [(65, True)]
    for m_rows, rich in cases:
        h = pool()[:m_rows]
        t = targets_for(m_rows, V, m_rows + 23)
        rng = np.random.default_rng(m_rows + 1)
        temp = rng.uniform(0.5, 1.5, m_rows).astype(np.float32) if rich else np.float32(0.7)
        it = jnp.asarray(oracle.inv_temperature(temp, m_rows))
        b = rnd((V,), jnp.float32) if rich else None
        tag = f"M{m_rows}" + ("_bias_rowT" if rich else "")
        kw = dict(vocab_size=V, padded_vocab_size=VP)
        srv = run(h, w, b, t, it, return_logits=True, return_entropy=True, **kw)
        plain = run(h, w, b, t, it, return_logits=True, **kw)
        trn = run(h, w, b, t, it, return_entropy=True, **kw)
        rows = np.unique(np.linspace(0, m_rows - 1, min(m_rows, 128)).astype(int))
        ok &= check_entropy_vs_oracle(rec, f"{tag}_oracle", srv, t, it, temp, V, VP, rows)
        ok &= entries_identical(rec, f"{tag}_entropy_off", srv, plain)
        lg_bad = logits_rows_differing(srv["logits"], plain["logits"], V)
        rec[f"{tag}_entropy_off_logits_rows_differing"] = lg_bad
        ok &= lg_bad == 0
        ok &= fields_identical(rec, f"{tag}_trainer_vs_serving", srv, trn, ENTROPY_FIELDS + ("z_t",))
        rec[f"{tag}_entropy_sample"] = np.asarray(srv["entropy"])[:3].tolist()
        del srv, plain, trn
    rec["brief"] = "; ".join(
        f"{k}: {v_['rows_differing']}" for k, v_ in rec.items() if isinstance(v_, dict) and "rows_differing" in v_
    )[:300]
    return ok


@functools.lru_cache(maxsize=None)
def probe_refs_entropy():
    """Each probe row alone (M=1, natural = decode bucket) with the entropy statistic."""
    tall = targets_for(POOL_N, V, 7)
    refs = []
    for p in PROBES:
        it = jnp.asarray(oracle.inv_temperature(TEMP_B, 1))
        out = run(
            pool()[p : p + 1],
            qwen_w(),
            None,
            tall[p : p + 1],
            it,
            vocab_size=V,
            padded_vocab_size=VP,
            return_entropy=True,
        )
        refs.append({f: np.asarray(out[f]) for f in ENTROPY_FIELDS})
    return tall, refs


def compare_probe_fields(batch_out, placed, refs, fields):
    bad = {f: 0 for f in fields}
    for k, pos in placed:
        for f in fields:
            if n_diff_rows(np.asarray(batch_out[f])[pos : pos + 1], refs[k][f]):
                bad[f] += 1
    return bad


@stage("F2 entropy batch invariance (M sweep 1..16384)")
def stage_f2(rec):
    tall, refs = probe_refs_entropy()
    _, refs_plain = probe_refs()  # the probes' logp/lse without the statistic
    rec["alone_entropy_vs_plain"] = {
        f: sum(n_diff_rows(a[f], c[f]) for a, c in zip(refs, refs_plain)) for f in ("m", "s", "logp", "lse")
    }
    ok = not any(rec["alone_entropy_vs_plain"].values())
    for m_rows in M_LIST:
        if time.time() - T_START > BUDGET - 60:
            rec[f"M{m_rows}"] = "skipped (budget)"
            continue
        n_p = min(len(PROBES), m_rows)
        positions = sorted({(k * 997 + m_rows // 2) % m_rows for k in range(n_p)})
        h, t, placed = build_batch(m_rows, positions, tall)
        it = jnp.asarray(oracle.inv_temperature(TEMP_B, m_rows))
        for bucket in BUCKETS if m_rows in FORCE_ALL_AT else [None]:
            out = run(h, qwen_w(), None, t, it, vocab_size=V, padded_vocab_size=VP, bucket=bucket, return_entropy=True)
            bad = compare_probe_fields(out, placed, refs, ENTROPY_FIELDS)
            rec[f"M{m_rows}_{tuning.select_bucket(m_rows, bucket).name}"] = bad
            ok &= not any(bad.values())
            del out
    fails = [k for k, v_ in rec.items() if isinstance(v_, dict) and any(v_.values())]
    n_runs = sum(isinstance(v_, dict) for v_ in rec.values()) - 1
    rec["brief"] = f"{n_runs} runs, failing: {fails}"
    if n_runs <= 0:
        raise RuntimeError("no M of the sweep ran within the budget (raise LADDER_BUDGET_S)")
    return ok


def main():
    todo = [("A", stage_a1), ("A", stage_a2), ("B", stage_b1), ("B", stage_b2), ("C", stage_c1), ("D", stage_d1)]
    todo += [("E", stage_e1), ("E", stage_e2), ("F", stage_f1), ("F", stage_f2)]
    # Timing early enough that a budget overrun in B does not lose it.
    order = [todo[0], todo[1], todo[5], todo[4], todo[2], todo[3], todo[6], todo[7], todo[8], todo[9]]
    for letter, fn in order:
        if letter in STAGES:
            fn()
    print_summary()
    write_results()
    n_bad = sum(1 for s in RESULTS["stages"].values() if s.get("status") not in ("PASS", "SKIP (budget)"))
    return 1 if n_bad else 0


if __name__ == "__main__":
    if DRY:
        from pallas_kernels.interpret_utils import row_invariant_wgmma

        with row_invariant_wgmma():
            sys.exit(main())
    sys.exit(main())
