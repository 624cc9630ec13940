"""detlogp_jax.body.gemm on CPU: the reference's row bytes are batch invariant, its values are
right, the API refuses what it does not support, strict mode and explicit backends behave as the
operator's do, and plain XLA's dot is shown NOT to be row invariant on XLA:CPU."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import body
from detlogp_jax.body import backends as body_backends
from tests.helpers import rel_err, row_mismatches

K, N = 100, 48  # K not a multiple of the reference's K unroll (the loop's tail is exercised)


def _operands(m, k=K, n=N, dtype=jnp.bfloat16, layout="kn", seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = rng.standard_normal((k, n) if layout == "kn" else (n, k)) / np.sqrt(k)
    return x, jnp.asarray(w, dtype)


def _w_kn(w, layout):
    return np.asarray(w, np.float64) if layout == "kn" else np.asarray(w, np.float64).T


def _ref(x, w, layout, **kw):
    return np.asarray(body.matmul(x, w, w_layout=layout, backend="reference", **kw), np.float32)


CASES = [(jnp.bfloat16, "kn"), (jnp.bfloat16, "nk"), (jnp.float32, "kn"), (jnp.float32, "nk")]


@pytest.mark.parametrize("dtype,layout", CASES)
def test_reference_rows_do_not_depend_on_m(dtype, layout):
    """Rows 0..M-1 of calls with M = 1, 3, 64, 257 have the bytes of the same rows in an M = 300
    call (300 and 257 rows run in three blocks of 100 / 86 rows, 64 in one)."""
    x, w = _operands(300, dtype=dtype, layout=layout)
    full = _ref(x, w, layout)
    for m in (1, 3, 64, 257):
        rows, mad = row_mismatches(_ref(x[:m], w, layout), full[:m])
        assert rows == 0, f"M={m}: {rows} rows differ, max_abs_diff={mad}"


@pytest.mark.parametrize("dtype,layout", CASES)
def test_reference_row_ignores_position_padding_and_neighbours(dtype, layout):
    """One row's bytes alone == at positions 0, 77, 199 of a 200-row batch whose other rows are
    random, garbage (1e30, inf) or NaN, and after every neighbour is replaced."""
    x, w = _operands(200, dtype=dtype, layout=layout, seed=1)
    row = x[5:6]
    alone = _ref(row, w, layout)
    junk = jnp.asarray(np.where(np.arange(200)[:, None] % 3 == 0, np.nan, np.full((200, K), 1e30)), dtype)
    junk = junk.at[1::3].set(jnp.inf)
    for others in (x, junk, x[::-1] * 3):
        for pos in (0, 77, 199):
            y = _ref(others.at[pos].set(row[0]), w, layout)
            rows, mad = row_mismatches(y[pos : pos + 1], alone)
            assert rows == 0, f"position {pos}: the row differs (max_abs_diff={mad})"


def test_reference_leading_axes_equal_flat_rows():
    """x [B, T, K] gives the bytes of its rows flattened to [B * T, K]."""
    x, w = _operands(24, seed=2)
    y3 = body.matmul(x.reshape(4, 6, K), w, backend="reference")
    assert y3.shape == (4, 6, N)
    rows, _ = row_mismatches(np.asarray(y3, np.float32).reshape(24, N), _ref(x, w, "kn"))
    assert rows == 0


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_reference_is_the_sequential_f32_chain(layout):
    """With f32 operands (whose products round), the reference equals numpy's loop
    acc = fl(acc + fl(x_k * w_k)), k ascending, bit for bit; an FMA chain (each product
    added before rounding) differs somewhere, so the comparison can see a contraction."""
    x, w = _operands(20, dtype=jnp.float32, layout=layout, seed=3)
    xn, wn = np.asarray(x), _w_kn(w, layout).astype(np.float32)
    acc = np.zeros((20, N), np.float32)
    fused = np.zeros((20, N), np.float32)
    for k in range(K):
        prod = xn[:, k : k + 1] * wn[k : k + 1, :]
        acc = acc + prod
        fused = (fused.astype(np.float64) + xn[:, k : k + 1].astype(np.float64) * wn[k : k + 1, :]).astype(np.float32)
    got = _ref(x, w, layout)
    assert row_mismatches(got, acc)[0] == 0
    assert row_mismatches(fused, acc)[0] > 0  # the check above would catch an FMA chain


@pytest.mark.parametrize("dtype,layout", CASES)
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_matmul_matches_float64(dtype, layout, out_dtype, backend):
    x, w = _operands(33, k=200, n=40, dtype=dtype, layout=layout, seed=4)
    want = np.asarray(x, np.float64) @ _w_kn(w, layout)
    y = body.matmul(x, w, w_layout=layout, out_dtype=out_dtype, backend=backend)
    assert y.dtype == jnp.dtype(out_dtype or dtype) and y.shape == (33, 40)
    tol = 1e-2 if y.dtype == jnp.bfloat16 else 1e-5
    assert rel_err(np.asarray(y, np.float64), want) < tol


def test_auto_on_cpu_is_the_reference():
    x, w = _operands(9, seed=5)
    rows, _ = row_mismatches(np.asarray(body.matmul(x, w), np.float32), _ref(x, w, "kn"))
    assert rows == 0
    assert body_backends.resolve("matmul", "auto", x, w, "kn").name == "reference"


def test_zero_rows():
    x, w = _operands(1)
    y = body.matmul(x[:0].reshape(0, 3, K), w)
    assert y.shape == (0, 3, N) and y.dtype == jnp.bfloat16


def test_xla_dot_is_not_row_invariant_on_cpu():
    """Plain XLA (the "xla" lane, `jnp.dot`) on XLA:CPU: rows 0..M-1 of a small-M call differ
    from the same rows of an M = 64 call (jax 0.11.2 on x86: f32 at M = 2..16, bf16 operands
    with an f32 output at M = 1, where its dot runs a matrix-vector kernel). With a bf16 output
    these CPU shapes showed no differing row (the rounding to bf16 hid the f32 differences); on
    the H200 XLA's bf16 GEMM drifts (tests/gpu/test_body_gpu.py). The reference's bytes do not
    move (tests above)."""
    drift = {}
    for dtype, m_small in ((jnp.float32, (2, 3, 8)), (jnp.bfloat16, (1,))):
        x, w = _operands(64, k=256, n=256, dtype=dtype, seed=6)
        run = lambda rows: np.asarray(body.matmul(rows, w, out_dtype=jnp.float32, backend="xla"))
        full = run(x)
        drift[jnp.dtype(dtype).name] = sum(row_mismatches(run(x[:m]), full[:m])[0] for m in m_small)
    assert all(v > 0 for v in drift.values()), drift


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda x, w: (x.astype(jnp.float16), w.astype(jnp.float16), {}), TypeError, "bfloat16"),
        (lambda x, w: (x.astype(jnp.int32), w.astype(jnp.int32), {}), TypeError, "float32"),
        (lambda x, w: (x, w.astype(jnp.float32), {}), TypeError, "must equal x.dtype"),
        (lambda x, w: (x, w, {"out_dtype": jnp.float16}), TypeError, "out_dtype"),
        (lambda x, w: (x, w, {"w_layout": "vd"}), ValueError, "'kn'"),
        (lambda x, w: (x, w[None], {}), ValueError, "2-D"),
        (lambda x, w: (x[:, :-1], w, {}), ValueError, "K"),
        (lambda x, w: (x, w, {"w_layout": "nk"}), ValueError, "K"),
        (lambda x, w: (x[0, 0], w, {}), ValueError, "[..., K]"),
        (lambda x, w: (x, w, {"backend": "cublas"}), ValueError, "registered"),
    ],
)
def test_bad_input_errors(make, exc, words):
    x, w = _operands(4)
    x, w, kw = make(x, w)
    with pytest.raises(exc, match=None) as info:
        body.matmul(x, w, **kw)
    assert words in str(info.value), str(info.value)


# --- strict mode and explicit backends --------------------------------------------------------


def test_strict_mode_refuses_xla(monkeypatch):
    x, w = _operands(4)
    with body.strict_mode():
        with pytest.raises(body.StrictModeError, match="not batch invariant"):
            body.matmul(x, w, backend="xla")
        body.matmul(x, w)  # auto -> reference on CPU: invariant, no fallback
        body.matmul(x, w, backend="reference")
    monkeypatch.setenv("DETLOGP_STRICT", "1")
    with pytest.raises(body.StrictModeError):
        body.matmul(x, w, backend="xla")


def test_explicit_unavailable_backend_raises():
    x, w = _operands(4)
    with pytest.raises(body.BackendUnavailableError, match="pallas_sm90.*not available"):
        body.matmul(x, w, backend="pallas_sm90")


def _fake_gpu(monkeypatch, serves: bool):
    """Replaces the registry's pallas_sm90 entry by an available one that refuses (or serves)."""
    fake = body_backends.BodyBackend(
        name="pallas_sm90",
        invariant=True,
        available=lambda: True,
        matmul=lambda x2, w, *, w_layout, out_dtype: jnp.full((x2.shape[0], w.shape[1]), 7, out_dtype),
        supports_matmul=lambda x2, w, w_layout: (serves, "" if serves else "a refusal for the test"),
    )
    real_get = body_backends.get
    monkeypatch.setattr(body_backends, "get", lambda name: fake if name == "pallas_sm90" else real_get(name))


