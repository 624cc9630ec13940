"""The Hopper body attention kernel (`pallas_kernels.body.attention`) on CPU: interpret mode and
lowering for CUDA.

Interpret mode runs the kernel's code (TMA ring, barriers, the two warpgroups, the chain with
pinned XLA:CPU arithmetic) with wgmma modelled as acc + matmul(a, b);
`interpret_utils.row_invariant_wgmma` makes that matmul's value per element depend on the
element's operands only. So these tests check the kernel's structure: which keys, rows and
blocks reach a row's state, the masks, the selects, the V clean-up, the padding and the
re-arrangement of q and out; not the GPU's bits (tests/gpu/test_body_attention_gpu.py).
Invariance is judged in bytes, per query row (b, t, head): 0 rows may differ.

Lowering for CUDA runs the Python half of Mosaic GPU (layouts, transforms, TMA and wgmma
checks) at the Qwen3-8B attention shapes, and the lowered module is read for what pins the
arithmetic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import body
from detlogp_jax.body import kv_attention as A
from tests.helpers import attention_f64, rel_err, row_mismatches

pa = pytest.importorskip("pallas_kernels.body.attention")
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels import interpret_utils  # noqa: E402
from pallas_kernels.body import attention_config as ac  # noqa: E402

BF16 = jnp.bfloat16


def _cache(rng, b, s, hkv, dh):
    mk = lambda: jnp.asarray(rng.standard_normal((b, s, hkv, dh)), BF16)  # noqa: E731
    return mk(), mk()


def _queries(rng, b, t, hq, dh):
    return jnp.asarray(rng.standard_normal((b, t, hq, dh)), BF16)


def _run(q, k, v, pos, kv_start=None, *, out_dtype=jnp.float32, config=None, interpret_params=None):
    """The kernel in interpret mode (row-invariant wgmma) -> float32 numpy [B, T, Hq, Dh]."""
    b = q.shape[0]
    ks = jnp.zeros((b,), jnp.int32) if kv_start is None else jnp.asarray(kv_start, jnp.int32)
    with interpret_utils.row_invariant_wgmma():
        out = pa.attention(
            q,
            k,
            v,
            q_positions=jnp.asarray(pos, jnp.int32),
            kv_start=ks,
            scale=q.shape[-1] ** -0.5,
            out_dtype=out_dtype,
            interpret=True,
            interpret_params=interpret_params,
            config=config,
        )
    assert out.shape == q.shape and out.dtype == jnp.dtype(out_dtype)
    return np.asarray(out, np.float32)


def _rows_differ(a, b):
    """Query rows (b, t, head) whose bytes differ."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return row_mismatches(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))[0]


# --- values -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv,dh", [(4, 2, 64), (6, 2, 128)])
def test_kernel_matches_float64(hq, hkv, dh):
    """Mixed positions per row (crossing blocks, a query without keys), left padding, GQA with a
    group that divides 64 (G = 2) and one that does not (G = 3: a query's rows straddle row
    tiles). f32 output vs float64 and the reference backend; the bf16 output is the f32 output
    rounded, byte for byte."""
    rng = np.random.default_rng(0)
    b, s, t = 2, 150, 23
    k, v = _cache(rng, b, s, hkv, dh)
    q = _queries(rng, b, t, hq, dh)
    kv_start = np.array([0, 11])
    pos = np.stack([np.arange(7, 7 + 6 * t, 6), np.arange(5, 5 + 5 * t, 5)]) - 3
    pos[1, 4] = -2  # a padding query: no keys, output +0
    pos = np.minimum(pos, s - 1 - kv_start[:, None])
    got = _run(q, k, v, pos, kv_start)
    want = attention_f64(q, k, v, pos, kv_start)
    assert rel_err(got, want) < 4e-3, rel_err(got, want)
    assert np.all(got[1, 4].view(np.uint32) == 0) and np.isfinite(got).all()
    ref = np.asarray(
        A.attention(q, k, v, q_positions=pos, kv_start=kv_start, out_dtype=jnp.float32, backend="reference")
    )
    assert rel_err(got, ref) < 4e-3
    got16 = _run(q, k, v, pos, kv_start, out_dtype=BF16)
    assert _rows_differ(got16, np.asarray(jnp.asarray(got).astype(BF16), np.float32)) == 0


