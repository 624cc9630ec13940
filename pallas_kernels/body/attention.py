"""Host side of the body attention: `attention(q, k, v, *, q_positions, kv_start, scale, out_dtype)`.

Re-arranges q [B, T, Hq, Dh] into the kernel's rows (an activation copy; the cache is read in
place): per KV head, rows r = t * G + g (query t, head g of the group), padded to whole tiles
of 64 rows; a prefill tile holds 64 / G queries x G heads, a decode tile the G heads of one
query (padding rows have no keys). Builds each row's position, each tile's metadata (its last
position, its leading blocks seen whole by every row with keys) and re-arranges the output back
to [B, T, Hq, Dh]. Launch geometry (`attention_config.select`) is bit-neutral. Interpret mode
(CPU) pads the cache by one KV block of zeros (the interpreter's slices are clamped where TMA
fills zeros) and runs the same kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.body import attention_config as ac
from pallas_kernels.body import attention_kernel

OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents (KV-head pairs, sequences)


def supports(q, k, v) -> tuple[bool, str]:
    """(ok, why): bfloat16 q, k, v; head dim in `attention_config.HEAD_DIMS` (64, 128); any
    GQA group size G = Hq / Hkv (a query's G rows may straddle row tiles: rows are independent);
    at most 65535 sequences and KV heads (the launch grid's y and z extents)."""
    dts = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if dts != {"bfloat16"}:
        return False, f"the Hopper attention kernel takes bfloat16 q, k and v, got {sorted(dts)}"
    dh = q.shape[-1]
    if dh not in ac.HEAD_DIMS:
        return False, f"the Hopper attention kernel takes head dims {ac.HEAD_DIMS}, got {dh}"
    if q.shape[0] > MAX_GRID_YZ or k.shape[2] > MAX_GRID_YZ:
        return (
            False,
            f"the Hopper attention kernel takes at most {MAX_GRID_YZ} sequences and KV heads, got {q.shape[0]}, {k.shape[2]}",
        )
    return True, ""


def _rows(x, hkv: int, rows: int):
    """[B, T, Hkv * G, ...] -> [B, Hkv, rows, ...] with row t * G + g, padded (zeros) to rows."""
    b, t, hq = x.shape[:3]
    g = hq // hkv
    y = x.reshape(b, t, hkv, g, *x.shape[3:])
    y = jnp.moveaxis(y, 2, 1).reshape(b, hkv, t * g, *x.shape[3:])
    pad = [(0, 0), (0, 0), (0, rows - t * g)] + [(0, 0)] * (x.ndim - 3)
    return jnp.pad(y, pad)


def tile_metadata(pos_rows):
    """pos_rows [B, R] (-1: no keys) -> [B, R / 64, 2] int32 of (n_full, last) per row tile:
    last = the largest position (-1 when no row has keys), n_full = the leading KV blocks that
    every row with keys sees whole ((min position + 1) // 64; 0 when no row has keys)."""
    b, r = pos_rows.shape
    tiles = pos_rows.reshape(b, r // ac.ROWS, ac.ROWS)
    last = jnp.max(tiles, axis=2)
    big = jnp.iinfo(jnp.int32).max
    first = jnp.min(jnp.where(tiles >= 0, tiles, big), axis=2)
    n_full = jnp.where(last >= 0, (first + 1) // ac.KV_BLOCK, 0)
    return jnp.stack([n_full, last], axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype", "cfg", "interpret", "interpret_params"))
def _launch(q, k, v, q_positions, kv_start, *, scale, out_dtype, cfg, interpret, interpret_params):
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    rows = -(-(t * g) // ac.ROWS) * ac.ROWS
    q_rows = _rows(q, hkv, rows)
    pos = jnp.maximum(q_positions.astype(jnp.int32), -1)  # any position < 0 has no keys
    pos_rows = jnp.pad(jnp.repeat(pos, g, axis=1), ((0, 0), (0, rows - t * g)), constant_values=-1)
    meta = tile_metadata(pos_rows)
    if interpret:  # slots past the cache: zeros, as TMA fills them
        pad = ((0, 0), (0, ac.KV_BLOCK), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    kernel = attention_kernel.build(
        batch=b,
        hkv=hkv,
        dh=dh,
        rows=rows,
        out_dtype=out_dtype,
        scale=scale,
        cfg=cfg,
        interpret=interpret,
        interpret_params=interpret_params,
    )
    out = kernel(q_rows, k, v, pos_rows, meta, kv_start.astype(jnp.int32))  # [B, Hkv, rows, Dh]
    out = out[:, :, : t * g].reshape(b, hkv, t, g, dh)
    return jnp.moveaxis(out, 2, 1).reshape(b, t, hq, dh)


def attention(
    q,
    k,
    v,
    *,
    q_positions,
    kv_start,
    scale: float,
    out_dtype,
    interpret: bool = False,
    interpret_params=None,
    config: "str | ac.AttentionConfig | None" = None,
):
    """Causal GQA attention of q [B, T, Hq, Dh] over the cache k, v [B, S, Hkv, Dh] (read in
    place), `detlogp_jax.body.kv_attention`'s contract (the `BodyBackend` function; operands
    validated by `body.attention`). config: force the launch geometry (bit-neutral); interpret:
    run in Mosaic GPU interpret mode (CPU), with `plgpu.InterpretGPUParams` interpret_params."""
    ok, why = supports(q, k, v)
    if not ok:
        raise ValueError(why)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[d.name for d in OUT_DTYPES]}, got {out_dtype.name}")
    b, t, hq, dh = q.shape
    rows = -(-(t * (hq // k.shape[2])) // ac.ROWS) * ac.ROWS
    cfg = ac.select(rows // ac.ROWS, dh, out_dtype.itemsize, config)
    kv_start = jnp.zeros((b,), jnp.int32) if kv_start is None else jnp.asarray(kv_start)
    return _launch(
        q,
        k,
        v,
        jnp.asarray(q_positions),
        kv_start,
        scale=float(scale),
        out_dtype=out_dtype,
        cfg=cfg,
        interpret=bool(interpret),
        interpret_params=interpret_params,
    )
