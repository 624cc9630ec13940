"""Fast CPU tests of the pallas_sm90 backend's pieces (no kernel launches).

* The straight-line PTX programs the GPU epilogue runs, executed by their
  numpy simulator, equal the oracle bit for bit (NaN payloads aside).
* tile_math.plog (the fold's log) equals oracle.plog.
* Split geometry per shard, tiles per group, bucket table, input checks.
* The per-kernel configs (tuning.WgmmaForwardConfig, WsForwardConfig,
  FoldConfig, DzConfig) refuse bad values when made; the shipped ones are pinned.
* Every launch bucket lowers for cuda (Mosaic GPU's Python half runs here).
* The interpret-mode wgmma model (`interpret_utils.row_invariant_wgmma`) is a fixed-order
  float64 sum per element: row-invariant and the same from any thread.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import contract as C
from detlogp_jax import numerics, oracle

pk = pytest.importorskip("pallas_kernels")
from pallas_kernels import common, ptx_ops, ptx_programs, tile_math, tuning  # noqa: E402


def _same(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | both_nan))


def _inputs(n=60000, seed=0):
    rng = np.random.default_rng(seed)
    specials = np.array(
        [
            0.0,
            -0.0,
            np.nan,
            -np.inf,
            np.inf,
            -104.0,
            -103.99999,
            -87.33,
            -88.72,
            1e-40,
            -1e-40,
            -(2.0**-126),
            -(2.0**-127),
            -150.0,
            -1e30,
            88.0,
            1.0,
            -1.0,
        ],
        np.float32,
    )
    a = np.concatenate(
        [
            rng.uniform(-120, 0, n),
            -np.exp(rng.uniform(-140, 5, n)),
            rng.standard_normal(n) * 30,
            specials,
        ]
    ).astype(np.float32)
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
        "mul.rn.ftz.f32",
        "add.rn.ftz.f32",
        "sub.rn.ftz.f32",
        "setp.lt.f32",
        "setp.nan.f32",
        "selp.f32",
        "selp.b32",
        "mov.b32",
        "add.s32",
        "sub.s32",
        "shl.b32",
        "setp.lt.s32",
        "mov.f32",
        "setp.eq.f32",  # the entropy's lane term (e == 0)
        "div.rn.ftz.f32",  # the entropy's rcp(S): IEEE division, round-to-nearest-even
    }
    progs = (ptx_programs.PEXP_DIFF, ptx_programs.PEXP, ptx_programs.MUL, ptx_programs.ADD, ptx_programs.SUB)
    for prog in progs + (ptx_programs.ENTROPY_TERM, ptx_programs.RCP):
        text = prog.ptx()
        assert "fma" not in text and "approx" not in text and "ex2" not in text
        ops = {m.group(1) for m in re.finditer(r"^\s*([a-z][\w.]*)\s", text, re.M)}
        assert ops <= allowed, ops - allowed


def test_ptx_entropy_term_equals_oracle():
    """ENTROPY_TERM (e, d) -> (e == 0) ? +0 : mul.rn.ftz(e, d), executed by the simulator, ==
    the oracle's u on exps of differences (incl. +-0, -inf, NaN, underflow, subnormal products)."""
    a, b = _inputs(seed=4)
    d = oracle.f_sub(a, b)
    d = d[~(d > 0)]  # the kernels' domain: d = fl(y - m') <= 0 (or NaN); pexp is not defined above ~88
    e = oracle.pexp(d)
    want = np.where(e == 0, np.float32(0), oracle.f_mul(e, d)).astype(np.float32)
    assert _same(ptx_programs.ENTROPY_TERM.simulate(e, d), want)
    # +0 for a zero e whatever d is (-inf, NaN, -0), the sign of a zero product kept otherwise
    e2 = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 2.0**-125, np.nan, 1.0], np.float32)
    d2 = np.array([-np.inf, np.nan, -0.0, -0.0, 0.0, -(2.0**-3), -1.0, np.inf], np.float32)
    got = ptx_programs.ENTROPY_TERM.simulate(e2, d2)
    assert _same(got[:6], np.array([0.0, 0.0, 0.0, -0.0, 0.0, -0.0], np.float32))  # -2^-128 flushed to -0 (FTZ)
    assert np.isnan(got[6]) and got[7] == np.inf
    # interpret mode's entry point gives the same bits
    ops = ptx_ops.InterpretOps(numerics.opaque_zero(jnp.asarray(e)))
    assert _same(jax.jit(ops.entropy_term)(e, d), want)


def test_ptx_rcp_equals_oracle_and_reciprocal_rn():
    """RCP = div.rn.ftz.f32 1.0 / s (simulated as IEEE division under FTZ) == oracle.reciprocal ==
    numerics.reciprocal_rn (the integer division interpret mode and XLA use) on every significand of
    a few exponents, random S of a fold's range, and the specials."""
    rng = np.random.default_rng(9)
    sig = np.arange(1 << 23, dtype=np.uint32)
    grid = np.concatenate([(sig | np.uint32(e << 23)).view(np.float32) for e in (127, 130, 200)])
    x = np.concatenate(
        [
            grid,
            np.exp(rng.uniform(0, 80, 100000)).astype(np.float32),
            np.array([0.0, -0.0, 1e-40, np.inf, -np.inf, np.nan, 1.0, 2.0**126, 2.0**127, 3.4e38, -2.5], np.float32),
        ]
    )
    got = ptx_programs.RCP.simulate(x)
    assert _same(got, oracle.reciprocal(x))
    assert _same(got, jax.jit(numerics.reciprocal_rn)(x))


