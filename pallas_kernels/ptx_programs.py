"""Contract programs as straight-line PTX, with a numpy simulator of that PTX.

The forward kernel's per-lane epilogue is the hot, large part of the kernel.
Emitting `numerics.pexp` op by op (one `inline_mgpu` per rounded op, ~20 per
exp) makes Mosaic GPU's layout inference and LLVM see ~10x more operations
(compile times of a minute per shape). Instead each per-lane program below is
ONE inline PTX block per element: nothing inside it can be contracted,
re-associated or re-scheduled by LLVM, and it is emitted from a tiny
instruction list that is also *executed in numpy* (`simulate`), so the exact
PTX text that runs on the GPU is checked against `detlogp_jax.oracle` on the
CPU (tests/test_pallas_units.py).

Instruction semantics modelled by `simulate` (PTX ISA, sm_90):
  mul/add/sub.rn.ftz.f32  one IEEE binary32 op, round-to-nearest-even,
                          subnormal inputs and results flushed to +-0
                          (= oracle.f_mul / f_add / f_sub; a NaN result is
                          any NaN: NaN payloads are not part of the contract)
  div.rn.ftz.f32          IEEE binary32 division, round-to-nearest-even, FTZ
                          (= oracle.f_div; the entropy's rcp(S) = fl(1 / S))
  setp.lt.f32             ordered a < b (false if either is NaN)
  setp.eq.f32             ordered a == b (false if either is NaN; +0 == -0)
  setp.nan.f32            a or b is NaN
  selp.b32                p ? a : b
  mov.b32                 bit copy between f32 and b32 registers
  mov.f32                 an f32 immediate into a register
  add.s32 / sub.s32       two's complement, wrapping
  shl.b32                 logical shift left (immediate count)
  setp.lt.s32             signed a < b
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from detlogp_jax import contract as C
from detlogp_jax import oracle

F32 = np.float32


def _f32_hex(v: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", float(np.float32(v))))[0]


@dataclasses.dataclass(frozen=True)
class Reg:
    kind: str  # "f" (f32), "r" (b32), "p" (pred)
    idx: int

    def name(self) -> str:
        return f"%t{self.kind}{self.idx}"


@dataclasses.dataclass(frozen=True)
class Imm:
    kind: str  # "f" or "r"
    value: float | int

    def text(self) -> str:
        return _f32_hex(self.value) if self.kind == "f" else str(int(self.value))


class Program:
    """A straight-line PTX program over f32 inputs with one f32 output."""

    def __init__(self, n_inputs: int):
        self.n_inputs = n_inputs
        self.inputs = [Reg("i", k) for k in range(n_inputs)]
        self.instrs: list[tuple[str, Reg, tuple]] = []
        self._count = {"f": 0, "r": 0, "p": 0}
        self.output: Reg | None = None

    # -- register allocation
    def _new(self, kind: str) -> Reg:
        r = Reg(kind, self._count[kind])
        self._count[kind] += 1
        return r

    def _emit(self, op: str, kind: str, *srcs) -> Reg:
        dst = self._new(kind)
        self.instrs.append((op, dst, tuple(srcs)))
        return dst

    @staticmethod
    def fimm(v) -> Imm:
        return Imm("f", float(np.float32(v)))

    @staticmethod
    def iimm(v) -> Imm:
        return Imm("r", int(v))

    # -- instructions
    def mul(self, a, b):
        return self._emit("mul.rn.ftz.f32", "f", a, b)

    def add(self, a, b):
        return self._emit("add.rn.ftz.f32", "f", a, b)

    def sub(self, a, b):
        return self._emit("sub.rn.ftz.f32", "f", a, b)

    def div(self, a, b):
        return self._emit("div.rn.ftz.f32", "f", a, b)

    def const_f(self, v):
        return self._emit("mov.f32", "f", self.fimm(v))

    def lt_f(self, a, b):
        return self._emit("setp.lt.f32", "p", a, b)

    def eq_f(self, a, b):
        return self._emit("setp.eq.f32", "p", a, b)

    def isnan(self, a):
        return self._emit("setp.nan.f32", "p", a, a)

    def sel_f(self, a, b, p):
        return self._emit("selp.f32", "f", a, b, p)

    def sel_i(self, a, b, p):
        return self._emit("selp.b32", "r", a, b, p)

    def bits(self, a):
        return self._emit("mov.b32", "r", a)

    def from_bits(self, a):
        return self._emit("mov.b32", "f", a)

    def add_i(self, a, b):
        return self._emit("add.s32", "r", a, b)

    def sub_i(self, a, b):
        return self._emit("sub.s32", "r", a, b)

    def shl(self, a, n: int):
        return self._emit("shl.b32", "r", a, self.iimm(n))

    def lt_i(self, a, b):
        return self._emit("setp.lt.s32", "p", a, b)

    # -- rendering
    def ptx(self) -> str:
        """Inline-asm text; $0 is the output, $1.. the inputs."""
        assert self.output is not None

        def opnd(x):
            if isinstance(x, Imm):
                return x.text()
            if x.kind == "i":
                return f"${x.idx + 1}"
            return x.name()

        decl = []
        for kind, ty in (("f", ".f32"), ("r", ".b32"), ("p", ".pred")):
            if self._count[kind]:
                decl.append(f".reg {ty} %t{kind}<{self._count[kind]}>;")
        body = []
        for op, dst, srcs in self.instrs:
            body.append(f"{op} {dst.name()}, {', '.join(opnd(s) for s in srcs)};")
        body.append(f"mov.f32 $0, {opnd(self.output)};")
        return "{\n" + "\n".join(decl + body) + "\n}"

    def constraints(self) -> str:
        return "=f" + ",f" * self.n_inputs

    # -- numpy execution of the same instruction list
    def simulate(self, *inputs) -> np.ndarray:
        assert len(inputs) == self.n_inputs
        shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
        env: dict = {}
        for k, x in enumerate(inputs):
            env[Reg("i", k)] = np.broadcast_to(np.asarray(x, F32), shape)

        def val(x, kind):
            if isinstance(x, Imm):
                return np.full(shape, F32(x.value)) if kind == "f" else np.full(shape, np.int32(x.value))
            v = env[x]
            if kind == "f" and v.dtype != F32:
                raise TypeError(f"{x} is not f32")
            return v

        with np.errstate(all="ignore"):
            for op, dst, srcs in self.instrs:
                if op == "mul.rn.ftz.f32":
                    r = oracle.f_mul(val(srcs[0], "f"), val(srcs[1], "f"))
                elif op == "add.rn.ftz.f32":
                    r = oracle.f_add(val(srcs[0], "f"), val(srcs[1], "f"))
                elif op == "sub.rn.ftz.f32":
                    r = oracle.f_sub(val(srcs[0], "f"), val(srcs[1], "f"))
                elif op == "div.rn.ftz.f32":
                    r = oracle.f_div(val(srcs[0], "f"), val(srcs[1], "f"))
                elif op == "mov.f32":
                    r = val(srcs[0], "f").copy()
                elif op == "setp.lt.f32":
                    r = val(srcs[0], "f") < val(srcs[1], "f")
                elif op == "setp.eq.f32":
                    r = val(srcs[0], "f") == val(srcs[1], "f")
                elif op == "setp.nan.f32":
                    a, b = val(srcs[0], "f"), val(srcs[1], "f")
                    r = np.isnan(a) | np.isnan(b)
                elif op == "selp.f32":
                    r = np.where(env[srcs[2]], val(srcs[0], "f"), val(srcs[1], "f")).astype(F32)
                elif op == "selp.b32":
                    r = np.where(env[srcs[2]], val(srcs[0], "r"), val(srcs[1], "r")).astype(np.int32)
                elif op == "mov.b32":
                    src = env[srcs[0]] if isinstance(srcs[0], Reg) else None
                    r = src.view(np.int32) if dst.kind == "r" else src.view(F32)
                elif op == "add.s32":
                    r = (val(srcs[0], "r").astype(np.int64) + val(srcs[1], "r")).astype(np.int64)
                    r = ((r + 2**31) % 2**32 - 2**31).astype(np.int32)
                elif op == "sub.s32":
                    r = (val(srcs[0], "r").astype(np.int64) - val(srcs[1], "r")).astype(np.int64)
                    r = ((r + 2**31) % 2**32 - 2**31).astype(np.int32)
                elif op == "shl.b32":
                    r = (val(srcs[0], "r").view(np.uint32) << np.uint32(srcs[1].value)).view(np.int32)
                elif op == "setp.lt.s32":
                    r = val(srcs[0], "r") < val(srcs[1], "r")
                else:  # pragma: no cover
                    raise NotImplementedError(op)
                env[dst] = r
        return np.asarray(env[self.output], F32).copy()


def emit_pexp(P: Program, x: Reg) -> Reg:
    """The contract's exp (oracle.pexp / numerics.pexp), instruction for instruction."""
    f = P.fimm
    small = P.lt_f(x, f(C.EXP_CLAMP_LO))
    xc = P.sel_f(f(C.EXP_CLAMP_LO), x, small)
    t = P.mul(xc, f(C.EXP_LOG2E))
    tm = P.add(t, f(C.EXP_ROUND_MAGIC))
    k = P.sub(tm, f(C.EXP_ROUND_MAGIC))
    ki = P.sub_i(P.bits(tm), P.iimm(C.EXP_ROUND_MAGIC_BITS))
    r = P.sub(P.sub(xc, P.mul(k, f(C.EXP_LN2_HI))), P.mul(k, f(C.EXP_LN2_LO)))
    # p = c7; p = p*r + c for c in c6..c0 (separately rounded mul, then add).
    # The first product c7*r is written r*c7 (IEEE multiplication commutes
    # exactly) so that the immediate is the second source operand.
    p = P.add(P.mul(r, f(C.EXP_POLY[0])), f(C.EXP_POLY[1]))
    for c in C.EXP_POLY[2:]:
        p = P.add(P.mul(p, r), f(c))
    nan = P.isnan(x)
    ki_safe = P.sel_i(P.iimm(0), ki, nan)
    out = P.from_bits(P.add_i(P.bits(p), P.shl(ki_safe, 23)))
    tiny = P.lt_i(ki, P.iimm(C.EXP_K_MIN))
    out = P.sel_f(f(0.0), out, tiny)
    return P.sel_f(x, out, nan)


