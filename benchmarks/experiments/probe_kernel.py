"""Kernel experiments on the GPU: time bit-neutral launch variants in one process.

Not the benchmark runner (`benchmarks/run.py` is): this script times the
pallas_sm90 forward kernel alone (`sm90_forward._forward_core` on pre-padded
operands), the fold alone, the full `linear_logp` path, the XLA baselines and
the chunked backward, for a list of launch variants, and checks that every
variant gives the same partials bytes as the bucket's current config. Each
experiment is one JSON line under --out; a table is printed at the end.

  PYTHONPATH=. python3 -m benchmarks.probe_kernel --groups decode,prefill --out /tmp/probe.jsonl

Device: an H200 (nvidia-h200). Times are medians over --samples samples of
--calls back-to-back calls with one synchronization (device time per call).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import traceback

import numpy as np
from absl import app, flags

import jax
import jax.numpy as jnp

from benchmarks import baselines, cases, shapes
from detlogp_jax import api, contract as C, grad
from pallas_kernels import sm90_fold, sm90_forward, tuning

FLAGS = flags.FLAGS
flags.DEFINE_list("groups", ["decode", "fold", "small", "prefill", "large", "serving", "backward", "full"],
                  "Experiment groups (also: epi, epi_large, epi_small, bwd_variants, epi_next, ws, ws_pipe, smem, cluster, decode_ws).")
flags.DEFINE_string("out", "/tmp/probe.jsonl", "JSON lines output.")
flags.DEFINE_integer("samples", 9, "Timed samples per experiment.")
flags.DEFINE_float("budget_s", 540.0, "Stop starting new experiments after this many seconds.")

SHAPE = shapes.get("qwen3_8b")
D, V_ROWS, V_REAL = SHAPE.d, SHAPE.v_rows, SHAPE.v_real
F32 = jnp.float32


def _inputs(m, seed):
  """(hidden, targets) of the benchmark runner's input set `seed` at M = m."""
  [(h, t)] = cases.make_inputs(SHAPE, jnp.bfloat16, seed, m)
  return h, t


def _weight():
  return cases.make_weight(SHAPE, jnp.bfloat16, seed=99)