def test_interpret_pins_survive_a_dropped_add_of_zero():
    """InterpretOps pins by an integer add of the opaque zero: with numerics.XlaOps' xor, a sum
    starting from +0 (0 + t0, dropped by XLA) cancelled t0's pin and LLVM fused t0's product into
    the next add (an FMA, one ulp off here); the pinned sum now equals the oracle's."""
    s = np.array([[38.120705, 24.510519]], np.float32)
    w = np.array([[0x3EA1EAF5, 0x3C7BA890]], np.uint32).view(np.float32)
    want = oracle.f_add(oracle.f_add(np.float32(0), oracle.f_mul(s[0, 0], w[0, 0])), oracle.f_mul(s[0, 1], w[0, 1]))

    @jax.jit
    def chain(s, w, src):
        ops = ptx_ops.InterpretOps(numerics.opaque_zero(src))
        acc = jnp.zeros_like(s[:, 0])
        for j in range(2):
            acc = ops.add(acc, ops.mul(s[:, j], w[:, j]))
        return acc

    assert _same(chain(s, w, jnp.ones((1,), jnp.float32)), want[None])


def test_plog_equals_oracle():
    rng = np.random.default_rng(3)
    x = np.concatenate(
        [
            rng.uniform(0, 300, 50000),
            np.exp(rng.uniform(-100, 88, 50000)),
            [0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, np.nan, -1, 1, 2.0**-126, 3.4e38],
        ]
    ).astype(np.float32)
    f = jax.jit(lambda v: tile_math.plog(v, ptx_ops.InterpretOps(numerics.opaque_zero(v))))
    assert _same(f(x), oracle.plog(x))


def test_ftz_matches_oracle():
    x = np.array([1e-40, -1e-40, 0.0, -0.0, 2.0**-126, -(2.0**-126), np.inf, np.nan, 1.0], np.float32)
    assert _same(jax.jit(numerics.ftz)(x), oracle.ftz(x))


def test_qwen_geometry():
    g = pk.shard_geometry(151936, 152064)
    assert g.n_local == 264 and g.max_tiles == 9 and g.tiles_per_group == 3 and g.n_groups == 3
    plan = C.split_bounds(152064)
    assert g.local_starts == plan.starts and g.local_ends == plan.ends


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_shards_are_split_aligned(tp):
    vp = 152064
    width = vp // tp
    seen = []
    for r in range(tp):
        g = pk.shard_geometry(151936, vp, col_offset=r * width, shard_cols=width)
        assert g.n_local == 264 // tp
        seen += list(range(g.split_first, g.split_first + g.n_local))
    assert seen == list(range(264))


def test_misaligned_shard_raises():
    with pytest.raises(C.ContractError):
        pk.shard_geometry(151936, 152064, col_offset=64, shard_cols=76032)
    with pytest.raises(C.ContractError):
        pk.shard_geometry(151936, 152064, col_offset=0, shard_cols=1000)


def test_split_formula_matches_plan():
    """The in-kernel split start/end arithmetic equals contract.split_bounds."""
    for vp in (512, 17408, 50688, 128512, 152064, 64 * 1001):
        g = common.shard_geometry(min(vp, 500), vp)
        plan = C.split_bounds(vp)
        j = jnp.arange(plan.n_split, dtype=jnp.int32)
        s, e = common.split_tiles(g, j)
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
    assert tuning.select_bucket(256).name == "small"
    assert tuning.select_bucket(257).name == "mid"
    assert tuning.select_bucket(2048).name == "mid"
    assert tuning.select_bucket(2049).name == "prefill"
    assert tuning.select_bucket(4096).name == "prefill"
    assert tuning.select_bucket(7, "prefill").name == "prefill"
    with pytest.raises(ValueError):
        tuning.select_bucket(7, "nope")
    for cfg in tuning.BUCKETS.values():
        assert cfg.block_m in (64, 128) and cfg.num_compute_wgs in (1, 2)


def test_shipped_configs_are_pinned():
    """The bucket table, the fold's and the dz kernel's configs carry the shipped values (each
    field; the Mosaic hash guard benchmarks/mosaic_ir_hashes.py checks the programs)."""
    assert {k: c for k, c in tuning.BUCKETS.items() if k != "mid"} == {
        "decode": tuning.WsForwardConfig(
            "decode",
            block_m=64,
            num_compute_wgs=1,
            max_concurrent_steps=5,
            ctas_per_sm=1,
            split_group=0,
        ),
        "small": tuning.WgmmaForwardConfig(
            "small",
            block_m=64,
            num_compute_wgs=2,
            max_concurrent_steps=4,
            ctas_per_sm=1,
            split_group=0,
            logits_slots=2,
        ),
        "prefill": tuning.WsForwardConfig(
            "prefill",
            block_m=64,
            num_compute_wgs=2,
            max_concurrent_steps=3,
            ctas_per_sm=1,
            split_group=4,
        ),
    }
    assert tuning.BUCKETS["mid"] == dataclasses.replace(tuning.BUCKETS["prefill"], name="mid", split_group=2)
    assert tuning.FOLD == tuning.FoldConfig(rows=32, chunk=64, unroll=None)
    assert tuning.DECODE_FOLD == tuning.FoldConfig(rows=8, chunk=64, unroll=None)
    assert tuning.DECODE_ROWS == 64
    assert tuning.DH_GEMM == tuning.GradGemmConfig(
        tile_m=128, tile_n=256, max_concurrent_steps=3, col_group=8, cluster=True
    )
    assert tuning.DW_GEMM == tuning.GradGemmConfig(
        tile_m=128, tile_n=256, max_concurrent_steps=4, col_group=8, cluster=True
    )
    assert tuning.DZ == tuning.DzConfig(block_m=64, num_compute_wgs=2, block_n=256, max_concurrent_steps=4, col_group=4)
    assert tuning.DZ.rows_per_cta == 128
    assert tuning.BUCKET_TABLE == ((64, "decode"), (256, "small"), (2048, "mid"), (1 << 62, "prefill"))


