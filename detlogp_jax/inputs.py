"""What every entry point does before it computes: the documented interface that
`linear_logp` and the layers above the core (`sharding`, integrations) share.

* `validate(...)` checks shapes, dtypes, vocab sizes, bias and temperature at
  trace time and returns `(vocab_size, padded_vocab_size)` with their defaults;
  `vocab_sizes` and `validate_temperature` are its parts.
* `checked_mode(checked)` resolves checked mode (the argument, else
  `DETLOGP_CHECKED`); `check_targets` raises on out-of-range targets, eagerly
  or at run time under jit.
* `inv_temperature(temperature, n_rows)` gives fl(1/T) per row, the contract's
  scale, with NaN in a row whose traced temperature is not positive and finite;
  it carries the derivative of 1/T, so the temperature is differentiable.
* `tuning_key(tuning)` turns bit-neutral knobs into a hashable static key.
* `check_residuals(residuals)` validates the backward's residual mode.
* `record_provenance(...)` builds the provenance of a call and makes it the one
  `last_provenance()` reports.
"""

from __future__ import annotations

import math
import numbers
import os

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from detlogp_jax import backends, numerics
from detlogp_jax import contract as C
from detlogp_jax.layout import VD, WeightLayout, as_layout

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# What the forward keeps for the backward (`detlogp_jax.grad`): "recompute" keeps hidden,
# the weight and per-row vectors (O(N*D + V*D)) and the backward recomputes the logits
# chunk by chunk; "logits" also keeps the forward's own FP32 logits (O(N*V)), so the
# backward runs no recompute GEMM. The forward's bytes never depend on it.
RESIDUALS = ("recompute", "logits")


def check_residuals(residuals) -> str:
    """The residual mode's name, or a ValueError for anything else."""
    if not isinstance(residuals, str) or residuals not in RESIDUALS:
        raise ValueError(
            "residuals must be 'recompute' (the backward recomputes the logits chunk by chunk) or 'logits' "
            f"(the forward keeps its FP32 logits [N, V] for the backward), got {residuals!r}"
        )
    return residuals


def is_concrete(x) -> bool:
    """True for a value known at trace time (not a tracer)."""
    return not isinstance(x, jax.core.Tracer)


def validate(
    hidden, weight, targets, bias, temperature, vocab_size, padded_vocab_size, weight_layout: WeightLayout = VD
) -> tuple[int, int]:
    """Checks a call's operands (trace time); returns (vocab_size, padded_vocab_size).
    `weight_layout` (a `WeightLayout` or its name) says which axis of the weight is the
    vocabulary; a weight whose D axis does not match hidden's is refused."""
    layout = as_layout(weight_layout)
    if not hasattr(hidden, "shape") or not hasattr(weight, "shape") or not hasattr(targets, "shape"):
        raise TypeError("hidden, weight and targets must be arrays")
    if hidden.ndim < 1:
        raise ValueError(f"hidden must have shape [..., D], got {hidden.shape}")
    shape_name = layout.shape_name
    if weight.ndim != 2:
        raise ValueError(f"weight must have shape {shape_name}, got {weight.shape}")
    d = hidden.shape[-1]
    if d < 1:
        raise ValueError("hidden size D must be >= 1")
    v_axis = layout.vocab_axis
    if weight.shape[1 - v_axis] != d:
        other = "'dv' for a [D, V] kernel" if layout is VD else "'vd' for a [V, D] lm_head"
        raise ValueError(
            f"D mismatch: hidden [..., {d}] vs weight {tuple(weight.shape)} as {shape_name}; pass weight_layout={other}"
        )
    if weight.shape[v_axis] < 1:
        raise ValueError("weight must have at least one vocabulary row")
    if jnp.dtype(hidden.dtype) not in FLOAT_DTYPES or jnp.dtype(weight.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"hidden/weight must be bfloat16, float16 or float32, got {hidden.dtype}/{weight.dtype}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets shape {targets.shape} must equal hidden's leading shape {hidden.shape[:-1]}")
    v_rows = weight.shape[v_axis]
    vocab, padded = vocab_sizes(v_rows, vocab_size, padded_vocab_size)
    if bias is not None:
        if not hasattr(bias, "shape") or tuple(bias.shape) != (v_rows,):
            raise ValueError(
                f"bias must have shape ({v_rows},) like the weight's rows, got {getattr(bias, 'shape', bias)}"
            )
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be floating point, got {bias.dtype}")
    validate_temperature(temperature, targets.shape)
    return vocab, padded


