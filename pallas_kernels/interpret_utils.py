"""Helpers for running the kernels in Mosaic GPU interpret mode (CPU tests).

Interpret mode models `wgmma` as `acc + np.matmul(a, b, dtype=f32)`, i.e. an
OpenBLAS sgemm whose summation order for a row depends on where the row sits
in the block (and on threading), so interpret-mode logits are NOT batch
invariant even though the kernel is. `row_invariant_wgmma()` swaps in a
matmul whose value for an output element depends only on that element's
operands (f64 accumulation of exact bf16 products, then one rounding to f32),
so interpret tests can check the kernel's structural batch invariance. It
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
        out = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64), **kw)
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
