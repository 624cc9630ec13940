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

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from detlogp_jax import backends, inputs, pipeline, row_sharding
from detlogp_jax import contract as C
from detlogp_jax.inputs import last_provenance  # noqa: F401  (re-exported: api.last_provenance)
from detlogp_jax.layout import as_layout
from detlogp_jax.pipeline import OpConfig


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


class Options(NamedTuple):
    """The keywords of `linear_logp`, with their defaults (see its docstring): one
    declaration that every entry point of the op (`linear_logp`, the tensor-parallel
    `sharding.linear_logp_tp(..., **options)`) validates through `configure`."""

    bias: object = None
    temperature: object = 1.0
    vocab_size: int | None = None
    padded_vocab_size: int | None = None
    return_logits: bool = False
    backend: str = "auto"
    checked: bool | None = None
    tuning: dict | None = None
    weight_layout: str = "vd"
    return_entropy: bool = False
    residuals: str = "recompute"


def configure(hidden, weight, targets, options: Options, shards=None) -> tuple[OpConfig, C.Provenance]:
    """Validates one call of the op at trace time and decides everything static about it.

    Checks the operands and options (`inputs.validate`: shapes, dtypes, layouts, vocab
    sizes, bias, temperature; bit-neutral tuning only; the residual mode), runs checked
    mode's target check, picks the backend (`backends.resolve`; strict mode's rules,
    `backends.guard_strict`) and records the call's provenance. `shards`: for a
    vocab-parallel call, a function (vocab_size, padded_vocab_size) -> `VocabShards`
    (it may refuse the geometry); such a call needs a contract-bearing backend.
    Returns (the `OpConfig`, the provenance)."""
    C.check_no_overrides(options.tuning)
    inputs.check_residuals(options.residuals)
    layout = as_layout(options.weight_layout)
    vocab, padded = inputs.validate(
        hidden,
        weight,
        targets,
        options.bias,
        options.temperature,
        options.vocab_size,
        options.padded_vocab_size,
        layout,
    )
    vocab_shards = None if shards is None else shards(vocab, padded)
    if inputs.checked_mode(options.checked):
        inputs.check_targets(targets, vocab)
    h_spec = jax.ShapeDtypeStruct((math.prod(hidden.shape[:-1]), hidden.shape[-1]), hidden.dtype)
    return_entropy = bool(options.return_entropy)
    be, fallback = backends.resolve(options.backend, h_spec, weight, layout, entropy=return_entropy)
    if vocab_shards is not None and not be.contract_bearing:
        raise ValueError(f"backend {be.name!r} is not contract-bearing; tensor parallelism needs its partials/fold")
    backends.guard_strict(be, fallback)
    prov = inputs.record_provenance(be, fallback, vocab, padded, options.backend, layout, return_entropy)
    cfg = OpConfig(
        backend=be.name,
        vocab_size=vocab,
        padded_vocab_size=padded,
        return_logits=bool(options.return_logits),
        layout=layout,
        return_entropy=return_entropy,
        residuals=options.residuals,
        tuning=inputs.tuning_key(options.tuning),
        shards=vocab_shards,
    )
    return cfg, prov


def empty_output(lead, cfg: OpConfig, prov, logits_cols: int) -> LogpOutput:
    """The output of a call with no rows (leading shape `lead` of size 0)."""
    empty = jnp.zeros(lead, jnp.float32)
    logits = jnp.zeros(lead + (logits_cols,), jnp.float32) if cfg.return_logits else None
    return LogpOutput(empty, empty, logits, prov, empty if cfg.return_entropy else None)


@functools.partial(jax.jit, static_argnums=(5,))
def _impl(hidden, weight, bias, targets, inv_t, cfg):
    return pipeline.op(hidden, weight, bias, targets, inv_t, None, cfg)


@functools.partial(jax.jit, static_argnums=(5,))
def _impl_autodiff(hidden, weight, bias, targets, inv_t, cfg):
    """Non-contract lanes (the XLA baseline) differentiate through plain autodiff."""
    return pipeline.forward(hidden, weight, bias, targets, inv_t, None, cfg)


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
    # numpy inputs go straight to the jitted stages (a transfer, no eager op to compile)
    targets = np.asarray(targets) if isinstance(targets, (list, tuple)) else targets
    options = Options(
        bias,
        temperature,
        vocab_size,
        padded_vocab_size,
        return_logits,
        backend,
        checked,
        tuning,
        weight_layout,
        return_entropy,
        residuals,
    )
    cfg, prov = configure(hidden, weight, targets, options)
    lead = hidden.shape[:-1]
    if math.prod(lead) == 0:
        return empty_output(lead, cfg, prov, cfg.vocab_size)
    if not hasattr(temperature, "shape"):
        temperature = jnp.asarray(temperature, jnp.float32)  # a runtime value: no retrace per T
    if isinstance(targets, np.ndarray):  # range-checked on the host, in its own width
        targets = inputs.narrow_targets(targets, cfg.vocab_size)
    run = functools.partial(_run, cfg=cfg)
    rows = row_sharding.explicit_rows(hidden, weight, bias)
    if rows is not None:
        out = row_sharding.run_per_shard(
            run, *rows, hidden, weight, bias, targets, temperature, logits=cfg.return_logits, entropy=cfg.return_entropy
        )
    else:
        out = run(hidden, weight, bias, targets, temperature)
    logp, lse, logits, entropy = out
    return LogpOutput(logp, lse, logits, prov, entropy)


def _run(hidden, weight, bias, targets, temperature, *, cfg: OpConfig):
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
    layout = as_layout(weight_layout)
    be, fallback = backends.resolve(backend, h2, weight, layout, entropy=bool(return_entropy))
    vocab, padded = inputs.vocab_sizes(layout.vocab_rows(weight), vocab_size, padded_vocab_size)
    return inputs.make_provenance(be, fallback, vocab, padded, backend, layout, bool(return_entropy))
