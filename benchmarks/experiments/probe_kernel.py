"""Kernel experiments on the GPU: time bit-neutral launch variants in one process.

Not the benchmark runner (`benchmarks/run.py` is): this script times the
pallas_sm90 forward kernel alone (its module's public `build` on pre-padded
operands, `kernel_timing.kernel_fn`), the fold alone (`sm90_fold.build`), the
full `linear_logp` path, the XLA baselines and the chunked backward, for a list
of launch variants, and checks that every forward variant gives the same
partials bytes as the first one timed at its M (and entry). Each experiment is
one JSON line under --out; a table is printed at the end.

  PYTHONPATH=. python3 -m benchmarks.experiments.probe_kernel --groups decode,prefill --out /tmp/probe.jsonl

The timing diagnostics of the kernels (skip_epilogue, no_exp, acc_max_only,
dump_one_tile, pad_smem96, ...) are gone from the kernels; the variants and
groups that used them are dropped here (benchmarks/experiments/README.md).

Device: an H200 (nvidia-h200). Times are medians over --samples samples of
--calls back-to-back calls with one synchronization (device time per call).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import baselines
from benchmarks.experiments import chain_stand_ins
from benchmarks.experiments import kernel_timing as kt
from detlogp_jax import api, grad
from detlogp_jax import contract as C
from pallas_kernels import sm90_fold, tuning

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "groups",
    ["decode", "fold", "small", "prefill", "large", "serving", "backward", "full"],
    "Experiment groups (also: epi, epi_large, epi_small, bwd_variants, epi_next, ws, decode_ws, decode7, small7, mid12, residual7, chunk7, walk10, shards13 (walk10's shards only), ceiling18, chain18, shape19, depth19; groups of removed kernel paths are in git history).",
)
# --out (JSON lines output): kernel_timing's flag.
flags.DEFINE_integer("samples", 9, "Timed samples per experiment.")
flags.DEFINE_float("budget_s", 540.0, "Stop starting new experiments after this many seconds.")

D, V_ROWS, V_REAL = kt.D, kt.V_ROWS, kt.V_REAL
F32 = jnp.float32


def _backward_variant(hidden, weight, targets, inv_t, lse, g_logp, *, vocab_size, chunk, dw_direct, z_bf16):
    """Experimental variants of `grad.backward` (no bias, no logits cotangent, g_lse = 0).

    dw_direct: the dW GEMM writes the weight dtype directly (f32 accumulation in
    the GEMM) instead of f32 + add + convert. z_bf16: the recompute GEMM writes
    bf16 logits (less traffic, less accurate; timing only).
    """
    from jax import lax

    n, d = hidden.shape
    v_rows = weight.shape[0]
    n_chunks = -(-v_rows // chunk)
    live = (targets >= 0) & (targets < vocab_size)
    g_logp = jnp.where(live, g_logp, 0.0)

    def body(carry, i):
        dh, dw = carry
        start = jnp.minimum(i * chunk, v_rows - chunk)
        w_c = lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)
        cols = start + jnp.arange(chunk)
        fresh = (cols >= i * chunk) & (cols < vocab_size)
        z = jnp.einsum("nd,vd->nv", hidden, w_c, preferred_element_type=jnp.bfloat16 if z_bf16 else F32).astype(F32)
        p = jnp.where(fresh[None, :], jnp.exp(z * inv_t[:, None] - lse[:, None]), 0.0)
        onehot = (cols[None, :] == targets[:, None]) & fresh[None, :]
        dz = inv_t[:, None] * (g_logp[:, None] * (onehot.astype(F32) - p))
        dz = jnp.where(fresh[None, :], dz, 0.0).astype(hidden.dtype)
        dh = dh + jnp.einsum("nv,vd->nd", dz, w_c, preferred_element_type=F32)
        if dw_direct:
            dw_c = jnp.einsum("nv,nd->vd", dz, hidden, preferred_element_type=weight.dtype)
            prev = lax.dynamic_slice_in_dim(dw, start, chunk, axis=0)
            dw_c = jnp.where((cols >= i * chunk)[:, None], dw_c, prev)
        else:
            dw_c = jnp.einsum("nv,nd->vd", dz, hidden, preferred_element_type=F32)
            prev = lax.dynamic_slice_in_dim(dw, start, chunk, axis=0)
            dw_c = (prev.astype(F32) + dw_c).astype(dw.dtype)
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c, start, axis=0)
        return (dh, dw), None

    (dh, dw), _ = lax.scan(body, (jnp.zeros((n, d), F32), jnp.zeros(weight.shape, weight.dtype)), jnp.arange(n_chunks))
    return dh.astype(hidden.dtype), dw


class Probe:
    def __init__(self, out_path, samples, budget_s):
        self.out = open(out_path, "w")
        self.samples = samples
        self.t_start = time.perf_counter()
        self.budget_s = budget_s
        self.rows = []
        self.w = kt.weight()
        self.inputs = {}
        self.ref_bits = {}
        self._w_dv = None

    def over_budget(self):
        return time.perf_counter() - self.t_start > self.budget_s

    def record(self, group, name, m, res, **extra):
        row = {"group": group, "name": name, "m": m, **res, **extra}
        if "median_ms" in res:
            row["tflops"] = 2.0 * m * D * V_ROWS / (res["median_ms"] * 1e-3) / 1e12
        self.rows.append(row)
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        print(json.dumps(row), flush=True)

    def sets(self, m):
        if m not in self.inputs:
            self.inputs[m] = [kt.inputs(m, s) for s in (1, 2)]
        return self.inputs[m]

    def dv_sets(self, m):
        """(hidden, weight as [D, V]) argument sets for the Pallas GEMM lanes; the 1.2 GB
        transpose is made once per process, on first use."""
        if self._w_dv is None:
            self._w_dv = jax.block_until_ready(self.w.T.copy())
        return [(h, self._w_dv) for h, _ in self.sets(m)]

    def kernel(self, group, name, m, cfg, *, return_logits=False, ref_key=None, **fn_kw):
        if self.over_budget():
            return
        try:
            t0 = time.perf_counter()
            run, prep = kt.kernel_fn(m, cfg, return_logits=return_logits, **fn_kw)
            arg_sets = [(*prep(h, t),) for h, t in self.sets(m)]
            arg_sets = [(a[0], self.w, a[1], a[2]) for a in arg_sets]
            out, res = kt.time_calls(run, arg_sets, kt.calls_for(m), self.samples)
            extra = {"cfg": tuning.describe(cfg), "wall_s": time.perf_counter() - t0}
            key = ref_key or (m, return_logits)
            # The M real rows only: a config with another rows/CTA pads to another n_pad
            # (m, s are [n_local, n_pad]), and whole arrays of different shapes never compare equal.
            bits = [np.asarray(x)[:, :m] for x in out[:3]] + [np.asarray(x)[:m] for x in out[3:]]
            if key not in self.ref_bits:
                self.ref_bits[key] = bits
                extra["bits"] = "reference"
            else:
                extra["bits"] = (
                    "same" if all(kt.bits_equal(a, b) for a, b in zip(bits, self.ref_bits[key])) else "DIFFERENT"
                )
            self.record(group, name, m, res, **extra)
        except Exception as e:  # keep going: one failing variant must not end the run
            self.record(group, name, m, {"error": f"{type(e).__name__}: {str(e)[:400]}"})
            traceback.print_exc()

    def generic(self, group, name, m, fn, arg_sets, calls=None):
        if self.over_budget():
            return
        try:
            t0 = time.perf_counter()
            _, res = kt.time_calls(fn, arg_sets, calls or kt.calls_for(m), self.samples)
            self.record(group, name, m, res, wall_s=time.perf_counter() - t0)
        except Exception as e:
            self.record(group, name, m, {"error": f"{type(e).__name__}: {str(e)[:400]}"})
            traceback.print_exc()


CHAIN_IN_WGMMA = kt.CHAIN_IN_WGMMA
DECODE_CHAIN_IN_WGMMA = kt.DECODE_CHAIN_IN_WGMMA


def _pallas_gemm(wg: str, minor: str, width: int, tile_m: int = 128, tile_n: int = 128, stages: int = 4):
    """(name, fn) of a Pallas Hopper GEMM lane (`kernel_timing.pallas_gemm`, [tile_m, tile_n] per
    warpgroup); the fourth session's two fastest 128x128 configurations are ("N", "M", 16) and
    ("M", "M", 4) (benchmarks/results/h200_2026-11-30d/gemm_ceiling_m4096.jsonl)."""
    name = f"pallas gemm {tile_m}x{tile_n} wg={wg} minor={minor} width={width}"
    if stages != 4:
        name += f" st{stages}"
    return name, kt.pallas_gemm(tile_m=tile_m, tile_n=tile_n, stages=stages, wg=wg, minor=minor, width=width)


def _v(base, name, **kw):
    """A variant of a base config. epilogue_wgs picks the kernel: 0 the chain-in-wgmma kernel,
    1 the epilogue-warpgroup kernel (the shared launch fields carry over)."""
    cfg = {"prefill_chain": CHAIN_IN_WGMMA, "decode_chain": DECODE_CHAIN_IN_WGMMA}.get(base) or tuning.BUCKETS[base]
    epi = kw.pop("epilogue_wgs", None)
    if epi == 0:
        return kt.as_wgmma(cfg, name=name, **kw)
    if epi == 1:
        return kt.as_ws(cfg, name=name, **kw)
    if epi is not None:
        raise ValueError(f"epilogue_wgs must be 0 or 1, got {epi}")
    return dataclasses.replace(cfg, name=name, **kw)


def main(argv):
    del argv
    p = Probe(FLAGS.out, FLAGS.samples, FLAGS.budget_s)
    groups = set(FLAGS.groups)
    print(jax.devices(), flush=True)

    def full_fn(backend, serving=False):
        @jax.jit
        def f(h, w, t):
            o = api.linear_logp(
                h, w, t, vocab_size=V_REAL, padded_vocab_size=V_ROWS, backend=backend, return_logits=serving
            )
            return (o.logp, o.lse) if not serving else (o.logp, o.lse, o.logits)

        return f

    if "full" in groups:
        for m in (1, 8, 64):
            sets = [(h, p.w, t) for h, t in p.sets(m)]
            p.generic("full", "pallas_sm90", m, full_fn("pallas_sm90"), sets)
            p.generic("full", "xla", m, full_fn("xla"), sets)
            p.generic("full", "gemm", m, jax.jit(lambda h, w, t: baselines.gemm(h, w)), sets)

    if "decode" in groups:
        for m in (1, 64):
            p.kernel("decode", "decode", m, tuning.BUCKETS["decode"])
            # The chain-in-wgmma decode kernel (the decode bucket before the fourth session) and its knobs.
            p.kernel("decode", "decode chain-in-wgmma", m, _v("decode_chain", "d0"))
            p.kernel("decode", "decode chain-in-wgmma+st8", m, _v("decode_chain", "d2", max_concurrent_steps=8))

    if "decode7" in groups:
        # The decode bucket's weight stream (seventh session, issue 18 item 3: the forward at M <= 64
        # against the GEMM alone): pipeline depth and two CTAs per SM (264 CTAs: one split each,
        # no item switch), next to the GEMM alone. (32-wide K slices, slower at every M, left the
        # kernel: docs/PERFORMANCE.md.)
        for m in (1, 8, 64):
            p.kernel("decode7", "decode (st5)", m, tuning.BUCKETS["decode"])
            p.kernel("decode7", "st4", m, _v("decode", "d7s4", max_concurrent_steps=4))
            p.kernel("decode7", "2 CTAs/SM st2", m, _v("decode", "d7c2", ctas_per_sm=2, max_concurrent_steps=2))
            sets = [(h, p.w) for h, _ in p.sets(m)]
            p.generic("decode7", "gemm", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)

    if "ceiling18" in groups:
        # Issue 18's forward bar (<= 1.02x the GEMM alone at M >= 512) against what a Pallas Mosaic
        # GPU GEMM without any epilogue reaches at the same shape, same run: JAX's Hopper GEMM
        # (hopper_matmul_mgpu, its two fastest configurations in the fourth session's sweep,
        # benchmarks/results/h200_2026-11-30d/gemm_ceiling_m4096.jsonl) on the weight as [D, V],
        # next to cuBLAS and the shipped bucket's kernel alone (timed before and after them).
        for m in (512, 1024, 2048, 4096, 16384):
            base = tuning.select_bucket(m).name
            p.kernel("ceiling18", base, m, tuning.BUCKETS[base])
            sets = [(h, p.w) for h, _ in p.sets(m)]
            p.generic("ceiling18", "gemm", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)
            for wg, minor, width in (("N", "M", 16), ("M", "M", 4)):
                name, fn = _pallas_gemm(wg, minor, width)
                p.generic("ceiling18", name, m, fn, p.dv_sets(m))
            p.kernel("ceiling18", f"{base} again", m, tuning.BUCKETS[base])

    if "chain18" in groups:
        # What the chain costs the forward kernel (issue 18's forward bar): the shipped bucket's
        # kernel alone, the same kernel with tile_math.chain_tile_sliced replaced (in this process,
        # while that lane is built) by chain_stand_ins' pass 1 only, one slice read and summed (the
        # pipeline and the hand-off without the chain) and both passes without the exp, next to
        # cuBLAS and JAX's Pallas Hopper GEMM. The stand-ins give other bytes (timing only).
        for m in (1, 512, 4096, 16384):
            base = tuning.select_bucket(m).name
            p.kernel("chain18", base, m, tuning.BUCKETS[base])
            for tag, stand_in in chain_stand_ins.STAND_INS.items():
                with chain_stand_ins.replaced_chain(stand_in):
                    p.kernel("chain18", f"{base} {tag}", m, _v(base, f"c18{base}{tag[:4]}"))
            sets = [(h, p.w) for h, _ in p.sets(m)]
            p.generic("chain18", "gemm", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)
            if m >= 512:
                name, fn = _pallas_gemm("M", "M", 4)
                p.generic("chain18", name, m, fn, p.dv_sets(m))
            p.kernel("chain18", f"{base} again", m, tuning.BUCKETS[base])

    if "shape19" in groups:
        # Why the mid pipeline without its chain is ~7% over the GEMM at M=512 (nineteenth session,
        # chain18) while JAX's Pallas GEMM (128x128 per warpgroup, a 256x128 CTA tile, 4 stages) is
        # at cuBLAS's time: that GEMM built at our kernel's CTA tile (two warpgroups of 64 x 192:
        # the wgmma N that the Qwen3 split plan's 9-tile splits give, tuning.tiles_per_group) with
        # our pipeline depth (3: the hand-off buffers take the rest of shared memory) and with 4;
        # next to the shipped bucket and its pipeline alone (chain_stand_ins' one slice).
        for m in (512, 2048, 4096):
            base = tuning.select_bucket(m).name
            p.kernel("shape19", base, m, tuning.BUCKETS[base])
            with chain_stand_ins.replaced_chain(chain_stand_ins.one_slice):
                p.kernel("shape19", f"{base} one slice, no chain", m, _v(base, f"s19{base}one"))
            sets = [(h, p.w) for h, _ in p.sets(m)]
            p.generic("shape19", "gemm", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)
            for shape in (dict(), dict(tile_m=64, tile_n=192, stages=3), dict(tile_m=64, tile_n=192)):
                name, fn = _pallas_gemm("M", "M", 4, **shape)
                p.generic("shape19", name, m, fn, p.dv_sets(m))
            p.kernel("shape19", f"{base} again", m, tuning.BUCKETS[base])

    if "depth19" in groups:
        # The mid bucket's pipeline is 3 stages deep (its hand-off buffers take the rest of shared
        # memory), and at that depth JAX's Pallas GEMM at the same CTA tile is ~8% over cuBLAS at
        # M=512 (shape19). One wgmma warpgroup of 64 rows per CTA (the decode bucket's layout:
        # half the hand-off, 5 stages, but twice the weight reads per row) at M = 512, 1024 in the
        # three work orders, next to the shipped mid bucket and cuBLAS. The same bytes.
        for m in (512, 1024):
            p.kernel("depth19", "mid", m, tuning.BUCKETS["mid"])
            for g in (0, 2, 4):
                p.kernel("depth19", f"decode layout split_group {g}", m, _v("decode", f"d19g{g}", split_group=g))
            sets = [(h, p.w) for h, _ in p.sets(m)]
            p.generic("depth19", "gemm", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)
            p.kernel("depth19", "mid again", m, tuning.BUCKETS["mid"])

    if "fold" in groups:
        # The fold alone on pre-padded split-major partials, per layout / knob
        # (all bit-neutral): each variant pads the rows to its own row block,
        # as fold_transposed does, and must give the bytes of the first variant.
        n_split = C.split_bounds(V_ROWS).n_split
        rng = np.random.default_rng(0)
        variants = [
            ("r32 c64 u32", dict(rows=32, chunk=64, unroll=32)),
            ("r32 c64 u8", dict(rows=32, chunk=64, unroll=8)),
            (f"r32 c64 u{n_split}", dict(rows=32, chunk=64, unroll=n_split)),
            ("r32 c32 u32", dict(rows=32, chunk=32, unroll=32)),
            ("r32 c128 u32", dict(rows=32, chunk=128, unroll=32)),
            ("r64 c64 u32", dict(rows=64, chunk=64, unroll=32)),
            ("r8 c64 u32", dict(rows=8, chunk=64, unroll=32)),
        ]
        for m in (1, 64, 4096):
            n_max = -(-m // 64) * 64  # (a multiple of every variant's rows)
            mt = jnp.asarray(rng.normal(0, 3, (n_split, n_max)), F32)
            st = jnp.asarray(rng.uniform(1, 40, (n_split, n_max)), F32)
            zt = jnp.asarray(rng.normal(0, 3, (n_max,)), F32)
            tg = jnp.asarray(rng.integers(0, V_REAL, n_max), jnp.int32)
            it = jnp.ones((n_max,), F32)
            ref = None
            for name, knobs in variants:
                fcfg = sm90_fold.config(**knobs)
                rb = sm90_fold.row_block(fcfg)
                n_pad = -(-m // rb) * rb
                args = (mt[:, :n_pad], st[:, :n_pad], zt[:n_pad], tg[:n_pad], it[:n_pad])
                f = jax.jit(
                    lambda a, b, c, d, e, n_pad=n_pad, fcfg=fcfg: sm90_fold.build(
                        n_split=n_split,
                        n_pad=n_pad,
                        vocab_size=V_REAL,
                        interpret=False,
                        interpret_params=None,
                        cfg=fcfg,
                    )(a, b, c, d, e)
                )
                try:
                    out = [np.asarray(x)[:m] for x in f(*args)]
                except Exception:  # noqa: BLE001 - record and go on with the other variants
                    p.record("fold", name, m, {"error": traceback.format_exc(limit=3)})
                    continue
                p.generic("fold", name, m, f, [args])
                if ref is None:
                    ref = out
                elif not all(kt.bits_equal(a, b) for a, b in zip(out, ref)):
                    p.record("fold", name, m, {"error": f"bits differ from {variants[0][0]}"})
            # The whole fold as callers run it (row padding included), on [n_split, m].
            for name, knobs in (("fold_transposed", {}), ("fold_transposed rows 8", dict(rows=8))):
                f = jax.jit(
                    lambda a, b, c, d, e, knobs=knobs: sm90_fold.fold_transposed(a, b, c, d, e, V_REAL, **knobs)
                )
                p.generic("fold", name, m, f, [(mt[:, :m], st[:, :m], zt[:m], tg[:m], it[:m])])

    if "small" in groups:
        for m in (256,):
            p.kernel("small", "small", m, tuning.BUCKETS["small"])
            p.kernel("small", "small+st6", m, _v("small", "s2", max_concurrent_steps=6))

    if "prefill" in groups:
        m = 4096
        p.kernel("prefill", "prefill", m, CHAIN_IN_WGMMA)
        p.kernel("prefill", "+g8", m, _v("prefill_chain", "p3", split_group=8))
        p.kernel("prefill", "+g16", m, _v("prefill_chain", "p4", split_group=16))
        p.kernel("prefill", "+st4", m, _v("prefill_chain", "p5", max_concurrent_steps=4))
        sets = [(h, p.w) for h, _ in p.sets(m)]
        p.generic("prefill", "gemm-bf16", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)

    if "epi" in groups:
        m = 4096
        p.kernel("epi", "new", m, CHAIN_IN_WGMMA)
        p.kernel("epi", "new+g8", m, _v("prefill_chain", "p7", split_group=8))
        p.kernel("epi", "new st4", m, _v("prefill_chain", "p8", max_concurrent_steps=4))
        p.kernel("epi", "new st6", m, _v("prefill_chain", "p9", max_concurrent_steps=6))

    if "epi_large" in groups:
        m = 16384
        p.kernel("epi_large", "new", m, CHAIN_IN_WGMMA)
        p.kernel("epi_large", "new+g8", m, _v("prefill_chain", "p7", split_group=8))
        p.kernel("epi_large", "new+g4", m, _v("prefill_chain", "p10", split_group=4))
        p.kernel("epi_large", "new+g16", m, _v("prefill_chain", "p11", split_group=16))

    if "epi_small" in groups:
        for m in (1, 64):
            p.kernel("epi_small", "decode new", m, tuning.BUCKETS["decode"])
        for m in (256, 1024):
            p.kernel("epi_small", "natural new", m, tuning.select_bucket(m))
        m = 4096
        p.kernel("epi_small", "serving new slots2", m, _v("prefill_chain", "l2", logits_slots=2), return_logits=True)
        p.kernel("epi_small", "serving new slots1", m, _v("prefill_chain", "l1", logits_slots=1), return_logits=True)
        p.kernel("epi_small", "serving new slots3", m, _v("prefill_chain", "l5", logits_slots=3), return_logits=True)

    if "epi_next" in groups:
        # The stage count of the chain-in-wgmma prefill config. (The chain-cost diagnostics of
        # this group, skip_epilogue / acc_max_only / one_tile / wg0_only / no_exp+no_hit, are
        # dropped with the kernels' diag variants.)
        m = 4096
        base = CHAIN_IN_WGMMA
        p.kernel("epi_next", "prefill", m, base)
        for st in (3, 4, 6):
            p.kernel("epi_next", f"st{st}", m, _v("prefill_chain", f"s{st}", max_concurrent_steps=st))

    if "ws" in groups:
        # Dedicated epilogue warpgroup (sm90_forward_ws): the chain of group g runs while the
        # wgmma warpgroups compute group g+1. Bytes are checked against the shipped bucket.
        # (The automatic warpgroup barriers and 32-wide K slices, slower, left the kernel:
        # docs/PERFORMANCE.md.)
        base = tuning.BUCKETS["prefill"]
        chain = kt.as_wgmma(base, name="prefill-chain3")
        for m in (4096, 16384, 1024):
            p.kernel("ws", "prefill", m, base)
            p.kernel("ws", "chain in the wgmma warpgroups", m, chain)
            for g in (0, 8):
                p.kernel("ws", f"prefill g{g}", m, _v("prefill", f"wsg{g}", split_group=g))
        m = 4096
        p.kernel("ws", "prefill serving", m, base, return_logits=True)
        p.kernel("ws", "chain in the wgmma warpgroups serving", m, chain, return_logits=True)

    if "decode_ws" in groups:
        # The epilogue-warpgroup kernel for the decode and small buckets: the chain runs beside
        # the weight stream instead of between tile groups of the one wgmma warpgroup.
        # (Run at 4407823, when the decode bucket was still the chain-in-wgmma config that
        # DECODE_CHAIN_IN_WGMMA keeps; since then "ws decode st5" is the decode bucket.)
        for m in (1, 8, 64):
            p.kernel("decode_ws", "decode", m, DECODE_CHAIN_IN_WGMMA)
            for st in (4, 5):
                p.kernel(
                    "decode_ws",
                    f"ws decode st{st}",
                    m,
                    _v("decode", f"wsd{st}", epilogue_wgs=1, max_concurrent_steps=st),
                )
        for m in (128, 256, 512):
            p.kernel("decode_ws", "small", m, tuning.BUCKETS["small"])
            p.kernel("decode_ws", "ws small st3", m, _v("small", "wss3", epilogue_wgs=1, max_concurrent_steps=3))
        m = 64
        p.kernel("decode_ws", "decode serving", m, DECODE_CHAIN_IN_WGMMA, return_logits=True)
        p.kernel(
            "decode_ws",
            "ws decode st5 serving",
            m,
            _v("decode", "wsd5", epilogue_wgs=1, max_concurrent_steps=5),
            return_logits=True,
        )

    if "large" in groups:
        m = 16384
        p.kernel("large", "prefill", m, CHAIN_IN_WGMMA)
        p.kernel("large", "+g8", m, _v("prefill_chain", "p3", split_group=8))
        p.kernel("large", "+g16", m, _v("prefill_chain", "p4", split_group=16))

    if "serving" in groups:
        m = 4096
        p.kernel("serving", "slots1", m, _v("prefill_chain", "l1", logits_slots=1), return_logits=True)
        p.kernel("serving", "slots2", m, _v("prefill_chain", "l2", logits_slots=2), return_logits=True)
        p.kernel("serving", "slots3", m, _v("prefill_chain", "l4", logits_slots=3), return_logits=True)

    def bwd_setup(m):
        """Backward inputs at M rows: arg sets (h, W, t), a fixed lse, unit inv_t / g_logp."""
        return [(h, p.w, t) for h, t in p.sets(m)], jnp.full((m,), 12.0, F32), jnp.ones((m,), F32)

    if "small7" in groups:
        # The launch config between decode and prefill (seventh session, issue 18 item 3: the
        # forward at M >= 512 against the GEMM alone): the small and prefill buckets and
        # variants at M = 128 .. 1024, next to the GEMM alone.
        for m in (128, 256, 512, 1024):
            p.kernel("small7", "small", m, tuning.BUCKETS["small"])
            p.kernel("small7", "prefill", m, tuning.BUCKETS["prefill"])
            p.kernel("small7", "ws small st3", m, _v("small", "s7w3", epilogue_wgs=1, max_concurrent_steps=3))
            p.kernel("small7", "small g4", m, _v("small", "s7g4", split_group=4))
            p.kernel("small7", "prefill g0", m, _v("prefill", "s7p0", split_group=0))
            sets = [(h, p.w) for h, _ in p.sets(m)]
            p.generic("small7", "gemm", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)

    if "mid12" in groups:
        # The prefill bucket's work order between the small bucket and large M (issue 18 item 3:
        # the forward at M >= 512 within 1.02x of the GEMM alone; the runner has 512 at 1.092x).
        # The seventh session's kernel-alone times at 512: split_group 0 0.978 ms vs the shipped
        # 4's 1.002 (1024: 1.866 vs 1.870). Here split_group 0 / 2 / 4 / 8 at M = 384 .. 4096 next
        # to the GEMM alone, the same bytes expected (a bit-neutral work order; bytes are checked
        # against the first variant at each M): where a fourth bucket would pay.
        for m in (384, 512, 768, 1024, 2048, 4096):
            p.kernel("mid12", "prefill", m, tuning.BUCKETS["prefill"])
            for g in (0, 2, 8):
                p.kernel("mid12", f"prefill g{g}", m, _v("prefill", f"m12g{g}", split_group=g))
            sets = [(h, p.w) for h, _ in p.sets(m)]
            p.generic("mid12", "gemm", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)

    if "residual7" in groups:
        # The residual mode's backward pieces at M = 4096 (issue 18 item 2): the whole backward
        # from saved FP32 logits, the dz pass alone, each gradient GEMM alone (output dtypes,
        # operand orders), against the same run's GEMM alone.
        m = 4096
        arg_sets, lse, ones = bwd_setup(m)
        lg = jax.random.normal(jax.random.key(7), (m, V_ROWS), F32) * 3.0
        zero = jnp.zeros_like(ones)
        full = jax.jit(
            lambda h, w, t, lg: grad.backward(h, w, None, t, ones, lse, ones, zero, None, vocab_size=V_REAL, logits=lg)
        )
        p.generic("residual7", "backward from logits", m, full, [(*a, lg) for a in arg_sets], calls=2)

        def dz_pass(lg, t):
            cols = jnp.arange(lg.shape[1])
            pr = jnp.where(cols < V_REAL, jnp.exp(lg - lse[:, None]), 0.0)
            return ((cols[None, :] == t[:, None]).astype(F32) - pr).astype(jnp.bfloat16)

        p.generic("residual7", "dz pass", m, jax.jit(dz_pass), [(lg, a[2]) for a in arg_sets], calls=2)
        dz = jax.block_until_ready(jax.jit(dz_pass)(lg, arg_sets[0][2]))
        del lg
        w = p.w
        gemms = {
            "dh f32 out": lambda dz, w, h: jnp.einsum("nv,vd->nd", dz, w, preferred_element_type=F32),
            "dh bf16 out": lambda dz, w, h: jnp.einsum("nv,vd->nd", dz, w, preferred_element_type=jnp.bfloat16),
            "dh as [D, N]": lambda dz, w, h: jnp.einsum("nv,vd->dn", dz, w, preferred_element_type=F32),
            "dW bf16 out": lambda dz, w, h: jnp.einsum("nv,nd->vd", dz, h, preferred_element_type=jnp.bfloat16),
            "dh + dW": lambda dz, w, h: (
                jnp.einsum("nv,vd->nd", dz, w, preferred_element_type=F32),
                jnp.einsum("nv,nd->vd", dz, h, preferred_element_type=jnp.bfloat16),
            ),
        }
        for name, f in gemms.items():
            p.generic("residual7", name, m, jax.jit(f), [(dz, w, a[0]) for a in arg_sets], calls=2)
        p.generic(
            "residual7", "gemm (forward)", m, jax.jit(lambda h, w: baselines.gemm(h, w)), [(a[0], w) for a in arg_sets]
        )

    if "chunk7" in groups:
        # The recompute backward's vocab chunk (issue 18 item 4: temp memory at M=4096 within 1.1x
        # of hidden + weight + gradients; 1.14x at 8192, the default until the eighth session): time and compiled
        # temp bytes of grad.backward with the fused dz kernel (as linear_logp runs it) per chunk.
        from detlogp_jax import backends

        dz_kernel = backends.get("pallas_sm90").dz
        # M = 1024 / 2048 too (eighth session): whether a chunk of 8192 below M = 4096, where its
        # [M, chunk] dz buffer is <= 32 MiB and the 1.1x bar still holds, is worth its own rule.
        for m, chunks in ((4096, (4096, 8192, 16384)), (2048, (4096, 8192)), (1024, (4096, 8192))):
            arg_sets, lse, ones = bwd_setup(m)
            for chunk in chunks:
                f = jax.jit(
                    lambda h, w, t, c=chunk, lse=lse, ones=ones: grad.backward(
                        h,
                        w,
                        None,
                        t,
                        ones,
                        lse,
                        ones,
                        jnp.zeros_like(ones),
                        None,
                        vocab_size=V_REAL,
                        chunk=c,
                        dz=dz_kernel,
                    )
                )
                try:
                    mem = f.lower(*arg_sets[0]).compile().memory_analysis()
                    temp_mb = getattr(mem, "temp_size_in_bytes", 0) / 2**20
                except Exception as e:  # keep timing without the figure
                    temp_mb = f"{type(e).__name__}: {e}"[:200]
                p.generic("chunk7", f"fused dz chunk{chunk} (temp_MB={temp_mb})", m, f, arg_sets, calls=2)

    if "walk10" in groups or "shards13" in groups:
        # shards13 (thirteenth session): only the tensor-parallel shards at the end of this group
        # (their last chunk's dW block now written before the full chunks).
        # The recompute backward's chunk walk without copies (tenth session, issue 18 item 1):
        # grad.backward with the in-place walk (sm90_dz.dz_in_place + sm90_grad_gemm: no weight-
        # chunk slices, no dW-chunk updates) against the slice walk (XLA's GEMMs on copies), alone
        # and at each GEMM config variant, with the compiled temp bytes; the gradient difference
        # of the two walks is printed (rel. Frobenius, dh / dW).
        from detlogp_jax import backends

        entry = backends.get("pallas_sm90").dz
        slices = dataclasses.replace(entry, in_place=None)

        # Earlier runs of this group (h200_2026-12-01f/): the first, at wg_split "n" ([128, 128] per
        # warpgroup, shipped then), also timed tile_n 64 with 4 dh stages, col_group 0 and a dW
        # tile_m of 64; the second wg_split "m" (25.04 ms at M=4096 vs "n" 25.19; 98.99 vs 99.85 at
        # 16384, where the slice walk took 96.18), dW 256x128, dh 256x128 with 3 stages and
        # col_group 16: none faster than the shipped configs; the third the chunk (8192 shipped).
        # The fourth (h200_2026-12-02/call1_probe_walk10.log) timed the 2-CTA clusters, off then:
        # "m" 23.90 / 96.22 ms vs none 24.29 / 96.89, "n" 24.34 / 96.78, 0 rows differing; "m" is
        # shipped since. The fifth (h200_2026-12-02b/call1_probe_walk10.log): the exact last chunk
        # 23.47 / 92.86 vs clamped 23.83 / 95.50, chunk 16384 23.04 / 91.63 (shipped since), dW
        # out_slots 4 no faster. Now: the shipped walk (clusters, chunk 16384, last chunk exact)
        # against no cluster and the last chunk clamped as before; then tensor-parallel shards
        # whose last chunk the kernels do not tile (rounded up vs clamped).
        from pallas_kernels import sm90_grad_gemm

        def with_gemms(dh_cfg=tuning.DH_GEMM, dw_cfg=tuning.DW_GEMM):
            w = entry.in_place
            dh = functools.partial(sm90_grad_gemm.dh_accumulate, cfg=dh_cfg)
            dw = functools.partial(sm90_grad_gemm.dw_write, cfg=dw_cfg)
            return dataclasses.replace(entry, in_place=dataclasses.replace(w, dh=dh, dw=dw))

        def with_cluster(cl):
            return with_gemms(
                dataclasses.replace(tuning.DH_GEMM, cluster=cl), dataclasses.replace(tuning.DW_GEMM, cluster=cl)
            )

        shipped = grad.IN_PLACE_CHUNK
        variants = [("in_place", entry, shipped), ("slices", slices, grad.DEFAULT_CHUNK)]
        # (the column-adjacent cluster pair and dW's whole tile of staging boxes, slower or no
        # faster in the fourth and fifth runs, are left out)
        variants += [("in_place no cluster", with_cluster(False), shipped)]
        # (One wgmma group in flight per consumer warpgroup, delay_release 1 in both GEMMs, the dz
        # kernel, all three, timed in the sixth run, h200_2026-12-02c/call1_probe_walk10.log: the
        # GEMMs 22.82 / 90.98 ms vs 23.14 / 90.64 with dh bytes moved in 26 / 203 rows, the dz
        # kernel 23.36 / 90.85 with 0 rows; the knobs were taken out.)
        # (The chunk: 16384 shipped since the twelfth session, once the last chunk was exact; 8192
        # and 12288 were slower in its run, h200_2026-12-02b/call1_probe_walk10.log, and are left
        # out now.)
        # The last chunk clamped as before the eleventh session (a walk whose kernels are declared
        # for whole chunks only, so grad takes the clamped last chunk) vs the shipped exact one.
        whole_only = dataclasses.replace(
            entry.in_place,
            supports=lambda n_pad, d, v_rows, c, layout: (
                c == shipped and entry.in_place.supports(n_pad, d, v_rows, c, layout)
            ),
        )
        variants += [("in_place clamped last chunk", dataclasses.replace(entry, in_place=whole_only), shipped)]

        def backward_fn(dzk, chunk, lse, ones, layout="vd"):
            return jax.jit(
                lambda h, w, t: grad.backward(
                    h,
                    w,
                    None,
                    t,
                    ones,
                    lse,
                    ones,
                    jnp.zeros_like(ones),
                    None,
                    vocab_size=V_REAL,
                    dz=dzk,
                    chunk=chunk,
                    weight_layout=layout,
                )
            )

        for m in (4096, 16384) if "walk10" in groups else ():
            arg_sets, lse, ones = bwd_setup(m)
            outs = {}
            for name, dzk, chunk in variants:
                f = backward_fn(dzk, chunk, lse, ones)
                try:
                    mem = f.lower(*arg_sets[0]).compile().memory_analysis()
                    temp_mb = getattr(mem, "temp_size_in_bytes", 0) / 2**20
                except Exception as e:
                    temp_mb = f"{type(e).__name__}: {e}"[:200]
                p.generic("walk10", f"backward {name} (temp_MB={temp_mb})", m, f, arg_sets, calls=2)
                try:
                    outs[name] = [np.asarray(x, np.float32) for x in f(*arg_sets[0])[:2]]
                except Exception as e:
                    print(f"walk10 {name} at M={m}: {type(e).__name__}: {e}"[:400])
            base = outs.get("in_place")
            for name, got in outs.items():
                if base is None or name == "in_place":
                    continue
                for what, a, b in zip(("dh", "dW"), got, base):
                    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
                    rows = int(np.any(a.view(np.uint32) != b.view(np.uint32), axis=1).sum())
                    print(f"walk10 M={m} {what}: {name} vs in_place: rows differing {rows}, rel. Frobenius {rel:.3e}")
        # [D, V] weight (Flax / Tunix kernel) at M = 4096
        arg_sets, lse, ones = bwd_setup(4096)
        if "walk10" in groups:  # (shards13 skips the [D, V] copy of the weight)
            dv_sets = [(h, jnp.asarray(w.T), t) for h, w, t in arg_sets[:1]]
            for name, dzk, chunk in variants[:2]:
                f = backward_fn(dzk, chunk, lse, ones, layout="dv")
                p.generic("walk10", f"backward dv {name}", 4096, f, dv_sets, calls=2)

        # A tensor-parallel shard's local head (TP = 4: 38016 rows = 2 x 16384 + 5248; TP = 8:
        # 19008 = 16384 + 2624): the last r columns do not tile by 256, so the walk's last chunk
        # is r rounded up (5376 / 2816: 128 / 192 columns recomputed; twelfth session) instead of a
        # clamped 16384-column chunk (11136 / 13760 recomputed): backward alone at M = 4096, rows
        # whose dh / dW bytes differ. The TP = 8 shard failed to compile on the H200 in the
        # thirteenth session (h200_2026-12-02c/call1_probe_walk10.log: XLA's dynamic-slice fusion,
        # "DUS target must be a fusion parameter", on the XLA-formed rows of its last chunk);
        # since then the dW kernel writes them (grad._in_place_walk).
        def shard_walks(label, rows_l, pair):
            """Times the backward on the first rows_l weight rows with the two (name, dz kernel)
            variants of `pair` at M = 4096; returns {name: [dh, dW]}."""
            shard_sets = [(h, w[:rows_l], jnp.clip(t, 0, rows_l - 1)) for h, w, t in arg_sets[:1]]
            outs = {}
            for name, dzk in pair:
                f = jax.jit(
                    lambda h, w, t, dzk=dzk: grad.backward(
                        h, w, None, t, ones, lse, ones, jnp.zeros_like(ones), None, vocab_size=rows_l, dz=dzk
                    )
                )
                p.generic("walk10", f"backward {label} ({rows_l} rows) {name}", 4096, f, shard_sets, calls=2)
                outs[name] = [np.asarray(x, np.float32) for x in f(*shard_sets[0])[:2]]
            return outs

        for tp in (4, 8):
            pair = (
                ("rounded last chunk", entry),
                ("clamped last chunk", dataclasses.replace(entry, in_place=whole_only)),
            )
            outs = shard_walks(f"shard TP={tp}", V_ROWS // tp, pair)
            for what, a, b in zip(("dh", "dW"), outs["rounded last chunk"], outs["clamped last chunk"]):
                rows = int(np.any(a.view(np.uint32) != b.view(np.uint32), axis=1).sum())
                print(f"walk10 TP={tp} shard {what}: rounded vs clamped last chunk: rows differing {rows}")
        # A shard shorter than one chunk that the kernels do not take whole: TP=8 of the Llama-3
        # head padded to 128512 (16064 rows; here the first 16064 rows of the Qwen3-8B weight):
        # the in-place walk on 15872 + 192 (walked as 256; thirteenth session, grad._in_place_chunk)
        # vs the slice walk it took before; the relative gradient difference (another summation
        # order: not bytes).
        outs = shard_walks("Llama-3 TP=8 shard", 16064, (("in_place rounded-down chunk", entry), ("slices", slices)))
        for what, a, b in zip(("dh", "dW"), outs["in_place rounded-down chunk"], outs["slices"]):
            rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            print(f"walk10 Llama-3 TP=8 shard {what}: in place vs slices: rel. Frobenius {rel:.3e}")

    if "backward" in groups:
        m = 4096
        arg_sets, lse, ones = bwd_setup(m)
        for chunk in (4096, 8192, 16384, 32768):
            f = jax.jit(
                lambda h, w, t, c=chunk: grad.backward(
                    h, w, None, t, ones, lse, ones, jnp.zeros_like(ones), None, vocab_size=V_REAL, chunk=c
                )
            )
            p.generic("backward", f"chunk{chunk}", m, f, arg_sets, calls=2)

    if "bwd_variants" in groups:
        m = 4096
        arg_sets, lse, ones = bwd_setup(m)
        f = jax.jit(
            lambda h, w, t: grad.backward(h, w, None, t, ones, lse, ones, jnp.zeros_like(ones), None, vocab_size=V_REAL)
        )
        p.generic("bwd_variants", "grad.backward", m, f, arg_sets, calls=2)
        for chunk, dw_direct, z_bf16 in (
            (4096, False, False),
            (4096, True, False),
            (8192, True, False),
            (16384, True, False),
            (8192, True, True),
        ):
            f = jax.jit(
                lambda h, w, t, c=chunk, a=dw_direct, b=z_bf16: _backward_variant(
                    h, w, t, ones, lse, ones, vocab_size=V_REAL, chunk=c, dw_direct=a, z_bf16=b
                )
            )
            p.generic("bwd_variants", f"chunk{chunk} dw_direct={dw_direct} z_bf16={z_bf16}", m, f, arg_sets, calls=2)
        # fwd+bwd through the library (pallas forward + chunked backward) and XLA autodiff.
        for backend in ("pallas_sm90", "xla"):

            def loss(h, w, t, backend=backend):
                return jnp.sum(
                    api.linear_logp(h, w, t, vocab_size=V_REAL, padded_vocab_size=V_ROWS, backend=backend).logp
                )

            f = jax.jit(jax.grad(loss, argnums=(0, 1)))
            p.generic("bwd_variants", f"fwd_bwd {backend}", m, f, arg_sets, calls=2)

    print("\n| group | name | M | median ms | min | max | TFLOP/s | bits |")
    print("|---|---|---|---|---|---|---|---|")
    for r in p.rows:
        if "error" in r:
            print(f"| {r['group']} | {r['name']} | {r['m']} | ERROR {r['error'][:80]} |")
        else:
            print(
                f"| {r['group']} | {r['name']} | {r['m']} | {r['median_ms']:.4f} | {r['min_ms']:.4f} | {r['max_ms']:.4f} | "
                f"{r.get('tflops', 0):.0f} | {r.get('bits', '')} |"
            )


if __name__ == "__main__":
    app.run(main)
