"""What one benchmark case computes: a jit-able fn(hidden, weight, targets) -> dict.

Backends:
  pallas_sm90, reference, xla  -> `detlogp_jax.linear_logp(backend=...)`
  xla_chunked                  -> `baselines.chunked_logp` (2048-row vocab blocks)
  gemm                         -> `baselines.gemm`, the GEMM alone (ceiling)
  gemm_remat                   -> the same GEMM with its logits rematerialized in the backward
                                  (fwd_bwd only: the four GEMM passes a recompute backward needs)

Entries: trainer (logp, lse) or serving (also FP32 logits; for gemm the GEMM
output is the logits either way). Weight layouts: "vd" (W [V_rows, D], the
lm_head layout) or "dv" (the [D, V_rows] Flax/Tunix kernel, made once by
`make_weight` outside the timed region and passed with weight_layout="dv", so
the library backends read it in place; xla_chunked and gemm take "vd" only). Modes: fwd, or fwd_bwd = value_and_grad
w.r.t. hidden and weight of sum(logp) (+ 0.01 * sum(entropy) for an entropy case; for gemm: of 0.5 * sum(z**2), so the
backward is two real GEMMs rather than a broadcast XLA could simplify away; gemm_remat takes that
loss under `jax.checkpoint`, so its backward recomputes z first: the floor of the library's recompute
mode, which keeps no [N, V] logits either).
Residuals (fwd_bwd, library backends): "recompute" (the default: the backward
recomputes the logits chunk by chunk) or "logits" (`linear_logp(residuals="logits")`:
the forward keeps its FP32 logits [M, V] and the backward runs only the dh / dW GEMMs);
the xla lane's plain autodiff ignores it.

Entropy (library backends): a case may also ask for the per-row entropy
(`return_entropy=True`, `linear-logp-entropy-v1`); its label is "<backend>+entropy"
(`benchmarks.run --entropy` times both in one run).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import baselines
from benchmarks.shapes import Shape
from detlogp_jax import api as detlogp_api
from detlogp_jax import backends as detlogp_backends

LIBRARY_BACKENDS = ("pallas_sm90", "reference", "xla")
GEMM_BACKENDS = ("gemm", "gemm_remat")
ALL_BACKENDS = LIBRARY_BACKENDS + ("xla_chunked",) + GEMM_BACKENDS
ENTRIES = ("trainer", "serving")
MODES = ("fwd", "fwd_bwd")
RESIDUALS = ("recompute", "logits")
WEIGHT_LAYOUTS = ("vd", "dv")

# Outputs with one row per input row: these are what the batch-invariance probe compares.
FORWARD_ROW_FIELDS = ("logp", "lse", "logits", "entropy")
GRAD_ROW_FIELDS = ("d_hidden",)

CaseFn = Callable[[jax.Array, jax.Array, jax.Array], dict]


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    backend: str
    shape: Shape
    entry: str = "trainer"
    mode: str = "fwd"
    gemm_out: str = "bf16"  # GEMM-alone output dtype: bf16 or f32
    chunk_block: int = baselines.DEFAULT_BLOCK
    tuning: tuple = ()  # bit-neutral knobs for linear_logp, as sorted (key, value) pairs
    weight_layout: str = "vd"  # "vd": W [V_rows, D]; "dv": W.T [D, V_rows] (a Flax kernel)
    residuals: str = "recompute"  # linear_logp(residuals=): what the forward keeps for the backward
    entropy: bool = False  # also return the entropy (return_entropy=True; library backends only)

    def __post_init__(self):
        if self.backend not in ALL_BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {ALL_BACKENDS}")
        if self.entry not in ENTRIES or self.mode not in MODES:
            raise ValueError(f"entry must be in {ENTRIES} and mode in {MODES}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be in {WEIGHT_LAYOUTS}, got {self.weight_layout!r}")
        if self.residuals not in RESIDUALS:
            raise ValueError(f"residuals must be in {RESIDUALS}, got {self.residuals!r}")
        if self.residuals != "recompute" and self.mode != "fwd_bwd":
            raise ValueError(f"residuals={self.residuals!r} changes only the backward: use it with mode='fwd_bwd'")
        if self.backend == "gemm_remat" and self.mode != "fwd_bwd":
            raise ValueError("gemm_remat differs from gemm only in its backward: use it with mode='fwd_bwd'")
        if self.entropy and self.backend not in LIBRARY_BACKENDS:
            raise ValueError(f"entropy cases need a library backend {LIBRARY_BACKENDS}, got {self.backend!r}")

    @property
    def serving(self) -> bool:
        return self.entry == "serving"

    @property
    def label(self) -> str:
        """The case's name in results: the backend, "+entropy" for an entropy case."""
        return self.backend + ("+entropy" if self.entropy else "")


def unavailable_reason(backend: str) -> str | None:
    """Why a backend cannot run on this machine at all (None if it can)."""
    if backend not in LIBRARY_BACKENDS:
        return None
    try:
        be = detlogp_backends.get(backend)
        if be.available():
            return None
        return be.description if be.description.startswith("unavailable") else "unavailable on this machine"
    except Exception as e:  # a half-built backend module is simply unavailable
        return f"unavailable ({type(e).__name__}: {e})"


def unsupported_reason(backend: str, hidden, weight, weight_layout: str = "vd", entropy: bool = False) -> str | None:
    """Why a backend cannot serve these operands (None if it can); no silent fallback."""
    if backend not in LIBRARY_BACKENDS:
        return None if weight_layout == "vd" else f"{backend} takes a [V, D] weight only (weight_layout='vd')"
    be = detlogp_backends.get(backend)
    if not be.reads(weight_layout):
        return f"{backend} does not read a weight_layout={weight_layout!r} weight in place"
    if entropy and not be.entropy:
        return f"{backend} does not declare the entropy (its registry entry refuses return_entropy=True)"
    ok, why = be.supports(hidden, weight) if weight_layout == "vd" else be.supports(hidden, weight, weight_layout)
    return None if ok else f"{backend} cannot serve this call: {why}"