# --- row bytes ----------------------------------------------------------------------------------


def _garbage_past(x, last, fill):
    """x [B, S, Hkv, Dh] with the slots after `last` set to fill (what a longer cache may hold)."""
    return x.at[:, last + 1 :].set(jnp.asarray(fill, x.dtype))


@pytest.fixture(scope="module")
def sequence():
    """One sequence (G = 4, 160 positions: three KV blocks) and its whole-sequence prefill
    (160 queries, 10 row tiles): (q, k, v, positions, output)."""
    rng = np.random.default_rng(1)
    s, hq, hkv, dh = 160, 4, 1, 64
    k, v = _cache(rng, 1, s, hkv, dh)
    q = _queries(rng, 1, s, hq, dh)
    pos = np.arange(s)[None]
    return q, k, v, pos, _run(q, k, v, pos)


def test_prefill_chunks_give_the_rows_of_the_whole_prefill(sequence):
    """The prefill's rows == the same rows computed in chunks of 37 / 64 / 59 queries over a
    cache whose slots past the chunk's last position hold NaN keys and inf values."""
    q, k, v, pos, full = sequence
    bad = []
    for c0, c1 in ((0, 37), (37, 101), (101, 160)):
        kc, vc = _garbage_past(k, c1 - 1, jnp.nan), _garbage_past(v, c1 - 1, jnp.inf)
        rows = _rows_differ(_run(q[:, c0:c1], kc, vc, pos[:, c0:c1]), full[:, c0:c1])
        bad += [(f"chunk {c0}:{c1}", rows)] if rows else []
    assert not bad, bad


def test_decode_steps_give_the_rows_of_the_prefill(sequence):
    """The prefill's rows == decode steps (one query, its 4 heads in one padded row tile) at
    positions 0, 63, 64, 100, 159 over a cache holding NaN keys and inf values past the step."""
    q, k, v, pos, full = sequence
    bad = []
    for t in (0, 63, 64, 100, 159):
        kc, vc = _garbage_past(k, t, jnp.nan), _garbage_past(v, t, jnp.inf)
        rows = _rows_differ(_run(q[:, t : t + 1], kc, vc, pos[:, t : t + 1]), full[:, t : t + 1])
        bad += [(f"decode {t}", rows)] if rows else []
    assert not bad, bad


def test_rows_do_not_depend_on_batch_position_padding_cache_length_or_neighbours():
    """A sequence's query rows (8 queries at positions 90..97 and a decode step at 120, G = 4)
    alone == the same rows at index 2 of a 4-sequence batch whose other sequences differ, with
    its cache left-padded by 9 NaN slots (kv_start), the cache 80 slots longer with NaN / inf
    past its keys, and the other heads of its queries holding other values or NaN."""
    rng = np.random.default_rng(2)
    s, hq, hkv, dh = 121, 4, 1, 64
    k, v = _cache(rng, 1, s, hkv, dh)
    q = _queries(rng, 1, 9, hq, dh)
    pos = np.array([list(range(90, 98)) + [120]])
    alone = _run(q, k, v, pos)
    pad, extra, big = 9, 80, 4
    ok, ov = _cache(np.random.default_rng(3), big, pad + s + extra, hkv, dh)
    place = lambda other, x: other.at[2, pad : pad + s].set(x[0]).at[2, :pad].set(jnp.nan)  # noqa: E731
    bk = _garbage_past(place(ok, k), pad + s - 1, jnp.nan)
    bv = _garbage_past(place(ov, v), pad + s - 1, jnp.inf)
    bq = _queries(np.random.default_rng(4), big, 9, hq, dh).at[2].set(q[0])
    bpos = np.repeat(pos, big, axis=0) - np.arange(big)[:, None] * 7 * (np.arange(big)[:, None] != 2)
    kv_start = np.array([0, 3, pad, 17])
    got = _run(bq, bk, bv, bpos, kv_start)
    assert _rows_differ(got[2:3], alone) == 0
    # The other heads of each query (the rows sharing its tile) hold NaN: head 1's rows keep their bytes.
    nq = q.at[:, :, [0, 2, 3]].set(jnp.nan)
    got = _run(nq, k, v, pos)
    assert _rows_differ(got[:, :, 1:2], alone[:, :, 1:2]) == 0