def _build(n_inputs: int, fn) -> Program:
    P = Program(n_inputs)
    P.output = fn(P, *P.inputs)
    return P


# pexp(x)
PEXP = _build(1, emit_pexp)
# pexp(fl(a - b)): alpha = pexp(m - m') and e = pexp(y - m').
PEXP_DIFF = _build(2, lambda P, a, b: emit_pexp(P, P.sub(a, b)))
# Single rounded ops (the same as PtxOps).
MUL = _build(2, lambda P, a, b: P.mul(a, b))
ADD = _build(2, lambda P, a, b: P.add(a, b))
SUB = _build(2, lambda P, a, b: P.sub(a, b))


def emit_entropy_term(P: Program, e: Reg, d: Reg) -> Reg:
    """The entropy's lane term u = (e == 0) ? +0 : fl(e * d) (CONTRACT.md section 9):
    e = pexp(d) (0 on padding lanes), d = fl(y - m') the argument of that exp."""
    zero = P.eq_f(e, P.fimm(0.0))
    return P.sel_f(P.fimm(0.0), P.mul(e, d), zero)


def emit_rcp(P: Program, x: Reg) -> Reg:
    """rcp(x) = fl(1 / x): one IEEE division (round-to-nearest-even, FTZ), the entropy's 1/S.
    (The dividend 1.0 is moved into a register first: the immediate is not a first source.)"""
    return P.div(P.const_f(1.0), x)


# u = (e == 0) ? +0 : fl(e * d): the entropy statistic's lane term (linear-logp-entropy-v1).
ENTROPY_TERM = _build(2, emit_entropy_term)
# fl(1 / s): the fold's rcp(S) for the entropy.
RCP = _build(1, emit_rcp)


__all__ = ["Program", "emit_pexp", "PEXP", "PEXP_DIFF", "MUL", "ADD", "SUB", "ENTROPY_TERM", "RCP"]