def _time(fn, arg_sets, calls, samples):
  out = fn(*arg_sets[0])
  jax.block_until_ready(out)
  for i in range(2):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  times = []
  for s in range(samples):
    t0 = time.perf_counter()
    outs = [fn(*arg_sets[(s * calls + j) % len(arg_sets)]) for j in range(calls)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) / calls * 1e3)
    del outs
  return out, {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def _calls(m):
  return 20 if m <= 256 else (6 if m <= 4096 else 3)


def _kernel_fn(m, cfg, *, return_logits=False, diag=()):
  """Jitted kernel-only call on pre-padded operands (as `partials` builds them)."""
  geom = sm90_forward.shard_geometry(V_REAL, V_ROWS)
  n_pad = tuning.padded_rows(m, cfg)
  num_ctas = tuning.persistent_ctas(n_pad, geom.n_local, cfg, tuning.default_num_sms() * cfg.ctas_per_sm)
  lg_rows = m if (m % 8 == 0 or m < 8) else -(-m // 8) * 8

  def prep(h, t):
    pad = n_pad - m
    return (jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(t, (0, pad), constant_values=C.IGNORE_INDEX),
            jnp.ones((n_pad,), F32))

  @jax.jit
  def run(h, w, t, invt):
    return sm90_forward._forward_core(
        h, w, t, invt, n_pad=n_pad, d=D, lg_cols=V_ROWS, geom=geom, cfg=cfg, has_bias=False,
        return_logits=return_logits, num_ctas=num_ctas, interpret=False, interpret_params=None,
        lg_rows=lg_rows, fused_ptx=True, diag=tuple(diag))

  return run, prep


def _bits_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return bool(a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)))


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
    self.w = _weight()
    self.inputs = {}
    self.ref_bits = {}

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
      self.inputs[m] = [_inputs(m, s) for s in (1, 2)]
    return self.inputs[m]

  def kernel(self, group, name, m, cfg, *, return_logits=False, diag=(), ref_key=None):
    if self.over_budget():
      return
    try:
      t0 = time.perf_counter()
      run, prep = _kernel_fn(m, cfg, return_logits=return_logits, diag=diag)
      arg_sets = [(*prep(h, t),) for h, t in self.sets(m)]
      arg_sets = [(a[0], self.w, a[1], a[2]) for a in arg_sets]
      out, res = _time(run, arg_sets, _calls(m), self.samples)
      extra = {"cfg": tuning.describe(cfg), "diag": list(diag), "wall_s": time.perf_counter() - t0}
      if set(diag) <= {"zero_first", "mask_always"}:
        key = ref_key or (m, return_logits)
        # The M real rows only: a config with another rows/CTA pads to another n_pad
        # (m, s are [n_local, n_pad]), and whole arrays of different shapes never compare equal.
        bits = [np.asarray(x)[:, :m] for x in out[:3]] + [np.asarray(x)[:m] for x in out[3:]]
        if key not in self.ref_bits:
          self.ref_bits[key] = bits
          extra["bits"] = "reference"
        else:
          extra["bits"] = "same" if all(_bits_equal(a, b) for a, b in zip(bits, self.ref_bits[key])) else "DIFFERENT"
      self.record(group, name, m, res, **extra)
    except Exception as e:  # keep going: one failing variant must not end the run
      self.record(group, name, m, {"error": f"{type(e).__name__}: {str(e)[:400]}"})
      traceback.print_exc()

  def generic(self, group, name, m, fn, arg_sets, calls=None):
    if self.over_budget():
      return
    try:
      t0 = time.perf_counter()
      _, res = _time(fn, arg_sets, calls or _calls(m), self.samples)
      self.record(group, name, m, res, wall_s=time.perf_counter() - t0)
    except Exception as e:
      self.record(group, name, m, {"error": f"{type(e).__name__}: {str(e)[:400]}"})
      traceback.print_exc()


# The prefill configuration before the epilogue warpgroup (chain in the wgmma warpgroups,
# 5 stages): the base of the experiment groups of the first two sessions.
CHAIN_IN_WGMMA = dataclasses.replace(tuning.BUCKETS["prefill"], name="prefill-chain", epilogue_wgs=0,
                                     max_concurrent_steps=5)


# The decode configuration before the epilogue warpgroup (fourth session): chain in the one
# wgmma warpgroup, 6 stages.
DECODE_CHAIN_IN_WGMMA = dataclasses.replace(tuning.BUCKETS["decode"], name="decode-chain", epilogue_wgs=0,
                                            max_concurrent_steps=6)


def _v(base, name, **kw):
  cfg = {"prefill_chain": CHAIN_IN_WGMMA, "decode_chain": DECODE_CHAIN_IN_WGMMA}.get(base) or tuning.BUCKETS[base]
  return dataclasses.replace(cfg, name=name, **kw)


