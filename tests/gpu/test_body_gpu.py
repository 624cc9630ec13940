"""The batch-invariant body GEMM (`detlogp_jax.body.gemm`, backend pallas_sm90) on a Hopper GPU.

    PYTHONPATH=. python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_body_gpu.py

At the Qwen3-8B projection shapes (q/o [4096 -> 4096], k/v [4096 -> 1024], gate/up
[4096 -> 12288], down [12288 -> 4096]), bf16 operands:
* the kernel vs float64 (f32 output: relative Frobenius error < 1e-4) in both layouts, and its
  bf16 output == its f32 output rounded to bf16, byte for byte;
* rows of M = 1, 8, 64, 65, 512 == the same rows of the M = 4096 call (decode / mid / prefill
  buckets, a padded row count), rows permuted, rows among NaN rows: 0 rows differing (asserted),
  and the same counts for plain XLA `jnp.dot` (recorded: XLA's GEMM is not invariant);
* every bucket and CTA count gives the same bytes (asserted);
* measured, not promised (printed): "kn" vs "nk" bytes, and whether forcing the wgmma
  instruction N to 128 / 256 changes bytes (`matmul_config.instruction_n` keeps it a function
  of the weight's N until this says it may follow M);
* auto resolves to pallas_sm90 here and falls back (warning) where the kernel refuses.
At the end a table: one line per check, `rows_differing / rows` and max_abs_diff.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import body
from detlogp_jax.body import backends as body_backends
from tests.helpers import rel_err, row_mismatches

pytestmark = pytest.mark.gpu

pm = pytest.importorskip("pallas_kernels.body.matmul")
from pallas_kernels.body import matmul_config as mc  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 12288), "down": (12288, 4096)}
M_FULL = 4096
MS = (1, 8, 64, 65, 512)
_TABLE: list[tuple[str, str, str, str]] = []  # (check, lane, rows differing / rows, max_abs_diff)


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    print("\n=== body GEMM on the GPU: rows differing in bytes (ours must be 0; xla is recorded) ===")
    print(f"{'check':48s} {'lane':6s} {'rows differing':>16s} {'max_abs_diff':>13s}")
    for check, lane, rows, mad in _TABLE:
        print(f"{check:48s} {lane:6s} {rows:>16s} {mad:>13s}")


def _record(check, lane, got, want):
    rows, mad = row_mismatches(got, want)
    _TABLE.append((check, lane, f"{rows} / {np.shape(got)[0]}", f"{mad:.3g}"))
    return rows


def _operands(k, n, layout, m=M_FULL, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    shape = (k, n) if layout == "kn" else (n, k)
    w = (jax.random.normal(kw, shape, jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    return x, w


@functools.lru_cache(maxsize=None)
def _ours(layout, out_dtype=jnp.bfloat16):
    return jax.jit(functools.partial(body.matmul, w_layout=layout, out_dtype=out_dtype, backend="pallas_sm90"))


@functools.lru_cache(maxsize=None)
def _xla(layout):
    """Plain XLA as a Flax / Tunix model runs it (bf16 in, bf16 out)."""
    if layout == "kn":
        return jax.jit(lambda x, w: jnp.dot(x, w))
    return jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))


def _np(y):
    return np.asarray(y, np.float32)


def _w_kn64(w, layout):
    w = np.asarray(w, np.float64)
    return w if layout == "kn" else w.T


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("proj", list(SHAPES))
def test_correct_vs_float64(proj, layout):
    k, n = SHAPES[proj]
    x, w = _operands(k, n, layout, m=512, seed=1)
    y32 = _np(_ours(layout, jnp.float32)(x, w))
    want = np.asarray(x[:64], np.float64) @ _w_kn64(w, layout)
    err = rel_err(y32[:64], want)
    assert err < 1e-4, f"{proj} {layout}: relative error {err}"
    y16 = _np(_ours(layout)(x, w))
    rounded = _np(jnp.asarray(y32).astype(jnp.bfloat16))
    assert _record(f"{proj} {layout} bf16 out == rounded f32 out", "ours", y16, rounded) == 0


@pytest.mark.parametrize("proj", list(SHAPES))
def test_rows_invariant_to_m_position_and_padding(proj):
    """Ours: 0 rows differing for every M, a permutation and NaN neighbours; XLA: recorded."""
    k, n = SHAPES[proj]
    x, w = _operands(k, n, "kn", seed=2)
    lanes = {"ours": _ours("kn"), "xla": _xla("kn")}
    perm = np.random.default_rng(3).permutation(M_FULL)
    nan_x = jnp.full_like(x, jnp.nan).at[::97].set(x[::97])
    bad = []
    for lane, f in lanes.items():
        full = _np(f(x, w))
        for m in MS:
            rows = _record(f"{proj} M={m} vs M={M_FULL}", lane, _np(f(x[:m], w)), full[:m])
            bad += [(lane, m, rows)] if lane == "ours" and rows else []
        rows = _record(f"{proj} rows permuted", lane, _np(f(x[perm], w)), full[perm])
        bad += [(lane, "perm", rows)] if lane == "ours" and rows else []
        rows = _record(f"{proj} among NaN rows", lane, _np(f(nan_x, w))[::97], full[::97])
        bad += [(lane, "nan", rows)] if lane == "ours" and rows else []
    assert not bad, bad


def test_nk_rows_invariant():
    k, n = SHAPES["q/o"]
    x, w = _operands(k, n, "nk", seed=4)
    f = _ours("nk")
    full = _np(f(x, w))
    for m in (1, 64, 65, 512):
        assert _record(f"q/o nk M={m} vs M={M_FULL}", "ours", _np(f(x[:m], w)), full[:m]) == 0


@pytest.mark.parametrize("proj", ["k/v", "gate/up"])
def test_buckets_and_cta_counts_give_the_same_bytes(proj):
    k, n = SHAPES[proj]
    x, w = _operands(k, n, "kn", m=512, seed=5)
    run = lambda **kw: _np(pm.matmul(x, w, w_layout="kn", out_dtype=jnp.bfloat16, **kw))
    base = run()
    for kw in [dict(bucket=b) for b in sorted(mc.BUCKETS)] + [dict(num_ctas=7)]:
        name = ",".join(f"{a}={b}" for a, b in kw.items())
        assert _record(f"{proj} M=512 {name} vs default", "ours", run(**kw), base) == 0


def test_layouts_measured():
    """ "kn" vs "nk" bytes of the same product (not promised; recorded)."""
    k, n = SHAPES["q/o"]
    x, w = _operands(k, n, "kn", m=512, seed=6)
    _record("q/o M=512 kn vs nk (measured)", "ours", _np(_ours("kn")(x, w)), _np(_ours("nk")(x, w.T)))


def test_instruction_n_is_bit_neutral():
    """Forced instruction N 128 / 256 vs the shipped 64 (decode bucket, M = 64): each is
    correct; whether the bytes move is recorded (the measurement that would let the
    instruction N follow M)."""
    k, n = SHAPES["q/o"]
    x, w = _operands(k, n, "kn", m=64, seed=7)
    want = np.asarray(x, np.float64) @ _w_kn64(w, "kn")
    run = lambda n_instr: _np(pm.matmul(x, w, w_layout="kn", out_dtype=jnp.float32, bucket="decode", n_instr=n_instr))
    base = run(64)
    for n_instr in (128, 256):
        y = run(n_instr)
        assert rel_err(y, want) < 1e-4
        _record(f"q/o M=64 f32 instruction N {n_instr} vs 64 (measured)", "ours", y, base)


def test_auto_resolution_on_the_gpu():
    x, w = _operands(128, 256, "kn", m=4)
    assert body_backends.resolve("matmul", "auto", x, w, "kn").name == "pallas_sm90"
    xs, ws = _operands(100, 256, "kn", m=4)  # K not a multiple of 64: the kernel refuses
    with pytest.warns(UserWarning, match="falls back to the reference"):
        y = body.matmul(xs, ws)
    assert rel_err(_np(y), np.asarray(xs, np.float64) @ np.asarray(ws, np.float64)) < 1e-2
    with pytest.raises(body.BackendUnavailableError, match="multiples of 64"):
        body.matmul(xs, ws, backend="pallas_sm90")
