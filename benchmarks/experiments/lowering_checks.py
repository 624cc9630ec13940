"""Mosaic GPU facts for kernel plans, checked by lowering for CUDA on any machine (no GPU).

  PYTHONPATH=. python3 -m benchmarks.experiments.lowering_checks

Each check builds a tiny kernel and lowers it (`jax.jit(f).trace(...).lower(lowering_platforms=
("cuda",))`, the whole Python half of Mosaic GPU) and prints whether Mosaic accepted it:
* semaphores: a global semaphore (`pl.get_global(plgpu.SemaphoreType.REGULAR)`) signalled by
  every CTA and awaited by one (the ordering point an in-kernel fold needs; docs/PERFORMANCE.md);
* oob_rows: a 64-row TMA load box from a [1, D] array (rows past the array: the hardware's
  zero fill, so a decode call's hidden need not be padded);
* swizzled_halves: a [64, 32] f32 array stored to and loaded whole from a 128B-swizzled SMEM
  ref (the swizzled hand-off of `sm90_forward_ws`), and a dynamic leading index into it;
* swizzled_column_slice: an 8-column slice of that ref loaded directly (refused: only whole
  swizzle rows load, which is why the hand-off loads halves and slices them in registers).
Lowering says nothing about what the GPU does at run time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32


def _lowers(f, *shapes) -> str:
    try:
        jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",))
        return "lowers"
    except Exception as e:  # the point is to report what Mosaic refuses
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def semaphores():
    def kernel(x_gmem, o_gmem):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        cid = lax.axis_index("x")
        o_gmem[cid] = x_gmem[cid] * 2.0
        pl.semaphore_signal(sem, 1)

        @pl.when(cid == 131)
        def _():
            pl.semaphore_wait(sem, 132)
            o_gmem[0] = o_gmem[0] + 1.0

    f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((132,), F32), grid=(132,), grid_names=("x",))
    return _lowers(f, jax.ShapeDtypeStruct((132,), F32))


def oob_rows():
    def kernel(x_gmem, o_gmem):
        tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

        @functools.partial(
            pl.run_scoped,
            buf=plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tr),
            bar=plgpu.Barrier(num_arrivals=1),
            collective_axes="wg",
        )
        def _(buf, bar):
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(lax.axis_index("x") * 64, 64), pl.ds(0, 64)], buf, bar)
            plgpu.barrier_wait(bar)
            o_gmem[0] = jnp.float32(1.0)

    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((8,), F32), grid=(1,), grid_names=("x",), num_threads=1, thread_name="wg"
    )
    return _lowers(f, jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16))


def _swizzled(variant):
    def kernel(x_gmem, o_gmem):
        tr = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

        @functools.partial(
            pl.run_scoped,
            buf=plgpu.SMEM((2, 64, 32), F32, transforms=tr),
            out=plgpu.SMEM((64, 8), F32),
            collective_axes="wg",
        )
        def _(buf, out):
            buf[0] = plgpu.load(x_gmem, layout=plgpu.Layout.WGMMA, optimized=False)
            if variant == "halves":
                i = lax.axis_index("x") % 2
                y = plgpu.load(buf.at[i], layout=plgpu.Layout.WGMMA, optimized=False)[:, 8:16]
            else:
                y = plgpu.load(buf.at[0, :, pl.ds(8, 8)], layout=plgpu.Layout.WGMMA, optimized=False)
            out[...] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf.at[0], o_gmem.at[pl.ds(0, 64), pl.ds(0, 32)])
            plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((128, 64), F32),
        grid=(2,),
        grid_names=("x",),
        num_threads=1,
        thread_name="wg",
    )
    return _lowers(f, jax.ShapeDtypeStruct((64, 32), F32))


CHECKS = {
    "semaphores": semaphores,
    "oob_rows": oob_rows,
    "swizzled_halves": lambda: _swizzled("halves"),
    "swizzled_column_slice": lambda: _swizzled("column"),
}


def main():
    for name, check in CHECKS.items():
        print(f"{name:24s} {check()}")


if __name__ == "__main__":
    main()
