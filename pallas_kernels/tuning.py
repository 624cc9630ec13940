"""Launch geometry of the sm90 kernels: the bit-neutral knobs only.

Nothing here may change a result bit. The contract fixes the vocab split plan
(`contract.split_bounds`), the 64-column tile chain, the in-tile tree, the
K walk (ascending, one FP32 accumulator) and the fold order. What varies here
is how the fixed work is laid onto the GPU:

* `block_m`: rows per consumer warpgroup (64 or 128; wgmma M is a multiple
  of 64 and the K walk per output element does not depend on it),
* `num_compute_wgs`: consumer warpgroups per CTA (each owns its own rows),
* `max_concurrent_steps`: TMA pipeline depth,
* `num_ctas`: persistent CTA count (work items are (row block, split) pairs,
  handed out round-robin; each work item is computed by exactly one CTA),

selected by an M bucket (`decode`, `small`, `prefill`). `tiles_per_group`
(the wgmma N width in 64-column tiles) is derived from the split geometry
ONLY (never from M or the bucket), so every bucket issues the same wgmma
instruction shape for a given vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

from detlogp_jax import contract as C

# wgmma N is at most 256 columns = 4 tiles.
MAX_TILES_PER_GROUP = 4


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """Bit-neutral launch geometry of the forward kernel."""

  name: str
  block_m: int  # rows per consumer warpgroup
  num_compute_wgs: int  # consumer warpgroups per CTA
  max_concurrent_steps: int  # pipeline depth (stages of (H, W) K-slices)
  ctas_per_sm: int = 1  # persistent CTAs per SM (num_ctas = min(work, sms * this))

  @property
  def cta_rows(self) -> int:
    return self.block_m * self.num_compute_wgs


# M-bucketed launch table. Every entry must give identical bytes (tested).
BUCKETS: dict[str, LaunchConfig] = {
    # One row block of 64; the 264 splits spread over all SMs (2 per CTA),
    # deep TMA pipeline to keep ~4 TB/s of weight streaming in flight.
    "decode": LaunchConfig("decode", block_m=64, num_compute_wgs=1, max_concurrent_steps=6, ctas_per_sm=1),
    # Two consumer warpgroups, 64 rows each.
    "small": LaunchConfig("small", block_m=64, num_compute_wgs=2, max_concurrent_steps=4, ctas_per_sm=1),
    # Large M: 2 x 64 rows per CTA, deeper pipeline.
    "prefill": LaunchConfig("prefill", block_m=64, num_compute_wgs=2, max_concurrent_steps=5, ctas_per_sm=1),
}

# Shared memory the TMA pipeline may use per CTA (H200: 227 KiB per block;
# the rest is left for the logits staging tiles and barriers).
PIPELINE_SMEM_BUDGET = 192 * 1024


def pipeline_stages(cfg: LaunchConfig, tiles_per_group: int, tile_k: int = 64) -> int:
  """Pipeline depth that fits the SMEM budget (bit-neutral)."""
  stage_bytes = (cfg.cta_rows + 64 * tiles_per_group) * tile_k * 2
  return max(2, min(cfg.max_concurrent_steps, PIPELINE_SMEM_BUDGET // stage_bytes))

# Upper bounds (inclusive) of M per bucket, in order.
BUCKET_TABLE: tuple[tuple[int, str], ...] = ((64, "decode"), (512, "small"), (1 << 62, "prefill"))


def select_bucket(n_rows: int, bucket: str | None = None) -> LaunchConfig:
  """The launch config for `n_rows` rows, or the forced `bucket`."""
  if bucket is not None:
    if bucket not in BUCKETS:
      raise ValueError(f"unknown bucket {bucket!r}; known: {sorted(BUCKETS)}")
    return BUCKETS[bucket]
  for upper, name in BUCKET_TABLE:
    if n_rows <= upper:
      return BUCKETS[name]
  raise AssertionError("unreachable")


def tiles_per_group(split_sizes: tuple[int, ...]) -> int:
  """wgmma N width (in 64-col tiles) for splits of the given tile counts.

  A function of the split plan only. Chooses the w <= 4 that minimises the
  number of (padded) tiles computed per split, preferring wider groups
  (fewer epilogues, better operand reuse) on ties. Qwen3 (9-tile splits) -> 3.
  """
  biggest = max(split_sizes)
  best = None
  for w in range(1, MAX_TILES_PER_GROUP + 1):
    groups = math.ceil(biggest / w)
    waste = groups * w - min(split_sizes)
    key = (groups * w, waste, -w)
    if best is None or key < best[0]:
      best = (key, w)
  return best[1]


def default_num_sms() -> int:
  """SM count of the default device (132 on H200); a placeholder on CPU."""
  try:
    import jax

    dev = jax.devices()[0]
    if dev.platform == "gpu":
      return int(getattr(dev, "core_count", 132) or 132)
  except Exception:  # pragma: no cover
    pass
  return 132


def describe(cfg: LaunchConfig) -> str:
  return (
      f"{cfg.name}: block_m={cfg.block_m} wgs={cfg.num_compute_wgs} rows/CTA={cfg.cta_rows} "
      f"stages={cfg.max_concurrent_steps} ctas/SM={cfg.ctas_per_sm}"
  )


__all__ = ["LaunchConfig", "BUCKETS", "BUCKET_TABLE", "select_bucket", "tiles_per_group", "C"]