def test_auto_falls_back_with_a_warning_and_strict_refuses(monkeypatch):
    _fake_gpu(monkeypatch, serves=False)
    x, w = _operands(4)
    with pytest.warns(UserWarning, match="falls back to the reference"):
        y = body.matmul(x, w)
    assert row_mismatches(np.asarray(y, np.float32), _ref(x, w, "kn"))[0] == 0
    with pytest.raises(body.BackendUnavailableError, match="a refusal for the test"):
        body.matmul(x, w, backend="pallas_sm90")
    with body.strict_mode(), pytest.raises(body.StrictModeError, match="forbids falling back"):
        body.matmul(x, w)


def test_auto_takes_the_gpu_backend_where_it_serves(monkeypatch):
    _fake_gpu(monkeypatch, serves=True)
    x, w = _operands(4)
    assert (np.asarray(body.matmul(x, w), np.float32) == 7).all()


def test_resolve_refuses_unknown_op_and_missing_op():
    x, w = _operands(4)
    with pytest.raises(ValueError, match="unknown body op"):
        body_backends.resolve("conv", "reference", x, w)
    b = body_backends.BodyBackend(name="t", invariant=True, available=lambda: True)
    assert b.serves("matmul", x, w, "kn") == (False, "it has no matmul")


# --- einsum ---------------------------------------------------------------------------------

