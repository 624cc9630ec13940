"""The body's batch-invariant attention (`detlogp_jax.body.kv_attention`), CPU.

The reference backend against float64, and its row bytes across what a rollout and a trainer
change: prefill of the whole sequence vs a chunk of it vs one decode step over the cache, the
batch size, the row's place in the batch, the cache's length and left padding (`kv_start`), the
other rows' values; the plain XLA lane as the negative control; bad input and strict mode.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import backends
from detlogp_jax.body import kv_attention as A
from tests.helpers import attention_f64, row_mismatches

DTYPES = [jnp.float32, jnp.bfloat16]


def _case(rng, b=3, s=150, hq=4, hkv=2, dh=32, dtype=jnp.float32):
    mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return mk(b, s, hq, dh), mk(b, s, hkv, dh), mk(b, s, hkv, dh)


def _bits(x):
    return np.asarray(jnp.asarray(x, jnp.float32)).view(np.uint32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_attention_matches_float64(dtype, backend):
    rng = np.random.default_rng(0)
    q, k, v = _case(rng, s=140, dtype=dtype)
    kv_start = np.array([0, 5, 12])
    pos = np.stack([np.arange(10, 130, 3)] * 3) - kv_start[:, None] // 2  # mixed positions per row
    pos = np.minimum(pos, 140 - 1 - kv_start[:, None])
    q = q[:, : pos.shape[1]]
    got = A.attention(q, k, v, q_positions=pos, kv_start=kv_start, backend=backend)
    want = attention_f64(q, k, v, pos, kv_start, 32**-0.5)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert got.dtype == dtype and np.abs(np.asarray(got, np.float64) - want).max() < tol * np.abs(want).max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_chunked_and_full_prefill_give_the_same_bytes(dtype):
    """Query rows computed in a whole-sequence prefill, in chunks of 37 queries over the cache
    and one decode step at a time give the same bytes (reference); positions cross blocks."""
    rng = np.random.default_rng(1)
    b, s = 3, 150
    q, k, v = _case(rng, b=b, s=s, dtype=dtype)
    pos = np.broadcast_to(np.arange(s), (b, s))
    full = _bits(A.attention(q, k, v, q_positions=pos, backend="reference"))
    chunks = [
        _bits(A.attention(q[:, c : c + 37], k, v, q_positions=pos[:, c : c + 37], backend="reference"))
        for c in range(0, s, 37)
    ]
    assert row_mismatches(np.concatenate(chunks, axis=1), full)[0] == 0
    for t in (0, 63, 64, 100, 149):
        step = _bits(A.attention(q[:, t : t + 1], k, v, q_positions=pos[:, t : t + 1], backend="reference"))
        assert row_mismatches(step, full[:, t : t + 1])[0] == 0, t


def test_rows_do_not_depend_on_batch_position_cache_padding_or_neighbours():
    """One sequence's rows alone, at another place in a larger batch, with a longer cache (slots
    past its keys hold garbage), left-padded by 9 slots (kv_start), and next to rows of other
    values: the same bytes (reference)."""
    rng = np.random.default_rng(2)
    q, k, v = _case(rng, b=1, s=120)
    pos = np.arange(120)[None]
    alone = _bits(A.attention(q, k, v, q_positions=pos, backend="reference"))
    oq, ok, ov = _case(np.random.default_rng(3), b=5, s=200)
    ok, ov = ok.at[:, 120:].set(jnp.nan), ov.at[:, 120:].set(jnp.inf)  # garbage past the keys, in the same block
    big_k = ok.at[3, :120].set(k[0])
    big_v = ov.at[3, :120].set(v[0])
    big_q = oq[:, :120].at[3].set(q[0])
    big_pos = np.broadcast_to(np.arange(120), (5, 120))
    in_batch = _bits(A.attention(big_q, big_k, big_v, q_positions=big_pos, backend="reference"))[3:4]
    assert row_mismatches(in_batch, alone)[0] == 0
    pad_k = ok[:1].at[0, 9:129].set(k[0])
    pad_v = ov[:1].at[0, 9:129].set(v[0])
    padded = _bits(A.attention(q, pad_k, pad_v, q_positions=pos, kv_start=np.array([9]), backend="reference"))
    assert row_mismatches(padded, alone)[0] == 0


def test_a_query_without_keys_gets_zeros():
    """A padding query (position < 0) attends nothing and gets +0.0, never NaN."""
    rng = np.random.default_rng(4)
    q, k, v = _case(rng, b=1, s=70)
    pos = np.arange(70)[None] - 3
    out = np.asarray(A.attention(q, k, v, q_positions=pos, backend="reference"))
    assert np.all(out[0, :3].view(np.uint32) == 0) and np.isfinite(out).all()


def test_xla_lane_is_not_row_invariant_on_cpu():
    """The negative control: plain XLA's decode step differs from its prefill row (f32, CPU)."""
    rng = np.random.default_rng(5)
    q, k, v = _case(rng, b=4, s=200, hq=8, dh=64)
    pos = np.broadcast_to(np.arange(200), (4, 200))
    full = _bits(A.attention(q, k, v, q_positions=pos, backend="xla"))
    step = _bits(A.attention(q[:, 150:151], k, v, q_positions=pos[:, 150:151], backend="xla"))
    assert row_mismatches(step, full[:, 150:151])[0] > 0


S = (1, 8, 4, 32)
KV = (1, 8, 2, 32)


