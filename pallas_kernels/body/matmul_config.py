"""Launch geometry of the body GEMM (`matmul_kernel`): one frozen `TuningConfig` per M bucket.

What is bit-relevant and what is not. Every output element is ONE f32 accumulator that
`plgpu.wgmma` advances by m64nNk16 instructions, k ascending over the whole K (64-wide
pipeline steps of four k16 instructions each). Per the project's Mosaic GPU facts, that
per-element instruction sequence does not depend on the accumulator's rows (64 or 128 per
warpgroup), the number of warpgroups, the grid or the SM count, so every field of
`TuningConfig` may change with M. The instruction's N (`instruction_n`) is kept a function of
the weight's N alone: whether the tensor cores' bytes depend on it has not been measured
(tests/gpu/test_body_gpu.py::test_instruction_n_is_bit_neutral measures it), so no M bucket
may change it. Accumulators per warpgroup (`accs`) side by side along N each run the same
instruction sequence on their own columns.
"""

from __future__ import annotations

import dataclasses

TILE_K = 64  # K per pipeline step: 64 bf16 = one 128-byte swizzle row
SWIZZLE = 128
EPI = 64  # epilogue box: [EPI, EPI] of the output per TMA store
SMEM_LIMIT = 224 * 1024  # an H200 block's 227 KiB less a margin for barriers
K_MULTIPLE = TILE_K  # K must divide into pipeline steps (x and an [N, K] weight tile K in swizzle rows)
N_MULTIPLE = 64  # N must divide into instruction columns (a [K, N] weight and the output tile N)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """One M bucket's launch geometry (all bit-neutral; see the module docstring).

    A CTA computes a [wgs * wg_rows, accs * N_instr] output tile: `wgs` consumer warpgroups
    split its rows, each holding accs = wg_cols / N_instr (at least 1) f32 accumulators
    [wg_rows, N_instr] side by side along N; a producer warpgroup feeds them through a `stages`-deep TMA ring. Persistent CTAs walk the
    tiles with the column tile fastest inside groups of `col_group` column tiles (0: row tiles
    fastest)."""

    name: str
    wg_rows: int  # rows of one warpgroup's accumulators: 64 or 128
    wgs: int  # consumer warpgroups: 1 or 2
    wg_cols: int  # a warpgroup's columns, as accumulators of the instruction N side by side (64, 128, 256)
    stages: int  # pipeline depth (at most; fewer where shared memory is short)
    col_group: int = 8

    def __post_init__(self):
        if self.wg_rows not in (64, 128):
            raise ValueError(f"{self}: wg_rows must be 64 or 128")
        if self.wgs not in (1, 2):
            raise ValueError(f"{self}: wgs must be 1 or 2")
        if self.wg_cols not in (64, 128, 256) or self.wg_rows * self.wg_cols > 128 * 128:
            raise ValueError(f"{self}: wg_cols in (64, 128, 256), at most 128 * 128 accumulator entries")
        if self.stages < 2 or self.col_group < 0:
            raise ValueError(f"{self}: stages >= 2, col_group >= 0")

    @property
    def cta_rows(self) -> int:
        return self.wg_rows * self.wgs


# M <= 64 (decode): one 64-row warpgroup per CTA and one column tile each, so that as many
# CTAs as the weight has column tiles stream it. Larger M: whichever of the tiles finishes its
# waves soonest by `select`'s estimate (256 x 128 tiles of 2 warpgroups of [128, 128], as
# cuBLAS-class GEMMs use, where they fill the SMs; 128 x 128 ("mid_wide") where 256-row tiles
# would leave most SMs idle and 128 x 64 tiles would need a second wave, e.g. down_proj at
# M = 512: 128 tiles of 128 x 128 are one wave of 132 SMs, 256 of 128 x 64 are two).
DECODE = TuningConfig("decode", wg_rows=64, wgs=1, wg_cols=64, stages=12)
MID = TuningConfig("mid", wg_rows=64, wgs=2, wg_cols=64, stages=8)
MID_WIDE = TuningConfig("mid_wide", wg_rows=64, wgs=2, wg_cols=128, stages=6)
PREFILL = TuningConfig("prefill", wg_rows=128, wgs=2, wg_cols=128, stages=4)
BUCKETS = {c.name: c for c in (DECODE, MID, MID_WIDE, PREFILL)}
DECODE_ROWS = 64
# select's cost per output entry of a tile, relative to PREFILL's (a single consumer warpgroup
# waits for each step's wgmma; smaller tiles read each operand more often). Estimates:
# bit-neutral, tuned against the measured ratios in docs/PERFORMANCE.md.
TILE_COST = {"decode": 1.5, "mid": 1.15, "mid_wide": 1.1, "prefill": 1.0}


def instruction_n(n: int) -> int:
    """wgmma's N for a weight of N output columns (a function of N only; see the module
    docstring): 128 where the weight has at least 64 such column tiles (decode still spreads
    over 64+ CTAs), else 64 (q / o / k / v / down of Qwen3-8B: 16-64 CTAs at decode)."""
    return 128 if n % 128 == 0 and n // 128 >= 64 else 64


def accs_for(cfg: TuningConfig, n: int, n_instr: int) -> int:
    """Accumulators per warpgroup: wg_cols / n_instr (at least 1), lowered until the CTA's
    columns divide N (bit-neutral)."""
    accs = max(1, cfg.wg_cols // n_instr)
    while accs > 1 and (n // n_instr) % accs:
        accs //= 2
    return accs


def tiles(cfg: TuningConfig, m: int, n: int, n_instr: int | None = None) -> int:
    """Output tiles of an [m, n] output under cfg (instruction N: `instruction_n(n)` by default)."""
    n_instr = instruction_n(n) if n_instr is None else n_instr
    return -(-m // cfg.cta_rows) * (n // (n_instr * accs_for(cfg, n, n_instr)))


def select(m: int, n: int, num_sms: int, bucket: "str | TuningConfig | None" = None) -> TuningConfig:
    """The config for an [m, n] output: a forced `bucket` (name or config), else DECODE for
    m <= 64, else the config whose waves of `num_sms` tiles cost least (waves x tile entries x
    TILE_COST; ties go to the larger tile). Bit-neutral (module docstring)."""
    if isinstance(bucket, TuningConfig):
        return bucket
    if bucket is not None:
        if bucket not in BUCKETS:
            raise ValueError(f"unknown body GEMM bucket {bucket!r}; known: {sorted(BUCKETS)}")
        return BUCKETS[bucket]
    if m <= DECODE_ROWS:
        return DECODE
    n_instr = instruction_n(n)

    def cost(cfg):
        waves = -(-tiles(cfg, m, n) // num_sms)
        return waves * cfg.cta_rows * accs_for(cfg, n, n_instr) * n_instr * TILE_COST[cfg.name]

    return min((PREFILL, MID_WIDE, MID, DECODE), key=cost)


def stages_for(cfg: TuningConfig, n_instr: int, accs: int, out_bytes: int, slots: int) -> int:
    """Pipeline depth that fits shared memory next to the epilogue's staging boxes (>= 2)."""
    stage = (cfg.cta_rows + accs * n_instr) * TILE_K * 2
    staging = cfg.wgs * slots * EPI * EPI * out_bytes
    return max(2, min(cfg.stages, (SMEM_LIMIT - staging) // stage))
