"""The split fold as a Pallas Mosaic GPU kernel: (m, S, z_t) -> (logp, lse).

Contract kept (`detlogp_jax.oracle.fold` is the spec), per row:
  M = max_j m_j (exact, computed first over all splits);
  S = +0; for j ascending: S = fl(S + fl(S_j * w_j)),
      w_j = 1 if m_j == M else pexp(m_j - M);
  lse = fl(M + plog(S)); y_t = fl(z_t * inv_t); d = fl(y_t - lse);
  logp = +0 if d > 0 else d; target == -100 -> +0; target < 0 (other) or
  target >= vocab_size -> NaN.
Every f32 op is one rounded op with FTZ (the `ptx_ops` PTX instructions on
the GPU, `ptx_ops.InterpretOps` in interpret mode); the sequential order over splits
is fixed and independent of N, the row block, the grid and every knob below.
Rows are independent: no row's bits depend on any other row.

Layout (`tuning.FoldConfig`; the shipped configs are `tuning.FOLD` and, for decode calls,
`tuning.DECODE_FOLD`): a CTA (one warpgroup) folds `rows` (8, 16, 32 or 64) rows. All of its
partials are first brought into shared memory by TMA (chunks of `chunk` splits, one mbarrier
per chunk, so pass 1 starts on the first chunk while the rest is in flight). The 128 threads
are G = 128 / rows split groups x rows: thread (g, r) handles row r and splits j = g, g + G,
g + 2G, ... (a [G, rows] register array in WG_STRIDED layout is exactly the contiguous SMEM
block of splits k*G .. k*G+G-1, so every access is a plain contiguous view). Per row:
  pass 1: each group takes the exact max of its splits; the G partial
          maxima are exchanged through SMEM, so every thread of the row
          holds M = the row's max (max is exact and, as `max.NaN.f32`,
          order-free; see below for +-0);
  pass 2: each group computes its terms t_j = fl(S_j * w_j) with that M
          (independent across j) and writes them over S_j in SMEM;
  chain:  the g = 0 thread of the row sums t_0, t_1, ..., t_{n_split-1}
          in ascending order, S = fl(S + t_j), starting from +0; the
          other groups run the same instructions on shifted (unused)
          data; then the epilogue, and the g = 0 results go to global
          memory through SMEM and a TMA store.
So each rounded op of a row is the same op on the same operands, in the same order, as in
the spec: only where the independent work runs moved. The partial-max exchange computes max
over the same set of values in a rotated order per thread; on the GPU `max.NaN.f32` gives the
same bits in any order (canonical NaN, +0 > -0). Where a different order could pick a
different zero sign (interpret mode), M = +-0 cannot change an output bit: m_j == M ignores
the sign, fl(m_j - M) for m_j != M differs only between +-0 (FTZ of a negative subnormal
m_j) and pexp(+-0) = 1 either way, and fl(+-0 + plog(S)) is the same because plog never
returns -0. The split count needs no padding: a step past the last split masks the missing
groups with -inf in pass 1 (max(x, -inf) == x) and its terms land in SMEM rows the chain of
a g = 0 thread never reads. Work per thread drops from n_split to n_split / G splits, and
every load in the compute loops hits SMEM. (One row per thread with the partials streamed
would leave each SM sub-partition one warp issuing all n_split exp programs of its 32 rows;
splitting a row's splits over G threads divides that by G.) Rows are padded to a multiple of
`rows` (fold_transposed; bit-neutral, rows are independent). Threads with g > 0 also run the
epilogue, on unfilled rows of the per-row input buffers; their results are never stored. All
partials of a CTA's rows must fit in SMEM (`staged_fits`; every split plan of the contract,
at most 264 splits, fits at rows <= 32 with the entropy and the split captures).

Code: on the GPU each block of steps (a chunk of pass 1 or pass 2, a trip of the chain) is ONE
`inline_mgpu` op on the SMEM view, emitting the same loads and instructions the Pallas ops
would (`_SmemBlocks`); interpret mode runs the same steps as Pallas ops (`_InterpretBlocks`).
The body is `fold_row_block(plan, ins, outs, scratch, r0)` (one warpgroup, one row block, the
scratch of `plan.scratch_types()`), in phases: `_issue_copies`, `_row_max`, `_row_inputs`,
`_terms`, `_chain`, `_zt_or`, `_store`.

The entropy (`fold(..., a=A)`, `build(entropy=True)`; `linear-logp-entropy-v1`): the kernel
also takes the statistic A [N, n_split]; pass 2 forms each split's rescaled term
resc(A_j, S_j, m_j, M, w_j) from the S_j it read (written over A_j in a third SMEM array, so
fewer splits fit: `staged_fits(..., entropy=True)`), the chain adds A = fl(A + term_j) in the
same ascending steps as S, and the epilogue forms h = fl(plog(S) - fl(A * rcp(S))) (plog
shared with the lse, rcp one `div.rn.ftz.f32`), +0 where h < 0. Without A the kernels are
exactly the kernels without it (benchmarks/mosaic_ir_hashes.py keeps both apart).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from pallas_kernels import common, interpret_utils, ptx_ops, tile_math, tuning

F32 = jnp.float32
CHAIN_UNROLL = 32  # default splits per loop trip of the chain (bit-neutral)
SMEM_LIMIT = 200 * 1024  # all partials of a CTA's rows live in SMEM


def row_block(cfg: tuning.FoldConfig = tuning.FOLD) -> int:
    """Rows per CTA (n_pad must be a multiple of it)."""
    return cfg.rows


def staged_fits(n_split: int, rows: int = tuning.FOLD.rows, entropy: bool = False, zt_splits: bool = False) -> bool:
    """Whether the fold can hold n_split splits of `rows` rows in SMEM (m and S, with
    `entropy` the statistic A too, and with `zt_splits` the target captures)."""
    g = 128 // rows
    k = -(-n_split // g)
    return (2 + int(entropy) + int(zt_splits)) * (k * g + g) * rows * 4 + 8 * 1024 <= SMEM_LIMIT


def zt_from_splits(ztT):
    """z_t [N] from the split-major target captures [n_split, N]: the bitwise OR of each
    row's captures (at most one is not +0: the owning split's; +0 where none is), the
    same bytes as selecting the owner's capture (`wrapper._owner_z_t`). (One exception that no
    output shows: a target at or past the weight's rows but inside the padded vocabulary is
    captured from TMA's zero rows, +-0, where the select gives +0; its logp is NaN either way
    and lse never reads z_t.)"""
    bits = lax.bitcast_convert_type(jnp.asarray(ztT, F32), jnp.int32)
    return lax.bitcast_convert_type(lax.reduce(bits, jnp.int32(0), lax.bitwise_or, (0,)), F32)


def build(
    *,
    n_split: int,
    n_pad: int,
    vocab_size: int,
    interpret: bool,
    interpret_params=None,
    cfg: tuning.FoldConfig = tuning.FOLD,
    entropy: bool = False,
    zt_splits: bool = False,
    n_out: int | None = None,
    scalar_rows: bool = False,
):
    """Kernel (mT [n_split, n_pad], sT, z_t [n_pad], targets [n_pad] i32, inv_t [n_pad]) -> (logp, lse).

    zt_splits (static): the kernel takes the forward kernel's split-major target captures
    ztT [n_split, n_pad] in place of z_t and forms each row's z_t itself (`zt_from_splits`):
    no split but the one owning the row's target ever writes a capture other than +0
    (`sm90_forward_ws` / `sm90_forward_wgmma`: the capture starts at +0 and only the tile
    holding the target replaces it), so z_t is the bitwise OR of the row's n_split captures,
    exact and order-free (+0 where no split owns the target, as the wrapper's select gives).
    Data movement only: the same z_t bytes reach the same epilogue. False builds exactly the
    kernel without it.

    n_out (static): the real rows, at most n_pad: targets / inv_t have n_out entries and the
    outputs are [n_out]; the grid covers ceil(n_out / rows) row blocks of the [n_split, n_pad]
    partials. Rows past n_out read targets / inv_t as 0 (TMA's fill) and their results are not
    stored (TMA clips the store); every row's fold is its own, so the bytes of the real rows are
    the same. `fold_transposed` passes it for a multiple of 8 rows only (1 or 3 rows read wrong
    by TMA on the H200). None: n_out = n_pad, exactly the kernel without it.

    scalar_rows (static, with zt_splits and n_out only; False builds exactly the kernel without
    it): the row inputs and outputs move without TMA, for any n_out: each row's target and inv_t
    by a scalar load (`common.gather_rows`, indices clamped inside the [n_out] arrays; rows past
    n_out get IGNORE_INDEX and 1.0, the padded arrays' values), each real row's logp / lse
    (/ entropy) by a scalar store from the SMEM row the TMA store would have read. Data movement
    only: the same values reach the same epilogue.

    entropy (static): the kernel takes the entropy statistic aT [n_split, n_pad] after
    sT and returns (logp, lse, entropy): in pass 2 each split's rescaled term
    resc(A_j, S_j, m_j, M, w_j) is formed next to fl(S_j * w_j), in the chain
    A = fl(A + term_j) is added in the same ascending loop as S, and the epilogue
    forms h = fl(plog(S) - fl(A * rcp(S))) (the plog of the lse, rcp one
    `div.rn.ftz.f32`), +0 where h < 0 (CONTRACT.md section 9). False builds
    exactly the kernel without it.

    `cfg` (no field changes a bit): `rows` = rows per CTA, `chunk` = splits per TMA copy,
    `unroll` = splits per trip of the chain's loop (default CHAIN_UNROLL). n_pad must be a
    multiple of `row_block(cfg)`.
    """
    if not isinstance(cfg, tuning.FoldConfig):
        raise TypeError(f"sm90_fold needs a tuning.FoldConfig, got {type(cfg).__name__}")
    kw = interpret_utils.kernel_kwargs(interpret, interpret_params)
    plan = config_plan(
        cfg, n_split=n_split, vocab_size=vocab_size, interpret=interpret, entropy=entropy, zt_splits=zt_splits
    )
    return _build_staged(plan, n_pad=n_pad, n_out=n_pad if n_out is None else n_out, kw=kw, scalar_rows=scalar_rows)


def _epilogue(acc, big_m, zt, tgt, invt, ops, vocab_size, acc_a=None):
    """lse, logp of a row from its S, M and target inputs (the spec's last lines); with
    the folded entropy statistic `acc_a` also the entropy h = fl(plog(S) - fl(A * rcp(S))),
    +0 where h < 0 (the same plog(S) as the lse's), as a third result."""
    if acc_a is None:
        lse = ops.add(big_m, tile_math.plog(acc, ops))
    else:
        lg = tile_math.plog(acc, ops)
        lse = ops.add(big_m, lg)
    y_t = ops.mul(zt, invt)
    d = ops.sub(y_t, lse)
    logp = jnp.where(d > 0, jnp.asarray(0.0, F32), d)
    logp = jnp.where(tgt == C.IGNORE_INDEX, jnp.asarray(0.0, F32), logp)
    bad = ((tgt < 0) & (tgt != C.IGNORE_INDEX)) | (tgt >= vocab_size)
    logp = jnp.where(bad, jnp.asarray(jnp.nan, F32), logp)
    if acc_a is None:
        return logp, lse
    h = ops.flush(ops.sub(lg, ops.flush(ops.mul(acc_a, ops.rcp(acc)))))
    return logp, lse, jnp.where(h < 0, jnp.asarray(0.0, F32), h)


@dataclasses.dataclass(frozen=True)
class StagedPlan:
    """The static shape of the fold of one row block: what `fold_row_block` runs.

    rows (8, 16, 32 or 64) rows per warpgroup, G = 128 / rows split groups; `chunk` splits per TMA copy
    (raised by `staged_plan` so that one barrier array needs at most 32 barriers); `unroll`
    splits per chain trip. rows, chunk, unroll and interpret change no bit (`tuning.FoldConfig`)."""

    n_split: int
    rows: int
    chunk: int
    unroll: int
    vocab_size: int
    interpret: bool
    entropy: bool = False
    zt_splits: bool = False

    @property
    def g_n(self) -> int:  # split groups per row
        return 128 // self.rows

    @property
    def shape(self) -> tuple[int, int]:  # one [G, rows] register array per thread group
        return (self.g_n, self.rows)

    @property
    def n_chunks(self) -> int:
        return -(-self.n_split // self.chunk)

    @property
    def n_full(self) -> int:  # chunks of exactly `chunk` splits; then one partial chunk if any
        return self.n_split // self.chunk

    @property
    def smem_rows(self) -> int:  # + G: the (unused) chains of g > 0 read up to n_split + G - 2
        return -(-self.n_split // self.g_n) * self.g_n + self.g_n

    def scratch_types(self) -> tuple:
        """The SMEM buffers and barriers `fold_row_block` takes, in its `scratch` order (`_Scratch`)."""
        ent = lambda *x: x if self.entropy else ()  # the entropy's scratch, only with it
        sm, br, shape, n_chunks = self.smem_rows, self.rows, self.shape, self.n_chunks
        scratch = (
            plgpu.SMEM((sm, br), F32),  # m
            plgpu.SMEM((sm, br), F32),  # s, then the terms
            *ent(plgpu.SMEM((sm, br), F32)),  # A, then its terms
            plgpu.SMEM((2 * self.g_n, br), F32),  # partial max exchange
            plgpu.SMEM(shape, F32),  # z_t (row 0)
            plgpu.SMEM(shape, jnp.int32),  # targets (row 0)
            plgpu.SMEM(shape, F32),  # inv_t (row 0)
            plgpu.SMEM(shape, F32),  # logp out (row 0 is stored)
            plgpu.SMEM(shape, F32),  # lse out
            *ent(plgpu.SMEM(shape, F32)),  # entropy out
            plgpu.Barrier(num_barriers=n_chunks),
            plgpu.Barrier(num_barriers=n_chunks),
            *ent(plgpu.Barrier(num_barriers=n_chunks)),  # A's chunks
            plgpu.Barrier(num_arrivals=2 if self.zt_splits else 3),  # the row inputs
        )
        if self.zt_splits:  # the captures [n_split rows, br] (rows past n_split: never read as captures)
            scratch += (plgpu.SMEM((sm, br), F32), plgpu.Barrier(num_barriers=n_chunks))
        return scratch


def staged_plan(*, n_split, vocab_size, interpret, unroll, rows, chunk, entropy=False, zt_splits=False) -> StagedPlan:
    """The plan `build` launches. Refuses what `tuning.FoldConfig` refuses (rows 8, 16, 32 or 64,
    chunk a multiple of 128 / rows in (0, 256], unroll >= 1), and (ValueError) a row block whose
    partials do not fit in SMEM."""
    tuning.FoldConfig(rows=rows, chunk=chunk, unroll=unroll)  # the config's checks (bit-neutral fields)
    g_n = 128 // rows
    # One mbarrier per chunk and copy stream, and Mosaic tracks at most 32
    # barriers per array: raise chunk to the smallest that needs <= 32.
    chunk = max(chunk, -(-(-(-n_split // 32)) // g_n) * g_n)
    if not staged_fits(n_split, rows, entropy, zt_splits):
        raise ValueError(
            f"the fold holds a row block's partials in SMEM: n_split={n_split} x {rows} rows"
            f"{' with the entropy' if entropy else ''} does not fit; use FoldConfig(rows=...) with fewer rows"
        )
    return StagedPlan(n_split, rows, chunk, unroll, vocab_size, interpret, entropy, zt_splits)


def config_plan(
    cfg: tuning.FoldConfig, *, n_split, vocab_size, interpret, entropy=False, zt_splits=False
) -> StagedPlan:
    """The plan `cfg` builds: its rows and chunk, its unroll (default CHAIN_UNROLL)."""
    return staged_plan(
        n_split=n_split,
        vocab_size=vocab_size,
        interpret=interpret,
        unroll=CHAIN_UNROLL if cfg.unroll is None else cfg.unroll,
        rows=cfg.rows,
        chunk=cfg.chunk,
        entropy=entropy,
        zt_splits=zt_splits,
    )


def _build_staged(plan: StagedPlan, *, n_pad, n_out, kw, scalar_rows=False):
    br, entropy = plan.rows, plan.entropy
    assert n_pad % br == 0, (n_pad, br)
    assert 1 <= n_out <= n_pad, (n_out, n_pad)
    n_blocks = -(-n_out // br)
    n_in, n_res = (6, 3) if entropy else (5, 2)

    def kernel(*refs):
        # Inputs, outputs, scratch (`plan.scratch_types()`); the entropy's refs only with `entropy`.
        ins, outs, scratch = refs[:n_in], refs[n_in : n_in + n_res], refs[n_in + n_res :]
        if not entropy:
            ins, outs = (ins[0], ins[1], None, *ins[2:]), (*outs, None)
        # (One row block: r0 is the constant 0, so scalar_rows touches only the real rows.)
        r0 = 0 if n_blocks == 1 and scalar_rows else lax.axis_index("rows") * br
        fold_row_block(plan, ins, outs, scratch, r0, scalar_rows=n_out if scalar_rows else None)

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((n_out,), F32),) * n_res,
        scratch_types=plan.scratch_types(),
        grid=(n_blocks,),
        grid_names=("rows",),
        compiler_params=plgpu.CompilerParams(approx_math=False, unsafe_no_auto_barriers=True),
        **kw,
    )


class _Scratch(NamedTuple):
    """`StagedPlan.scratch_types()` as refs (the entropy's and the captures' None without them)."""

    m_s: object
    s_s: object
    a_s: object
    x2: object  # the partial max (and capture OR) exchange
    z_in: object
    t_in: object
    i_in: object
    o_l: object
    o_s: object
    o_h: object
    bar_m: object
    bar_s: object
    bar_a: object
    bar_in: object
    zt_s: object
    bar_z: object

    @classmethod
    def of(cls, plan: StagedPlan, scratch) -> "_Scratch":
        scratch = tuple(scratch)
        zt_s = bar_z = None
        if plan.zt_splits:  # the captures' SMEM copy and its barriers come last
            scratch, (zt_s, bar_z) = scratch[:-2], scratch[-2:]
        if plan.entropy:
            (m_s, s_s, a_s, x2, z_in, t_in, i_in, o_l, o_s, o_h, bar_m, bar_s, bar_a, bar_in) = scratch
        else:
            (m_s, s_s, x2, z_in, t_in, i_in, o_l, o_s, bar_m, bar_s, bar_in) = scratch
            a_s = o_h = bar_a = None
        return cls(m_s, s_s, a_s, x2, z_in, t_in, i_in, o_l, o_s, o_h, bar_m, bar_s, bar_a, bar_in, zt_s, bar_z)


class _Lanes(NamedTuple):
    """How this warpgroup's [G, rows] arrays are read and formed (per plan and mode)."""

    layout: object  # WG_STRIDED over [G, rows]
    blk: object  # `_SmemBlocks` (GPU) or `_InterpretBlocks`
    load: object
    cast: object


def _sync():
    # Every thread's SMEM stores visible to every thread of the warpgroup. (The kernel runs
    # with unsafe_no_auto_barriers, so that SMEM stores do not each cost two warpgroup barriers.)
    plgpu.commit_smem()


def fold_row_block(plan: StagedPlan, ins, outs, scratch, r0, scalar_rows: int | None = None):
    """The fold of rows [r0, r0 + plan.rows) by one warpgroup (module docstring).

    ins: GMEM refs (mT, sT, aT or None, z_t or ztT (with `plan.zt_splits`), targets, inv_t),
    the partials split-major [n_split, >= r0 + rows]; outs: GMEM refs (logp, lse, entropy or
    None), [>= r0 + rows] (TMA clips a store past them); scratch: refs of
    `plan.scratch_types()`, in order. Every rounded op of a row is the contract's fold
    (`detlogp_jax.oracle.fold`) on the same operands in the same order, whatever r0; rows are
    independent. Issues its own TMA copies and awaits them, and ends with its stores complete
    (`wait_smem_to_gmem(0)`). scalar_rows = N (with `plan.zt_splits`): targets / inv_t / the
    outputs are [N] arrays moved by scalar loads and stores (`build(scalar_rows=True)`); r0
    may then be a Python int."""
    layout = plgpu.Layout.WG_STRIDED(plan.shape, vec_size=1)
    blk = _InterpretBlocks(plan.g_n) if plan.interpret else _SmemBlocks(layout, plan.shape)
    lanes = _Lanes(layout, blk, *interpret_utils.load_and_cast(layout, plan.interpret))
    sc = _Scratch.of(plan, scratch)
    cols = pl.ds(r0, plan.rows)
    if scalar_rows is not None and not plan.zt_splits:
        raise ValueError("scalar_rows needs plan.zt_splits")
    _issue_copies(plan, ins, sc, cols, scalar_rows)
    big_m = _row_max(plan, sc, lanes)
    invt, tgt = _row_inputs(plan, ins, sc, lanes, r0, scalar_rows)
    ops = ptx_ops.make_ops(plan.interpret, lambda shape: layout, source=invt if plan.interpret else None)
    _terms(plan, sc, lanes, big_m, ops)
    acc = _chain(plan, sc, lanes, ops)
    zt = _zt_or(plan, sc, lanes) if plan.zt_splits else lanes.load(sc.z_in)
    tgt = lanes.load(sc.t_in) if tgt is None else tgt
    if plan.entropy:
        results = _epilogue(acc[0], big_m, zt, tgt, invt, ops, plan.vocab_size, acc_a=acc[1])
    else:
        results = _epilogue(acc, big_m, zt, tgt, invt, ops, plan.vocab_size)
    _store(plan, outs, sc, results, r0, cols, scalar_rows)


def _chunk_splits(plan: StagedPlan, c):
    return pl.ds(c * plan.chunk, min(plan.chunk, plan.n_split - c * plan.chunk))


def _issue_copies(plan: StagedPlan, ins, sc: _Scratch, cols, scalar_rows):
    """All copies, issued up front: the row inputs (tiny; none with scalar_rows), all of m, all
    of S (all of A, all of the captures)."""
    m_ref, s_ref, a_ref, zt_ref, tgt_ref, invt_ref = ins
    if plan.zt_splits:
        row_inputs = ((tgt_ref, sc.t_in), (invt_ref, sc.i_in))
    else:
        row_inputs = ((zt_ref, sc.z_in), (tgt_ref, sc.t_in), (invt_ref, sc.i_in))
    if scalar_rows is not None:
        row_inputs = ()
    for src, dst in row_inputs:
        plgpu.copy_gmem_to_smem(src.at[cols], dst.at[0], sc.bar_in)
    streams = [(m_ref, sc.m_s, sc.bar_m), (s_ref, sc.s_s, sc.bar_s)]
    if plan.entropy:
        streams.append((a_ref, sc.a_s, sc.bar_a))
    if plan.zt_splits:
        streams.append((zt_ref, sc.zt_s, sc.bar_z))
    for src, dst, bars in streams:
        for c in range(plan.n_chunks):
            splits = _chunk_splits(plan, c)
            plgpu.copy_gmem_to_smem(src.at[splits, cols], dst.at[splits], bars.at[c])


def _over_chunks(plan: StagedPlan, bars, full_steps, last_step, carry):
    """Steps of G splits in ascending order, chunk by chunk (each after its copy landed;
    `bars`: one barrier array or a tuple of them, all awaited): full_steps(j0, count, carry)
    runs `count` full steps from split j0; last_step(j0, n_valid, carry) the final step if it
    is partial."""
    bars = bars if isinstance(bars, tuple) else (bars,)
    chunk, g_n, n_full, n_split = plan.chunk, plan.g_n, plan.n_full, plan.n_split

    def chunk_body(c, carry):
        for b in bars:
            plgpu.barrier_wait(b.at[c])
        return full_steps(c * chunk, chunk // g_n, carry)

    if n_full:
        carry = lax.fori_loop(0, n_full, chunk_body, carry)
    if plan.n_chunks > n_full:
        for b in bars:
            plgpu.barrier_wait(b.at[n_full])
        j0, count = n_full * chunk, (n_split - n_full * chunk) // g_n
        if count:
            carry = full_steps(j0, count, carry)
        if n_split % g_n:
            carry = last_step(j0 + count * g_n, n_split % g_n, carry)
    return carry


def _row_max(plan: StagedPlan, sc: _Scratch, lanes: _Lanes):
    """Pass 1: per group the exact max over its splits (from -inf, which max(x, -inf) == x leaves
    out; splits past n_split masked to -inf), then the G partial maxima exchanged through x2 =
    [pm; pm] (rows d .. d+G-1 hold, for thread (g, r), the partial max of group (g + d) mod G of
    row r): M in every thread of the row."""
    g_n, shape, cast, load = plan.g_n, plan.shape, lanes.cast, lanes.load

    def max_last(j0, n_valid, pm):
        group = cast(lax.broadcasted_iota(jnp.int32, shape, 0))
        x = jnp.where(group < n_valid, load(sc.m_s.at[pl.ds(j0, g_n)]), jnp.asarray(-jnp.inf, F32))
        return jnp.maximum(pm, x)

    pm = _over_chunks(
        plan,
        sc.bar_m,
        lambda j0, k, pm: lanes.blk.max(sc.m_s.at[pl.ds(j0, k * g_n)], k, pm),
        max_last,
        cast(jnp.full(shape, -jnp.inf, F32)),
    )
    sc.x2.at[pl.ds(0, g_n)][...] = pm
    sc.x2.at[pl.ds(g_n, g_n)][...] = pm
    _sync()
    big_m = pm
    for d in range(1, g_n):
        big_m = jnp.maximum(big_m, load(sc.x2.at[pl.ds(d, g_n)]))
    return big_m


def _row_inputs(plan: StagedPlan, ins, sc: _Scratch, lanes: _Lanes, r0, scalar_rows):
    """(inv_t, targets or None) of the rows: from their SMEM copies (the targets are read after
    the chain), or with scalar_rows by scalar loads (`common.gather_rows`)."""
    if scalar_rows is None:
        plgpu.barrier_wait(sc.bar_in)
        return lanes.load(sc.i_in), None
    tgt_ref, invt_ref = ins[4], ins[5]

    def gather(ref, fill):
        return common.gather_rows(
            ref, r0, scalar_rows, plan.rows, fill, lanes.layout, plan.interpret, shape=plan.shape, axis=1
        )

    invt = gather(invt_ref, 1.0)
    return invt, gather(tgt_ref, C.IGNORE_INDEX)


def _terms(plan: StagedPlan, sc: _Scratch, lanes: _Lanes, big_m, ops):
    """Pass 2: the terms t_j = fl(S_j * w_j), written over S_j (each thread rewrites only what it
    read), and with the entropy the A terms resc(A_j, S_j, m_j, M, w_j) (from S_j before its term
    overwrites it) over A_j. A partial last step computes garbage in the missing groups, into
    SMEM rows past n_split that no chain of a g = 0 thread reads."""
    g_n, blk = plan.g_n, lanes.blk

    def terms(j0, count, carry):
        sl = pl.ds(j0, count * g_n)
        if plan.entropy:
            blk.terms_entropy(sc.m_s.at[sl], sc.s_s.at[sl], sc.a_s.at[sl], count, big_m, ops)
        else:
            blk.terms(sc.m_s.at[sl], sc.s_s.at[sl], count, big_m, ops)
        return carry

    bars = (sc.bar_s, sc.bar_a) if plan.entropy else sc.bar_s
    _over_chunks(plan, bars, terms, lambda j0, n_valid, carry: terms(j0, 1, carry), jnp.int32(0))
    _sync()


def _chain(plan: StagedPlan, sc: _Scratch, lanes: _Lanes, ops):
    """The chain: thread (0, r) reads t_j of row r at step j, ascending j, S = fl(S + t_j) from
    +0 (with the entropy both sums in the same loop: (S, A)), `unroll` splits per loop trip."""
    g_n, unroll, n_split, blk = plan.g_n, plan.unroll, plan.n_split, lanes.blk

    def add_splits(j0, count, acc):
        view = pl.ds(j0, count + g_n - 1)
        if plan.entropy:
            return blk.chain_entropy(sc.s_s.at[view], sc.a_s.at[view], count, acc, ops)
        return blk.chain(sc.s_s.at[view], count, acc, ops)

    n_trips = n_split // unroll
    acc = lanes.cast(jnp.zeros(plan.shape, F32))
    if plan.entropy:
        acc = (acc, lanes.cast(jnp.zeros(plan.shape, F32)))
    if n_trips:
        acc = lax.fori_loop(0, n_trips, lambda i, a: add_splits(i * unroll, unroll, a), acc)
    if n_split - n_trips * unroll:
        acc = add_splits(n_trips * unroll, n_split - n_trips * unroll, acc)
    return acc


def _zt_or(plan: StagedPlan, sc: _Scratch, lanes: _Lanes):
    """The row's z_t: the OR of its captures' bits (`zt_from_splits`), each group over its
    splits j = g, g + G, ... (a loop of [G, rows] views), then across the G groups through x2
    (free again: every thread passed the syncs after the max exchange)."""
    g_n, n_split, shape, load, cast, x2 = plan.g_n, plan.n_split, plan.shape, lanes.load, lanes.cast, sc.x2
    for c in range(plan.n_chunks):
        plgpu.barrier_wait(sc.bar_z.at[c])
    bits = lambda x: lax.bitcast_convert_type(x, jnp.int32)
    n_whole = n_split // g_n

    def step(u, acc):
        return acc | bits(load(sc.zt_s.at[pl.ds(u * g_n, g_n)]))

    acc = lax.fori_loop(0, n_whole, step, cast(jnp.zeros(shape, jnp.int32)))
    if n_split % g_n:  # the partial last step: groups past n_split hold no capture
        group = cast(lax.broadcasted_iota(jnp.int32, shape, 0))
        last = bits(load(sc.zt_s.at[pl.ds(n_whole * g_n, g_n)]))
        acc = acc | jnp.where(group < n_split % g_n, last, jnp.int32(0))
    as_f32 = lax.bitcast_convert_type(acc, F32)
    x2.at[pl.ds(0, g_n)][...] = as_f32
    x2.at[pl.ds(g_n, g_n)][...] = as_f32
    _sync()
    for d in range(1, g_n):
        acc = acc | bits(load(x2.at[pl.ds(d, g_n)]))
    return lax.bitcast_convert_type(acc, F32)


def _store(plan: StagedPlan, outs, sc: _Scratch, results, r0, cols, scalar_rows):
    """The g = 0 threads' results (logp, lse[, entropy]) through SMEM to global memory: by TMA
    (clipped past the outputs), or with scalar_rows by one scalar store per real row."""
    logp_ref, lse_ref, h_ref = outs
    sc.o_l[...] = results[0]
    sc.o_s[...] = results[1]
    if plan.entropy:
        sc.o_h[...] = results[2]
    _sync()
    if scalar_rows is not None:
        # Row r's results are row 0, column r of the SMEM arrays (the g = 0 threads'); every
        # thread stores the same word.
        pairs = ((sc.o_l, logp_ref), (sc.o_s, lse_ref)) + (((sc.o_h, h_ref),) if plan.entropy else ())

        def store(r):
            for src, dst in pairs:
                dst[r0 + r] = src[0, r]

        for r in range(plan.rows):
            if not isinstance(r0, int):  # a traced row block: its rows past N are skipped at run time
                pl.when(r0 + r < scalar_rows)(functools.partial(store, r))
            elif r0 + r < scalar_rows:
                store(r)
        return
    plgpu.copy_smem_to_gmem(sc.o_l.at[0], logp_ref.at[cols])
    plgpu.copy_smem_to_gmem(sc.o_s.at[0], lse_ref.at[cols])
    if plan.entropy:
        plgpu.copy_smem_to_gmem(sc.o_h.at[0], h_ref.at[cols])
    plgpu.wait_smem_to_gmem(0)


class _InterpretBlocks:
    """The staged fold's inner steps as Pallas ops (interpret mode). Each
    method takes an SMEM view whose rows u*G .. u*G+G-1 (max, terms) or
    u .. u+G-1 (chain) are step u, as a [G, rows] array (thread (g, r) <-> row
    g, column r of the block)."""

    def __init__(self, g_n):
        self.g_n = g_n

    def _rows(self, ref, first):
        return ref.at[pl.ds(first, self.g_n)][...]

    def max(self, ref, count, pm):
        for u in range(count):
            pm = jnp.maximum(pm, self._rows(ref, u * self.g_n))
        return pm

    def terms(self, m_ref, s_ref, count, big_m, ops):
        for u in range(count):
            m_j, s_j = self._rows(m_ref, u * self.g_n), self._rows(s_ref, u * self.g_n)
            w = jnp.where(m_j == big_m, jnp.asarray(1.0, F32), ops.exp_diff(m_j, big_m))
            s_ref.at[pl.ds(u * self.g_n, self.g_n)][...] = ops.mul(s_j, w)

    def chain(self, ref, count, acc, ops):
        for u in range(count):
            acc = ops.add(acc, self._rows(ref, u))
        return acc

    def terms_entropy(self, m_ref, s_ref, a_ref, count, big_m, ops):
        """`terms`, and over A_j its rescaled term resc(A_j, S_j, m_j, M, w_j) (from S_j
        as read, before its own term overwrites it)."""
        for u in range(count):
            rows = pl.ds(u * self.g_n, self.g_n)
            m_j, s_j, a_j = (self._rows(r, u * self.g_n) for r in (m_ref, s_ref, a_ref))
            w = jnp.where(m_j == big_m, jnp.asarray(1.0, F32), ops.exp_diff(m_j, big_m))
            a_term = tile_math.rescale_a(a_j, s_j, m_j, big_m, w, ops)
            s_ref.at[rows][...] = ops.mul(s_j, w)
            a_ref.at[rows][...] = a_term

    def chain_entropy(self, s_ref, a_ref, count, acc, ops):
        """`chain` over the S terms and the A terms in the same steps: acc = (S, A)."""
        acc_s, acc_a = acc
        for u in range(count):
            acc_s = ops.add(acc_s, self._rows(s_ref, u))
            acc_a = ops.add(acc_a, self._rows(a_ref, u))
        return acc_s, acc_a


class _SmemBlocks:
    """The same steps on the GPU, each block as ONE `inline_mgpu` op on the
    SMEM view, with exactly the instructions the Pallas ops lower to: strided
    loads / stores (thread t <-> element t of the [G, rows] block), max.NaN.f32
    (jnp.maximum), the PEXP_DIFF PTX block (PtxOps.exp_diff), an oeq compare
    and select (jnp.where), mul.rn.ftz.f32 / add.rn.ftz.f32 (PtxOps.mul / add),
    in the same order per element. (Per-step Pallas ops made Mosaic's layout
    inference, which grows faster than linearly with the op count, take ~10 s
    to ~80 s per compile; these blocks keep it at a few seconds.)"""

    def __init__(self, layout, shape):
        self.layout, self.shape = layout, shape
        self.g_n = shape[0]
        self.ret = plgpu.ShapeDtypeStruct(shape, F32, layout=layout)

    @staticmethod
    def _mgpu():
        from jax.experimental.mosaic import gpu as mgpu  # Lazy: lowering time only.

        return mgpu

    def _load(self, ref, first):
        mgpu = self._mgpu()
        return mgpu.FragmentedArray.load_strided(
            mgpu.utils.memref_slice(ref, slice(first, first + self.g_n)), vec_size=1
        )

    def max(self, ref, count, pm):
        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), self.layout), return_type=self.ret)
        def run(ctx, ref, pm):
            del ctx
            for u in range(count):
                pm = pm.max(self._load(ref, u * self.g_n))
            return pm

        return run(ref, plgpu.layout_cast(pm, self.layout))

    def terms(self, m_ref, s_ref, count, big_m, ops):
        del ops
        from jaxlib.mlir import ir  # Lazy: lowering time only.

        from pallas_kernels import ptx_programs

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), self.layout))
        def run(ctx, m_ref, s_ref, big_m):
            del ctx
            mgpu = self._mgpu()
            exp_diff = ptx_ops.lift_program(ptx_programs.PEXP_DIFF)
            mul = ptx_ops.lift_ptx(ptx_ops.PTX["mul"])
            one = mgpu.FragmentedArray.splat(mgpu.c(1.0, ir.F32Type.get()), self.shape, layout=big_m.layout)
            ms = [self._load(m_ref, u * self.g_n) for u in range(count)]
            ss = [self._load(s_ref, u * self.g_n) for u in range(count)]
            for u, (m_j, s_j) in enumerate(zip(ms, ss)):
                w = (m_j == big_m).select(one, m_j._pointwise(exp_diff, big_m))
                term = s_j._pointwise(mul, w)
                term.store_untiled(mgpu.utils.memref_slice(s_ref, slice(u * self.g_n, (u + 1) * self.g_n)))

        run(m_ref, s_ref, plgpu.layout_cast(big_m, self.layout))

    def chain(self, ref, count, acc, ops):
        del ops

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), self.layout), return_type=self.ret)
        def run(ctx, ref, acc):
            del ctx
            add = ptx_ops.lift_ptx(ptx_ops.PTX["add"])
            for u in range(count):
                acc = acc._pointwise(add, self._load(ref, u))
            return acc

        return run(ref, plgpu.layout_cast(acc, self.layout))

    def terms_entropy(self, m_ref, s_ref, a_ref, count, big_m, ops):
        """`terms` plus the A terms, as `_InterpretBlocks.terms_entropy` (tile_math.rescale_a's
        instructions in its order: sub, mul by S, add to A, mul by w; oeq compares and selects)."""
        del ops
        from jaxlib.mlir import ir  # Lazy: lowering time only.

        from pallas_kernels import ptx_programs

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), self.layout))
        def run(ctx, m_ref, s_ref, a_ref, big_m):
            del ctx
            mgpu = self._mgpu()
            exp_diff = ptx_ops.lift_program(ptx_programs.PEXP_DIFF)
            mul = ptx_ops.lift_ptx(ptx_ops.PTX["mul"])
            add = ptx_ops.lift_ptx(ptx_ops.PTX["add"])
            sub = ptx_ops.lift_ptx(ptx_ops.PTX["sub"])
            f32 = ir.F32Type.get()
            one = mgpu.FragmentedArray.splat(mgpu.c(1.0, f32), self.shape, layout=big_m.layout)
            zero = mgpu.FragmentedArray.splat(mgpu.c(0.0, f32), self.shape, layout=big_m.layout)
            ms = [self._load(m_ref, u * self.g_n) for u in range(count)]
            ss = [self._load(s_ref, u * self.g_n) for u in range(count)]
            as_ = [self._load(a_ref, u * self.g_n) for u in range(count)]
            for u, (m_j, s_j, a_j) in enumerate(zip(ms, ss, as_)):
                same = m_j == big_m
                w = same.select(one, m_j._pointwise(exp_diff, big_m))
                term = s_j._pointwise(mul, w)
                delta = m_j._pointwise(sub, big_m)
                moved = w._pointwise(mul, a_j._pointwise(add, delta._pointwise(mul, s_j)))
                a_term = same.select(a_j, (w == zero).select(zero, moved))
                rows = slice(u * self.g_n, (u + 1) * self.g_n)
                term.store_untiled(mgpu.utils.memref_slice(s_ref, rows))
                a_term.store_untiled(mgpu.utils.memref_slice(a_ref, rows))

        run(m_ref, s_ref, a_ref, plgpu.layout_cast(big_m, self.layout))

    def chain_entropy(self, s_ref, a_ref, count, acc, ops):
        """`chain` over the S terms and the A terms in the same steps: acc = (S, A)."""
        del ops

        @plgpu.inline_mgpu(
            arg_types=(plgpu.RefType(), plgpu.RefType(), self.layout, self.layout), return_type=(self.ret, self.ret)
        )
        def run(ctx, s_ref, a_ref, acc_s, acc_a):
            del ctx
            add = ptx_ops.lift_ptx(ptx_ops.PTX["add"])
            for u in range(count):
                acc_s = acc_s._pointwise(add, self._load(s_ref, u))
                acc_a = acc_a._pointwise(add, self._load(a_ref, u))
            return acc_s, acc_a

        return run(s_ref, a_ref, plgpu.layout_cast(acc[0], self.layout), plgpu.layout_cast(acc[1], self.layout))


