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
* `delay_release`: 1 keeps one wgmma group in flight per consumer warpgroup
  (`wgmma_wait(1)`, the pipeline slot is released one step later); the
  instruction sequence per accumulator is unchanged (chain-in-wgmma kernel
  only: `sm90_forward_ws` refuses it),
* `split_group`: the order of work items (0: row blocks fastest over all
  splits; G > 0: groups of G splits, the split fastest inside a group, so the
  CTAs running at once share both operands in L2),
* `logits_slots`: staging buffers per consumer warpgroup for the serving
  entry's FP32 logits TMA stores (stores overlap the next tiles' epilogue),
* `epilogue_wgs`: 0 runs the chain in the wgmma warpgroups between tile
  groups (`sm90_forward`); 1 or 2 hands each finished accumulator through
  shared memory to that many dedicated epilogue warpgroups
  (`sm90_forward_ws`), so the next group's wgmmas run while the chain of the
  previous one does; the operations and their order per tile are the same,
* `cluster`: 2 pairs CTAs into a cluster that works on two adjacent row
  blocks of the same split at once; each CTA loads half of every weight K
  slice and multicasts it to both (TMA `.multicast::cluster`), so the weight
  bytes read from L2 per CTA halve. The data each wgmma reads is the same,
  only how it reaches shared memory differs (H200: same bytes but slower,
  M=4096 8.49 vs 8.10 ms; benchmarks/results/h200_2026-11-30d/probe_cluster.jsonl),

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
  delay_release: int = 0  # 1: wgmma_wait(1) and release the pipeline slot one step later
  split_group: int = 0  # work order: 0 = row blocks fastest; G = G splits fastest within a group
  logits_slots: int = 2  # serving entry: SMEM staging tiles per consumer warpgroup
  epilogue_wgs: int = 0  # >0: the chain runs in this many dedicated warpgroups (sm90_forward_ws)
  mma_registers: int = 0  # sm90_forward_ws: registers per wgmma-warpgroup thread (0: auto)
  epilogue_slices: int = 2  # sm90_forward_ws: 8-column slices per step of the chain's exp loop
  tile_k: int = 64  # sm90_forward_ws: K slice per pipeline stage (64: 128B swizzle, 32: 64B)
  auto_barriers: bool = False  # sm90_forward_ws: keep Pallas's automatic warpgroup barriers (timing only)
  cluster: int = 1  # sm90_forward_ws: CTAs per cluster sharing each weight K slice by TMA multicast

  @property
  def cta_rows(self) -> int:
    return self.block_m * self.num_compute_wgs

  @property
  def row_quantum(self) -> int:
    """Rows the kernel's input is padded to a multiple of (a cluster's row blocks)."""
    return self.cta_rows * self.cluster


