"""Launch geometry of the body attention kernel (`attention_kernel`): frozen configs, all bit-neutral.

What is fixed for every path, and why. A CTA's consumer warpgroup owns one tile of `ROWS` = 64
query rows (one wgmma M) and walks the KV blocks of `KV_BLOCK` = 64 positions (the contract's
block, `detlogp_jax.body.kv_attention.KV_BLOCK`). Every row-wise step runs on a [64, 64] score
tile or a [64, Dh] accumulator of the WGMMA layout whatever the call (prefill, a chunk of one,
decode): Mosaic GPU's built-in row reductions change their association with the tile's rows
(the project's Mosaic GPU facts), so the tile shape is not a tuning knob. The sums the contract
pins (tree64 of e) are explicit trees; the row max is exact.

What `AttentionConfig` may change (none of it reaches a row's arithmetic): the depth of the K/V
ring, the order in which CTAs take row tiles, and the register split between the consumer and
the producer warpgroup.
"""

from __future__ import annotations

import dataclasses

from detlogp_jax.body.kv_attention import KV_BLOCK

ROWS = 64  # query rows of one tile (one consumer warpgroup, one wgmma M): fixed
assert KV_BLOCK == 64, KV_BLOCK  # the kernel's score tile is [ROWS, KV_BLOCK] = [64, 64]
CHUNK = 64  # head-dim columns per shared-memory chunk: one 128-byte swizzle row of bf16
HEAD_DIMS = (64, 128)  # Dh the kernel takes (a multiple of a 128-byte swizzle row; [64, Dh] f32 fits the registers)
SWIZZLE = 128
SMEM_LIMIT = 220 * 1024  # an H200 block's 227 KiB less a margin for barriers, reduction scratch and alignment


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One launch geometry (bit-neutral; module docstring).

    stages: K/V ring slots per consumer warpgroup (each one K and one V block of [64, Dh] bf16),
    at least 2; fewer where shared memory is short (`stages_for`). heavy_first: CTAs take the
    row tiles of a (sequence, KV head) from the last (the most KV blocks, causal) to the first,
    so the long tiles start in the first wave. wgs: consumer warpgroups per CTA, each with its
    own row tile, ring and chain (one producer warpgroup feeds them all), so one warpgroup's
    chain runs while the other waits on its wgmma or its loads; pair: what they split, "tile"
    (consecutive row tiles of one (sequence, KV head): prefill) or "head" (one row tile of
    consecutive KV heads: decode). consumer_regs / producer_regs: `setmaxnreg` of the
    warpgroups; the defaults are the split JAX's warp-specialized pipeline gives one compute
    warpgroup and a 40-register producer (what the body GEMM's decode bucket runs on the H200;
    with two compute warpgroups it gives them 232 each)."""

    name: str
    stages: int
    heavy_first: bool = True
    wgs: int = 1
    pair: str = "tile"
    consumer_regs: int = 256
    producer_regs: int = 40

    def __post_init__(self):
        if self.stages < 2:
            raise ValueError(f"{self}: stages >= 2")
        if self.wgs not in (1, 2) or self.pair not in ("tile", "head"):
            raise ValueError(f"{self}: wgs in (1, 2), pair in ('tile', 'head')")
        if not (24 <= self.producer_regs <= self.consumer_regs <= 256):
            raise ValueError(f"{self}: 24 <= producer_regs <= consumer_regs <= 256")
        if self.consumer_regs % 8 or self.producer_regs % 8:
            raise ValueError(f"{self}: register counts must be multiples of 8 (setmaxnreg)")
        if self.wgs * self.consumer_regs + self.producer_regs > 512:
            raise ValueError(f"{self}: the warpgroups' registers exceed the register file (512 per thread slot)")


# Decode (one row tile per (sequence, KV head), the cache streamed once: memory bound): two
# consumer warpgroups on consecutive KV heads, two K/V blocks in flight each. Prefill (causal:
# every block read by many tiles, from L2; the consumers' chain bound): two consumer warpgroups
# on consecutive row tiles. The one-warpgroup configs (deeper rings) serve where two do not fit
# shared memory (a 128-wide head with an f32 output) and as a fallback. Estimates, not
# measurements: bit-neutral, to be tuned on the H200.
DECODE = AttentionConfig("decode", stages=2, wgs=2, pair="head", consumer_regs=232)
PREFILL = AttentionConfig("prefill", stages=2, wgs=2, pair="tile", consumer_regs=232)
DECODE_1WG = AttentionConfig("decode_1wg", stages=4)
PREFILL_1WG = AttentionConfig("prefill_1wg", stages=3)
CONFIGS = {c.name: c for c in (DECODE, PREFILL, DECODE_1WG, PREFILL_1WG)}


def smem_bytes(dh: int, stages: int, out_bytes: int, wgs: int = 1) -> int:
    """Shared memory of one CTA: per consumer warpgroup its q tile, K/V ring and output tile."""
    return wgs * (ROWS * dh * 2 + stages * 2 * KV_BLOCK * dh * 2 + ROWS * dh * out_bytes)


def fits(cfg: AttentionConfig, dh: int, out_bytes: int) -> bool:
    """Whether cfg's CTA fits shared memory with at least 2 ring slots."""
    return smem_bytes(dh, 2, out_bytes, cfg.wgs) <= SMEM_LIMIT


def select(row_tiles: int, dh: int, out_bytes: int, config: "str | AttentionConfig | None" = None) -> AttentionConfig:
    """The config for a call with `row_tiles` row tiles per (sequence, KV head): a forced one
    (name or config), else DECODE for a single tile, else PREFILL; a two-warpgroup config that
    does not fit shared memory gives way to its one-warpgroup twin. Bit-neutral."""
    if isinstance(config, AttentionConfig):
        cfg = config
    elif config is not None:
        if config not in CONFIGS:
            raise ValueError(f"unknown body attention config {config!r}; known: {sorted(CONFIGS)}")
        cfg = CONFIGS[config]
    else:
        cfg = DECODE if row_tiles <= 1 else PREFILL
    if not fits(cfg, dh, out_bytes):
        if cfg.wgs == 1:
            raise ValueError(f"body attention config {cfg.name}: does not fit shared memory at Dh={dh}")
        cfg = DECODE_1WG if cfg.pair == "head" else PREFILL_1WG
    return cfg


def stages_for(cfg: AttentionConfig, dh: int, out_bytes: int) -> int:
    """cfg.stages, lowered until the CTA's shared memory fits (at least 2)."""
    stages = cfg.stages
    while stages > 2 and smem_bytes(dh, stages, out_bytes, cfg.wgs) > SMEM_LIMIT:
        stages -= 1
    return stages