def main(argv):
  del argv
  p = Probe(FLAGS.out, FLAGS.samples, FLAGS.budget_s)
  groups = set(FLAGS.groups)
  print(jax.devices(), flush=True)

  def full_fn(backend, serving=False):
    @jax.jit
    def f(h, w, t):
      o = api.linear_logp(h, w, t, vocab_size=V_REAL, padded_vocab_size=V_ROWS, backend=backend,
                          return_logits=serving)
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
      p.kernel("decode", "decode chain-in-wgmma+delay", m, _v("decode_chain", "d1", delay_release=1))
      p.kernel("decode", "decode chain-in-wgmma+st8", m, _v("decode_chain", "d2", max_concurrent_steps=8))
      p.kernel("decode", "decode-skip-epi", m, tuning.BUCKETS["decode"], diag=("skip_epilogue",))

  if "fold" in groups:
    # The fold alone on pre-padded split-major partials, per layout / knob
    # (all bit-neutral): each variant pads the rows to its own row block,
    # as fold_transposed does, and must give the bytes of the first variant.
    n_split = C.split_bounds(V_ROWS).n_split
    rng = np.random.default_rng(0)
    variants = [
        ("rowloop u8", dict(staged=False, unroll=8)),
        ("staged r32 c64 u32", dict(staged=True, rows=32, chunk=64, unroll=32)),
        ("staged r32 c64 u8", dict(staged=True, rows=32, chunk=64, unroll=8)),
        (f"staged r32 c64 u{n_split}", dict(staged=True, rows=32, chunk=64, unroll=n_split)),
        ("staged r32 c32 u32", dict(staged=True, rows=32, chunk=32, unroll=32)),
        ("staged r32 c128 u32", dict(staged=True, rows=32, chunk=128, unroll=32)),
        ("staged r64 c64 u32", dict(staged=True, rows=64, chunk=64, unroll=32)),
    ]
    for m in (1, 64, 4096):
      n_max = -(-m // sm90_fold.FOLD_ROWS) * sm90_fold.FOLD_ROWS
      mt = jnp.asarray(rng.normal(0, 3, (n_split, n_max)), F32)
      st = jnp.asarray(rng.uniform(1, 40, (n_split, n_max)), F32)
      zt = jnp.asarray(rng.normal(0, 3, (n_max,)), F32)
      tg = jnp.asarray(rng.integers(0, V_REAL, n_max), jnp.int32)
      it = jnp.ones((n_max,), F32)
      ref = None
      for name, knobs in variants:
        rb = sm90_fold.row_block(staged=knobs["staged"], rows=knobs.get("rows", sm90_fold.ROWS))
        n_pad = -(-m // rb) * rb
        args = (mt[:, :n_pad], st[:, :n_pad], zt[:n_pad], tg[:n_pad], it[:n_pad])
        f = jax.jit(lambda a, b, c, d, e, n_pad=n_pad, knobs=knobs: sm90_fold._fold_core(
            a, b, c, d, e, n_split=n_split, n_pad=n_pad, vocab_size=V_REAL, interpret=False, interpret_params=None,
            **knobs))
        try:
          out = [np.asarray(x)[:m] for x in f(*args)]
        except Exception:  # noqa: BLE001 - record and go on with the other variants
          p.record("fold", name, m, {"error": traceback.format_exc(limit=3)})
          continue
        p.generic("fold", name, m, f, [args])
        if ref is None:
          ref = out
        elif not all(_bits_equal(a, b) for a, b in zip(out, ref)):
          p.record("fold", name, m, {"error": f"bits differ from {variants[0][0]}"})
      # The whole fold as callers run it (row padding included), on [n_split, m].
      for name, knobs in (("fold_transposed staged", {}), ("fold_transposed rowloop", dict(staged=False))):
        f = jax.jit(lambda a, b, c, d, e, knobs=knobs: sm90_fold.fold_transposed(a, b, c, d, e, V_REAL, **knobs))
        p.generic("fold", name, m, f, [(mt[:, :m], st[:, :m], zt[:m], tg[:m], it[:m])])

  if "small" in groups:
    for m in (256,):
      p.kernel("small", "small", m, tuning.BUCKETS["small"])
      p.kernel("small", "small+delay", m, _v("small", "s1", delay_release=1))
      p.kernel("small", "small+delay+st6", m, _v("small", "s2", delay_release=1, max_concurrent_steps=6))

  if "prefill" in groups:
    m = 4096
    p.kernel("prefill", "prefill", m, CHAIN_IN_WGMMA)
    p.kernel("prefill", "+delay", m, _v("prefill_chain", "p1", delay_release=1))
    p.kernel("prefill", "+delay+g4", m, _v("prefill_chain", "p2", delay_release=1, split_group=4))
    p.kernel("prefill", "+delay+g8", m, _v("prefill_chain", "p3", delay_release=1, split_group=8))
    p.kernel("prefill", "+delay+g16", m, _v("prefill_chain", "p4", delay_release=1, split_group=16))
    p.kernel("prefill", "+delay+st4", m, _v("prefill_chain", "p5", delay_release=1, max_concurrent_steps=4))
    p.kernel("prefill", "+delay+3wg", m, _v("prefill_chain", "p6", delay_release=1, num_compute_wgs=3, max_concurrent_steps=4))
    p.kernel("prefill", "skip-epi", m, CHAIN_IN_WGMMA, diag=("skip_epilogue",))
    p.kernel("prefill", "+delay skip-epi", m, _v("prefill_chain", "p1", delay_release=1), diag=("skip_epilogue",))
    sets = [(h, p.w) for h, _ in p.sets(m)]
    p.generic("prefill", "gemm-bf16", m, jax.jit(lambda h, w: baselines.gemm(h, w)), sets)

  if "epi" in groups:
    m = 4096
    old = ("zero_first", "mask_always")
    p.kernel("epi", "old(zero_first,mask_always)", m, CHAIN_IN_WGMMA, diag=old)
    p.kernel("epi", "new", m, CHAIN_IN_WGMMA)
    p.kernel("epi", "zero_first", m, CHAIN_IN_WGMMA, diag=("zero_first",))
    p.kernel("epi", "mask_always", m, CHAIN_IN_WGMMA, diag=("mask_always",))
    p.kernel("epi", "new no_hit", m, CHAIN_IN_WGMMA, diag=("no_hit",))
    p.kernel("epi", "new no_exp", m, CHAIN_IN_WGMMA, diag=("no_exp",))
    p.kernel("epi", "old no_mask", m, CHAIN_IN_WGMMA, diag=("zero_first", "no_mask"))
    p.kernel("epi", "skip_epilogue", m, CHAIN_IN_WGMMA, diag=("skip_epilogue",))
    p.kernel("epi", "new+g8", m, _v("prefill_chain", "p7", split_group=8))
    p.kernel("epi", "new+delay", m, _v("prefill_chain", "p1", delay_release=1))
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
      p.kernel("epi_small", "decode old", m, tuning.BUCKETS["decode"], diag=("zero_first", "mask_always"))
    for m in (256, 1024):
      p.kernel("epi_small", "natural new", m, tuning.select_bucket(m))
      p.kernel("epi_small", "natural old", m, tuning.select_bucket(m), diag=("zero_first", "mask_always"))
    m = 4096
    p.kernel("epi_small", "serving new slots2", m, _v("prefill_chain", "l2", logits_slots=2), return_logits=True)
    p.kernel("epi_small", "serving new slots1", m, _v("prefill_chain", "l1", logits_slots=1), return_logits=True)
    p.kernel("epi_small", "serving new slots3", m, _v("prefill_chain", "l5", logits_slots=3), return_logits=True)

  if "epi_next" in groups:
    # Next experiments on the chain's cost (not run yet): does it scale with the tiles
    # per group, with the warpgroups running it, or is it a fixed cost of reading the
    # accumulator at a group boundary? And the stage count of the shipped config.
    m = 4096
    base = CHAIN_IN_WGMMA
    p.kernel("epi_next", "prefill", m, base)
    for diag in (("skip_epilogue",), ("acc_max_only",), ("one_tile",), ("wg0_only",), ("no_exp", "no_hit")):
      p.kernel("epi_next", "+".join(diag), m, base, diag=diag)
    for st in (3, 4, 6):
      p.kernel("epi_next", f"st{st}", m, _v("prefill_chain", f"s{st}", max_concurrent_steps=st))
      p.kernel("epi_next", f"st{st} skip_epilogue", m, _v("prefill_chain", f"s{st}", max_concurrent_steps=st),
               diag=("skip_epilogue",))
    p.kernel("epi_next", "g0 skip_epilogue", m, _v("prefill_chain", "g0", split_group=0), diag=("skip_epilogue",))

  if "ws" in groups:
    # Dedicated epilogue warpgroup (sm90_forward_ws): the chain of group g runs while the
    # wgmma warpgroups compute group g+1. Bytes are checked against the shipped bucket.
    base = tuning.BUCKETS["prefill"]
    ws = lambda name, **kw: _v("prefill", name, epilogue_wgs=1, **kw)
    m = 4096
    p.kernel("ws", "prefill", m, base)
    p.kernel("ws", "ws1 tk64", m, ws("ws1"))
    p.kernel("ws", "ws1 tk64 auto_barriers", m, ws("ws1ab", auto_barriers=True))
    p.kernel("ws", "ws1 tk64 skip_epilogue", m, ws("ws1"), diag=("skip_epilogue",))
    for st in (4, 6):
      p.kernel("ws", f"ws1 tk32 st{st}", m, ws(f"ws1k32s{st}", tile_k=32, max_concurrent_steps=st))
      p.kernel("ws", f"ws1 tk32 st{st} skip_epilogue", m, ws(f"ws1k32s{st}", tile_k=32, max_concurrent_steps=st),
               diag=("skip_epilogue",))
    for g in (0, 8):
      p.kernel("ws", f"ws1 tk32 st6 g{g}", m, ws(f"ws1k32g{g}", tile_k=32, max_concurrent_steps=6, split_group=g))
    for m in (16384, 1024):
      p.kernel("ws", "prefill", m, base)
      p.kernel("ws", "ws1 tk64", m, ws("ws1"))
      p.kernel("ws", "ws1 tk32 st6", m, ws("ws1k32s6", tile_k=32, max_concurrent_steps=6))
    m = 4096
    p.kernel("ws", "prefill serving", m, base, return_logits=True)
    p.kernel("ws", "ws1 tk64 serving", m, ws("ws1"), return_logits=True)
    p.kernel("ws", "ws1 tk32 st6 serving", m, ws("ws1k32s6", tile_k=32, max_concurrent_steps=6), return_logits=True)

  if "ws_pipe" in groups:
    # Why the ws pipeline alone (skip_epilogue) runs at ~7.4 ms while the chain-in-wgmma
    # kernel at 3 stages without its chain ran at ~5.4 ms (probe_epi_next.jsonl).
    m = 4096
    base = tuning.BUCKETS["prefill"]
    p.kernel("ws_pipe", "prefill(ws)", m, base)
    p.kernel("ws_pipe", "prefill(ws) skip", m, base, diag=("skip_epilogue",))
    p.kernel("ws_pipe", "ws st2 skip", m, _v("prefill", "st2", max_concurrent_steps=2), diag=("skip_epilogue",))
    p.kernel("ws_pipe", "ws g0 skip", m, _v("prefill", "g0", split_group=0), diag=("skip_epilogue",))
    p.kernel("ws_pipe", "old st3 skip", m, _v("prefill", "old3", epilogue_wgs=0), diag=("skip_epilogue",))
    p.kernel("ws_pipe", "old st3", m, _v("prefill", "old3", epilogue_wgs=0))
    p.kernel("ws_pipe", "old st5 skip", m, _v("prefill", "old5", epilogue_wgs=0, max_concurrent_steps=5),
             diag=("skip_epilogue",))

  if "smem" in groups:
    # Does the pipeline's speed follow its shared-memory footprint? (Next-session question:
    # 120 KiB pipelines ran at ~5.4 ms without a chain, >= 160 KiB ones at ~7.5 ms.)
    m = 4096
    p.kernel("smem", "ws (216 KiB)", m, tuning.BUCKETS["prefill"])
    p.kernel("smem", "ws skip (216 KiB)", m, tuning.BUCKETS["prefill"], diag=("skip_epilogue",))
    p.kernel("smem", "ws dump_one_tile st3 skip (152 KiB)", m, tuning.BUCKETS["prefill"],
             diag=("skip_epilogue", "dump_one_tile"))
    p.kernel("smem", "ws dump_one_tile st4 skip (192 KiB)", m, _v("prefill", "ws1t4", max_concurrent_steps=4),
             diag=("skip_epilogue", "dump_one_tile"))
    p.kernel("smem", "chain st3 skip (120 KiB)", m, _v("prefill_chain", "c3", max_concurrent_steps=3),
             diag=("skip_epilogue",))
    p.kernel("smem", "chain st3 skip + 96 KiB pad (216 KiB)", m, _v("prefill_chain", "c3", max_concurrent_steps=3),
             diag=("skip_epilogue", "pad_smem96"))
    p.kernel("smem", "chain st3 + 96 KiB pad", m, _v("prefill_chain", "c3", max_concurrent_steps=3),
             diag=("pad_smem96",))

  if "cluster" in groups:
    # TMA multicast of the weight K slices over 2-CTA clusters (half the L2->SMEM
    # weight traffic per CTA). Bytes of every variant vs the shipped prefill config.
    c2 = _v("prefill", "c2", cluster=2)
    for m in (4096, 16384):
      p.kernel("cluster", "prefill", m, tuning.BUCKETS["prefill"])
      p.kernel("cluster", "cluster2", m, c2)
    m = 4096
    p.kernel("cluster", "prefill skip", m, tuning.BUCKETS["prefill"], diag=("skip_epilogue",))
    p.kernel("cluster", "cluster2 skip", m, c2, diag=("skip_epilogue",))
    for g in (0, 2, 8):
      p.kernel("cluster", f"cluster2 g{g}", m, _v("prefill", f"c2g{g}", cluster=2, split_group=g))
    p.kernel("cluster", "prefill serving", m, tuning.BUCKETS["prefill"], return_logits=True)
    p.kernel("cluster", "cluster2 serving", m, c2, return_logits=True)
    for m in (640, 4160):  # an odd number of 128-row blocks: the cluster pads one more
      p.kernel("cluster", "prefill", m, tuning.BUCKETS["prefill"])
      p.kernel("cluster", "cluster2", m, c2)

  if "decode_ws" in groups:
    # The epilogue-warpgroup kernel for the decode and small buckets: the chain runs beside
    # the weight stream instead of between tile groups of the one wgmma warpgroup.
    # (Run at 4407823, when the decode bucket was still the chain-in-wgmma config that
    # DECODE_CHAIN_IN_WGMMA keeps; since then "ws decode st5" is the decode bucket.)
    for m in (1, 8, 64):
      p.kernel("decode_ws", "decode", m, DECODE_CHAIN_IN_WGMMA)
      for st in (4, 5):
        p.kernel("decode_ws", f"ws decode st{st}", m, _v("decode", f"wsd{st}", epilogue_wgs=1, max_concurrent_steps=st))
    for m in (128, 256, 512):
      p.kernel("decode_ws", "small", m, tuning.BUCKETS["small"])
      p.kernel("decode_ws", "ws small st3", m, _v("small", "wss3", epilogue_wgs=1, max_concurrent_steps=3))
    m = 64
    p.kernel("decode_ws", "decode serving", m, DECODE_CHAIN_IN_WGMMA, return_logits=True)
    p.kernel("decode_ws", "ws decode st5 serving", m, _v("decode", "wsd5", epilogue_wgs=1, max_concurrent_steps=5),
             return_logits=True)
    # Is a pipeline without a live accumulator dead code? The 3-stage chain-in-wgmma pipeline
    # ran at 5.3 ms with `skip_epilogue` (the accumulator is never read); here it is read.
    p.kernel("decode_ws", "chain st3 acc_max_only", 4096, _v("prefill_chain", "c3", max_concurrent_steps=3),
             diag=("acc_max_only",))

  if "large" in groups:
    m = 16384
    p.kernel("large", "prefill", m, CHAIN_IN_WGMMA)
    p.kernel("large", "+delay", m, _v("prefill_chain", "p1", delay_release=1))
    p.kernel("large", "+delay+g8", m, _v("prefill_chain", "p3", delay_release=1, split_group=8))
    p.kernel("large", "+delay+g16", m, _v("prefill_chain", "p4", delay_release=1, split_group=16))

  if "serving" in groups:
    m = 4096
    p.kernel("serving", "slots1", m, _v("prefill_chain", "l1", logits_slots=1), return_logits=True)
    p.kernel("serving", "slots2", m, _v("prefill_chain", "l2", logits_slots=2), return_logits=True)
    p.kernel("serving", "delay+slots2", m, _v("prefill_chain", "l3", delay_release=1, logits_slots=2), return_logits=True)
    p.kernel("serving", "delay+slots3", m, _v("prefill_chain", "l4", delay_release=1, logits_slots=3), return_logits=True)

  def bwd_setup(m):
    """Backward inputs at M rows: arg sets (h, W, t), a fixed lse, unit inv_t / g_logp."""
    return [(h, p.w, t) for h, t in p.sets(m)], jnp.full((m,), 12.0, F32), jnp.ones((m,), F32)

  if "backward" in groups:
    m = 4096
    arg_sets, lse, ones = bwd_setup(m)
    for chunk in (4096, 8192, 16384, 32768):
      f = jax.jit(lambda h, w, t, c=chunk: grad.backward(h, w, None, t, ones, lse, ones, jnp.zeros_like(ones), None,
                                                          vocab_size=V_REAL, chunk=c))
      p.generic("backward", f"chunk{chunk}", m, f, arg_sets, calls=2)

  if "bwd_variants" in groups:
    m = 4096
    arg_sets, lse, ones = bwd_setup(m)
    f = jax.jit(lambda h, w, t: grad.backward(h, w, None, t, ones, lse, ones, jnp.zeros_like(ones), None,
                                              vocab_size=V_REAL))
    p.generic("bwd_variants", "grad.backward", m, f, arg_sets, calls=2)
    for chunk, dw_direct, z_bf16 in ((4096, False, False), (4096, True, False), (8192, True, False),
                                     (16384, True, False), (8192, True, True)):
      f = jax.jit(lambda h, w, t, c=chunk, a=dw_direct, b=z_bf16: _backward_variant(
          h, w, t, ones, lse, ones, vocab_size=V_REAL, chunk=c, dw_direct=a, z_bf16=b))
      p.generic("bwd_variants", f"chunk{chunk} dw_direct={dw_direct} z_bf16={z_bf16}", m, f,
                arg_sets, calls=2)
    # fwd+bwd through the library (pallas forward + chunked backward) and XLA autodiff.
    for backend in ("pallas_sm90", "xla"):
      def loss(h, w, t, backend=backend):
        return jnp.sum(api.linear_logp(h, w, t, vocab_size=V_REAL, padded_vocab_size=V_ROWS, backend=backend).logp)
      f = jax.jit(jax.grad(loss, argnums=(0, 1)))
      p.generic("bwd_variants", f"fwd_bwd {backend}", m, f, arg_sets, calls=2)

  print("\n| group | name | M | median ms | min | max | TFLOP/s | bits |")
  print("|---|---|---|---|---|---|---|---|")
  for r in p.rows:
    if "error" in r:
      print(f"| {r['group']} | {r['name']} | {r['m']} | ERROR {r['error'][:80]} |")
    else:
      print(f"| {r['group']} | {r['name']} | {r['m']} | {r['median_ms']:.4f} | {r['min_ms']:.4f} | {r['max_ms']:.4f} | "
            f"{r.get('tflops', 0):.0f} | {r.get('bits', '')} |")


if __name__ == "__main__":
  app.run(main)