@pytest.fixture(scope="module")
def odd_heads():
    """3 KV heads (G = 2) and 70 queries (140 rows: 3 row tiles), so a CTA's second consumer
    warpgroup has no tile or no head in the last CTA of either pairing; and the bytes of the
    one-warpgroup prefill config: (q, k, v, pos, output)."""
    rng = np.random.default_rng(5)
    s, hq, hkv, dh = 150, 6, 3, 64
    k, v = _cache(rng, 1, s, hkv, dh)
    q = _queries(rng, 1, 70, hq, dh)
    pos = np.arange(s - 70, s)[None]
    return q, k, v, pos, _run(q, k, v, pos, config="prefill_1wg")


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    ["prefill", "decode", "decode_1wg", ac.AttentionConfig("ring2_first_to_last", stages=2, heavy_first=False)],
    ids=lambda c: getattr(c, "name", c),
)
def test_launch_configs_are_bit_neutral(odd_heads, config):
    """Every config (two consumer warpgroups on consecutive row tiles or KV heads, or one; 2- to
    4-slot rings, a 2-slot ring wrapping around 3 KV blocks; tiles last-to-first or first-to-last)
    gives the bytes of the one-warpgroup prefill config."""
    q, k, v, pos, base = odd_heads
    assert _rows_differ(_run(q, k, v, pos, config=config), base) == 0


def _races_found():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return gpu_callbacks.get_races().races_found


@pytest.mark.slow
@pytest.mark.parametrize("wgs", [1, 2])
def test_no_races_in_one_cta(wgs):
    """Race detection over a single CTA (one sequence; one KV head, or two with two consumer
    warpgroups) walking three KV blocks through 2-slot rings (slots reused), the last one partial
    (mask, selects, V clean-up)."""
    rng = np.random.default_rng(6)
    s, dh = 150, 64
    k, v = _cache(rng, 1, s, wgs, dh)
    q = _queries(rng, 1, 2, 4 * wgs, dh)
    ring2 = ac.AttentionConfig("ring2", stages=2, wgs=wgs, pair="head", consumer_regs=232 if wgs == 2 else 256)
    params = plgpu.InterpretGPUParams(detect_races=True)
    got = _run(q, k, v, np.array([[140, 149]]), config=ring2, interpret_params=params)
    assert not _races_found(), "race detected in the attention kernel"
    assert np.isfinite(got).all()


def test_config_selection():
    """Two consumer warpgroups by default (decode: one row tile per (sequence, KV head); prefill:
    more), one where two do not fit shared memory (Dh = 128 with an f32 output)."""
    assert ac.select(1, 128, 2) is ac.DECODE and ac.select(2, 128, 2) is ac.PREFILL
    assert ac.select(1, 128, 4) is ac.DECODE_1WG and ac.select(9, 128, 4) is ac.PREFILL_1WG
    assert ac.select(9, 64, 4) is ac.PREFILL and ac.select(9, 64, 2, "decode_1wg") is ac.DECODE_1WG
    assert all(ac.smem_bytes(128, ac.stages_for(c, 128, 2), 2, c.wgs) <= ac.SMEM_LIMIT for c in ac.CONFIGS.values())
    with pytest.raises(ValueError, match="known"):
        ac.select(1, 64, 2, "fastest")
    with pytest.raises(ValueError, match="wgs"):
        ac.AttentionConfig("bad", stages=2, wgs=3)


