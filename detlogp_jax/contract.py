"""The numeric contract of `linear_logp`: every bit-relevant choice, as code.

Everything in this module is *frozen* for a contract version. A backend that
bears the contract produces logp/lse bytes that are a pure function of
(its FP32 logits, targets, temperature, vocab_size, padded_vocab_size); the
post-GEMM arithmetic is specified exactly here and in `docs/CONTRACT.md`, and
`detlogp_jax.oracle` executes it in numpy.

Changing any constant, the split policy, the trees or the exp/log programs
means a new `CONTRACT_VERSION`, an update of `docs/CONTRACT.md` and new golden
fingerprints. Only bit-neutral knobs (row block sizes, warps, pipeline depth,
CTA counts) may be tuned; they live with each backend, never here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Mapping

CONTRACT_NAME = "linear-logp-contract"
CONTRACT_VERSION = 1
CONTRACT_ID = f"{CONTRACT_NAME}-v{CONTRACT_VERSION}"

# The per-row entropy (`return_entropy=True`) is a second statistic streamed through
# the same tiles, chain and fold as S. It has its own version: it extends
# CONTRACT_ID without changing a byte of logp/lse, and a change to its program
# (docs/CONTRACT.md section 9) moves ENTROPY_VERSION only.
ENTROPY_NAME = "linear-logp-entropy"
ENTROPY_VERSION = 1
ENTROPY_ID = f"{ENTROPY_NAME}-v{ENTROPY_VERSION}"

# --- Vocabulary tiling and splits -------------------------------------------------
TILE_V = 64  # vocab columns per tile: the unit of the in-tile tree and the chain.
TP_MAX = 8  # largest tensor-parallel degree whose shard edges must be split edges.
TARGET_SPLITS = 264  # = 2 x 132 SMs: enough independent splits for one decode row.

# --- Targets ----------------------------------------------------------------------
IGNORE_INDEX = -100  # rows with this target get logp = +0.0 (and zero gradient).


def bad_target(targets, vocab_size):
    """The contract's bad-target predicate: a target that is neither IGNORE_INDEX nor in
    [0, vocab_size) (its row's logp is NaN). Exact integer logic on numpy or jax arrays."""
    return ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= vocab_size)


# --- Pinned exp (software, separately rounded f32 ops, FTZ) -----------------------
EXP_LOG2E = 1.44269502162933349609375  # f32(log2 e) = 0x3FB8AA3B
EXP_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (t + M) - M rounds t half-to-even
EXP_ROUND_MAGIC_BITS = 0x4B400000  # bits of EXP_ROUND_MAGIC
EXP_LN2_HI = 0.693145751953125  # 0x3F317200: 16 significant bits, k*HI exact
EXP_LN2_LO = 1.428606765330187045e-06  # f32(ln2 - LN2_HI) = 0x35BFBE8E
EXP_CLAMP_LO = -104.0  # arguments below are clamped here before reduction
EXP_K_MIN = -125  # results with k < EXP_K_MIN are flushed to +0.0
# Horner coefficients c7..c0 of p(r) ~ exp(r) on [-ln2/2, ln2/2] (f32 values).
EXP_POLY = (
    1.979034423129633e-04,
    1.3944648671895266e-03,
    8.333496749401093e-03,
    4.166629537940025e-02,
    1.666666567325592e-01,
    0.5,
    1.0,
    1.0,
)

# --- Pinned log (software, for S >= 1 in practice; defined for all f32) ------------
LOG_SQRT2 = 1.41421353816986083984375  # f32(sqrt 2): mantissa fold threshold
LOG_LN2_HI = EXP_LN2_HI
LOG_LN2_LO = EXP_LN2_LO
# Horner coefficients q_n..q_0 with log1p(r) ~ r * q(r) on [sqrt(2)/2 - 1, sqrt(2) - 1].
LOG_POLY = (
    -5.994085967540741e-02,
    1.0726970434188843e-01,
    -1.0870510339736938e-01,
    1.1021100729703903e-01,
    -1.2412643432617188e-01,
    1.4285697042942047e-01,
    -1.6670328378677368e-01,
    2.0000097155570984e-01,
    -2.4999937415122986e-01,
    3.333333134651184e-01,
    -0.5,
    1.0,
)