EINSUMS = [
    ("BTD,DNH->BTNH", (2, 3, 64), (64, 4, 8)),
    ("BSD,DKH->BSKH", (2, 5, 64), (64, 2, 8)),
    ("BTNH,NHD->BTD", (2, 3, 4, 8), (4, 8, 64)),
    ("BTD,DF->BTF", (2, 3, 64), (64, 96)),
    ("BTF,FD->BTD", (2, 3, 96), (96, 64)),
    ("...TM,MD->...TD", (2, 3, 32), (32, 16)),
    ("BTD,VD->BTV", (2, 3, 64), (40, 64)),  # W [N, K]: "nk"
    ("TBD,DF->BTF", (3, 2, 64), (64, 24)),  # x transposed, output permuted
]


@pytest.mark.parametrize("spec,xs,ws", EINSUMS)
def test_einsum_matches_float64(spec, xs, ws):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal(xs), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(ws) / 8, jnp.bfloat16)
    want = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
    got = body.einsum(spec, x, w, out_dtype=jnp.float32)
    assert got.shape == want.shape
    assert rel_err(np.asarray(got), want) < 1e-5


def test_einsum_moves_no_weight():
    """The lowered einsum (xla lane) has no transpose fed by W: W reaches the dot by reshapes."""
    x = jnp.zeros((2, 3, 64), jnp.bfloat16)
    w = jnp.zeros((64, 4, 8), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: body.einsum("BTD,DNH->BTNH", x, w, backend="xla"))(x, w).jaxpr
    from_w = {jaxpr.invars[1]}
    for eqn in jaxpr.eqns:
        if any(v in from_w for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)):
            assert eqn.primitive.name in ("reshape", "pjit", "jit"), eqn.primitive.name
            if eqn.primitive.name in ("pjit", "jit"):
                inner = [e.primitive.name for e in eqn.params["jaxpr"].jaxpr.eqns]
                assert "transpose" not in inner and "copy" not in inner, inner
            from_w.update(eqn.outvars)


@pytest.mark.parametrize(
    "spec,xs,ws,words",
    [
        ("BTD,SNDH->SBTNH", (2, 3, 8), (3, 2, 8, 4), "first or last"),
        ("BTD,BDF->BTF", (2, 3, 8), (2, 8, 4), "batch letters"),
        ("BTD,DF->BT", (2, 3, 8), (8, 4), "one side"),
        ("BTD,DF->BTFX", (2, 3, 8), (8, 4), "from nowhere"),
        ("BTD,DF", (2, 3, 8), (8, 4), "'LHS,RHS->OUT'"),
        ("BTD,...DF->BTF", (2, 3, 8), (8, 4), "'...'"),
        ("BTD,DF->BTF", (2, 3, 8), (9, 4), "letter 'D'"),
        ("BTD,DF->BTF", (2, 3, 8, 1), (8, 4), "does not match"),
        ("BTT,TF->BF", (2, 3, 3), (3, 4), "distinct letters"),
    ],
)
def test_einsum_bad_specs(spec, xs, ws, words):
    x, w = jnp.zeros(xs, jnp.bfloat16), jnp.zeros(ws, jnp.bfloat16)
    with pytest.raises(ValueError) as info:
        body.einsum(spec, x, w)
    assert words in str(info.value), str(info.value)


