"""Fast CPU tests of the pallas_sm90 backend's pieces (no kernel launches).

* The straight-line PTX programs the GPU epilogue runs, executed by their
  numpy simulator, equal the oracle bit for bit (NaN payloads aside).
* tile_math.plog (the fold's log) equals oracle.plog.
* Split geometry per shard, tiles per group, bucket table, input checks.
* Every launch bucket lowers for cuda (Mosaic GPU's Python half runs here).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import numerics, contract as C
from detlogp_jax import oracle

pk = pytest.importorskip("pallas_kernels")
from pallas_kernels import ptx_ops, ptx_programs, sm90_forward, tile_math, tuning  # noqa: E402


def _same(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | both_nan))


def _inputs(n=60000, seed=0):
    rng = np.random.default_rng(seed)
    specials = np.array(
        [0.0, -0.0, np.nan, -np.inf, np.inf, -104.0, -103.99999, -87.33, -88.72, 1e-40, -1e-40,
         -(2.0**-126), -(2.0**-127), -150.0, -1e30, 88.0, 1.0, -1.0],
        np.float32,
    )
    a = np.concatenate([
        rng.uniform(-120, 0, n), -np.exp(rng.uniform(-140, 5, n)), rng.standard_normal(n) * 30, specials,
    ]).astype(np.float32)
    b = np.concatenate([rng.uniform(-5, 5, a.size - specials.size), np.zeros(specials.size)]).astype(np.float32)
    return a, b


def test_ptx_pexp_diff_equals_oracle():
    a, b = _inputs()
    assert _same(ptx_programs.PEXP_DIFF.simulate(a, b), oracle.pexp(oracle.f_sub(a, b)))
    # every ordered pair of specials, both ways round
    s = a[-18:]
    x, y = np.meshgrid(s, s)
    assert _same(ptx_programs.PEXP_DIFF.simulate(x, y), oracle.pexp(oracle.f_sub(x, y)))
    assert _same(ptx_programs.PEXP.simulate(a), oracle.pexp(a))


@pytest.mark.parametrize("prog,ref", [("MUL", oracle.f_mul), ("ADD", oracle.f_add), ("SUB", oracle.f_sub)])
def test_ptx_single_ops_equal_oracle(prog, ref):
    a, b = _inputs(seed=1)
    assert _same(getattr(ptx_programs, prog).simulate(a, b), ref(a, b))


def test_ptx_text_is_pinned():
    """Only explicitly rounded, FTZ f32 arithmetic and exact int/select ops; no FMA."""
    allowed = {
        "mul.rn.ftz.f32", "add.rn.ftz.f32", "sub.rn.ftz.f32", "setp.lt.f32", "setp.nan.f32", "selp.f32",
        "selp.b32", "mov.b32", "add.s32", "sub.s32", "shl.b32", "setp.lt.s32", "mov.f32",
    }
    for prog in (ptx_programs.PEXP_DIFF, ptx_programs.PEXP, ptx_programs.MUL, ptx_programs.ADD, ptx_programs.SUB):
        text = prog.ptx()
        assert "fma" not in text and "approx" not in text and "ex2" not in text
        ops = {m.group(1) for m in re.finditer(r"^\s*([a-z][\w.]*)\s", text, re.M)}
        assert ops <= allowed, ops - allowed


def test_plog_equals_oracle():
    rng = np.random.default_rng(3)
    x = np.concatenate([
        rng.uniform(0, 300, 50000), np.exp(rng.uniform(-100, 88, 50000)),
        [0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, np.nan, -1, 1, 2.0**-126, 3.4e38],
    ]).astype(np.float32)
    f = jax.jit(lambda v: tile_math.plog(v, ptx_ops.InterpretOps(numerics.opaque_zero(v))))
    assert _same(f(x), oracle.plog(x))


def test_ftz_matches_oracle():
    x = np.array([1e-40, -1e-40, 0.0, -0.0, 2.0**-126, -(2.0**-126), np.inf, np.nan, 1.0], np.float32)
    assert _same(jax.jit(numerics.ftz)(x), oracle.ftz(x))


def test_qwen_geometry():
    g = sm90_forward.shard_geometry(151936, 152064)
    assert g.n_local == 264 and g.max_tiles == 9 and g.tiles_per_group == 3 and g.n_groups == 3
    plan = C.split_bounds(152064)
    assert g.local_starts == plan.starts and g.local_ends == plan.ends


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_shards_are_split_aligned(tp):
    vp = 152064
    width = vp // tp
    seen = []
    for r in range(tp):
        g = sm90_forward.shard_geometry(151936, vp, col_offset=r * width, shard_cols=width)
        assert g.n_local == 264 // tp
        seen += list(range(g.split_first, g.split_first + g.n_local))
    assert seen == list(range(264))


def test_misaligned_shard_raises():
    with pytest.raises(C.ContractError):
        sm90_forward.shard_geometry(151936, 152064, col_offset=64, shard_cols=76032)
    with pytest.raises(C.ContractError):
        sm90_forward.shard_geometry(151936, 152064, col_offset=0, shard_cols=1000)


def test_split_formula_matches_plan():
    """The in-kernel split start/end arithmetic equals contract.split_bounds."""
    for vp in (512, 17408, 50688, 128512, 152064, 64 * 1001):
        g = sm90_forward.shard_geometry(min(vp, 500), vp)
        plan = C.split_bounds(vp)
        j = jnp.arange(plan.n_split, dtype=jnp.int32)
        s, e = sm90_forward._split_tiles(g, j)
        assert list(np.asarray(s)) == list(plan.starts) and list(np.asarray(e)) == list(plan.ends), vp


def test_tiles_per_group_depends_on_plan_only():
    assert tuning.tiles_per_group((9,)) == 3
    assert tuning.tiles_per_group((1, 2)) == 2
    assert tuning.tiles_per_group((1,)) == 1
    assert tuning.tiles_per_group((4,)) == 4
    assert tuning.tiles_per_group((8,)) == 4


def test_buckets():
    assert tuning.select_bucket(1).name == "decode"
    assert tuning.select_bucket(64).name == "decode"
    assert tuning.select_bucket(65).name == "small"
    assert tuning.select_bucket(4096).name == "prefill"
    assert tuning.select_bucket(7, "prefill").name == "prefill"
    with pytest.raises(ValueError):
        tuning.select_bucket(7, "nope")
    for cfg in tuning.BUCKETS.values():
        assert cfg.block_m in (64, 128) and cfg.num_compute_wgs in (1, 2)


def test_cluster_rows_and_ctas():
    """A 2-CTA cluster pads rows to two row blocks and launches an even CTA count."""
    import dataclasses

    c2 = dataclasses.replace(tuning.BUCKETS["prefill"], name="c2", cluster=2)
    assert c2.row_quantum == 256 and tuning.BUCKETS["prefill"].row_quantum == 128
    assert tuning.padded_rows(640, tuning.BUCKETS["prefill"]) == 640  # 5 row blocks
    assert tuning.padded_rows(640, c2) == 768  # 6: the pair of the fifth block is padding
    assert tuning.padded_rows(0, c2) == 256
    assert tuning.persistent_ctas(768, 264, c2, 132) == 132
    assert tuning.persistent_ctas(256, 1, c2, 132) == 2  # one pair of row blocks, one split
    assert tuning.persistent_ctas(4096, 264, c2, 131) == 130  # a whole number of clusters
    assert tuning.persistent_ctas(128, 1, tuning.BUCKETS["prefill"], 132) == 1


def test_ws_kernel_refuses_delay_release():
    import dataclasses

    cfg = dataclasses.replace(tuning.BUCKETS["decode"], name="d", delay_release=1)
    h = jnp.zeros((4, 128), jnp.bfloat16)
    w = jnp.zeros((64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="delay_release"):
        pk.partials(h, w, None, jnp.zeros((4,), jnp.int32), jnp.ones((4,), jnp.float32), vocab_size=64,
                    padded_vocab_size=64, bucket=cfg, interpret=True)


def test_cluster_refused_in_interpret_mode():
    import dataclasses

    c2 = dataclasses.replace(tuning.BUCKETS["prefill"], name="c2", cluster=2)
    h = jnp.zeros((4, 128), jnp.bfloat16)
    w = jnp.zeros((64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="multicast"):
        pk.partials(h, w, None, jnp.zeros((4,), jnp.int32), jnp.ones((4,), jnp.float32), vocab_size=64,
                    padded_vocab_size=64, bucket=c2, interpret=True)


def test_supports_and_input_errors():
    h = jnp.zeros((4, 128), jnp.bfloat16)
    w = jnp.zeros((64, 128), jnp.bfloat16)
    assert pk.supports(h, w) == (True, "ok")
    assert not pk.supports(h.astype(jnp.float32), w)[0]
    assert not pk.supports(jnp.zeros((4, 96), jnp.bfloat16), jnp.zeros((64, 96), jnp.bfloat16))[0]
    t = jnp.zeros((4,), jnp.int32)
    it = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match="bf16"):
        pk.partials(h.astype(jnp.float32), w, None, t, it, vocab_size=64, padded_vocab_size=64)
    with pytest.raises(ValueError, match="multiple of 64"):
        pk.partials(jnp.zeros((4, 96), jnp.bfloat16), jnp.zeros((64, 96), jnp.bfloat16), None, t, it,
                    vocab_size=64, padded_vocab_size=64)
    with pytest.raises(ValueError, match="cover"):
        pk.partials(h, w, None, t, it, vocab_size=100, padded_vocab_size=128)
    assert pk.BACKEND_NAME == "pallas_sm90"


def _lower(n, d, v, vp, bucket, bias, logits, col_offset=0, shard_cols=None):
    vl = v if shard_cols is None else min(v - col_offset, shard_cols)
    h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((vl, d), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((vl,), jnp.float32) if bias else None
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    it = jax.ShapeDtypeStruct((n,), jnp.float32)

    def f(h, w, b, t, it):
        return pk.partials(h, w, b, t, it, vocab_size=v, padded_vocab_size=vp, col_offset=col_offset,
                           shard_cols=shard_cols, return_logits=logits, bucket=bucket)

    jax.jit(f).trace(h, w, b, t, it).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("bucket", sorted(tuning.BUCKETS))
def test_forward_lowers_for_cuda(bucket):
    _lower(70, 192, 1000, 1024, bucket, bias=True, logits=True)
    _lower(70, 192, 1000, 1024, bucket, bias=False, logits=False, col_offset=512, shard_cols=512)


def test_cluster_forward_lowers_for_cuda():
    import dataclasses

    c2 = dataclasses.replace(tuning.BUCKETS["prefill"], name="c2", cluster=2)
    _lower(300, 192, 1000, 1024, c2, bias=True, logits=True)


@pytest.mark.parametrize("n,n_split,knobs", [
    (300, 264, {}), (1, 37, {}), (5, 9, {"chunk": 4}), (70, 1, {}), (3, 1000, {}),
    (300, 264, {"staged": False}), (64, 264, {"rows": 64}),
])
def test_fold_lowers_for_cuda(n, n_split, knobs):
    a = jax.ShapeDtypeStruct((n, n_split), jnp.float32)
    v = jax.ShapeDtypeStruct((n,), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    jax.jit(lambda *x: pk.fold(*x, 151936, **knobs)).trace(a, a, v, t, v).lower(lowering_platforms=("cuda",))


@pytest.mark.slow
def test_qwen_forward_lowers_for_cuda():
    _lower(4096, 4096, 151936, 152064, "prefill", bias=False, logits=False)
    _lower(1, 4096, 151936, 152064, "decode", bias=False, logits=True)