@functools.partial(
    jax.jit,
    static_argnames=(
        "n_split",
        "n_pad",
        "vocab_size",
        "interpret",
        "interpret_params",
        "cfg",
        "entropy",
        "zt_splits",
        "n_out",
        "scalar_rows",
    ),
)
def _fold_core(*args, **static):
    """The fold launch, jitted on the padded row count (shared across N)."""
    return build(**static)(*args)


def config(cfg: tuning.FoldConfig | None = None, **knobs) -> tuning.FoldConfig:
    """`cfg` (default `tuning.FOLD`) with the given fields replaced (bit-neutral; checked by FoldConfig)."""
    cfg = tuning.FOLD if cfg is None else cfg
    if not isinstance(cfg, tuning.FoldConfig):
        raise TypeError(f"cfg must be a tuning.FoldConfig, got {type(cfg).__name__}")
    unknown = set(knobs) - {f.name for f in dataclasses.fields(tuning.FoldConfig)}
    if unknown:
        raise TypeError(f"unknown fold knobs {sorted(unknown)}")
    return dataclasses.replace(cfg, **knobs) if knobs else cfg


def fold_transposed(
    mT,
    sT,
    z_t,
    targets,
    inv_t,
    vocab_size: int,
    *,
    aT=None,
    ztT=None,
    n_rows: int | None = None,
    interpret: bool = False,
    interpret_params=None,
    cfg: tuning.FoldConfig | None = None,
    **knobs,
):
    """fold() on split-major partials mT, sT [n_split, N]; returns (logp [N], lse [N]),
    and with the entropy statistic aT [n_split, N] (logp, lse, entropy [N]).

    ztT: the forward kernel's split-major target captures [n_split, N] in place of z_t
    (pass z_t=None): the kernel forms z_t from them itself (`build(zt_splits=True)`; no XLA
    select before the fold) where the captures fit in SMEM next to the partials, else XLA
    does (`zt_from_splits`); the same bytes.

    n_rows: the real rows when the partials' last N - n_rows columns are padding rows (a
    forward kernel's padded rows): targets / inv_t then have n_rows entries and the outputs
    are [n_rows]. On the GPU the kernel reads and writes exactly those when n_rows is a
    multiple of 8 (`build(n_out=)`: no padded targets / inv_t, no output slices); otherwise
    with ztT (the kernel forming z_t) for any other n_rows, and in interpret mode, the kernel
    moves them by scalar loads and stores (`build(scalar_rows=True)`); otherwise they are
    padded and sliced.

    `cfg` / `knobs`: the `tuning.FoldConfig` (default `tuning.FOLD`) and fields of it to
    replace: rows / chunk / unroll (bit-neutral). ValueError where a row block's partials do
    not fit in SMEM (never for a split plan of the contract at rows <= 32).
    """
    cfg = config(cfg, **knobs)
    n_split, n = mT.shape
    rows = n if n_rows is None else int(n_rows)
    if not 1 <= rows <= max(n, 1) or tuple(targets.shape) != (rows,) or tuple(inv_t.shape) != (rows,):
        raise ValueError(
            f"targets and inv_t must be [n_rows] with 1 <= n_rows <= {n} (got n_rows={n_rows}, "
            f"{tuple(targets.shape)}, {tuple(inv_t.shape)})"
        )
    entropy = aT is not None
    if entropy and tuple(aT.shape) != (n_split, n):
        raise ValueError(f"the entropy statistic must be [N, n_split] like m, got {aT.shape[::-1]} vs {(n, n_split)}")
    if (ztT is None) == (z_t is None):
        raise ValueError("pass exactly one of z_t [N] and ztT [n_split, N]")
    if ztT is not None and tuple(ztT.shape) != (n_split, n):
        raise ValueError(f"the target captures must be [n_split, N] like mT, got {tuple(ztT.shape)} vs {(n_split, n)}")
    in_kernel = ztT is not None and staged_fits(n_split, cfg.rows, entropy, True)
    if ztT is not None and not in_kernel:
        z_t, ztT = zt_from_splits(ztT), None
    br = row_block(cfg)
    n_pad = -(-max(n, 1) // br) * br
    pad = n_pad - n
    # The kernel reads targets / inv_t of the real rows and writes only those (GPU: TMA's fill
    # and clipped stores; the interpreter's slices are bounded, so it gets padded rows). Only for
    # a multiple of 8 rows: 1-D TMA operands of 4 or 12 bytes (1 or 3 rows) read wrong on the
    # H200 (docs/PERFORMANCE.md); 32 bytes were right.
    io_rows = not interpret and rows < n and pad == 0 and rows % 8 == 0
    # Other row counts (and interpret mode, whose scalar reads stay inside the arrays): the row
    # inputs and outputs by scalar loads and stores (`build(scalar_rows=True)`), no pads, no slices.
    scalar = in_kernel and rows < n and pad == 0 and not io_rows
    io_rows = io_rows or scalar

    def p(x, val):
        short = n_pad - x.shape[-1]
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, short)], constant_values=val) if short else x

    # Padding rows: m = -inf, S = A = +0 (their outputs are dropped).
    parts = (p(mT.astype(F32), -jnp.inf), p(sT.astype(F32), 0.0))
    if entropy:
        parts += (p(jnp.asarray(aT).astype(F32), 0.0),)
    out = _fold_core(
        *parts,
        p(jnp.asarray(ztT).astype(F32), 0.0) if in_kernel else p(jnp.asarray(z_t).astype(F32), 0.0),
        targets.astype(jnp.int32) if io_rows else p(targets.astype(jnp.int32), C.IGNORE_INDEX),
        inv_t.astype(F32) if io_rows else p(inv_t.astype(F32), 1.0),
        n_split=n_split,
        n_pad=n_pad,
        vocab_size=int(vocab_size),
        interpret=interpret,
        interpret_params=interpret_params,
        cfg=cfg,
        entropy=entropy,
        zt_splits=in_kernel,
        **({"n_out": rows} if io_rows else {}),
        **({"scalar_rows": True} if scalar else {}),
    )
    return out if io_rows else tuple(x[:rows] for x in out)