# --- the Hopper kernel on CPU: interpret mode and lowering for CUDA -----------------------------
# Interpret mode models wgmma as acc + matmul(a, b); `interpret_utils.row_invariant_wgmma` makes
# that matmul's value per element depend on the element's operands only, so these tests check the
# kernel's indexing, padding and tile walk (which rows and K slices reach an accumulator), not the
# GPU's bits (tests/gpu/test_body_gpu.py).

pm = pytest.importorskip("pallas_kernels.body.matmul")
from pallas_kernels import interpret_utils  # noqa: E402
from pallas_kernels.body import matmul_config as mc  # noqa: E402

KI, NI = 128, 128  # interpret-mode K and N: two pipeline steps, one or two column tiles


def _kernel(x, w, layout, bucket, out_dtype=jnp.float32, **kw):
    with interpret_utils.row_invariant_wgmma():
        y = pm.matmul(x, w, w_layout=layout, out_dtype=out_dtype, interpret=True, bucket=bucket, **kw)
    return np.asarray(y, np.float32)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("bucket,m", [("decode", 5), ("mid", 130), ("prefill", 260)])
def test_interpret_kernel_matches_float64(layout, bucket, m):
    """Every bucket (decode: 1 warpgroup of 64 rows; mid: 2 x 64; prefill: 2 x 128 with two
    accumulators per warpgroup) in both layouts, rows not a multiple of the tile."""
    x, w = _operands(m, k=KI, n=NI, layout=layout, seed=8)
    want = np.asarray(x, np.float64) @ _w_kn(w, layout)
    got = _kernel(x, w, layout, bucket)
    assert got.shape == (m, NI)
    assert rel_err(got, want) < 1e-6
    got16 = _kernel(x, w, layout, bucket, out_dtype=jnp.bfloat16)
    assert row_mismatches(got16, np.asarray(jnp.asarray(got).astype(jnp.bfloat16), np.float32))[0] == 0


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_interpret_rows_do_not_depend_on_bucket_m_position_or_padding(layout):
    """In the interpreter: rows of M = 1, 3 (decode) equal the same rows of M = 70 (decode,
    two row tiles) and of M = 70 forced to every other bucket; a row's bytes at
    positions 0 / 69 among NaN rows equal its bytes alone."""
    x, w = _operands(70, k=KI, n=NI, layout=layout, seed=9)
    base = _kernel(x, w, layout, None)
    for bucket in sorted(set(mc.BUCKETS) - {"decode"}):
        rows, mad = row_mismatches(_kernel(x, w, layout, bucket), base)
        assert rows == 0, f"{bucket}: {rows} rows differ (max_abs_diff={mad})"
    for m in (1, 3):
        assert row_mismatches(_kernel(x[:m], w, layout, None), base[:m])[0] == 0
    junk = jnp.full((70, KI), jnp.nan, jnp.bfloat16)
    for pos in (0, 69):
        y = _kernel(junk.at[pos].set(x[4]), w, layout, None)
        assert row_mismatches(y[pos : pos + 1], base[4:5])[0] == 0, pos


def test_interpret_more_column_tiles_than_ctas():
    """N = 256 in 64-column tiles walked by 2 persistent CTAs (4 tiles each), K = 192."""
    x, w = _operands(9, k=192, n=256, seed=10)
    got = _kernel(x, w, "kn", "decode", num_ctas=2)
    assert rel_err(got, np.asarray(x, np.float64) @ _w_kn(w, "kn")) < 1e-6


def test_pallas_supports_refuses_with_reasons():
    x, w = _operands(4, k=128, n=128)
    assert pm.supports(x, w, "kn") == (True, "")
    ok, why = pm.supports(x.astype(jnp.float32), w.astype(jnp.float32), "kn")
    assert not ok and "bfloat16" in why
    ok, why = pm.supports(x[:, :100], w[:100], "kn")
    assert not ok and "multiples of 64" in why