# --- FTZ ----------------------------------------------------------------------------
F32_MIN_NORMAL = 1.1754943508222875e-38  # 2**-126


class ContractError(ValueError):
    """A request would change a bit-relevant choice of the frozen contract."""


# Names a caller might try to override; all are frozen.
FROZEN_CONSTANTS: tuple[str, ...] = (
    "TILE_V",
    "TP_MAX",
    "TARGET_SPLITS",
    "IGNORE_INDEX",
    "EXP_LOG2E",
    "EXP_ROUND_MAGIC",
    "EXP_LN2_HI",
    "EXP_LN2_LO",
    "EXP_CLAMP_LO",
    "EXP_K_MIN",
    "EXP_POLY",
    "LOG_SQRT2",
    "LOG_POLY",
    "K_WALK",
    "SPLIT_POLICY",
    "TILE_TREE",
    "FOLD_ORDER",
    "FTZ",
)

# Bit-neutral tuning knobs a backend may accept (rows per block, warps, stages...).
# Each backend applies the ones it has (`Backend.knobs`) and ignores the others.
BIT_NEUTRAL_KNOBS: frozenset[str] = frozenset(
    {
        "row_block",  # reference: rows per lax.map block
        "bucket",  # pallas_sm90: force a launch bucket ("decode", "small", "mid", "prefill")
        "num_ctas",  # pallas_sm90: persistent CTA count
    }
)

_ENV_PREFIX = "DETLOGP_"
_ENV_ALLOWED = frozenset({"DETLOGP_STRICT", "DETLOGP_BACKEND", "DETLOGP_CHECKED"})


def check_no_overrides(overrides: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None) -> None:
    """Raises `ContractError` if any bit-relevant constant is being overridden.

    `overrides` are tuning options passed by a caller (e.g. a backend config);
    only `BIT_NEUTRAL_KNOBS` are accepted. Environment variables starting with
    `DETLOGP_` other than the documented switches are refused too, so that no
    deployment can silently move a contract constant.
    """
    for key in overrides or {}:
        if key.upper() in FROZEN_CONSTANTS or key.lower() in {c.lower() for c in FROZEN_CONSTANTS}:
            raise ContractError(
                f"{key!r} is a bit-relevant constant of {CONTRACT_ID} and cannot be overridden; "
                "a different value requires a new contract version"
            )
        if key not in BIT_NEUTRAL_KNOBS:
            raise ContractError(
                f"unknown tuning option {key!r}; only bit-neutral knobs {sorted(BIT_NEUTRAL_KNOBS)} may be set"
            )
    env = os.environ if environ is None else environ
    for key in env:
        if key.startswith(_ENV_PREFIX) and key not in _ENV_ALLOWED:
            raise ContractError(
                f"environment variable {key} tries to configure {CONTRACT_ID}; only "
                f"{sorted(_ENV_ALLOWED)} are recognised and contract constants cannot be overridden"
            )


# --- Vocabulary geometry ------------------------------------------------------------


