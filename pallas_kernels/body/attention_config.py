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
SMEM_LIMIT = 224 * 1024  # an H200 block's 227 KiB less a margin for barriers


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """One launch geometry (bit-neutral; module docstring).

    stages: K/V ring slots (each one K and one V block of [64, Dh] bf16), at least 2; fewer
    where shared memory is short (`stages_for`). heavy_first: CTAs take the row tiles of a
    (sequence, KV head) from the last (the most KV blocks, causal) to the first, so the long
    tiles start in the first wave. consumer_regs / producer_regs: `setmaxnreg` of the two
    warpgroups; the defaults are the split JAX's warp-specialized pipeline gives one compute
    warpgroup and a 40-register producer (what the body GEMM's decode bucket runs on the H200)."""

    name: str
    stages: int
    heavy_first: bool = True
    consumer_regs: int = 256
    producer_regs: int = 40

    def __post_init__(self):
        if self.stages < 2:
            raise ValueError(f"{self}: stages >= 2")
        if not (24 <= self.producer_regs <= self.consumer_regs <= 256):
            raise ValueError(f"{self}: 24 <= producer_regs <= consumer_regs <= 256")
        if self.consumer_regs % 8 or self.producer_regs % 8:
            raise ValueError(f"{self}: register counts must be multiples of 8 (setmaxnreg)")


# Decode (one row tile per (sequence, KV head), the cache streamed once: memory bound): a deep
# ring, four K/V blocks in flight per CTA. Prefill (causal: every block read by many tiles, from
# L2; the consumer's chain bound): three. Estimates, not measurements: bit-neutral, to be tuned
# on the H200.
DECODE = AttentionConfig("decode", stages=4)
PREFILL = AttentionConfig("prefill", stages=3)
CONFIGS = {c.name: c for c in (DECODE, PREFILL)}


def select(row_tiles: int, config: "str | AttentionConfig | None" = None) -> AttentionConfig:
    """The config for a call with `row_tiles` row tiles per (sequence, KV head): a forced one
    (name or config), else DECODE for a single tile, else PREFILL. Bit-neutral."""
    if isinstance(config, AttentionConfig):
        return config
    if config is not None:
        if config not in CONFIGS:
            raise ValueError(f"unknown body attention config {config!r}; known: {sorted(CONFIGS)}")
        return CONFIGS[config]
    return DECODE if row_tiles <= 1 else PREFILL


def smem_bytes(dh: int, stages: int, out_bytes: int) -> int:
    """Shared memory of one CTA: the q tile, the K/V ring and the output staging tile."""
    return ROWS * dh * 2 + stages * 2 * KV_BLOCK * dh * 2 + ROWS * dh * out_bytes


def stages_for(cfg: AttentionConfig, dh: int, out_bytes: int) -> int:
    """cfg.stages, lowered until the CTA's shared memory fits (at least 2)."""
    stages = cfg.stages
    while stages > 2 and smem_bytes(dh, stages, out_bytes) > SMEM_LIMIT:
        stages -= 1
    return stages