@pytest.mark.parametrize("name", sorted(tuning.BUCKETS))
def test_each_bucket_builds(name):
    """Every bucket's config re-validates (dataclasses.replace runs __post_init__) and builds its
    kernel (the builder's own checks: stages, shared memory, register split)."""
    from pallas_kernels import sm90_forward_wgmma, sm90_forward_ws

    cfg = dataclasses.replace(tuning.BUCKETS[name])
    assert cfg == tuning.BUCKETS[name]
    module = sm90_forward_ws if isinstance(cfg, tuning.WsForwardConfig) else sm90_forward_wgmma
    geom = pk.shard_geometry(151936, 152064)
    n_pad = tuning.padded_rows(4096, cfg)
    for logits in (False, True):
        module.build(
            n_pad=n_pad,
            d=4096,
            lg_cols=151936,
            geom=geom,
            cfg=cfg,
            has_bias=True,
            return_logits=logits,
            num_ctas=132,
            interpret=False,
            lg_rows=4096,
        )


_BAD_CONFIGS = [
    (tuning.WgmmaForwardConfig, dict(block_m=32), "block_m"),
    (tuning.WgmmaForwardConfig, dict(block_m=96), "block_m"),
    (tuning.WgmmaForwardConfig, dict(num_compute_wgs=3), "num_compute_wgs"),
    (tuning.WgmmaForwardConfig, dict(num_compute_wgs=0), "num_compute_wgs"),
    (tuning.WgmmaForwardConfig, dict(max_concurrent_steps=0), "max_concurrent_steps"),
    (tuning.WgmmaForwardConfig, dict(ctas_per_sm=0), "ctas_per_sm"),
    (tuning.WgmmaForwardConfig, dict(split_group=-1), "split_group"),
    (tuning.WgmmaForwardConfig, dict(logits_slots=0), "logits_slots"),
    (tuning.WgmmaForwardConfig, dict(name=""), "name"),
    (tuning.WsForwardConfig, dict(block_m=256), "block_m"),
    (tuning.WsForwardConfig, dict(num_compute_wgs=3), "num_compute_wgs"),
    (tuning.WsForwardConfig, dict(max_concurrent_steps=-1), "max_concurrent_steps"),
]


@pytest.mark.parametrize("cls,bad,what", _BAD_CONFIGS, ids=lambda x: str(x) if isinstance(x, dict) else None)
def test_forward_configs_refuse_bad_values(cls, bad, what):
    base = dict(name="t", block_m=64, num_compute_wgs=2, max_concurrent_steps=3)
    cls(**base)  # the base itself is valid
    with pytest.raises(ValueError, match=what):
        cls(**{**base, **bad})