def vocab_sizes(v_rows: int, vocab_size, padded_vocab_size) -> tuple[int, int]:
    """(vocab_size, padded_vocab_size) with their defaults (the weight's rows), validated."""
    vocab = v_rows if vocab_size is None else vocab_size
    padded = v_rows if padded_vocab_size is None else padded_vocab_size
    for name, value in (("vocab_size", vocab), ("padded_vocab_size", padded)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{name} must be a static int, got {type(value).__name__}")
    vocab, padded = int(vocab), int(padded)
    if not 1 <= vocab <= v_rows:
        raise ValueError(f"vocab_size must be in [1, weight rows = {v_rows}], got {vocab}")
    if padded < v_rows:
        raise ValueError(f"padded_vocab_size {padded} is smaller than the weight's {v_rows} rows")
    return vocab, padded


def validate_temperature(temperature, row_shape) -> None:
    """A positive finite scalar, or a float array of one value per row (checked when concrete)."""
    if isinstance(temperature, numbers.Real) and not isinstance(temperature, bool):
        if not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be a finite positive number, got {temperature}")
        return
    if not hasattr(temperature, "shape"):
        raise TypeError(f"temperature must be a positive scalar or an array of one value per row, got {temperature!r}")
    if tuple(temperature.shape) not in ((), tuple(row_shape)):
        raise ValueError(
            f"temperature must be a scalar or have the targets' shape {tuple(row_shape)}, got {temperature.shape}"
        )
    if not jnp.issubdtype(temperature.dtype, jnp.floating):
        raise TypeError(f"temperature must be floating point, got {temperature.dtype}")
    if is_concrete(temperature):
        t = np.asarray(temperature, np.float64)
        if not np.all(np.isfinite(t) & (t > 0)):
            raise ValueError("temperature must be finite and > 0 in every row")


def checked_mode(checked: bool | None) -> bool:
    """Checked mode: the argument, else DETLOGP_CHECKED."""
    if checked is None:
        return os.environ.get("DETLOGP_CHECKED", "0").strip().lower() in ("1", "true", "yes", "on")
    return bool(checked)


def check_targets(targets, vocab_size: int) -> None:
    """Checked mode: raise on a target outside [0, vocab_size) that is not the ignore index.

    Concrete targets (an eager call) are checked here: a ValueError names the first bad target,
    its index and the vocabulary. Traced targets (inside `jax.jit`) are checked through
    `jax.experimental.checkify`: run the jitted function under `checkify.checkify` and
    `err.throw()` raises the same message. A trace that is not checkified is refused at trace
    time with a ValueError that says so (a host callback could only fail as an XLA runtime
    error); without checked mode a bad target gives NaN logp in its own row only."""

    def message(value, index):
        return f"target {value} at index {index} is outside [0, {vocab_size}) and is not {C.IGNORE_INDEX}"

    if is_concrete(targets):
        t = np.asarray(targets)
        bad = C.bad_target(t, vocab_size)
        if bad.any():
            idx = np.argwhere(bad)[0].tolist()
            raise ValueError(message(t[tuple(idx)], idx))
        return
    from jax.experimental import checkify

    bad = C.bad_target(targets, vocab_size)
    first = jnp.argmax(bad.reshape(-1))
    value = targets.reshape(-1)[first]
    try:
        checkify.check(
            ~jnp.any(bad),
            message("{value}", "{index}") + " (flat index)",
            value=value,
            index=first,
        )
    except ValueError as e:
        if "functionalized" not in str(e):
            raise
        raise ValueError(
            "checked=True (or DETLOGP_CHECKED=1) inside jax.jit checks the targets with "
            "jax.experimental.checkify: wrap the jitted function, `err, out = checkify.checkify(f)(...)` then "
            "`err.throw()` (it names a bad target and the vocabulary), or check them before jit with "
            "`detlogp_jax.inputs.check_targets(targets, vocab_size)` on concrete targets. Without checked mode a "
            "bad target gives NaN logp in its own row only."
        ) from None


def narrow_targets(targets, vocab_size: int):
    """int32 targets: every value that is neither `IGNORE_INDEX` nor in [0, vocab_size)
    becomes -1 (a bad target: NaN logp in its row), decided in the input's own integer
    width and signedness before any narrowing (an int64 2**32 + 5 is bad, not token 5;
    an unsigned value is never the ignore index). numpy in, numpy out; else jnp."""
    xp = np if isinstance(targets, np.ndarray) else jnp
    dtype = np.dtype(targets.dtype)
    if dtype == np.int32:
        return targets
    info = np.iinfo(dtype)
    keep = targets >= 0
    if vocab_size <= info.max:
        keep = keep & (targets < vocab_size)
    if np.issubdtype(dtype, np.signedinteger) and info.min <= C.IGNORE_INDEX:
        keep = keep | (targets == C.IGNORE_INDEX)
    kept = xp.where(keep, targets, 0).astype(xp.int32)  # exact: kept values fit in int32
    return xp.where(keep, kept, -1)


def tuning_key(tuning) -> tuple:
    """Bit-neutral tuning knobs as a hashable, order-free static key."""
    return tuple(sorted((tuning or {}).items()))


@jax.custom_jvp
def reciprocal(t):
    """fl(1/t) per element (`numerics.reciprocal_rn`: integer operations, the same bits on
    every backend) with the derivative of 1/t attached: d(1/t) = -(1/t)^2 dt (the integer
    program itself has no derivative)."""
    return numerics.reciprocal_rn(t)


@reciprocal.defjvp
def _reciprocal_jvp(primals, tangents):
    (t,), (dt,) = primals, tangents
    inv = numerics.reciprocal_rn(t)
    return inv, -(inv * inv) * dt


def inv_temperature(temperature, n_rows: int):
    """fl(1/T) [n_rows] f32 for a scalar or per-row temperature; NaN where T <= 0 or not finite.
    Differentiable: the temperature gets d(1/T)/dT = -1/T^2 times the op's exact inv_t
    cotangent (see `detlogp_jax.grad`)."""
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32).reshape(-1), (n_rows,))
    inv = reciprocal(t)
    # A traced non-positive temperature makes only its own row NaN.
    return jnp.where((t > 0) & jnp.isfinite(t), inv, jnp.nan)


