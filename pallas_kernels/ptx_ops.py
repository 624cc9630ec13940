"""Rounded f32 primitives for the Pallas Mosaic GPU kernels.

The contract (`detlogp_jax.oracle`) states every post-GEMM f32 operation as
ONE separately rounded IEEE binary32 op, round-to-nearest-even, with FTZ and
no FMA anywhere. `detlogp_jax.numerics` implements the programs (pexp, plog,
fold) against an `ops` object with `mul`, `add`, `sub`; this module supplies
two such objects:

* `PtxOps` (real GPU): each primitive is one inline PTX instruction
  `mul.rn.ftz.f32` / `add.rn.ftz.f32` / `sub.rn.ftz.f32`, emitted per register
  through `plgpu.inline_mgpu`. Explicit-rounding PTX is never contracted into
  an FMA by LLVM or ptxas, and `.ftz` gives the contract's flush-to-zero of
  subnormal inputs and results. (Register-array `+ - *` in Mosaic GPU carry
  `fastmath<contract>` and may be fused; they are never used for pinned math.)
* `InterpretOps` (interpret mode on CPU, where `inline_mgpu` is unsupported):
  `numerics.XlaOps`-style pinning: every result passes an xor with an opaque
  zero so XLA:CPU cannot contract or re-associate; XLA:CPU arithmetic is
  FTZ/DAZ, so the results equal the oracle's.

Both also provide `exp_diff(a, b)` = pexp(fl(a - b)). On the GPU it is ONE
straight-line PTX block per lane (`ptx_programs.PEXP_DIFF`, whose exact text
is executed against the oracle by a numpy simulator in the CPU tests); that
keeps the kernel IR ~10x smaller than emitting `numerics.pexp` op by op.
For the entropy statistic (`linear-logp-entropy-v1`, only in kernels built with
it) they provide `exp(d)` = pexp(d) (`ptx_programs.PEXP`: the exp of a difference
`d` the kernel keeps), `entropy_term(e, d)` = (e == 0) ? +0 : fl(e * d)
(`ptx_programs.ENTROPY_TERM`), `rcp(s)` = fl(1 / s) (`ptx_programs.RCP`, one
`div.rn.ftz.f32`; interpret mode: `numerics.reciprocal_rn`, integer ops) and
`flush(x)`: FTZ of a product or difference (the identity on the GPU, whose `.ftz`
instructions flush already; explicit in interpret mode, as `numerics` does).

`lift_ptx`, `lift_program` and `PTX` are public for the fold's `inline_mgpu`
blocks (`sm90_fold`), which emit the same instructions on FragmentedArrays.

Exact operations (compare, select, max, integer shifts/adds, bitcasts) are
used directly on register arrays; they need no pinning.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import numerics

F32 = jnp.float32

PTX = {"mul": "mul.rn.ftz.f32", "add": "add.rn.ftz.f32", "sub": "sub.rn.ftz.f32"}


def lift_ptx(instr: str):
    """A per-register lowering of a binary f32 PTX instruction on FragmentedArrays."""
    from jax.experimental.mosaic import gpu as mgpu  # Lazy: only needed at lowering time.

    return mgpu.FragmentedArray._lift_fast_instr(instr)


def lift_program(prog):
    """Per-register application of a `ptx_programs.Program` (one asm per element)."""
    from jaxlib.mlir import ir  # Lazy: lowering time only.
    from jaxlib.mlir.dialects import llvm, vector

    text, cons = prog.ptx(), prog.constraints()

    def per_reg(*regs):
        f32 = ir.F32Type.get()
        ty = regs[0].type
        if ty == f32:
            return llvm.inline_asm(f32, list(regs), text, cons)
        assert isinstance(ty, ir.VectorType), ty
        [n] = ir.VectorType(ty).shape
        out = llvm.mlir_undef(ty)
        for i in range(n):
            pos = ir.DenseI64ArrayAttr.get([i])
            elems = [vector.extract(r, dynamic_position=[], static_position=pos) for r in regs]
            v = llvm.inline_asm(f32, elems, text, cons)
            out = vector.insert(v, out, dynamic_position=[], static_position=pos)
        return out

    return per_reg


def _is_python_scalar(x) -> bool:
    return isinstance(x, (float, int))


def _const_value(x):
    """Returns a Python float if `x` is a concrete scalar constant, else None."""
    if _is_python_scalar(x):
        return float(x)
    try:
        if getattr(x, "shape", None) == () and not isinstance(x, jax.core.Tracer):
            return float(x)
    except Exception:  # pragma: no cover - defensive
        return None
    return None


class PtxOps:
    """mul/add/sub as inline PTX with explicit rounding and FTZ (GPU only).

    `layout_of(shape)` returns the `plgpu.Layout` of register arrays of that
    shape in the calling kernel (e.g. WGMMA for [BM, 64] tiles, WGMMA row
    vectors for [BM]). Array operands are layout-cast to it (splat arrays such
    as `jnp.full_like` become register arrays of that layout); concrete scalar
    constants are folded into the instruction as immediates-in-registers.
    """

    def __init__(self, layout_of: Callable[[tuple[int, ...]], object]):
        self._layout_of = layout_of

    def _binary(self, name: str, a, b):
        instr = PTX[name]
        ca, cb = _const_value(a), _const_value(b)
        if ca is not None and cb is not None:
            raise ValueError("PtxOps needs at least one array operand")
        shape = tuple(jnp.shape(b) if ca is not None else jnp.shape(a))
        if ca is None and cb is None:
            shape = tuple(jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)))
        layout = self._layout_of(shape)
        ret = plgpu.ShapeDtypeStruct(shape, F32, layout=layout)

        def as_arr(x):
            x = jnp.asarray(x, F32)
            if x.shape != shape:
                x = jnp.broadcast_to(x, shape)
            return plgpu.layout_cast(x, layout)

        if ca is None and cb is None:

            @plgpu.inline_mgpu(arg_types=(layout, layout), return_type=ret)
            def op2(ctx, x, y):
                del ctx
                return x._pointwise(lift_ptx(instr), y)

            return op2(as_arr(a), as_arr(b))
        if cb is not None:

            @plgpu.inline_mgpu(arg_types=(layout,), return_type=ret)
            def op_rc(ctx, x):
                del ctx
                return x._pointwise(lift_ptx(instr), cb)

            return op_rc(as_arr(a))

        @plgpu.inline_mgpu(arg_types=(layout,), return_type=ret)
        def op_cr(ctx, y):
            del ctx
            return y._pointwise(lambda v, c: lift_ptx(instr)(c, v), ca)

        return op_cr(as_arr(b))

    def mul(self, a, b):
        return self._binary("mul", a, b)

    def add(self, a, b):
        return self._binary("add", a, b)

    def sub(self, a, b):
        return self._binary("sub", a, b)

    def program(self, prog, *arrays):
        """Applies a straight-line `ptx_programs.Program` elementwise to same-shape f32 arrays."""
        shape = tuple(jnp.shape(arrays[0]))
        layout = self._layout_of(shape)
        ret = plgpu.ShapeDtypeStruct(shape, F32, layout=layout)
        fn = lift_program(prog)

        @plgpu.inline_mgpu(arg_types=(layout,) * len(arrays), return_type=ret)
        def run(ctx, first, *rest):
            del ctx
            return first._pointwise(fn, *rest)

        return run(*(plgpu.layout_cast(jnp.broadcast_to(jnp.asarray(a, F32), shape), layout) for a in arrays))

    def exp_diff(self, a, b):
        """pexp(fl(a - b)) (contract exp of a rounded difference), one PTX block per lane."""
        from pallas_kernels import ptx_programs

        return self.program(ptx_programs.PEXP_DIFF, a, b)

    def exp(self, d):
        """pexp(d), one PTX block per lane (the same instructions as `exp_diff` after its subtract)."""
        from pallas_kernels import ptx_programs

        return self.program(ptx_programs.PEXP, d)

    def entropy_term(self, e, d):
        """(e == 0) ? +0 : mul.rn.ftz(e, d), one PTX block per lane."""
        from pallas_kernels import ptx_programs

        return self.program(ptx_programs.ENTROPY_TERM, e, d)

    def rcp(self, s):
        """fl(1 / s): div.rn.ftz.f32 (IEEE division, round-to-nearest-even, FTZ), one PTX block per lane."""
        from pallas_kernels import ptx_programs

        return self.program(ptx_programs.RCP, s)

    @staticmethod
    def flush(x):
        """FTZ of a result of these ops: the identity (every `.ftz` instruction flushes already)."""
        return x


class InterpretOps(numerics.XlaOps):
    """mul/add/sub for interpret mode: `numerics.XlaOps` (each result pinned behind
    an opaque xor) plus the kernel's `exp_diff` entry point (and the entropy's
    `exp`, `entropy_term`, `rcp`, `flush`, as `numerics` computes them).

    The pin is an integer add of the opaque zero, not `numerics.XlaOps`' xor: a kernel
    sum that starts from a constant +0 (the fold's row loop) has its first add dropped by
    XLA's simplifier (`0 + x -> x`), and then the xor pins of x and of that add cancel
    (`x ^ z ^ z == x`), so LLVM saw x's product feed the next add and contracted the two
    into an FMA (XLA:CPU, found by the entropy's row-loop fold test); adds of z do not
    cancel. (The values are the same: z is zero at run time.)"""

    def _pin(self, v):
        bits = lax.bitcast_convert_type(v, jnp.uint32) + self._zero
        return lax.bitcast_convert_type(bits, F32)

    def exp_diff(self, a, b):
        """pexp(fl(a - b)) via numerics.pexp (the spec implementation)."""
        return numerics.pexp(self.sub(a, b), self)

    def exp(self, d):
        """pexp(d) via numerics.pexp."""
        return numerics.pexp(d, self)

    def entropy_term(self, e, d):
        """(e == 0) ? +0 : fl(e * d), the product flushed explicitly (as numerics.chain_step_entropy)."""
        return jnp.where(e == 0, jnp.asarray(0.0, F32), numerics.fmul_ftz(e, numerics.ftz(d), self))

    @staticmethod
    def rcp(s):
        """fl(1 / s) via numerics.reciprocal_rn (integer operations only)."""
        return numerics.reciprocal_rn(s)

    @staticmethod
    def flush(x):
        """FTZ, explicitly (XLA:GPU would not flush; XLA:CPU does, so this only makes it certain)."""
        return numerics.ftz(x)


def make_ops(interpret: bool, layout_of: Callable[[tuple[int, ...]], object], source=None):
    """The ops object for a kernel body: InterpretOps on CPU, PtxOps on GPU.

    `source`: a runtime array of the kernel (interpret mode: seeds the opaque zero).
    """
    return InterpretOps(numerics.opaque_zero(source)) if interpret else PtxOps(layout_of)


def fence(instr: str) -> None:
    """Emits one PTX memory or proxy fence statement (e.g. "fence.acq_rel.gpu;") in every thread
    of the calling warpgroup (GPU only: `inline_mgpu` has no interpret-mode rule). Used where
    Mosaic GPU has no primitive for an ordering a kernel needs (`sm90_forward_ws`'s in-kernel
    fold: the epilogue's plain partial stores before the grid semaphore's signal, and the
    semaphore's acquire before the fold's TMA reads of other CTAs' partials)."""
    if not (instr.startswith("fence.") and instr.endswith(";")):
        raise ValueError(f"not one PTX fence statement: {instr!r}")

    @plgpu.inline_mgpu()
    def _emit(ctx):
        from jax.experimental.mosaic.gpu import utils  # Lazy: lowering time only.

        utils.inline_ptx(instr, has_side_effects=True)

    _emit()