def fold(
    m,
    s,
    z_t,
    targets,
    inv_t,
    vocab_size: int,
    *,
    a=None,
    interpret: bool = False,
    interpret_params=None,
    cfg: tuning.FoldConfig | None = None,
    **knobs,
):
    """Merges split partials m, s [N, n_split] in ascending split order -> (logp [N], lse [N]).

    Same contract as `detlogp_jax.oracle.fold`. `z_t` is the raw (unscaled,
    post-bias) target logit; `inv_t` = fl(1/T) per row. `cfg` / `knobs`: see
    `fold_transposed` (bit-neutral).
    a: the entropy statistic A [N, n_split] of the same splits (`partials(...,
    return_entropy=True)`'s sixth array), or None. Given, returns (logp, lse, entropy)
    with the entropy of `oracle.fold_entropy` (CONTRACT.md section 9) folded in the
    same kernel and loop as S; logp and lse keep their bits. None launches exactly
    the kernel without it.
    """
    m = jnp.asarray(m, F32)
    if m.ndim != 2:
        raise ValueError(f"m must be [N, n_split], got {m.shape}")
    return fold_transposed(
        m.T,
        jnp.asarray(s, F32).T,
        jnp.asarray(z_t),
        jnp.asarray(targets),
        jnp.asarray(inv_t),
        vocab_size,
        aT=None if a is None else jnp.asarray(a, F32).T,
        interpret=interpret,
        interpret_params=interpret_params,
        cfg=cfg,
        **knobs,
    )