def test_tile_metadata():
    pos = np.full((2, 128), -1, np.int32)
    pos[0, :64] = np.arange(100, 164)
    pos[0, 64:70] = [5, 70, -1, 64, 200, 3]
    meta = np.asarray(pa.tile_metadata(jnp.asarray(pos)))
    assert meta.tolist() == [[[1, 163], [0, 200]], [[0, -1], [0, -1]]]


# --- what it takes ------------------------------------------------------------------------------


def test_supports_refuses_with_reasons():
    q = jnp.zeros((1, 2, 8, 128), BF16)
    kv = jnp.zeros((1, 16, 2, 128), BF16)
    assert pa.supports(q, kv, kv) == (True, "")
    assert pa.supports(q[..., :64], kv[..., :64], kv[..., :64]) == (True, "")
    assert pa.supports(q[:, :, :6], kv, kv) == (True, "")  # G = 3
    ok, why = pa.supports(q.astype(jnp.float32), kv.astype(jnp.float32), kv.astype(jnp.float32))
    assert not ok and "bfloat16" in why
    for dh in (32, 256):
        qd, kd = jnp.zeros((1, 2, 8, dh), BF16), jnp.zeros((1, 16, 2, dh), BF16)
        ok, why = pa.supports(qd, kd, kd)
        assert not ok and "(64, 128)" in why and str(dh) in why
    big_q, big_kv = jax.ShapeDtypeStruct((70000, 1, 8, 64), BF16), jax.ShapeDtypeStruct((70000, 16, 2, 64), BF16)
    ok, why = pa.supports(big_q, big_kv, big_kv)
    assert not ok and "65535" in why
    with pytest.raises(ValueError, match="bfloat16"):
        pa.attention(
            q.astype(jnp.float32),
            kv,
            kv,
            q_positions=np.zeros((1, 2), int),
            kv_start=None,
            scale=1.0,
            out_dtype=jnp.float32,
        )
    with pytest.raises(TypeError, match="out_dtype"):
        pa.attention(q, kv, kv, q_positions=np.zeros((1, 2), int), kv_start=None, scale=1.0, out_dtype=jnp.float16)


def test_registered_as_pallas_sm90():
    from pallas_kernels.body import body_entry

    entry = body_entry()
    assert entry.attention is pa.attention and entry.supports_attention is pa.supports
    q, kv = jnp.zeros((1, 2, 8, 64), BF16), jnp.zeros((1, 16, 2, 64), BF16)
    assert entry.serves("attention", q, kv, kv) == (True, "")
    assert entry.serves("attention", q.astype(jnp.float32), kv, kv)[0] is False
    with pytest.raises(body.BackendUnavailableError, match="pallas_sm90.*not available"):
        body.attention(q, kv, kv, q_positions=np.zeros((1, 2), int), backend="pallas_sm90")


# --- lowering for CUDA --------------------------------------------------------------------------

QWEN3_8B = dict(hq=32, hkv=8, dh=128)
LOWERINGS = {  # name: (B, T, S)
    "prefill_8x1024": (8, 1024, 1024),
    "prefill_1x4096": (1, 4096, 4096),
    "chunked_prefill_8x256_over_4096": (8, 256, 4096),
    "decode_64_over_4096": (64, 1, 4096),
}


def _lower(b, t, s, hq, hkv, dh, out_dtype, config=None):
    q = jax.ShapeDtypeStruct((b, t, hq, dh), BF16)
    kv = jax.ShapeDtypeStruct((b, s, hkv, dh), BF16)
    ints = jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)

    def f(q, k, v, pos, ks):
        return pa.attention(q, k, v, q_positions=pos, kv_start=ks, scale=dh**-0.5, out_dtype=out_dtype, config=config)

    return jax.jit(f).trace(q, kv, kv, *ints).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("name", sorted(LOWERINGS))
