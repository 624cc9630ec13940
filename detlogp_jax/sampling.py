"""Deterministic, replayable token sampling over FP32 logits.

A :class:`SamplingProgram` turns a row of *unscaled* logits ``[..., V]`` (``V`` = real
vocab, no padding columns) into a processed distribution in a pinned order::

    temperature -> top-k -> top-p -> min-p -> log-softmax over the kept set

Every step is explicit float32 arithmetic whose result is fixed by IEEE rounding
alone (no library reductions whose order the compiler may pick):

* temperature: ``s = logits * inv_t`` with ``inv_t = float32(1) / float32(T)``
  computed once on the host.
* order: tokens are sorted by ``(-s, token_id)`` (``lax.sort`` on two keys), so ties
  go to the lower token id. ``m = s[rank 0]`` is the row max, ``d = s - m`` and
  ``e = exp(d)`` (``e == 1`` exactly at rank 0).
* top-k (``0 < k < V``): keep ranks ``< k``.
* top-p (``top_p < 1``): ``p = e_k / sum(e_k)`` over the top-k-kept set (``e_k`` = ``e``
  masked to 0 outside it); keep rank ``r`` iff the exclusive prefix sum of ``p`` in rank
  order is ``< float32(top_p)``, i.e. the smallest prefix reaching ``top_p``; rank 0 is
  always kept.
* min-p (``min_p > 0``): keep iff ``e >= float32(min_p)``. Since ``e`` at the max is 1,
  this is ``prob >= min_p * max_prob`` for any normalisation of the kept set.
* processed logprob: ``d - log(sum(e over kept))`` on the kept set, ``-inf`` elsewhere.

Sums are a fixed pairwise tree over the (zero-padded to a power of two) vocab axis and
prefix sums are a fixed Hillis-Steele scan, both written as element-wise adds, so a
row's result does not depend on the batch it sits in or on the reduction strategy the
compiler would choose. Results are bitwise reproducible on one platform (same JAX/XLA
build, same backend); different backends may differ in ``exp``/``log`` ulps.

Sampling is **Gumbel-max**: ``token = argmax(logp_processed + g)`` over the kept set,
with ``g = -log(-log(u))`` and ``u = (float32(bits >> 9) + 0.5) * 2**-23`` computed
exactly from ``jax.random.bits(key, ..., uint32)``, so ``0 < u < 1``. Argmax ties go to
the lower token id.

Contracts:

* :func:`processed_logprobs` (``[..., V] -> [..., V]``) is the single code path both
  :func:`sample` and :func:`processed_logprob` gather from, so
  ``processed_logprob(logits, program, sample(logits, program, key).token)`` equals
  ``sample(...).processed_logprob`` bit for bit.
* :func:`sample` is a pure function of ``(logits, program, key)``.
* Logits must be finite except for ``-inf`` entries (masked tokens); at least one
  entry per row must be finite. ``NaN``/``+inf`` make the row's outputs ``NaN``.

The processed logprob is the *sampler's* view. The RL contract logp of the sampled
token (from the library op, e.g. ``linear_logp``) is a different number and is never
recomputed here. Typical flow::

    logits = <serving entry of the op>(hidden, lm_head)           # [B, V] fp32
    res = sample(logits, program, key,
                 logp_from_op=lambda tok: linear_logp(hidden, lm_head, tok))
    res.token, res.processed_logprob, res.logp                    # logp from the op

``logp_from_op`` may also be a precomputed ``[..., V]`` logp table (see
:func:`gather_logp`), or be left ``None`` and the op called later with
``targets=res.token``.
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Integral, Real
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "SamplingProgram",
    "SampleResult",
    "processed_logprobs",
    "processed_logprob",
    "sample",
    "gather_logp",
]


@dataclasses.dataclass(frozen=True)
class SamplingProgram:
    """Static, hashable sampling configuration (usable as a ``jit`` static argument).

    ``top_k == 0`` disables top-k; ``top_p == 1`` disables top-p; ``min_p == 0`` disables
    min-p. Values are normalised to Python ``int``/``float`` so equal programs hash equal.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        def real(name, v):
            if isinstance(v, bool) or not isinstance(v, Real):
                raise ValueError(f"{name} must be a real number, got {v!r}")
            v = float(v)
            if math.isnan(v):
                raise ValueError(f"{name} must not be NaN")
            return v

        t = real("temperature", self.temperature)
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be finite and > 0, got {t!r}")
        with np.errstate(all="ignore"):
            t32 = np.float32(t)
            inv = np.float32(1) / t32
        if not (np.isfinite(t32) and t32 > 0 and np.isfinite(inv) and inv > 0):
            raise ValueError(f"temperature {t!r} is not representable as a usable float32")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral):
            raise ValueError(f"top_k must be an int (0 = off), got {self.top_k!r}")
        k = int(self.top_k)
        if k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {k}")
        p = real("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        mp = real("min_p", self.min_p)
        if not 0.0 <= mp < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {mp!r}")
        for name, v in (("temperature", t), ("top_k", k), ("top_p", p), ("min_p", mp)):
            object.__setattr__(self, name, v)

    @property
    def inv_temperature(self) -> np.float32:
        """``float32(1) / float32(temperature)``: the multiplier applied to the logits."""
        return np.float32(1) / np.float32(self.temperature)


class SampleResult(NamedTuple):
    token: jax.Array  # int32 [...]
    processed_logprob: jax.Array  # float32 [...], the sampler's log-prob of `token`
    logp: Optional[jax.Array]  # contract logp of `token` from the op, or None


def _tree_sum(x):
    """Sum over the last axis as a fixed pairwise tree of element-wise adds."""
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _exclusive_prefix_sum(x):
    """Exclusive prefix sum over the last axis (fixed Hillis-Steele scan)."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        x = x + jnp.pad(x[..., : n - shift], [(0, 0)] * (x.ndim - 1) + [(shift, 0)])
        shift *= 2
    return jnp.pad(x[..., : n - 1], [(0, 0)] * (x.ndim - 1) + [(1, 0)])


def _check_logits(logits):
    logits = jnp.asarray(logits)
    if logits.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"logits must be float32 (or bf16/f16, upcast exactly), got {logits.dtype}")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    return logits.astype(jnp.float32)


@jax.jit(static_argnames="program")
def _processed_table(logits, program: SamplingProgram):
    v = logits.shape[-1]
    ids = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    scaled = logits * program.inv_temperature
    neg_sorted, sorted_ids = lax.sort((-scaled, ids), dimension=-1, num_keys=2)
    s_sorted = -neg_sorted  # descending, ties by lower id
    d = s_sorted - s_sorted[..., :1]  # s - max
    e = jnp.exp(d)
    rank = ids  # the same iota, read in rank (sorted) order

    keep = jnp.ones(logits.shape, jnp.bool_)
    if 0 < program.top_k < v:
        keep = rank < program.top_k
    if program.top_p < 1.0:
        e_k = jnp.where(keep, e, 0.0)
        p = e_k / _tree_sum(e_k)[..., None]
        keep = keep & (_exclusive_prefix_sum(p) < np.float32(program.top_p))
    if program.min_p > 0.0:
        keep = keep & (e >= np.float32(program.min_p))

    log_z = jnp.log(_tree_sum(jnp.where(keep, e, 0.0)))
    lp_sorted = jnp.where(keep, d - log_z[..., None], -jnp.inf)
    _, lp = lax.sort((sorted_ids, lp_sorted), dimension=-1, num_keys=1)  # back to token order
    return lp


def processed_logprobs(logits, program: SamplingProgram) -> jax.Array:
    """Processed log-probabilities ``[..., V]`` (``-inf`` outside the kept set).

    Contract: deterministic element-wise/tree arithmetic described in the module
    docstring; the one code path :func:`sample` and :func:`processed_logprob` use.
    """
    return _processed_table(_check_logits(logits), program)


def _gather(table, token):
    return _gather_jit(table, jnp.asarray(token))


@jax.jit
def _gather_jit(table, token):
    if not jnp.issubdtype(token.dtype, jnp.integer) or token.shape != table.shape[:-1]:
        raise ValueError(f"token must be integer with shape {table.shape[:-1]}, got {token.dtype}{token.shape}")
    token = token.astype(jnp.int32)
    in_range = (token >= 0) & (token < table.shape[-1])
    got = jnp.take_along_axis(table, jnp.clip(token, 0, table.shape[-1] - 1)[..., None], -1)
    return jnp.where(in_range, got[..., 0], jnp.nan)


def processed_logprob(logits, program: SamplingProgram, token) -> jax.Array:
    """Replay the sampler's processed logprob of ``token`` (shape ``logits.shape[:-1]``).

    Contract: bitwise equal to ``sample(logits, program, key).processed_logprob`` when
    ``token`` is the sampled token and ``logits``/``program`` are the same; ``-inf`` for
    tokens outside the kept set, ``NaN`` for out-of-range ids.
    """
    return _gather(processed_logprobs(logits, program), token)


@jax.jit
def _pick(table, key):
    """Gumbel-max over the kept set; argmax ties go to the lower token id."""
    noisy = jnp.where(table > -jnp.inf, table + _gumbel(key, table.shape), -jnp.inf)
    return jnp.argmax(noisy, axis=-1).astype(jnp.int32)


def _gumbel(key, shape):
    """Gumbel noise of ``shape`` (token order). ``key``: one key, or one key per row."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        bits = jax.random.bits(key, shape, jnp.uint32)
    elif key.shape == shape[:-1]:
        rows = jax.vmap(lambda k: jax.random.bits(k, shape[-1:], jnp.uint32))(key.reshape(-1))
        bits = rows.reshape(shape)
    else:
        raise ValueError(f"key must be a single key or have batch shape {shape[:-1]}, got key shape {key.shape}")
    u = ((bits >> 9).astype(jnp.float32) + np.float32(0.5)) * np.float32(2.0**-23)
    return -jnp.log(-jnp.log(u))


def gather_logp(logp_table_or_callable: Union[jax.Array, Callable[[jax.Array], Any]], token):
    """Contract logp of ``token`` from the op.

    ``logp_table_or_callable`` is either a callable ``token -> logp`` (typically
    ``lambda t: linear_logp(hidden, lm_head, t)``) whose result is returned unchanged, or
    an array ``[..., V]`` of logps gathered at ``token`` (``NaN`` for out-of-range ids).
    """
    if callable(logp_table_or_callable):
        return logp_table_or_callable(token)
    return _gather(jnp.asarray(logp_table_or_callable), token)


def sample(logits, program: SamplingProgram, key, *, logp_from_op=None) -> SampleResult:
    """Sample one token per row by Gumbel-max over the processed distribution.

    ``key`` is a single PRNG key (noise drawn with shape ``logits.shape``) or an array of
    keys with shape ``logits.shape[:-1]`` (one key per row: a row's token then does not
    depend on the rest of the batch). Raw ``uint32`` key data is accepted.

    Contract: pure in ``(logits, program, key)``; ``processed_logprob`` of the result is
    bitwise what :func:`processed_logprob` replays; ``logp`` is
    ``gather_logp(logp_from_op, token)`` or ``None`` when ``logp_from_op`` is ``None``.
    """
    table = processed_logprobs(logits, program)
    token = _pick(table, jnp.asarray(key))
    logp = None if logp_from_op is None else gather_logp(logp_from_op, token)
    return SampleResult(token, _gather(table, token), logp)
