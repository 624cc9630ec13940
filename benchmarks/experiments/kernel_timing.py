"""What the kernel experiments share: the Qwen3-8B inputs, the timing loop, the kernel-only call.

Used by `probe_kernel`, `power_probe` and `gemm_ceiling` (each one entry point
on the GPU machine). Defines their shared `--out` flag (JSON lines output).
Kernel internals are reached through public names only: a forward kernel is
built by its module's `build` (`sm90_forward_wgmma` for a
`tuning.WgmmaForwardConfig`, `sm90_forward_ws` for a `tuning.WsForwardConfig`)
on operands padded as `pallas_kernels.wrapper.partials` pads them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper_matmul

import pallas_kernels as pk
from benchmarks import cases, shapes
from detlogp_jax import contract as C
from pallas_kernels import sm90_forward_wgmma, sm90_forward_ws, tuning

flags.DEFINE_string("out", "/tmp/probe.jsonl", "JSON lines output.")

SHAPE = shapes.get("qwen3_8b")
D, V_ROWS, V_REAL = SHAPE.d, SHAPE.v_rows, SHAPE.v_real
F32 = jnp.float32


def inputs(m, seed):
    """(hidden, targets) of the benchmark runner's input set `seed` at M = m."""
    [(h, t)] = cases.make_inputs(SHAPE, jnp.bfloat16, seed, m)
    return h, t


def weight():
    """The benchmark runner's Qwen3-8B lm_head weight [V_ROWS, D] bf16."""
    return cases.make_weight(SHAPE, jnp.bfloat16, seed=99)


def time_calls(fn, arg_sets, calls, samples):
    """(first output, {median_ms, min_ms, max_ms}): `samples` samples of `calls` back-to-back
    calls with one synchronization each (device time per call), after two warm-up calls."""
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


def calls_for(m):
    """Back-to-back calls per timed sample at M = m."""
    return 20 if m <= 256 else (6 if m <= 4096 else 3)


def forward_build(cfg):
    """The `build` of the forward kernel this config is for."""
    if isinstance(cfg, tuning.WsForwardConfig):
        return sm90_forward_ws.build
    if isinstance(cfg, tuning.WgmmaForwardConfig):
        return sm90_forward_wgmma.build
    raise TypeError(f"not a forward kernel config: {cfg!r}")


def kernel_fn(m, cfg, *, return_logits=False, **build_kw):
    """(run, prep): a jitted kernel-only call run(h_pad, w, t_pad, inv_t_pad) on pre-padded
    operands (as `partials` builds them; no bias), and prep(h, t) -> (h_pad, t_pad, inv_t_pad)."""
    geom = pk.shard_geometry(V_REAL, V_ROWS)
    n_pad = tuning.padded_rows(m, cfg)
    h_rows = row_rows = n_pad
    num_ctas = tuning.persistent_ctas(n_pad, geom.n_local, cfg, tuning.default_num_sms() * cfg.ctas_per_sm)
    lg_rows = m if (m % 8 == 0 or m < 8) else -(-m // 8) * 8
    build = forward_build(cfg)

    def prep(h, t):
        return (
            jnp.pad(h, ((0, h_rows - m), (0, 0))),
            jnp.pad(t, (0, row_rows - m), constant_values=C.IGNORE_INDEX),
            jnp.ones((row_rows,), F32),
        )

    @jax.jit
    def run(h, w, t, invt):
        return build(
            n_pad=n_pad,
            d=D,
            lg_cols=V_ROWS,
            geom=geom,
            cfg=cfg,
            has_bias=False,
            return_logits=return_logits,
            num_ctas=num_ctas,
            interpret=False,
            interpret_params=None,
            lg_rows=lg_rows,
            **build_kw,
        )(h, w, t, invt)

    return run, prep


def pallas_gemm(*, tile_m: int = 128, tile_n: int = 128, stages: int = 4, wg: str, minor: str, width: int):
    """A jitted fn(hidden [M, D], weight [D, V]) of JAX's Pallas Hopper GEMM
    (`hopper_matmul_mgpu`: [tile_m, tile_n] per warpgroup, 64-wide K slices, `stages` pipeline
    stages, no epilogue but the output's store), the consumer warpgroups along `wg` and the grid's
    minor dimension `minor` ("M" or "N"), grid tile width `width`: the GEMM-alone lanes of
    `gemm_ceiling` (its sweep) and `probe_kernel`'s ceiling18 / chain18 / shape19."""
    dim = hopper_matmul.MatmulDimension
    cfg = hopper_matmul.TuningConfig(
        tile_m=tile_m,
        tile_n=tile_n,
        tile_k=64,
        max_concurrent_steps=stages,
        grid_minor_dim=dim[minor],
        grid_tile_width=width,
        wg_dimension=dim[wg],
    )
    return jax.jit(lambda h, w: hopper_matmul.matmul(h, w, None, cfg))


def bits_equal(a, b):
    """Same shape and the same bytes (f32 viewed as uint32)."""
    a, b = np.asarray(a), np.asarray(b)
    return bool(a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def as_wgmma(cfg: tuning.ForwardConfig, **kw) -> tuning.WgmmaForwardConfig:
    """The chain-in-wgmma config with cfg's shared launch fields (block_m, warpgroups, stages,
    CTAs per SM, work order), then `kw` replaced (e.g. name=, max_concurrent_steps=)."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(tuning.ForwardConfig)}
    return tuning.WgmmaForwardConfig(**{**shared, **kw})


def as_ws(cfg: tuning.ForwardConfig, **kw) -> tuning.WsForwardConfig:
    """The epilogue-warpgroup config with cfg's shared launch fields, then `kw` replaced."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(tuning.ForwardConfig)}
    return tuning.WsForwardConfig(**{**shared, **kw})


# The prefill configuration with the chain in the wgmma warpgroups (5 stages): the base of the
# chain-in-wgmma experiment groups.
CHAIN_IN_WGMMA = as_wgmma(tuning.BUCKETS["prefill"], name="prefill-chain", max_concurrent_steps=5)

# The decode configuration with the chain in the one wgmma warpgroup, 6 stages.
DECODE_CHAIN_IN_WGMMA = as_wgmma(tuning.BUCKETS["decode"], name="decode-chain", max_concurrent_steps=6)