QWEN3_8B = {"q": (4096, 4096), "kv": (4096, 1024), "gate_up": (4096, 12288), "down": (12288, 4096)}


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("proj", sorted(QWEN3_8B))
def test_kernel_lowers_for_cuda_in_every_bucket(layout, proj):
    """Each bucket's kernel at the Qwen3-8B projection shapes lowers for the GPU (Mosaic's layout
    checks run here), with a bf16 and an f32 output, M unpadded (1, 8) and padded to 8 (65)."""
    k, n = QWEN3_8B[proj]
    w = jax.ShapeDtypeStruct((k, n) if layout == "kn" else (n, k), jnp.bfloat16)
    for m, bucket, out_dtype in [
        (1, "decode", jnp.bfloat16),
        (8, "decode", jnp.float32),
        (65, "mid", jnp.bfloat16),
        (130, "mid_wide", jnp.float32),
        (512, "prefill", jnp.bfloat16),
        (4096, None, jnp.float32),
    ]:
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        f = lambda x, w: pm.matmul(x, w, w_layout=layout, out_dtype=out_dtype, bucket=bucket, num_ctas=132)
        jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",))


def _wgmma_accumulators(jaxpr, found):
    """Accumulator shapes of every wgmma in a jaxpr and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "wgmma_ref":
            found.append(tuple(eqn.invars[0].aval.shape))
        for p in eqn.params.values():
            for q in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(q, jax.extend.core.ClosedJaxpr):
                    _wgmma_accumulators(q.jaxpr, found)
                elif isinstance(q, jax.extend.core.Jaxpr):
                    _wgmma_accumulators(q, found)
    return found


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_instruction_n_depends_on_the_weight_only(layout):
    """Every wgmma of the traced kernel accumulates [64 or 128, N_instr] with N_instr =
    instruction_n(N) whatever bucket M selects (the bit-relevant instruction N never follows M),
    and one wgmma per accumulator per step (no partial sums)."""
    for (k, n), want in (((4096, 4096), 64), ((4096, 1024), 64), ((4096, 12288), 128)):
        w = jax.ShapeDtypeStruct((k, n) if layout == "kn" else (n, k), jnp.bfloat16)
        buckets = set()
        for m in (1, 8, 65, 512, 4096, 8192):
            buckets.add(mc.select(m, n, 132).name)
            x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
            f = lambda x, w: pm.matmul(x, w, w_layout=layout, out_dtype=jnp.bfloat16, num_ctas=132)
            accs = _wgmma_accumulators(jax.make_jaxpr(f)(x, w).jaxpr, [])
            cfg = mc.select(m, n, 132)
            assert len(accs) == mc.accs_for(cfg, n, want), (m, accs)
            assert all(a == (cfg.wg_rows, want) for a in accs), (m, n, accs)
        assert len(buckets) >= 2, buckets  # the check spans buckets


def test_body_benchmark_runs_on_cpu(tmp_path):
    """`python -m benchmarks.body` at the tiny shapes: every lane row and ratio row is in the JSON."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "body.json"
    cmd = [sys.executable, "-m", "benchmarks.body", "--shape=tiny", "--m=1,8", "--gemm_proj=q,down"]
    cmd += ["--lanes=ours,xla,cublas", "--iters=2", "--warmup=1", "--calls_per_sample=1", f"--out={out}"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {(r["proj"], r["m"], r["lane"]) for r in report["lanes"]} == {
        (p, m, lane) for p in ("q", "down") for m in (1, 8) for lane in ("ours", "xla", "cublas")
    }
    assert [(r["proj"], r["m"]) for r in report["ratios"]] == [("q", 1), ("q", 8), ("down", 1), ("down", 8)]
    assert all(r["max_abs_diff_vs_xla"] < 0.1 and r["ours_over_xla"] > 0 for r in report["ratios"])
    assert "ours/xla" in proc.stdout


@pytest.mark.parametrize("case", ["decode", "train"])
def test_body_benchmark_layer_lanes_run_on_cpu(tmp_path, case):
    """`python -m benchmarks.body --ops=layer` at the tiny shapes: a decode step over a cache
    (or the trainer's fwd+bwd) of a 2-layer stack, ours and plain XLA on the same weights, with
    a ratio row (ours agrees with XLA to bf16 rounding)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "layer.json"
    cmd = [sys.executable, "-m", "benchmarks.body", "--ops=layer", "--shape=tiny", f"--layer_cases={case}"]
    cmd += ["--iters=1", "--warmup=1", "--calls_per_sample=1", f"--out={out}"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu")
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {(r["proj"], r["lane"]) for r in report["lanes"]} == {(case, lane) for lane in ("ours", "xla")}
    assert all(r["median_ms"] and "failed" not in r["note"] for r in report["lanes"]), report["lanes"]
    assert [r["proj"] for r in report["ratios"]] == [case] and f"layer {case}" in proc.stdout
    assert all(r["rel_diff_vs_xla"] < 0.1 for r in report["ratios"]), report["ratios"]