_LAST_PROVENANCE: list[C.Provenance] = []


def last_provenance() -> C.Provenance | None:
    """Provenance of the most recent entry-point call that ran Python: an eager call, or
    the trace of a jitted one. A cached jitted call runs no Python and records nothing;
    its own record is `LogpOutput.provenance` of the output it returns."""
    return _LAST_PROVENANCE[-1] if _LAST_PROVENANCE else None


def make_provenance(
    be: backends.Backend,
    fallback: bool,
    vocab: int,
    padded: int,
    requested: str,
    weight_layout: WeightLayout = VD,
    entropy: bool = False,
) -> C.Provenance:
    """The provenance record of a call served by `be` (requested as `requested`);
    `entropy`: the call returns the entropy (recorded as its statistic's id)."""
    info = backends.platform_info()
    entropy_id = None
    if entropy:
        entropy_id = C.ENTROPY_ID if be.contract_bearing else "none (non-contract lane)"
    return C.Provenance(
        contract_id=C.CONTRACT_ID if be.contract_bearing else "none (non-contract lane)",
        backend=be.name,
        contract_bearing=be.contract_bearing,
        platform=info["platform"],
        device_kind=info["device_kind"],
        compute_capability=info["compute_capability"],
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        vocab_size=vocab,
        padded_vocab_size=padded,
        n_split=C.n_split(padded),
        requested_backend=requested,
        fallback=fallback,
        weight_layout=as_layout(weight_layout).name,
        entropy_id=entropy_id,
    )


def record_provenance(
    be: backends.Backend,
    fallback: bool,
    vocab: int,
    padded: int,
    requested: str,
    weight_layout: WeightLayout = VD,
    entropy: bool = False,
) -> C.Provenance:
    """Builds the call's provenance and makes it the one `last_provenance()` reports."""
    prov = make_provenance(be, fallback, vocab, padded, requested, weight_layout, entropy)
    _LAST_PROVENANCE[:] = [prov]
    return prov
