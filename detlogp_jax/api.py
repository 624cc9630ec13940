"""Public entry point: `linear_logp`.

Contract kept (for contract-bearing backends): for every row, logp and lse are
the oracle's function of that row's FP32 logits, the row's target and
temperature, `vocab_size` and `padded_vocab_size` only. So the bytes of a row
do not depend on the batch size, the row's position, its neighbours, whether
logits or the entropy are returned, or whether the weight is padded to
`padded_vocab_size`. With `return_entropy=True` the row's entropy is likewise the
oracle's function of its logits, temperature and vocab geometry
(`linear-logp-entropy-v1`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from detlogp_jax import backends, inputs, row_sharding, vma
from detlogp_jax import contract as C
from detlogp_jax import grad as grad_lib
from detlogp_jax.inputs import last_provenance  # noqa: F401  (re-exported: api.last_provenance)


class LogpOutput(NamedTuple):
    """logp [...] f32, lse [...] f32 (of logits / T), logits [..., vocab_size] f32 or None,
    the provenance of the computation that produced them, and entropy [...] f32 (of
    softmax(logits / T) over the real vocabulary) or None.

    `provenance` is a static pytree node (no arrays): returned from a jitted function it
    comes back with every call, cached or not, as the record of that function's trace.
    `entropy` comes last so that the positions of the older fields do not move.
    """

    logp: jax.Array
    lse: jax.Array
    logits: jax.Array | None = None
    provenance: C.Provenance | None = None
    entropy: jax.Array | None = None


jax.tree_util.register_static(C.Provenance)


@dataclasses.dataclass(frozen=True)
class _Config:
    backend: str
    vocab_size: int
    padded_vocab_size: int
    return_logits: bool
    tuning: tuple = ()
    weight_layout: str = "vd"
    return_entropy: bool = False
    residuals: str = "recompute"  # "logits": the forward keeps its FP32 logits for the backward

    def layout_kwargs(self) -> dict:
        """The layout argument for a backend (omitted for the default layout)."""
        return {} if self.weight_layout == "vd" else {"weight_layout": self.weight_layout}

    def entropy_kwargs(self) -> dict:
        """The entropy flag for a backend (omitted unless requested: older backends lack it)."""
        return {"return_entropy": True} if self.return_entropy else {}


def _serve(hidden, weight, bias, targets, inv_t, cfg: _Config, keep_logits: bool = False):
    """(logp, lse, logits | None, entropy | None) of the backend named by `cfg`.

    keep_logits (contract backends; the residual mode's forward): the logits come back
    even without `cfg.return_logits`, from the same forward launch (its logp/lse bytes
    do not depend on return_logits), as [N, V_rows] (all the weight's rows: the backward
    slices its chunks in place); with `cfg.return_logits` they are the returned
    [N, vocab_size] array itself, never a second copy."""
    be = backends.get(cfg.backend)
    entropy = None
    if be.contract_bearing:
        # logits_cols: the backend writes the real vocabulary's columns only, so the
        # serving entry never copies an [N, V_rows] array to drop the padding columns.
        kw = dict(
            vocab_size=cfg.vocab_size,
            padded_vocab_size=cfg.padded_vocab_size,
            return_logits=cfg.return_logits or keep_logits,
            logits_cols=cfg.vocab_size if cfg.return_logits else None,
            **cfg.layout_kwargs(),
            **cfg.entropy_kwargs(),
            **be.tuning_kwargs(cfg.tuning),
        )
        if be.fused_forward is not None:  # the bytes of the partials + fold below, in one call
            return be.fused_forward(hidden, weight, bias, targets, inv_t, **kw)
        parts = be.partials(hidden, weight, bias, targets, inv_t, **kw)
        m, s, z_t, owned, logits = parts[:5]
        if cfg.return_entropy:
            logp, lse, entropy = be.fold(m, s, z_t, targets, inv_t, cfg.vocab_size, a=parts[5])
        else:
            logp, lse = be.fold(m, s, z_t, targets, inv_t, cfg.vocab_size)
    else:
        out = be.forward(
            hidden,
            weight,
            bias,
            targets,
            inv_t,
            vocab_size=cfg.vocab_size,
            return_logits=cfg.return_logits,
            **cfg.layout_kwargs(),
            **cfg.entropy_kwargs(),
        )
        logp, lse, logits = out[:3]
        entropy = out[3] if cfg.return_entropy else None
        if logits is not None:
            logits = logits[:, : cfg.vocab_size]
    return logp, lse, logits, entropy


def unwrap_primals(*primals):
    """(values, perturbed flags) of a custom_vjp fwd's primals under symbolic zeros."""
    is_p = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
    values = jax.tree.map(lambda x: x.value if is_p(x) else x, primals, is_leaf=is_p)
    flags = [any(getattr(x, "perturbed", False) for x in jax.tree.leaves(p, is_leaf=is_p)) for p in primals]
    return values, flags


def nonzero_cotangents(*cts):
    """Cotangents with symbolic zeros as None."""
    return tuple(None if isinstance(c, jax.custom_derivatives.SymbolicZero) else c for c in cts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _core(hidden, weight, bias, targets, inv_t, cfg):
    return _serve(hidden, weight, bias, targets, inv_t, cfg)


def _core_fwd(hidden, weight, bias, targets, inv_t, cfg):
    (hidden, weight, bias, targets, inv_t), perturbed = unwrap_primals(hidden, weight, bias, targets, inv_t)
    keep = cfg.residuals == "logits"
    out = _serve(hidden, weight, bias, targets, inv_t, cfg, keep_logits=keep)
    logp, lse, logits, entropy = out
    if keep and not cfg.return_logits:  # kept for the backward only
        out = (logp, lse, None, entropy)
    # The temperature gradient needs the forward's logp; its presence says it is wanted.
    want_t = perturbed[4]
    saved = logits if keep else None
    return out, (hidden, weight, bias, targets, inv_t, lse, entropy, logp if want_t else None, saved)


def _core_bwd(cfg, res, cts):
    hidden, weight, bias, targets, inv_t, lse, entropy, logp, saved = res
    g_logp, g_lse, g_logits, g_entropy = nonzero_cotangents(*cts)
    want_t = logp is not None
    out = grad_lib.backward(
        hidden,
        weight,
        bias,
        targets,
        inv_t,
        lse,
        jnp.zeros_like(lse) if g_logp is None else g_logp,
        jnp.zeros_like(lse) if g_lse is None else g_lse,
        g_logits,
        vocab_size=cfg.vocab_size,
        dz=backends.get(cfg.backend).dz,
        weight_layout=cfg.weight_layout,
        entropy=entropy,
        g_entropy=g_entropy,
        row_sums=want_t,
        logits=saved,
    )
    dh, dw, db = out[:3]
    g_inv_t = None
    if want_t:
        plp, var = out[3]
        g_inv_t = grad_lib.inv_t_cotangent(
            inv_t, lse, logp, targets, cfg.vocab_size, g_logp, g_lse, entropy, g_entropy, plp, var
        )
        g_inv_t = vma.match_cotangent(g_inv_t, inv_t)
    # Under vma typing (inside shard_map) a replicated weight's gradient is the sum
    # over the axes its rows' contributions vary over.
    dh, dw, db = vma.match_cotangent(dh, hidden), vma.match_cotangent(dw, weight), vma.match_cotangent(db, bias)
    return dh, dw, db, None, g_inv_t


_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)


@functools.partial(jax.jit, static_argnums=(5,))
def _impl(hidden, weight, bias, targets, inv_t, cfg):
    return _core(hidden, weight, bias, targets, inv_t, cfg)


@functools.partial(jax.jit, static_argnums=(5,))
def _impl_autodiff(hidden, weight, bias, targets, inv_t, cfg):
    """Non-contract lanes (the XLA baseline) differentiate through plain autodiff."""
    return _serve(hidden, weight, bias, targets, inv_t, cfg)


def _row_bucket(n: int) -> int:
    """Compile-size bucket for eager reference calls (bit-neutral: rows are independent)."""
    if n <= 8:
        return 8
    if n <= 1024:
        return 1 << (n - 1).bit_length()
    return -(-n // 1024) * 1024


def linear_logp(
    hidden,
    weight,
    targets,
    *,
    bias=None,
    temperature=1.0,
    vocab_size: int | None = None,
    padded_vocab_size: int | None = None,
    return_logits: bool = False,
    backend: str = "auto",
    checked: bool | None = None,
    tuning: dict | None = None,
    weight_layout: str = "vd",
    return_entropy: bool = False,
    residuals: str = "recompute",
) -> LogpOutput:
    """Log-probability of `targets` under logits = hidden @ W.T (+ bias), / temperature.

    hidden [..., D] and the weight share a float dtype; the weight is W [V, D]
    (weight_layout="vd", the lm_head layout) or W.T [D, V] (weight_layout="dv",
    a Flax/Tunix kernel), read in place in either layout with the same bytes;
    targets [...] int (global vocab ids; -100 = ignore: logp +0.0, no gradient;
    any other id outside [0, vocab_size) -> NaN logp in that row only, or an
    error with `checked=True` / DETLOGP_CHECKED=1). bias [V] is added in FP32.
    temperature: positive scalar or one value per row. vocab_size: the real
    vocabulary (weight rows at or beyond it are padding). padded_vocab_size:
    the canonical padded vocab that fixes the split structure (default: the
    weight's row count); an unpadded weight declared with the padded size gives
    the padded weight's bytes without copying it. return_logits: also return
    FP32 unscaled logits [..., vocab_size], never changing logp/lse bits.
    return_entropy: also return the FP32 entropy [...] of softmax(logits / T) over the
    real vocabulary (padding lanes add nothing; ignored and bad-target rows keep theirs),
    streamed with the lse (`linear-logp-entropy-v1`, docs/CONTRACT.md section 9); never
    changing logp/lse bits, and with False the statistic is not traced at all. A backend
    that does not produce it refuses the call (auto falls back to the reference backend).
    backend: "auto" | "reference" | "pallas_sm90" | "xla". `tuning`: bit-neutral
    knobs only (`contract.BIT_NEUTRAL_KNOBS`: row_block, bucket, num_ctas; each
    backend applies its own); contract constants raise ContractError.
    Differentiable w.r.t. hidden, weight, bias and the temperature (chunked custom_vjp;
    the entropy's cotangent joins the logp/lse ones in the same recompute pass).
    residuals: what the forward keeps for the backward under differentiation.
    "recompute" (default): hidden, the weight and per-row vectors (extra memory
    O(N*D + V*D)); the backward recomputes the logits chunk by chunk (four GEMM passes
    with the forward). "logits": also the forward's own FP32 logits (O(N*V) memory, the
    same array as the returned logits with return_logits=True under jit; called op by op,
    the returned logits are the entry's row-sliced / reshaped copy of it), so
    the backward forms dz from them and runs only the dh and dW GEMMs (three passes);
    it never uses a backend's fused dz kernel (that kernel recomputes; it has no logits
    input). logp/lse/entropy bytes never depend on it; the gradient bytes equal the
    recompute mode's when the saved logits equal the backward's recomputed ones bit for
    bit, and agree within the documented gradient accuracy otherwise (`detlogp_jax.grad`).
    The xla lane differentiates through XLA's autodiff and ignores it.
    """
    C.check_no_overrides(tuning)
    inputs.check_residuals(residuals)
    # numpy inputs go straight to the jitted stages (a transfer, no eager op to compile)
    targets = np.asarray(targets) if isinstance(targets, (list, tuple)) else targets
    vocab, padded = inputs.validate(
        hidden, weight, targets, bias, temperature, vocab_size, padded_vocab_size, weight_layout
    )
    lead = hidden.shape[:-1]
    n = math.prod(lead)
    if inputs.checked_mode(checked):
        inputs.check_targets(targets, vocab)

    h_spec = jax.ShapeDtypeStruct((n, hidden.shape[-1]), hidden.dtype)
    return_entropy = bool(return_entropy)
    be, fallback = backends.resolve(backend, h_spec, weight, weight_layout, entropy=return_entropy)
    backends.guard_strict(be, fallback)
    prov = inputs.record_provenance(be, fallback, vocab, padded, backend, weight_layout, return_entropy)
    cfg = _Config(
        be.name,
        vocab,
        padded,
        bool(return_logits),
        inputs.tuning_key(tuning),
        weight_layout,
        return_entropy,
        residuals,
    )
    if n == 0:
        empty = jnp.zeros(lead, jnp.float32)
        return LogpOutput(
            empty,
            empty,
            jnp.zeros(lead + (vocab,), jnp.float32) if return_logits else None,
            prov,
            empty if return_entropy else None,
        )
    if not hasattr(temperature, "shape"):
        temperature = jnp.asarray(temperature, jnp.float32)  # a runtime value: no retrace per T
    if isinstance(targets, np.ndarray):  # range-checked on the host, in its own width
        targets = inputs.narrow_targets(targets, vocab)
    run = functools.partial(_run, cfg=cfg)
    rows = row_sharding.explicit_rows(hidden, weight, bias)
    if rows is not None:
        out = row_sharding.run_per_shard(
            run, *rows, hidden, weight, bias, targets, temperature, logits=cfg.return_logits, entropy=return_entropy
        )
    else:
        out = run(hidden, weight, bias, targets, temperature)
    logp, lse, logits, entropy = out
    return LogpOutput(logp, lse, logits, prov, entropy)


def _run(hidden, weight, bias, targets, temperature, *, cfg: _Config):
    """The op on one device's rows: flatten, fl(1/T), pad, compute, unflatten."""
    lead = hidden.shape[:-1]
    n = math.prod(lead)
    pad = 0
    if cfg.backend == "reference" and inputs.is_concrete(hidden):
        pad = _row_bucket(n) - n
    h2, t2, inv_t = _prepare(hidden, targets, temperature, pad, cfg.vocab_size)
    impl = _impl if backends.get(cfg.backend).contract_bearing else _impl_autodiff
    return _finish(*impl(h2, weight, bias, t2, inv_t, cfg), lead)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _prepare(hidden, targets, temperature, pad: int, vocab_size: int):
    """Flattens leading dims, range-checks targets before narrowing them to int32,
    computes inv_t, pads rows to a compile bucket."""
    n = math.prod(hidden.shape[:-1])
    h2 = hidden.reshape(n, hidden.shape[-1])
    t2 = inputs.narrow_targets(targets.reshape(n), vocab_size)
    inv_t = inputs.inv_temperature(temperature, n)
    if pad:
        h2 = jnp.pad(h2, ((0, pad), (0, 0)))
        t2 = jnp.pad(t2, (0, pad), constant_values=C.IGNORE_INDEX)
        inv_t = jnp.pad(inv_t, (0, pad), constant_values=1.0)
    return h2, t2, inv_t


@functools.partial(jax.jit, static_argnums=(4,))
def _finish(logp, lse, logits, entropy, lead):
    n = math.prod(lead)
    out_logits = None if logits is None else logits[:n].reshape(lead + logits.shape[1:])
    out_entropy = None if entropy is None else entropy[:n].reshape(lead)
    return logp[:n].reshape(lead), lse[:n].reshape(lead), out_logits, out_entropy


def provenance(
    hidden,
    weight,
    *,
    vocab_size=None,
    padded_vocab_size=None,
    backend="auto",
    weight_layout="vd",
    return_entropy: bool = False,
) -> C.Provenance:
    """The provenance record a call with these arguments would get (no compute)."""
    h2 = jax.ShapeDtypeStruct((math.prod(hidden.shape[:-1]), hidden.shape[-1]), hidden.dtype)
    be, fallback = backends.resolve(backend, h2, weight, weight_layout, entropy=bool(return_entropy))
    vocab, padded = inputs.vocab_sizes(weight.shape[inputs.vocab_axis(weight_layout)], vocab_size, padded_vocab_size)
    return inputs.make_provenance(be, fallback, vocab, padded, backend, weight_layout, bool(return_entropy))