def _library_forward(spec: CaseSpec) -> CaseFn:
    # The XLA lane is the non-contract baseline: traced explicitly outside strict mode, so
    # its trace carries no run-time DETLOGP_STRICT check (a host callback) and is timed as
    # plain XLA. Contract lanes trace under whatever strict mode the caller set.
    # A fresh context per trace (a generator context manager can be entered only once, and
    # fn is traced once per compiled M plus once more for the M=1 probe).
    lane = (lambda: detlogp_backends.strict_mode(False)) if spec.backend == "xla" else contextlib.nullcontext

    def fn(hidden, weight, targets):
        with lane():
            out = detlogp_api.linear_logp(
                hidden,
                weight,
                targets,
                vocab_size=spec.shape.v_real,
                padded_vocab_size=spec.shape.v_rows,
                return_logits=spec.serving,
                backend=spec.backend,
                tuning=dict(spec.tuning) or None,
                weight_layout=spec.weight_layout,
                residuals=spec.residuals,
                **({"return_entropy": True} if spec.entropy else {}),
            )
        res = {"logp": out.logp, "lse": out.lse}
        if spec.serving:
            res["logits"] = out.logits
        if spec.entropy:
            res["entropy"] = out.entropy
        return res

    return fn


def _chunked_forward(spec: CaseSpec) -> CaseFn:
    def fn(hidden, weight, targets):
        logp, lse, logits = baselines.chunked_logp(
            hidden, weight, targets, vocab_size=spec.shape.v_real, block=spec.chunk_block, return_logits=spec.serving
        )
        res = {"logp": logp, "lse": lse}
        if spec.serving:
            res["logits"] = logits
        return res

    return fn


def _gemm_forward(spec: CaseSpec) -> CaseFn:
    out_dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[spec.gemm_out]

    def fn(hidden, weight, targets):
        del targets
        return {"logits": baselines.gemm(hidden, weight, out_dtype)}

    return fn


def _loss(spec: CaseSpec, out: dict):
    if spec.backend in GEMM_BACKENDS:
        z = out["logits"].astype(jnp.float32)
        return 0.5 * jnp.sum(z * z)
    if spec.entropy:  # a loss that uses the entropy too (an entropy bonus): its term is in the backward
        return jnp.sum(out["logp"]) + 0.01 * jnp.sum(out["entropy"])
    return jnp.sum(out["logp"])


def _with_grad(spec: CaseSpec, forward: CaseFn) -> CaseFn:
    def fn(hidden, weight, targets):
        def loss(h, w):
            out = forward(h, w, targets)
            return _loss(spec, out), out

        if spec.backend == "gemm_remat":  # the backward keeps only (h, w) and recomputes z
            loss = jax.checkpoint(loss)
        (_, out), (d_hidden, d_weight) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, weight)
        return {**out, "d_hidden": d_hidden, "d_weight": d_weight}

    return fn


def build(spec: CaseSpec) -> CaseFn:
    """The (un-jitted) function one case times."""
    if spec.backend in LIBRARY_BACKENDS:
        forward = _library_forward(spec)
    elif spec.backend == "xla_chunked":
        forward = _chunked_forward(spec)
    else:
        forward = _gemm_forward(spec)
    return forward if spec.mode == "fwd" else _with_grad(spec, forward)


def flops(spec: CaseSpec, m: int) -> float:
    """Model FLOPs: 2*M*D*V_rows for the forward GEMM, x3 with the two backward GEMMs."""
    fwd = 2.0 * m * spec.shape.d * spec.shape.v_rows
    return fwd if spec.mode == "fwd" else 3.0 * fwd


def min_bytes(spec: CaseSpec, m: int, itemsize: int) -> float:
    """Bytes a perfect logp kernel must move: W + hidden + targets + outputs (+ dW, dh)."""
    d, v_rows, v_real = spec.shape.d, spec.shape.v_rows, spec.shape.v_real
    w, h = v_rows * d * itemsize, m * d * itemsize
    total = w + h + 4 * m + 8 * m  # targets int32, logp + lse f32
    if spec.serving:
        total += 4 * m * v_real
    if spec.mode == "fwd_bwd":
        total += w + h
    return float(total)


# --- inputs (shared by benchmarks.run and benchmarks.experiments.trace_calls) ---------------


def make_weight(shape: Shape, dtype, seed: int, weight_layout: str = "vd") -> jax.Array:
    """W [V_rows, D] ~ N(0, (3/sqrt(D))^2): logits of std ~3 for unit hidden; for
    weight_layout="dv" its transpose [D, V_rows] as its own buffer (the same values,
    made here once, never inside a timed call)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 0)
    w = jax.random.normal(key, (shape.v_rows, shape.d), jnp.float32) * (3.0 / np.sqrt(shape.d))
    w = w.astype(dtype)
    if weight_layout == "dv":
        w = jax.block_until_ready(jax.jit(jnp.transpose)(w))
    return w


def make_inputs(shape: Shape, dtype, seed: int, m: int, sets: int = 1) -> list[tuple[jax.Array, jax.Array]]:
    """`sets` (hidden [M, D], targets [M]) pairs; identical for every backend at this M."""
    out = []
    for i in range(sets):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), 1 + i), m)
        kh, kt = jax.random.split(key)
        h = jax.random.normal(kh, (m, shape.d), jnp.float32).astype(dtype)
        t = jax.random.randint(kt, (m,), 0, shape.v_real, jnp.int32)
        out.append((h, t))
    return out