def padded_rows(n_rows: int, cfg: LaunchConfig) -> int:
  """Rows of the padded operands for n_rows real rows (at least one row block per cluster CTA)."""
  q = cfg.row_quantum
  return max(-(-n_rows // q), 1) * q


def persistent_ctas(n_pad: int, n_local: int, cfg: LaunchConfig, max_ctas: int) -> int:
  """Persistent CTA count: one per work item, at most max_ctas (e.g. SMs * ctas_per_sm),
  rounded down to whole clusters (at least one)."""
  work = (n_pad // cfg.cta_rows) * n_local
  return max(cfg.cluster, min(max_ctas, work) // cfg.cluster * cfg.cluster)


# M-bucketed launch table. Every entry must give identical bytes (tested).
BUCKETS: dict[str, LaunchConfig] = {
    # One row block of 64; the 264 splits spread over all SMs (2 per CTA),
    # deep TMA pipeline to keep ~4 TB/s of weight streaming in flight. The chain
    # runs in a dedicated epilogue warpgroup (sm90_forward_ws: 5 stages of 32 KiB
    # + 48 KiB hand-off), so the weight stream does not pause between tile groups
    # (H200, kernel-only, M = 1/8/64: 0.304/0.305/0.305 ms vs 0.332/0.327/0.331 ms
    # with the chain in the wgmma warpgroup at 6 stages;
    # benchmarks/results/h200_2026-11-30d/probe_decode_ws.jsonl).
    "decode": LaunchConfig("decode", block_m=64, num_compute_wgs=1, max_concurrent_steps=5, ctas_per_sm=1,
                           epilogue_wgs=1),
    # Two consumer warpgroups, 64 rows each.
    "small": LaunchConfig("small", block_m=64, num_compute_wgs=2, max_concurrent_steps=4, ctas_per_sm=1),
    # Large M: 2 x 64 rows per CTA in two wgmma warpgroups plus one dedicated
    # epilogue warpgroup fed through shared memory (sm90_forward_ws: 3 stages of
    # 40 KiB + 96 KiB of hand-off buffers), so the chain of a tile group runs
    # under the next group's wgmmas (H200, kernel-only: M=4096 7.90 vs 8.62 ms,
    # M=16384 31.2 vs 35.3 ms for the chain in the wgmma warpgroups;
    # benchmarks/results/h200_2026-11-30c/probe_ws3.jsonl). Work items in groups
    # of 4 splits so the CTAs running at once share hidden rows in L2.
    "prefill": LaunchConfig("prefill", block_m=64, num_compute_wgs=2, max_concurrent_steps=3, ctas_per_sm=1,
                            split_group=4, epilogue_wgs=1),
}

# Shared memory the TMA pipeline may use per CTA (H200: 227 KiB per block;
# the rest is left for the logits staging tiles and barriers).
PIPELINE_SMEM_BUDGET = 192 * 1024


# Shared memory of one H200 thread block (227 KiB) less a margin for barriers.
SMEM_LIMIT = 224 * 1024


def logits_staging_bytes(cfg: LaunchConfig) -> int:
  """SMEM of the serving entry's FP32 logits staging tiles (64 x 64 f32 each)."""
  return cfg.num_compute_wgs * cfg.logits_slots * cfg.block_m * 64 * 4


def accumulator_copy_bytes(cfg: LaunchConfig, tiles_per_group: int) -> int:
  """SMEM holding one copy of every wgmma warpgroup's accumulator [block_m, 64 w] f32
  (the hand-off buffers of `sm90_forward_ws`)."""
  return cfg.num_compute_wgs * cfg.block_m * 64 * tiles_per_group * 4


def stage_bytes(cfg: LaunchConfig, tiles_per_group: int, tile_k: int = 64) -> int:
  """SMEM of one pipeline stage: the K slice of the CTA's hidden rows and of a tile group's weight rows (bf16)."""
  return (cfg.cta_rows + 64 * tiles_per_group) * tile_k * 2


def pipeline_stages(cfg: LaunchConfig, tiles_per_group: int, tile_k: int = 64, extra_smem: int = 0) -> int:
  """Pipeline depth that fits the SMEM budget next to `extra_smem` bytes (bit-neutral)."""
  budget = min(PIPELINE_SMEM_BUDGET, SMEM_LIMIT - extra_smem)
  stages = max(2, min(cfg.max_concurrent_steps, budget // stage_bytes(cfg, tiles_per_group, tile_k)))
  return max(stages, cfg.delay_release + 1)

# Upper bounds (inclusive) of M per bucket, in order.
BUCKET_TABLE: tuple[tuple[int, str], ...] = ((64, "decode"), (512, "small"), (1 << 62, "prefill"))


def select_bucket(n_rows: int, bucket: "str | LaunchConfig | None" = None) -> LaunchConfig:
  """The launch config for `n_rows` rows, or the forced `bucket` (a name or, for
  experiments, a `LaunchConfig`)."""
  if isinstance(bucket, LaunchConfig):
    return bucket
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
  """Every field of the config (so probe records and ladder reports name each knob)."""
  fields = " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg) if f.name != "name")
  return f"{cfg.name}: rows/CTA={cfg.cta_rows} {fields}"


__all__ = ["LaunchConfig", "BUCKETS", "BUCKET_TABLE", "select_bucket", "tiles_per_group", "C"]