def test_kernel_lowers_for_cuda_at_qwen3_8b_shapes(name):
    """Prefill, chunked prefill and decode at the Qwen3-8B attention heads (Hq = 32, Hkv = 8,
    Dh = 128), bf16 output, and f32 output for the decode."""
    b, t, s = LOWERINGS[name]
    _lower(b, t, s, out_dtype=BF16, **QWEN3_8B)
    if name.startswith("decode"):
        _lower(b, t, s, out_dtype=jnp.float32, **QWEN3_8B)


@pytest.mark.parametrize("config", sorted(ac.CONFIGS))
def test_kernel_lowers_for_cuda_with_head_dim_64_and_odd_groups(config):
    """Dh = 64 (Hq = 14, Hkv = 2: G = 7), a cache length that is not a multiple of 8, both configs."""
    _lower(3, 37, 301, hq=14, hkv=2, dh=64, out_dtype=jnp.float32, config=config)


def _mosaic_module(lower):
    """The Mosaic GPU module text of the kernel lowered by `lower()` (captured as it is serialized)."""
    from jax.experimental.mosaic.gpu import core as mosaic_core

    captured = []
    original = mosaic_core._run_serde_pass

    def run_serde_pass(module, *args, **kwargs):
        if kwargs.get("serialize"):
            captured.append(module.operation.get_asm(enable_debug_info=False))
        return original(module, *args, **kwargs)

    mosaic_core._run_serde_pass = run_serde_pass
    try:
        lower()
    finally:
        mosaic_core._run_serde_pass = original
    assert len(captured) == 1, len(captured)
    return captured[0]


@pytest.mark.parametrize("dh", [64, 128])
def test_lowered_kernel_pins_its_arithmetic(dh):
    """In the lowered module: no f32 multiply, subtract, divide, FMA or libdevice exp that LLVM
    could contract or that a CPU could not reproduce (the chain's multiplies, subtracts, exp
    and reciprocal are inline PTX `.rn.ftz`; the only `arith.addf` are the tree's 8-column
    slice sums); every wgmma is m64n64k16 with f32 accumulation of bf16 operands, Dh / 64 * 4
    of them per block for S and as many for PV, in each of the two block loops."""
    text = _mosaic_module(lambda: _lower(2, 64, 256, hq=8, hkv=2, dh=dh, out_dtype=BF16))
    for op in ("arith.mulf", "arith.subf", "arith.divf", "math.fma", "math.exp", "__nv_"):
        assert op not in text, op
    assert "mul.rn.ftz.f32" in text and "add.rn.ftz.f32" in text and "div.rn.ftz.f32" in text
    wgmmas = [line for line in text.splitlines() if "wgmma.mma_async" in line]
    assert all("m64n64k16.f32.bf16.bf16" in line for line in wgmmas)
    assert len(wgmmas) == 2 * 2 * (dh // 64) * 4, len(wgmmas)
    # tree64's slice sums: per loop, 8 slices x 2 rows per thread x (in-thread pair, 2 shuffles, + init 0).
    assert text.count("arith.addf") == 2 * 8 * 2 * 4


def test_lowered_rings_alias_their_two_views():
    """The kernel relies on the TMA's untiled view and wgmma's tiled view of each K / V ring
    being the same bytes: in the lowered module (Qwen3-8B decode: 2 consumer warpgroups, 2
    slots, 2 chunks of a 128-wide head) both views of each ring start at the same offset, and
    there are two rings."""
    import re

    text = _mosaic_module(lambda: _lower(64, 1, 4096, out_dtype=BF16, **QWEN3_8B))
    view = r"memref\.view %\w+\[%c(\d+)\]\[\] : memref<\?xi8, #gpu\.address_space<workgroup>> to memref<{}xbf16"
    untiled = set(re.findall(view.format("2x2x2x64x64"), text))
    tiled = set(re.findall(view.format("2x2x2x8x1x8x64"), text))
    assert len(untiled) == 2 and untiled == tiled, (untiled, tiled)