def test_configs_have_only_their_kernels_fields():
    """logits_slots belongs to the chain-in-wgmma kernel; the ws kernel's config has the shared
    fields only (its hand-off, registers and epilogue warpgroup are fixed); the shared part is
    not a config of any kernel; the configs and the bucket table are frozen."""
    assert {f.name for f in dataclasses.fields(tuning.WsForwardConfig)} == {
        f.name for f in dataclasses.fields(tuning.ForwardConfig)
    }
    with pytest.raises(TypeError):
        dataclasses.replace(tuning.BUCKETS["prefill"], logits_slots=2)
    for gone in ("cluster", "mma_stagger", "epilogue_wgs", "handoff", "tile_k", "delay_release"):
        with pytest.raises(TypeError):
            dataclasses.replace(tuning.BUCKETS["prefill"], **{gone: 1})
    with pytest.raises(TypeError):
        dataclasses.replace(tuning.BUCKETS["small"], delay_release=1)
    with pytest.raises(TypeError):
        tuning.ForwardConfig("x", block_m=64, num_compute_wgs=1, max_concurrent_steps=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.BUCKETS["small"].block_m = 128
    with pytest.raises(TypeError):  # the table is read-only: another launch is a config passed in
        tuning.BUCKETS["small"] = tuning.BUCKETS["mid"]


@pytest.mark.parametrize(
    "bad,what",
    [
        (dict(rows=48), "rows"),
        (dict(rows=128), "rows"),
        (dict(chunk=0), "chunk"),
        (dict(chunk=257), "chunk"),
        (dict(chunk=6), "chunk"),  # rows=32: a multiple of 4
        (dict(rows=64, chunk=3), "chunk"),  # rows=64: a multiple of 2
        (dict(unroll=0), "unroll"),
    ],
)
def test_fold_config_refuses_bad_values(bad, what):
    with pytest.raises(ValueError, match=what):
        tuning.FoldConfig(**bad)
    tuning.FoldConfig(rows=64, chunk=6, unroll=5)  # valid


def test_fold_knobs_are_fold_config_fields():
    from pallas_kernels import sm90_fold

    assert sm90_fold.config(rows=8) == tuning.FoldConfig(rows=8)
    assert sm90_fold.config() is tuning.FOLD
    with pytest.raises(TypeError, match="unknown fold knobs"):
        sm90_fold.config(rows_per_cta=32)
    with pytest.raises(TypeError, match="unknown fold knobs"):
        sm90_fold.config(staged=False)  # (the row-per-thread fold left the tree)
    with pytest.raises(ValueError, match="chunk"):
        pk.fold(
            np.zeros((2, 3), np.float32),
            np.zeros((2, 3), np.float32),
            np.zeros(2, np.float32),
            np.zeros(2, np.int32),
            np.ones(2, np.float32),
            100,
            interpret=True,
            chunk=5,
        )


@pytest.mark.parametrize(
    "bad,what",
    [
        (dict(block_m=32), "block_m"),
        (dict(num_compute_wgs=3), "num_compute_wgs"),
        (dict(block_n=320), "block_n"),
        (dict(block_n=100), "block_n"),
        (dict(max_concurrent_steps=0), "max_concurrent_steps"),
        (dict(col_group=-1), "col_group"),
    ],
)
def test_dz_config_refuses_bad_values(bad, what):
    with pytest.raises(ValueError, match=what):
        tuning.DzConfig(**bad)


def test_rows_and_ctas():
    """Rows pad to whole row blocks; one persistent CTA per work item, at most the given count."""
    pre = tuning.BUCKETS["prefill"]
    assert tuning.padded_rows(640, pre) == 640 and tuning.padded_rows(641, pre) == 768
    assert tuning.padded_rows(0, pre) == 128
    assert tuning.persistent_ctas(768, 264, pre, 132) == 132
    assert tuning.persistent_ctas(128, 1, pre, 132) == 1
    assert tuning.persistent_ctas(4096, 264, pre, 131) == 131


def test_partials_refuses_a_config_of_no_kernel():
    h = jnp.zeros((4, 128), jnp.bfloat16)
    w = jnp.zeros((64, 128), jnp.bfloat16)
    with pytest.raises(TypeError):
        pk.partials(
            h,
            w,
            None,
            jnp.zeros((4,), jnp.int32),
            jnp.ones((4,), jnp.float32),
            vocab_size=64,
            padded_vocab_size=64,
            bucket=tuning.FOLD,
            interpret=True,
        )


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
        pk.partials(
            jnp.zeros((4, 96), jnp.bfloat16),
            jnp.zeros((64, 96), jnp.bfloat16),
            None,
            t,
            it,
            vocab_size=64,
            padded_vocab_size=64,
        )
    with pytest.raises(ValueError, match="cover"):
        pk.partials(h, w, None, t, it, vocab_size=100, padded_vocab_size=128)
    assert pk.BACKEND_NAME == "pallas_sm90"


def _lower(n, d, v, vp, bucket, bias, logits, col_offset=0, shard_cols=None, weight_layout="vd", vl=None):
    if vl is None:
        vl = v if shard_cols is None else min(v - col_offset, shard_cols)
    h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, vl) if weight_layout == "dv" else (vl, d), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((vl,), jnp.float32) if bias else None
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    it = jax.ShapeDtypeStruct((n,), jnp.float32)

    def f(h, w, b, t, it):
        return pk.partials(
            h,
            w,
            b,
            t,
            it,
            vocab_size=v,
            padded_vocab_size=vp,
            col_offset=col_offset,
            shard_cols=shard_cols,
            return_logits=logits,
            bucket=bucket,
            weight_layout=weight_layout,
        )

    return jax.jit(f).trace(h, w, b, t, it).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("bucket", sorted(tuning.BUCKETS))
def test_forward_lowers_for_cuda(bucket):
    """Every bucket (the ws kernel's swizzled hand-off: [bm, 32] halves stored from the
    accumulator, loaded whole and sliced in registers, TMA-stored as logits) lowers for CUDA."""
    _lower(70, 192, 1000, 1024, bucket, bias=True, logits=True)
    _lower(70, 192, 1000, 1024, bucket, bias=False, logits=False, col_offset=512, shard_cols=512)


@pytest.mark.slow
@pytest.mark.parametrize("bucket", sorted(tuning.BUCKETS))
def test_dv_forward_lowers_for_cuda(bucket):
    """weight_layout="dv": Mosaic accepts the [64, 64 w] TMA blocks of a [D, V] weight
    (tiling/swizzle over the vocab columns) and the N-major wgmma B operand, for both kernels,
    both entries, a TP shard."""
    rows = 70
    _lower(rows, 192, 1000, 1024, bucket, bias=True, logits=True, weight_layout="dv", vl=1024)
    _lower(
        rows,
        192,
        1000,
        1024,
        bucket,
        bias=False,
        logits=False,
        col_offset=512,
        shard_cols=512,
        weight_layout="dv",
        vl=512,
    )


def test_dv_wgmma_reads_b_n_major_with_the_same_instructions():
    """The dv module issues the vd module's wgmma instructions (same m64nNk16 shapes and
    count) with wgmma's B-transpose immediate set (an N-major B read from shared memory)
    where vd has it clear (a K-major B seen through .T); the immediates are the last
    operands of each wgmma's inline PTX (tnspA, tnspB after use-out, scale-a, scale-b)."""
    from jax.experimental.mosaic.gpu import core as mosaic_core

    captured = []
    original = mosaic_core._run_serde_pass

    def capture(module, *args, **kwargs):
        if kwargs.get("serialize"):
            captured.append(module.operation.get_asm(enable_debug_info=False))
        return original(module, *args, **kwargs)

    mosaic_core._run_serde_pass = capture
    try:
        for layout in ("vd", "dv"):
            _lower(128, 128, 328, 512, "small", bias=False, logits=False, weight_layout=layout, vl=512)
    finally:
        mosaic_core._run_serde_pass = original
    vd, dv = captured[-2:]
    instr = lambda text: re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", text)
    assert instr(vd) and instr(vd) == instr(dv)

    def transposes(text):
        consts = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i32\) : i32", text))
        out = set()
        for line in text.splitlines():
            if "wgmma.mma_async" in line:
                operands = re.search(r"\"\s+([^\"]*?) : \(", line).group(1).split(", ")
                out.add(tuple(consts[o] for o in operands[-2:]))  # the immediates (tnspA, tnspB)
        return out

    assert transposes(vd) == {("0", "0")}
    assert transposes(dv) == {("0", "1")}