def n_tiles(padded_vocab_size: int) -> int:
    """Number of 64-column tiles covering the canonical padded vocabulary."""
    return -(-int(padded_vocab_size) // TILE_V)


def canonical_padded_vocab(vocab_size: int, tp_max: int = TP_MAX) -> int:
    """The canonical padded vocab: `vocab_size` rounded up to a multiple of 64 * tp_max.

    Every tensor-parallel degree that divides `tp_max` then shards the padded
    vocabulary on split boundaries (see `split_bounds`). Qwen3: 151936 ->
    152064; Llama-3: 128256 -> 128512.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if tp_max < 1 or tp_max & (tp_max - 1):
        raise ValueError(f"tp_max must be a power of two, got {tp_max}")
    unit = TILE_V * tp_max
    return -(-int(vocab_size) // unit) * unit


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """The split structure of a padded vocabulary. A function of V_pad only.

    `starts[j]`/`ends[j]` are tile indices (half-open) of split j. Splits are
    contiguous, ascending, cover all tiles, and every shard edge of a
    tensor-parallel degree in {1, 2, 4, ..., groups} is a split edge.
    """

    padded_vocab_size: int
    n_tiles: int
    groups: int
    parts_per_group: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    @property
    def n_split(self) -> int:
        return len(self.starts)

    @property
    def max_tiles_per_split(self) -> int:
        return max(e - s for s, e in zip(self.starts, self.ends))

    def aligned_tp_degrees(self) -> tuple[int, ...]:
        """TP degrees whose vocab shards fall on split (and tile) boundaries."""
        return tuple(t for t in (1, 2, 4, 8, 16, 32) if self.groups % t == 0)


@functools.lru_cache(maxsize=64)
def split_bounds(padded_vocab_size: int) -> SplitPlan:
    """The contract's vocab-split policy (depends on the padded vocab size only).

    T = ceil(V_pad / 64) tiles. g = the largest of (8, 4, 2, 1) dividing T: the
    tiles form g equal groups of G = T / g tiles (the TP-8 shards when g = 8).
    Each group is cut into q = min(G, ceil(264 / g)) contiguous parts; part p of
    group a spans tiles [a*G + floor(p*G/q), a*G + floor((p+1)*G/q)). The split
    count is g*q (264 for every production vocab), splits differ in size by at
    most one tile, and group (shard) edges are split edges.
    """
    v = int(padded_vocab_size)  # (cached: a pure function of one int, frozen result)
    if v < 1:
        raise ValueError(f"padded_vocab_size must be >= 1, got {v}")
    t = n_tiles(v)
    g = next(d for d in (TP_MAX, 4, 2, 1) if t % d == 0)
    size = t // g
    q = min(size, -(-TARGET_SPLITS // g))
    starts, ends = [], []
    for a in range(g):
        for p in range(q):
            starts.append(a * size + (p * size) // q)
            ends.append(a * size + ((p + 1) * size) // q)
    return SplitPlan(v, t, g, q, tuple(starts), tuple(ends))


def local_splits(padded_vocab_size: int, col_offset: int, shard_cols: int) -> range:
    """The splits of `split_bounds(padded_vocab_size)` that tile the shard
    [col_offset, col_offset + shard_cols) exactly (a vocab-parallel shard, or the
    whole padded vocabulary).

    Shard edges must be split edges, so that a shard's partials are exactly the
    single-device partials of those splits; ContractError otherwise.
    """
    plan = split_bounds(padded_vocab_size)
    lo, hi = int(col_offset), int(col_offset) + int(shard_cols)
    if lo % TILE_V or (hi % TILE_V and hi != int(padded_vocab_size)):
        raise ContractError(f"shard columns [{lo}, {hi}) are not split edges: not on {TILE_V}-column tile boundaries")
    t_lo, t_hi = lo // TILE_V, n_tiles(hi)
    if t_hi == t_lo:
        return range(0)
    idx = [j for j in range(plan.n_split) if plan.starts[j] >= t_lo and plan.ends[j] <= t_hi]
    if not idx or plan.starts[idx[0]] != t_lo or plan.ends[idx[-1]] != t_hi:
        raise ContractError(
            f"shard columns [{lo}, {hi}) do not fall on split edges of {describe_splits(padded_vocab_size)} "
            f"(aligned TP degrees: {plan.aligned_tp_degrees()})"
        )
    return range(idx[0], idx[-1] + 1)


def n_split(padded_vocab_size: int) -> int:
    return split_bounds(padded_vocab_size).n_split


# --- Provenance ---------------------------------------------------------------------


def contract_constants() -> dict[str, Any]:
    """All frozen constants with their values (for provenance records and docs)."""
    return {
        "TILE_V": TILE_V,
        "TP_MAX": TP_MAX,
        "TARGET_SPLITS": TARGET_SPLITS,
        "IGNORE_INDEX": IGNORE_INDEX,
        "K_WALK": "ascending K, one FP32 accumulator per output, no split-K, no atomics",
        "SPLIT_POLICY": "g=max{8,4,2,1 | T}; q=min(T/g, ceil(264/g)); floor-partition of each group",
        "TILE_TREE": "adjacent-pairwise balanced binary tree over the 64 lanes of a tile",
        "CHAIN": "ascending tiles within a split; running max, rescale by exp(m_old - m_new)",
        "FOLD_ORDER": "global max over splits first, then ascending sequential sum of S_j*exp(m_j - M)",
        "EXP": {
            "log2e": EXP_LOG2E,
            "round_magic": EXP_ROUND_MAGIC,
            "ln2_hi": EXP_LN2_HI,
            "ln2_lo": EXP_LN2_LO,
            "clamp_lo": EXP_CLAMP_LO,
            "k_min": EXP_K_MIN,
            "poly": EXP_POLY,
        },
        "LOG": {"sqrt2": LOG_SQRT2, "ln2_hi": LOG_LN2_HI, "ln2_lo": LOG_LN2_LO, "poly": LOG_POLY},
        "FTZ": "post-GEMM f32 ops flush subnormal inputs and results to sign-preserving zero",
        "BIAS": "z = fl(acc + b) in FP32 before masking and max",
        "TEMPERATURE": "inv_t = fl(1/T); y = fl(z * inv_t) on every lane and on z_t; logits returned unscaled",
        "PADDING": "lanes with col >= vocab_size: y = -inf for the max, e = +0 for the sum",
        "CLAMP": "logp = d if not d > 0 else +0.0, d = fl(y_t - lse); NaN propagates",
        "ENTROPY": {
            "id": ENTROPY_ID,
            "tile": "d = fl(y - m'); e = pexp(d); u = (e == 0) ? +0 : fl(e * d); A = fl(resc(A) + tree64(u))",
            "rescale": "resc(A) = A if m == m' else (+0 if w == 0 else fl(w * fl(A + fl(fl(m - m') * S))))",
            "fold": "ascending j: A = fl(A + resc(A_j)) with m' = M, w = w_j",
            "output": "h = fl(plog(S) - fl(A * rcp(S))), rcp = correctly rounded 1/S; H = +0 if h < 0 else h",
        },
    }


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Which backend served a call and under which contract."""

    contract_id: str
    backend: str
    contract_bearing: bool
    platform: str
    device_kind: str
    compute_capability: str | None
    jax_version: str
    jaxlib_version: str
    vocab_size: int
    padded_vocab_size: int
    n_split: int
    requested_backend: str
    fallback: bool
    weight_layout: str = "vd"
    entropy_id: str | None = None  # ENTROPY_ID when the call returned the entropy (None: not asked)
    constants: Mapping[str, Any] = dataclasses.field(default_factory=contract_constants)

    def as_dict(self) -> dict[str, Any]:
        """The whole record, the contract constants included (`repr` keeps to the key fields)."""
        return dataclasses.asdict(self)

    def __repr__(self) -> str:
        """The key fields, one per line (the whole record: `as_dict()`)."""
        gpu = f" (compute capability {self.compute_capability})" if self.compute_capability else ""
        lines = [
            f"contract:  {self.contract_id}" + (f" + {self.entropy_id}" if self.entropy_id else ""),
            f"backend:   {self.backend}"
            + (f" (requested {self.requested_backend!r}" + (", fallback)" if self.fallback else ")")),
            f"device:    {self.device_kind} [{self.platform}]{gpu}",
            f"vocab:     {self.vocab_size} real of {self.padded_vocab_size} padded, {self.n_split} splits, "
            f"weight layout {self.weight_layout!r}",
            f"jax:       {self.jax_version} / jaxlib {self.jaxlib_version}",
            f"constants: {len(self.constants)} contract constants (as_dict()['constants'])",
        ]
        return "Provenance(\n  " + "\n  ".join(lines) + "\n)"

    __str__ = __repr__

    def __hash__(self):  # a static pytree node (it rides on LogpOutput through jit): hashable
        return hash(repr(sorted(self.as_dict().items())))


def describe_splits(padded_vocab_size: int) -> str:
    plan = split_bounds(padded_vocab_size)
    sizes = sorted({e - s for s, e in zip(plan.starts, plan.ends)})
    return (
        f"V_pad={plan.padded_vocab_size}: tiles={plan.n_tiles} groups={plan.groups} "
        f"n_split={plan.n_split} tiles/split={sizes} aligned TP={plan.aligned_tp_degrees()}"
    )


def _self_check() -> None:
    # Polynomials and constants are f32 values; keep them honest.
    import numpy as np

    for c in EXP_POLY + LOG_POLY + (EXP_LOG2E, EXP_LN2_HI, EXP_LN2_LO, LOG_SQRT2):
        assert math.isfinite(c)
    assert float(np.float32(EXP_LN2_HI)) == EXP_LN2_HI
    assert int(np.float32(EXP_ROUND_MAGIC).view(np.uint32)) == EXP_ROUND_MAGIC_BITS