@pytest.mark.parametrize(
    "q,k,v,pos,start,exc,words",
    [
        (np.zeros(S, np.float16), np.zeros(KV, np.float16), np.zeros(KV, np.float16), None, None, TypeError, "q.dtype"),
        (np.zeros(S), np.zeros(KV, np.float16), np.zeros(KV), None, None, TypeError, "k.dtype"),
        (np.zeros((8, 4, 32)), np.zeros(KV), np.zeros(KV), None, None, ValueError, "B, T, Hq, Dh"),
        (np.zeros((1, 8, 3, 32)), np.zeros(KV), np.zeros(KV), None, None, ValueError, "multiple of the KV heads"),
        (np.zeros(S), np.zeros(KV), np.zeros((1, 9, 2, 32)), None, None, ValueError, "k and v"),
        (np.zeros(S), np.zeros(KV), np.zeros(KV), np.zeros((1, 7), int), None, ValueError, "q_positions"),
        (np.zeros(S), np.zeros(KV), np.zeros(KV), np.zeros((1, 8)), None, ValueError, "q_positions"),
        (np.zeros(S), np.zeros(KV), np.zeros(KV), None, np.zeros(2, int), ValueError, "kv_start"),
    ],
)
def test_bad_input_errors(q, k, v, pos, start, exc, words):
    cast = lambda x: jnp.asarray(x, jnp.float32) if x.dtype == np.float64 else jnp.asarray(x)  # noqa: E731
    pos = np.zeros((1, 8), int) if pos is None else pos
    with pytest.raises(exc, match=words):
        A.attention(cast(q), cast(k), cast(v), q_positions=pos, kv_start=start)


def test_strict_mode_refuses_the_xla_lane():
    q, k, v = (jnp.zeros(s, jnp.float32) for s in (S, KV, KV))
    with backends.strict_mode():
        with pytest.raises(backends.StrictModeError, match="not batch invariant"):
            A.attention(q, k, v, q_positions=np.zeros((1, 8), int), backend="xla")
        out = A.attention(q, k, v, q_positions=np.zeros((1, 8), int))  # auto: the reference on a CPU
    assert out.shape == S


def test_auto_takes_the_reference_where_the_gpu_backend_lacks_the_op(monkeypatch, recwarn):
    """On a machine whose Hopper backend has no attention, "auto" prefers the reference for
    attention (not a fallback: no warning, and strict mode serves it)."""
    from detlogp_jax.body import backends as body_backends

    fake = body_backends.BodyBackend(
        name="pallas_sm90", invariant=True, available=lambda: True, matmul=lambda *a, **k: 0
    )
    real_get = body_backends.get
    monkeypatch.setattr(body_backends, "get", lambda name: fake if name == "pallas_sm90" else real_get(name))
    assert body_backends.preferred("attention") == "reference" and body_backends.preferred("matmul") == "pallas_sm90"
    q, k, v = (jnp.ones(s, jnp.float32) for s in (S, KV, KV))
    with backends.strict_mode():
        out = A.attention(q, k, v, q_positions=np.zeros((1, 8), int))
    assert out.shape == S and not [w for w in recwarn if "falls back" in str(w.message)]


@pytest.mark.slow
def test_body_benchmark_attention_runs_on_cpu(tmp_path):
    """`python -m benchmarks.body --ops=attention` at the tiny shapes: a lane row per (case, lane)
    (cuDNN skipped with its reason on a CPU) and a ratio row per case in the JSON."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "attn.json"
    cmd = [sys.executable, "-m", "benchmarks.body", "--ops=attention", "--shape=tiny", "--attn_cases=decode,prefill"]
    cmd += ["--iters=2", "--warmup=1", "--calls_per_sample=1", f"--out={out}"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    lanes = {(r["proj"], r["lane"]): r for r in report["lanes"]}
    assert set(lanes) == {(c, lane) for c in ("decode", "prefill") for lane in ("ours", "xla", "cudnn")}
    assert lanes[("decode", "ours")]["served_by"] == "reference" and lanes[("decode", "ours")]["median_ms"] > 0
    assert lanes[("prefill", "cudnn")]["median_ms"] is None and "skipped" in lanes[("prefill", "cudnn")]["note"]
    assert [(r["op"], r["proj"]) for r in report["ratios"]] == [("attention", "decode"), ("attention", "prefill")]
    assert all(r["max_abs_diff_vs_xla"] < 0.05 and r["ours_over_xla"] > 0 for r in report["ratios"])
    assert "ours/cudnn" in proc.stdout


def test_padding_queries_get_zero_outputs_and_finite_gradients():
    """A query with no key (position < 0) outputs +0 on both lanes, and the gradient through the
    invariant op (whose backward is the plain lane's) is finite, with nothing from that row."""
    import jax

    rng = np.random.default_rng(6)
    q, k, v = _case(rng, b=2, s=70)
    pos = np.broadcast_to(np.arange(70) - 2, (2, 70))  # two padding queries per sequence
    for backend in ("reference", "xla"):
        out = np.asarray(A.attention(q, k, v, q_positions=pos, backend=backend))
        assert np.all(out[:, :2].view(np.uint32) == 0), backend
    loss = lambda q, k, v: jnp.sum(A.attention(q, k, v, q_positions=pos, backend="reference") ** 2)  # noqa: E731
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[:, :2] == 0)