@pytest.mark.parametrize(
    "n,n_split,knobs",
    [
        (300, 264, {}),
        (1, 37, {}),
        (5, 9, {"chunk": 4}),
        (70, 1, {}),
        (3, 600, {}),
        (64, 264, {"rows": 64}),
        (1, 264, {"rows": 8}),
    ],
)
def test_fold_lowers_for_cuda(n, n_split, knobs):
    a = jax.ShapeDtypeStruct((n, n_split), jnp.float32)
    v = jax.ShapeDtypeStruct((n,), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    jax.jit(lambda *x: pk.fold(*x, 151936, **knobs)).trace(a, a, v, t, v).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("n,n_split,entropy", [(300, 264, False), (1, 264, False), (64, 264, True), (5, 9, False)])
def test_fold_with_split_captures_lowers_for_cuda(n, n_split, entropy):
    """The staged fold that ORs the forward's split captures into z_t itself
    (`fold_transposed(ztT=...)`, `build(zt_splits=True)`) lowers for CUDA, with the entropy too
    (four SMEM arrays at 264 splits)."""
    from pallas_kernels import sm90_fold

    assert sm90_fold.staged_fits(264, entropy=True, zt_splits=True)
    a = jax.ShapeDtypeStruct((n_split, n), jnp.float32)
    v = jax.ShapeDtypeStruct((n,), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)

    def f(m, s, st, zt, tt, it):
        return sm90_fold.fold_transposed(m, s, None, tt, it, 151936, aT=st if entropy else None, ztT=zt)

    jax.jit(f).trace(a, a, a, a, t, v).lower(lowering_platforms=("cuda",))


def _lower_forward(n, bucket=None, **kw) -> str:
    """The StableHLO text of pk.forward (logp, lse) at the Qwen3-8B head, N = n, lowered for CUDA."""
    d, v, vp = 4096, 151936, 152064
    args = [
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((vp, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    ]

    def f(h, w, t, it):
        out = pk.forward(h, w, None, t, it, vocab_size=v, padded_vocab_size=vp, bucket=bucket, **kw)
        return out[0], out[1]

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _forward_ops(n, bucket=None, **kw):
    """The StableHLO ops (by name) of `_lower_forward`."""
    return re.findall(r"\bstablehlo\.([a-z_]+)", _lower_forward(n, bucket, **kw))


@pytest.mark.slow
@pytest.mark.parametrize(
    "n,bucket", [(1, None), (3, None), (8, None), (13, None), (296, None), (72, "decode"), (1, "mid"), (70, "prefill")]
)
def test_forward_has_no_xla_glue_where_the_rows_do_not_fill_the_kernel(n, bucket):
    """pk.forward(unpadded=True) on the GPU with N not a multiple of the kernel's rows (a decode call, a
    296-row prefill chunk): the whole call is the two Mosaic kernels: no row pads of hidden /
    targets / inv_t, no XLA select of z_t (the fold ORs the split captures), no output slices
    (the fold writes [N]). In one row block (1, 3, 8, 13) targets / inv_t go in as they are
    (scalar loads in both kernels); hidden too where N < 8 or a multiple of 8, and at 13 rows
    hidden alone is padded to 16 (Mosaic's tiled TMA takes no other row count >= 8). The mid /
    prefill buckets' 128-row block at 1 and 70 rows (two hand-off buffers, the second at M=1
    with no real row: Mosaic's layout inference once failed on its unused iota). Calls of
    several row blocks (296; 72 rows in the decode bucket's two blocks) stay padded. With
    unpadded=False the pads to 64 / 384 rows and the slices are back (the contrast that makes
    this test able to fail); the default is unpadded=True."""
    one_block = n < tuning.select_bucket(n, bucket).cta_rows
    padded = _forward_ops(n, bucket, unpadded=False)
    assert "pad" in padded and "slice" in padded and "gather" not in padded, padded
    default = _forward_ops(n, bucket)
    assert default == _forward_ops(n, bucket, unpadded=True)
    if not one_block:
        assert default == padded
        return
    ops = [op for op in default if op not in ("constant", "convert")]  # (pad values)
    if n > 8 and n % 8:  # (13, 70: hidden rounded up to 16 / 72 rows)
        assert ops == ["pad", "custom_call", "custom_call"], ops
    else:
        assert ops == ["custom_call", "custom_call"], ops


def test_one_row_block_is_a_call_that_leaves_its_one_row_block_part_empty():
    """tuning.one_row_block: the calls whose rows go in unpadded by default (decode): fewer rows
    than the config's one row block; not a full block, not several."""
    dec, mid = tuning.BUCKETS["decode"], tuning.BUCKETS["mid"]
    assert tuning.one_row_block(1, dec) and tuning.one_row_block(63, dec) and tuning.one_row_block(70, mid)
    assert not tuning.one_row_block(64, dec) and not tuning.one_row_block(65, dec)


_ENTROPY_VARIANTS = [
    *sorted(tuning.BUCKETS),
    dataclasses.replace(tuning.BUCKETS["small"], name="small-g3", split_group=3),
    dataclasses.replace(tuning.BUCKETS["prefill"], name="prefill-1wg", num_compute_wgs=1),
]


def _lower_entropy(n, d, v, vp, bucket, bias, logits, weight_layout="vd", vl=None, **kw):
    vl = v if vl is None else vl
    args = [
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, vl) if weight_layout == "dv" else (vl, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((vl,), jnp.float32) if bias else None,
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    ]

    def f(h, w, b, t, it):
        out = pk.partials(
            h,
            w,
            b,
            t,
            it,
            vocab_size=v,
            padded_vocab_size=vp,
            return_logits=logits,
            bucket=bucket,
            weight_layout=weight_layout,
            return_entropy=True,
            **kw,
        )
        assert len(out) == 6 and out[5].shape == out[0].shape
        return out

    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.slow
@pytest.mark.parametrize("bucket", _ENTROPY_VARIANTS, ids=lambda b: getattr(b, "name", b))
def test_entropy_forward_lowers_for_cuda(bucket):
    """Both forward kernels built with return_entropy=True lower for CUDA (the PEXP /
    ENTROPY_TERM blocks, the A carry in the pipeline / epilogue loops, the fourth output):
    serving with bias, trainer on a TP shard, and a [D, V] weight."""
    rows = 70
    _lower_entropy(rows, 192, 1000, 1024, bucket, bias=True, logits=True)
    _lower_entropy(rows, 192, 1000, 1024, bucket, bias=False, logits=False, col_offset=512, shard_cols=512, vl=512)
    _lower_entropy(rows, 192, 1000, 1024, bucket, bias=False, logits=True, weight_layout="dv", vl=1024)


@pytest.mark.parametrize(
    "n,n_split,knobs",
    [(300, 264, {}), (1, 37, {}), (5, 9, {"chunk": 4}), (70, 1, {}), (3, 600, {"rows": 16}), (1, 264, {"rows": 8})],
)
def test_entropy_fold_lowers_for_cuda(n, n_split, knobs):
    """The fold with A lowers for CUDA: the A terms block, the two-sum chain block, the RCP
    block, the third output."""
    a = jax.ShapeDtypeStruct((n, n_split), jnp.float32)
    v = jax.ShapeDtypeStruct((n,), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)

    def f(m, s, st, z, tt, it):
        out = pk.fold(m, s, z, tt, it, 151936, a=st, **knobs)
        assert len(out) == 3
        return out

    jax.jit(f).trace(a, a, a, v, t, v).lower(lowering_platforms=("cuda",))


def test_pallas_entry_declares_the_entropy(monkeypatch):
    """The registry entry declares the entropy (validated on the H200) and resolve serves
    return_entropy=True on pallas_sm90; an entry that does not declare it refuses the entropy
    (explicit request -> BackendUnavailableError); the dz kernel (not contract-bearing) takes
    the entropy term either way."""
    from detlogp_jax import backends
    from pallas_kernels import backend as pallas_backend

    be = backends.get("pallas_sm90")
    assert be.entropy is True and be.dz.entropy is True
    assert pallas_backend.backend_entry().entropy is True
    h = jax.ShapeDtypeStruct((4, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 128), jnp.bfloat16)
    monkeypatch.setitem(backends._LOADED, "pallas_sm90", type(be)(**{**be.__dict__, "available": lambda: True}))
    assert backends.resolve("pallas_sm90", h, w, entropy=True)[0].entropy
    unset = type(be)(**{**be.__dict__, "available": lambda: True, "entropy": False})
    monkeypatch.setitem(backends._LOADED, "pallas_sm90", unset)
    with pytest.raises(backends.BackendUnavailableError, match="entropy"):
        backends.resolve("pallas_sm90", h, w, entropy=True)


@pytest.mark.slow
def test_qwen_forward_lowers_for_cuda():
    _lower(4096, 4096, 151936, 152064, "prefill", bias=False, logits=False)
    _lower(1, 4096, 151936, 152064, "decode", bias=False, logits=True)
    # A Flax/Tunix [4096, 151936] kernel read in place (unpadded, declared with the padded vocab).
    _lower(4096, 4096, 151936, 152064, "prefill", bias=False, logits=False, weight_layout="dv")
    _lower(1, 4096, 151936, 152064, "decode", bias=False, logits=True, weight_layout="dv")
    # The entropy variants at the Qwen3-8B shape (the hash tool lowers every one of them).
    _lower_entropy(4096, 4096, 151936, 152064, "prefill", bias=False, logits=False)
    _lower_entropy(1, 4096, 151936, 152064, "decode", bias=True, logits=True)
    _lower_entropy(65, 4096, 151936, 152064, "small", bias=False, logits=False)


def test_pallas_backend_resolves_a_dv_weight(monkeypatch):
    """The registry entry declares both layouts; resolve asks `supports` with the layout, so a
    [D, V] kernel with V % 64 == 0 is served, one with V % 64 != 0 raises for an explicit
    request and falls back under auto (on this CPU the backend is made 'available')."""
    from detlogp_jax import backends
    from detlogp_jax.layout import DV, VD

    be = backends.get("pallas_sm90")
    assert be.layouts == frozenset({VD, DV}) and be.reads("dv") and be.reads(DV)
    assert be.dz.layouts == frozenset({VD, DV})  # the dz kernel reads [D, chunk] slices too
    fake = type(be)(**{**be.__dict__, "available": lambda: True})
    monkeypatch.setitem(backends._LOADED, "pallas_sm90", fake)
    h = jax.ShapeDtypeStruct((4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
    assert backends.resolve("pallas_sm90", h, k, "dv") == (fake, False)
    assert backends.resolve("pallas_sm90", h, jax.ShapeDtypeStruct((512, 128), jnp.bfloat16), "vd") == (fake, False)
    odd = jax.ShapeDtypeStruct((128, 328), jnp.bfloat16)
    with pytest.raises(backends.BackendUnavailableError, match="multiple of 64"):
        backends.resolve("pallas_sm90", h, odd, "dv")
    monkeypatch.setattr(backends, "preferred", lambda: "pallas_sm90")
    monkeypatch.delenv("DETLOGP_BACKEND", raising=False)
    with pytest.warns(UserWarning, match="auto falls back"):
        got, fallback = backends.resolve("auto", h, odd, "dv")
    assert got.name == "reference" and fallback


@pytest.mark.slow
@pytest.mark.parametrize("entropy", [False, True], ids=["plain", "entropy"])
def test_the_unsharded_program_does_not_relayout_the_partials(monkeypatch, entropy):
    """linear_logp on pallas_sm90, lowered for CUDA: the two kernels (forward, fold) with no
    transpose of the split partials between them and, at this one-row decode call, no row pad
    either (`pk.forward(unpadded=True)`, its default) -- the fused forward (`Backend.fused_forward`); the partials + fold route it replaced
    transposes and pads the partials again (the positive control)."""
    import detlogp_jax as dl
    from detlogp_jax import backends

    fake = dataclasses.replace(backends.get("pallas_sm90"), available=lambda: True)
    h = jax.ShapeDtypeStruct((1, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 128), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((1,), jnp.int32)

    def ops(be):
        monkeypatch.setitem(backends._LOADED, "pallas_sm90", be)
        jax.clear_caches()

        def f(h, w, t):
            o = dl.linear_logp(h, w, t, vocab_size=500, backend="pallas_sm90", return_entropy=entropy)
            return o.logp, o.lse, o.entropy

        text = jax.jit(f).trace(h, w, t).lower(lowering_platforms=("cuda",)).as_text()
        return {op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in ("custom_call", "transpose", "pad")}

    assert ops(fake) == {"custom_call": 2, "transpose": 0, "pad": 0}
    unfused = ops(dataclasses.replace(fake, fused_forward=None))
    assert unfused["custom_call"] == 2 and unfused["transpose"] > 0 and unfused["pad"] > 3, unfused


def _decode_ws_kernel(h_box_rows, interpret, d=256, vp=1024, v=1000, n_pad=64):
    from pallas_kernels import sm90_forward_ws

    geom = pk.shard_geometry(v, vp)
    return sm90_forward_ws.build(
        n_pad=n_pad,
        d=d,
        lg_cols=vp,
        geom=geom,
        cfg=tuning.BUCKETS["decode"],
        has_bias=False,
        return_logits=False,
        num_ctas=2 if interpret else 4,
        interpret=interpret,
        interpret_params=None,
        lg_rows=8,
        h_box_rows=h_box_rows,
    )


@pytest.mark.parametrize("h_rows", [64, 8, 1])
def test_hidden_box_lowers_for_cuda(h_rows):
    """sm90_forward_ws.build(h_box_rows=8) (a decode call's hidden box: 8 rows, the slot's other
    rows zeroed once by the producer) lowers for CUDA on a padded, an 8-row and a 1-row hidden
    array; a box that is not a multiple of 8 or a launch of more than one row block is refused."""
    S = jax.ShapeDtypeStruct
    args = (S((h_rows, 256), jnp.bfloat16), S((1024, 256), jnp.bfloat16), S((64,), jnp.int32), S((64,), jnp.float32))
    jax.jit(_decode_ws_kernel(8, False)).trace(*args).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="h_box_rows"):
        _decode_ws_kernel(12, False)
    with pytest.raises(ValueError, match="one row block"):
        _decode_ws_kernel(8, False, n_pad=128)


@pytest.mark.slow
def test_hidden_box_gives_the_same_bytes_in_interpret_mode():
    """The 8-row hidden box reads the rows the full box reads where the hidden array's other
    rows are zeros (padding rows): every partial equal, padding rows included."""
    rng = np.random.default_rng(3)
    h = np.zeros((64, 256), np.float32)
    h[:3] = rng.standard_normal((3, 256))
    w = jnp.asarray(rng.standard_normal((1024, 256)) * 0.2, jnp.bfloat16)
    t = jnp.asarray([5, 999, 400] + [C.IGNORE_INDEX] * 61, jnp.int32)
    it = jnp.ones((64,), jnp.float32)
    args = (jnp.asarray(h, jnp.bfloat16), w, t, it)
    full = _decode_ws_kernel(None, True)(*args)
    boxed = _decode_ws_kernel(8, True)(*args)
    assert len(full) == len(boxed) == 3
    for a, b, name in zip(full, boxed, ("m", "s", "z_t")):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32), err_msg=name)


def test_row_invariant_interpret_matmul_is_a_fixed_order_sum_per_element():
    """The interpret-mode wgmma model of `row_invariant_wgmma`: each output element is
    sum_k a[i, k] * b[k, j] in float64, k ascending, rounded once to f32: a row computed
    alone, in a block of other rows, or from several threads at once has the same bytes (the
    interpreter's own model, np.matmul(a, b, dtype=f32), gives every row alone other bytes
    than in this block, so this can fail), and one element equals the sequential float64 sum
    written out."""
    import threading

    import ml_dtypes

    from pallas_kernels.interpret_utils import _NumpyWithRowInvariantMatmul
    from tests.helpers import assert_bitwise_equal

    mm = _NumpyWithRowInvariantMatmul.matmul
    rng = np.random.default_rng(3)
    # products spread over ~40 binades: float64 sums of them are not exact, so order matters
    a = (rng.standard_normal((64, 64)) * np.exp2(rng.integers(-40, 0, (64, 64)))).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((64, 96)).astype(ml_dtypes.bfloat16)
    block = mm(a, b, dtype=np.float32)
    assert block.dtype == np.float32 and block.shape == (64, 96)
    alone = np.stack([mm(a[i : i + 1], b)[0] for i in range(64)])
    assert_bitwise_equal(block, alone, "rows alone vs in the block")
    runs = []
    threads = [threading.Thread(target=lambda: runs.append(mm(a, b))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in runs:
        assert_bitwise_equal(block, r, "threads")
    i, j = 5, 17
    s = 0.0
    for k in range(64):
        s += float(a[i, k]) * float(b[k, j])
    assert block[i, j] == np.float32(s)
    with pytest.raises(ValueError, match=r"\[m, k\] @ \[k, n\]"):
        mm(a[None], b)


@pytest.mark.slow
def test_entry_points_take_a_weight_layout_or_its_name():
    """Every entry point the op core calls takes weight_layout as "vd" / "dv" or as a
    `detlogp_jax.layout.WeightLayout` (converted once with `as_layout`), with the same result:
    supports / unsupported, the registry entry's dz and in-place predicates, and the lowered
    partials, forward, dz and gradient GEMM programs (the same StableHLO ops and Mosaic
    modules); an unknown layout is refused naming the two."""
    from detlogp_jax.layout import DV, VD
    from pallas_kernels import backend, sm90_dz, sm90_grad_gemm, wrapper

    S = jax.ShapeDtypeStruct
    h, w_dv = S((4, 128), jnp.bfloat16), S((128, 512), jnp.bfloat16)
    assert pk.supports(h, w_dv, DV) == pk.supports(h, w_dv, "dv") == (True, "ok")
    assert pk.supports(h, S((512, 128), jnp.bfloat16), VD) == (True, "ok")
    assert wrapper.unsupported(h, S((128, 328), jnp.bfloat16), DV) == wrapper.unsupported(
        h, S((128, 328), jnp.bfloat16), "dv"
    )
    with pytest.raises(ValueError, match="'vd'.*'dv'"):
        pk.supports(h, w_dv, "kv")
    entry = backend.backend_entry()
    assert entry.dz.supports(h, w_dv, 512, DV) and entry.dz.supports(h, w_dv, 512, "dv")
    assert entry.dz.in_place.supports(256, 512, 1536, 512, DV) == entry.dz.in_place.supports(256, 512, 1536, 512, "dv")

    from benchmarks import mosaic_ir_hashes as mh

    mh._capture_modules()

    def text(f, *args):
        """The lowered program: its StableHLO ops and the digests of its Mosaic modules (without
        locations: the two calls differ only in their Python call sites)."""
        start = len(mh._captured)
        hlo = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        modules = [mh._digest(m) for m in mh._captured[start:]]
        assert modules, "no Mosaic module lowered"
        return re.findall(r"\bstablehlo\.([a-z_]+)", hlo), modules

    t, it = S((4,), jnp.int32), S((4,), jnp.float32)
    for layout in ("dv", "vd"):
        typed = {"dv": DV, "vd": VD}[layout]
        w = S((128, 512) if layout == "dv" else (512, 128), jnp.bfloat16)

        def parts(h, w, t, it, lay):
            return pk.partials(h, w, None, t, it, vocab_size=500, padded_vocab_size=512, weight_layout=lay)[:2]

        def fwd(h, w, t, it, lay):
            return pk.forward(h, w, None, t, it, vocab_size=500, padded_vocab_size=512, weight_layout=lay)[:2]

        for fn in (parts, fwd):
            assert text(lambda *a, fn=fn: fn(*a, layout), h, w, t, it) == text(
                lambda *a, fn=fn: fn(*a, typed), h, w, t, it
            )
        n, chunk = 128, 256
        hp, dz = S((n, 128), jnp.bfloat16), S((n, chunk), jnp.bfloat16)
        wc = S((128, chunk) if layout == "dv" else (chunk, 128), jnp.bfloat16)
        v = S((n,), jnp.float32)

        def dzc(hp, wc, tt, a, lay):
            return sm90_dz.dz_chunk(hp, wc, None, tt, a, a, a, a, 0, chunk, weight_layout=lay)

        tt = S((n,), jnp.int32)
        assert text(lambda *a: dzc(*a, layout), hp, wc, tt, v) == text(lambda *a: dzc(*a, typed), hp, wc, tt, v)
        wf = S((256, 1024) if layout == "dv" else (1024, 256), jnp.bfloat16)  # (D = 256: the GEMMs' tile)
        st, dh, hp = S((), jnp.int32), S((n, 256), jnp.float32), S((n, 256), jnp.bfloat16)

        def dha(dh, dz, w, s, lay):
            return sm90_grad_gemm.dh_accumulate(dh, dz, w, s, weight_layout=lay)

        assert text(lambda *a: dha(*a, layout), dh, dz, wf, st) == text(lambda *a: dha(*a, typed), dh, dz, wf, st)

        def dww(dw, dz, h, s, lay):
            return sm90_grad_gemm.dw_write(dw, dz, h, s, weight_layout=lay)

        assert text(lambda *a: dww(*a, layout), wf, dz, hp, st) == text(lambda *a: dww(*a, typed), wf, dz, hp, st)
