"""Host side of the body GEMM: `matmul(x2, w, *, w_layout, out_dtype)` for `detlogp_jax.body`.

Picks the launch geometry (`matmul_config.select`: by M, N and the SM count; bit-neutral) and
the instruction N (`matmul_config.instruction_n`: by the weight's N alone), passes x with its
own rows where TMA takes them (fewer than 8, or a multiple of 8; else rounded up to 8 by a pad
of zero rows) and W untouched, and returns the real rows. Interpret mode (CPU) pads x to whole
CTA tiles (the interpreter's slices are bounded) and runs the same kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detlogp_jax.body.gemm import w_layout_of
from pallas_kernels import tuning
from pallas_kernels.body import matmul_config as mc
from pallas_kernels.body import matmul_kernel

OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def supports(x2, w, w_layout) -> tuple[bool, str]:
    """(ok, why): bf16 x [M, K] and w, K a multiple of 64, N a multiple of 64."""
    lay = w_layout_of(w_layout)
    k, n = lay.hidden_size(w), lay.vocab_rows(w)
    if x2.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        return False, f"the Hopper GEMM takes bfloat16 x and w, got {x2.dtype} and {w.dtype}"
    if k % mc.K_MULTIPLE or n % mc.N_MULTIPLE:
        return False, f"the Hopper GEMM needs K and N multiples of {mc.K_MULTIPLE}, got K={k}, N={n}"
    return True, ""


def _rows_in(m: int, cta_rows: int, interpret: bool) -> int:
    """Rows of x (and of the output) as the kernel gets them."""
    if interpret:
        return -(-m // cta_rows) * cta_rows
    return m if m < 8 or m % 8 == 0 else -(-m // 8) * 8


@functools.partial(jax.jit, static_argnames=("rows", "nk", "out_dtype", "cfg", "n_instr", "num_ctas", "interpret"))
def _launch(x_in, w, *, rows, nk, out_dtype, cfg, n_instr, num_ctas, interpret):
    n, k = w.shape if nk else w.shape[::-1]
    kernel = matmul_kernel.build(
        rows=rows,
        n=n,
        k=k,
        nk=nk,
        out_dtype=out_dtype,
        cfg=cfg,
        n_instr=n_instr,
        num_ctas=num_ctas,
        interpret=interpret,
    )
    return kernel(x_in, w)


def matmul(
    x2,
    w,
    *,
    w_layout: str,
    out_dtype,
    interpret: bool = False,
    bucket: "str | mc.TuningConfig | None" = None,
    num_ctas: int | None = None,
    n_instr: int | None = None,
):
    """out [M, N] = x2 @ W (W [K, N] for "kn", [N, K] for "nk", read in place) in out_dtype, one
    f32 accumulator per element, K ascending (`matmul_kernel`). bucket / num_ctas: force the
    launch geometry (bit-neutral); n_instr: force the instruction N (bit-relevant unless the
    H200 shows otherwise; for the GPU test that measures it)."""
    ok, why = supports(x2, w, w_layout)
    if not ok:
        raise ValueError(why)
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {[d.name for d in OUT_DTYPES]}, got {out_dtype.name}")
    lay = w_layout_of(w_layout)
    m, n = x2.shape[0], lay.vocab_rows(w)
    sms = 2 if interpret else tuning.default_num_sms()
    cfg = mc.select(m, n, sms, bucket)
    n_instr = mc.instruction_n(n) if n_instr is None else int(n_instr)
    rows = _rows_in(m, cfg.cta_rows, interpret)
    ctas = min(mc.tiles(cfg, rows, n, n_instr), sms if num_ctas is None else int(num_ctas))
    x_in = x2 if rows == m else jnp.pad(x2, ((0, rows - m), (0, 0)))
    y = _launch(
        x_in,
        w,
        rows=rows,
        nk=not lay.transposed,
        out_dtype=out_dtype,
        cfg=cfg,
        n_instr=n_instr,
        num_ctas=max(1, ctas),
        interpret=bool(interpret),
    )
    return y if rows == m else y[:m]
