"""Helpers for running the kernels in Mosaic GPU interpret mode (CPU tests).

Interpret mode models `wgmma` as `acc + np.matmul(a, b, dtype=f32)`, i.e. an
OpenBLAS sgemm whose summation order for a row depends on where the row sits
in the block (and on threading), so interpret-mode logits are NOT batch
invariant even though the kernel is. `row_invariant_wgmma()` swaps in a
matmul whose value for an output element depends only on that element's
operands: exact products of the bf16 inputs summed in float64 over K in
ascending order (a fixed loop of elementwise adds, no BLAS: the same bytes
on every machine, thread count and run), then one rounding to f32. It
changes nothing on a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np


def load(ref, layout, interpret: bool):
    """ref[...] as a register array of `layout` (interpret mode: plain ref read)."""
    if interpret:
        return ref[...]
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.load(ref, layout=layout, optimized=False)


def cast(x, layout, interpret: bool):
    """x laid out as `layout` (a no-op in interpret mode, which has no layouts)."""
    if interpret:
        return x
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(x, layout)


def load_and_cast(layout, interpret: bool):
    """(load(ref), cast(x)) bound to one layout: the pair every kernel body uses."""
    return (
        functools.partial(load, layout=layout, interpret=interpret),
        functools.partial(cast, layout=layout, interpret=interpret),
    )


def kernel_kwargs(interpret: bool, interpret_params=None) -> dict:
    """The `plgpu.kernel` keyword that selects interpret mode ({} on a GPU)."""
    if not interpret:
        return {}
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return {"interpret": interpret_params if interpret_params is not None else plgpu.InterpretGPUParams()}


class _NumpyWithRowInvariantMatmul:
    """Proxies the numpy module; only `matmul` differs."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, dtype=None, **kw):
        """a @ b for 2-D a [m, k], b [k, n]: each element sum_k a[i, k] * b[k, j] in float64,
        k ascending, then rounded to `dtype` (f32 by default). BLAS is not used: a threaded
        dgemm's order of adds may depend on how its threads split the block, while this loop's
        order is fixed (two identical interpret-mode walks once differed in one row on a CI
        machine; the dgemm is the one reduction in that path whose order the kernels do not
        fix, the suspect, not a confirmed cause)."""
        if kw or np.ndim(a) != 2 or np.ndim(b) != 2 or np.shape(a)[1] != np.shape(b)[0]:
            raise ValueError(
                f"row-invariant matmul takes a [m, k] @ [k, n] pair, got {np.shape(a)}, {np.shape(b)}, {kw}"
            )
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        out = np.zeros((a64.shape[0], b64.shape[1]), np.float64)
        for k in range(a64.shape[1]):
            out += a64[:, k, None] * b64[None, k, :]
        return out.astype(dtype if dtype is not None else np.float32)


@contextlib.contextmanager
def row_invariant_wgmma():
    """Within the context, interpret-mode wgmma uses a row-invariant matmul."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    saved = gpu_callbacks.np
    gpu_callbacks.np = _NumpyWithRowInvariantMatmul()
    try:
        yield
    finally:
        gpu_callbacks.np = saved
