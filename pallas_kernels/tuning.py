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
* `split_group`: the order of work items (0: row blocks fastest over all
  splits; G > 0: groups of G splits, the split fastest inside a group, so the
  CTAs running at once share both operands in L2),
* `logits_slots`: staging buffers per consumer warpgroup for the serving
  entry's FP32 logits TMA stores (chain-in-wgmma kernel only),
* the kernel itself: a `WgmmaForwardConfig` builds `sm90_forward_wgmma` (the
  chain runs in the wgmma warpgroups between tile groups); a `WsForwardConfig`
  builds `sm90_forward_ws`, which hands each finished accumulator through
  shared memory to a dedicated epilogue warpgroup, so the next group's wgmmas
  run while the chain of the previous one does; the operations and their order
  per tile are the same,

selected by an M bucket (`decode`, `small`, `mid`, `prefill`). `tiles_per_group`
(the wgmma N width in 64-column tiles) is derived from the split geometry
ONLY (never from M or the bucket), so every bucket issues the same wgmma
instruction shape for a given vocabulary.

One frozen config per kernel, each checked when it is made (`__post_init__`):
`WgmmaForwardConfig`, `WsForwardConfig` (both `ForwardConfig`s, the fields the
two forward kernels share), `FoldConfig` (`sm90_fold`), `DzConfig` (`sm90_dz`)
and `GradGemmConfig` (`sm90_grad_gemm`). The shipped values are `BUCKETS`,
`FOLD` / `DECODE_FOLD`, `DZ`, `DH_GEMM` and `DW_GEMM`: constants, read where a
kernel is traced and never reassigned (a caller that wants another launch passes
a config: `partials(bucket=)`, `forward(fold_cfg=)`, `sm90_grad_gemm.*(cfg=)`).
Why each shipped value (what was measured against what): docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses
import math
import types

# wgmma N is at most 256 columns = 4 tiles.
MAX_TILES_PER_GROUP = 4


def _require(ok: bool, cfg, what: str):
    if not ok:
        raise ValueError(f"{type(cfg).__name__} {getattr(cfg, 'name', '')!r}: {what}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require_int(cfg, field: str, low: int):
    """`cfg.<field>` must be an int >= low (ValueError naming the field otherwise)."""
    x = getattr(cfg, field)
    what = "a positive int" if low == 1 else f"an int >= {low}"
    _require(_is_int(x) and x >= low, cfg, f"{field} must be {what}, got {x}")


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """The launch fields both forward kernels use. Build a `WgmmaForwardConfig` or a
    `WsForwardConfig` (the type picks the kernel)."""

    name: str
    block_m: int  # rows per consumer (wgmma) warpgroup
    num_compute_wgs: int  # consumer (wgmma) warpgroups per CTA
    max_concurrent_steps: int  # pipeline depth (stages of (H, W) K-slices), before the SMEM budget
    ctas_per_sm: int = 1  # persistent CTAs per SM (num_ctas = min(work, sms * this))
    split_group: int = 0  # work order: 0 = row blocks fastest; G = G splits fastest within a group

    def __post_init__(self):
        if type(self) is ForwardConfig:
            raise TypeError("ForwardConfig is the shared part; build a WgmmaForwardConfig or a WsForwardConfig")
        _require(isinstance(self.name, str) and bool(self.name), self, "name must be a non-empty string")
        _require(self.block_m in (64, 128), self, f"block_m must be 64 or 128, got {self.block_m}")
        # Three consumer warpgroups (192 rows per CTA) pass interpret mode but their bytes were
        # never compared on a GPU (docs/PERFORMANCE.md): refused until they are.
        _require(self.num_compute_wgs in (1, 2), self, f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
        _require_int(self, "max_concurrent_steps", 1)
        _require_int(self, "ctas_per_sm", 1)
        _require_int(self, "split_group", 0)

    @property
    def cta_rows(self) -> int:
        """Rows of one CTA's row block; the kernel's input is padded to a multiple of this."""
        return self.block_m * self.num_compute_wgs


@dataclasses.dataclass(frozen=True)
class WgmmaForwardConfig(ForwardConfig):
    """The chain-in-wgmma forward kernel (`sm90_forward_wgmma`)."""

    logits_slots: int = 2  # serving entry: SMEM staging tiles per consumer warpgroup

    def __post_init__(self):
        super().__post_init__()
        _require_int(self, "logits_slots", 1)


@dataclasses.dataclass(frozen=True)
class WsForwardConfig(ForwardConfig):
    """The forward kernel with a dedicated epilogue warpgroup (`sm90_forward_ws`): one producer,
    `num_compute_wgs` wgmma warpgroups and one epilogue warpgroup fed through swizzled hand-off
    buffers (the shared fields are all it takes)."""


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """The split fold (`sm90_fold`); every field is bit-neutral (see its module docstring)."""

    rows: int = 32  # rows per CTA (8, 16, 32 or 64)
    chunk: int = 64  # splits per TMA copy (a multiple of 128 / rows in (0, 256]; raised to
    # ceil(n_split / 32) at least)
    unroll: int | None = None  # splits per trip of the chain's loop (None: `sm90_fold.CHAIN_UNROLL`)

    def __post_init__(self):
        # rows = 128 would not fit in SMEM; 8 and 16 rows (32- / 64-byte TMA rows) give the
        # 32-row fold's bytes on the H200 (docs/PERFORMANCE.md).
        _require(self.rows in (8, 16, 32, 64), self, f"rows must be 8, 16, 32 or 64, got {self.rows}")
        g_n = 128 // self.rows
        _require(
            _is_int(self.chunk) and self.chunk % g_n == 0 and 0 < self.chunk <= 256,
            self,
            f"chunk must be a multiple of {g_n} in (0, 256], got {self.chunk}",
        )
        _require(
            self.unroll is None or (_is_int(self.unroll) and self.unroll >= 1),
            self,
            f"unroll must be None or >= 1, got {self.unroll}",
        )


@dataclasses.dataclass(frozen=True)
class DzConfig:
    """The backward's dz kernel (`sm90_dz`)."""

    block_m: int = 64  # rows per consumer warpgroup
    num_compute_wgs: int = 2  # consumer warpgroups per CTA
    block_n: int = 256  # columns per work item (wgmma N); chunks must be a multiple of it
    max_concurrent_steps: int = 4  # pipeline depth
    col_group: int = 4  # work order: column blocks in groups of this, row blocks fastest inside

    def __post_init__(self):
        _require(self.block_m in (64, 128), self, f"block_m must be 64 or 128, got {self.block_m}")
        _require(self.num_compute_wgs in (1, 2), self, f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
        _require(self.block_n in (64, 128, 192, 256), self, f"block_n must be 64, 128, 192 or 256, got {self.block_n}")
        _require_int(self, "max_concurrent_steps", 1)
        _require_int(self, "col_group", 0)

    @property
    def rows_per_cta(self) -> int:
        """Callers pad rows to a multiple of this."""
        return self.block_m * self.num_compute_wgs


def logits_width(cfg: ForwardConfig, want_cols: int, v_rows: int, return_logits: bool) -> int:
    """The logits width the kernel writes for `want_cols` wanted columns of a weight with `v_rows`
    vocab entries: `want_cols` itself when the serving entry asks for logits and it is a multiple
    of the config's column multiple (8 for TMA row strides and the staging swizzle, 32 with the ws
    kernel's swizzled hand-off, whose [rows, 32] boxes tile the columns), else `v_rows` rounded up
    to that multiple (the caller slices). The trainer entry writes no logits (any width builds the
    same kernel)."""
    align = 32 if isinstance(cfg, WsForwardConfig) else 8
    if return_logits and want_cols % align == 0:
        return want_cols
    return -(-v_rows // align) * align


def padded_rows(n_rows: int, cfg: ForwardConfig) -> int:
    """Rows of the padded operands for n_rows real rows (at least one row block)."""
    q = cfg.cta_rows
    return max(-(-n_rows // q), 1) * q


def one_row_block(n_rows: int, cfg: ForwardConfig) -> bool:
    """Whether n_rows real rows leave part of the config's one row block empty (a decode call:
    its rows go in unpadded, `wrapper.forward(unpadded=True)`)."""
    return n_rows < padded_rows(n_rows, cfg) == cfg.cta_rows


def persistent_ctas(n_pad: int, n_local: int, cfg: ForwardConfig, max_ctas: int) -> int:
    """Persistent CTA count: one per work item, at most max_ctas (e.g. SMs * ctas_per_sm), at least one."""
    work = (n_pad // cfg.cta_rows) * n_local
    return max(1, min(max_ctas, work))


@dataclasses.dataclass(frozen=True)
class GradGemmConfig:
    """The backward's in-place gradient GEMMs (`sm90_grad_gemm`): dh += dz @ W_c and dW_c = dz.T @ h.

    A CTA computes a [tile_m, tile_n] output tile over K in 64-wide steps (one FP32
    accumulator per element, K ascending); its two consumer warpgroups split the tile's rows
    ([tile_m / 2, tile_n] each, wgmma N = tile_n). Work items (output tiles) are ordered in
    groups of `col_group` column tiles, the column tile fastest inside a group (0: row tiles
    fastest). tile_m, max_concurrent_steps, col_group and cluster change only where and when
    each element's sum over K runs; tile_n also sets the wgmma instruction's N. The backward is
    deterministic (same bytes run to run), not part of the frozen contract."""

    tile_m: int = 128
    tile_n: int = 256
    max_concurrent_steps: int = 4  # pipeline depth
    col_group: int = 8  # work order (see above)
    # 2-CTA clusters on two tiles adjacent in rows, each CTA loading half of the shared B
    # operand's blocks and multicasting them to both (what cuBLAS's dW kernel does). An output
    # that does not tile by the cluster's two tiles runs without it (`sm90_grad_gemm._config`:
    # the same bytes).
    cluster: bool = False

    def __post_init__(self):
        _require(isinstance(self.cluster, bool), self, f"cluster must be a bool, got {self.cluster!r}")
        wm, wn = self.wg_tile
        _require(wm in (64, 128), self, f"a warpgroup's rows (tile_m / 2) must be 64 or 128, got {wm}")
        _require(wn in (64, 128, 256), self, f"a warpgroup's columns (wgmma N) must be 64, 128 or 256, got {wn}")
        _require_int(self, "max_concurrent_steps", 1)
        _require_int(self, "col_group", 0)

    @property
    def wg_tile(self) -> tuple[int, int]:
        """(rows, columns) of one consumer warpgroup's accumulator."""
        return self.tile_m // 2, self.tile_n

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """(rows, columns) of the output a cluster covers (a CTA's tile without a cluster)."""
        return self.tile_m * (2 if self.cluster else 1), self.tile_n


# M-bucketed launch table. Every entry must give identical bytes (tested). Both ws buckets hand
# tiles to the epilogue as two swizzled [bm, 32] halves, 8 slices per epilogue step (H200, kernel
# alone: M = 4096 7.754 vs 7.857 ms for eight [bm, 8] slices, 2 per step; docs/PERFORMANCE.md).
_BUCKETS: dict[str, ForwardConfig] = {
    # One row block of 64; the 264 splits spread over all SMs (2 per CTA), deep TMA pipeline to
    # keep ~4 TB/s of weight streaming in flight; the chain in the epilogue warpgroup (5 stages of
    # 32 KiB + 48 KiB hand-off), so the weight stream does not pause between tile groups (H200,
    # kernel alone, M = 1/8/64: 0.304/0.305/0.305 ms vs 0.332/0.327/0.331 ms with the chain in the
    # wgmma warpgroup; docs/PERFORMANCE.md).
    "decode": WsForwardConfig("decode", block_m=64, num_compute_wgs=1, max_concurrent_steps=5, ctas_per_sm=1),
    # Two consumer warpgroups, 64 rows each, the chain between tile groups (sm90_forward_wgmma).
    "small": WgmmaForwardConfig("small", block_m=64, num_compute_wgs=2, max_concurrent_steps=4, ctas_per_sm=1),
    # Large M: 2 x 64 rows per CTA in two wgmma warpgroups plus the epilogue warpgroup fed
    # through shared memory (3 stages of 40 KiB + 96 KiB of hand-off buffers), so the chain of a
    # tile group runs under the next group's wgmmas (H200, kernel alone: M=4096 7.90 vs 8.62 ms
    # for the chain in the wgmma warpgroups; docs/PERFORMANCE.md). Work items in groups of 4
    # splits so the CTAs running at once share hidden rows in L2.
    "prefill": WsForwardConfig(
        "prefill", block_m=64, num_compute_wgs=2, max_concurrent_steps=3, ctas_per_sm=1, split_group=4
    ),
}
# The prefill kernel with work items in groups of 2 splits (bit-neutral) for 256 < M <= 2048,
# where it was faster (H200, kernel alone, split_group 2 vs 4: M = 512 0.986 vs 1.005 ms, 2048
# 3.714 vs 3.861; at 4096 7.741 vs 7.701, so prefill keeps 4; docs/PERFORMANCE.md).
_BUCKETS["mid"] = dataclasses.replace(_BUCKETS["prefill"], name="mid", split_group=2)
# Read-only: a launch other than the table's is a config passed in (`select_bucket(bucket=)`).
BUCKETS: "types.MappingProxyType[str, ForwardConfig]" = types.MappingProxyType(_BUCKETS)

# The fold of a call of more than DECODE_ROWS rows, and of the TP path (`fold`).
FOLD = FoldConfig()
# The fold `pallas_kernels.forward` runs for a call of at most DECODE_ROWS rows (bit-neutral: 16
# threads share a row's splits instead of 4; the contract's chain and its order are unchanged).
# H200, M=1: the fold 3.7 us vs 5.1 with 32 rows, the same bytes (docs/PERFORMANCE.md).
DECODE_FOLD = FoldConfig(rows=8)
DZ = DzConfig()
# The gradient GEMMs (dh: FP32 in and out, so one stage fewer for its FP32 staging tiles), both
# in 2-CTA clusters multicasting the B operand (the same dh / dW bytes; H200, the recompute
# backward alone at M = 4096: 23.90 vs 24.29 ms without; docs/PERFORMANCE.md).
DH_GEMM = GradGemmConfig(max_concurrent_steps=3, cluster=True)
DW_GEMM = GradGemmConfig(cluster=True)

# Shared memory the TMA pipeline may use per CTA (H200: 227 KiB per block;
# the rest is left for the logits staging tiles and barriers).
PIPELINE_SMEM_BUDGET = 192 * 1024


# Shared memory of one H200 thread block (227 KiB) less a margin for barriers.
SMEM_LIMIT = 224 * 1024


def logits_staging_bytes(cfg: WgmmaForwardConfig) -> int:
    """SMEM of the chain-in-wgmma kernel's serving-entry FP32 logits staging tiles (64 x 64 f32 each)."""
    return cfg.num_compute_wgs * cfg.logits_slots * cfg.block_m * 64 * 4


def accumulator_copy_bytes(cfg: ForwardConfig, tiles_per_group: int) -> int:
    """SMEM holding one copy of every wgmma warpgroup's accumulator [block_m, 64 w] f32
    (the hand-off buffers of `sm90_forward_ws`)."""
    return cfg.num_compute_wgs * cfg.block_m * 64 * tiles_per_group * 4


def stage_bytes(cfg: ForwardConfig, tiles_per_group: int, tile_k: int = 64) -> int:
    """SMEM of one pipeline stage: the K slice of the CTA's hidden rows and of a tile group's weight rows (bf16)."""
    return (cfg.cta_rows + 64 * tiles_per_group) * tile_k * 2


def pipeline_stages(cfg: ForwardConfig, tiles_per_group: int, tile_k: int = 64, extra_smem: int = 0) -> int:
    """Pipeline depth that fits the SMEM budget next to `extra_smem` bytes (bit-neutral), at least 2."""
    budget = min(PIPELINE_SMEM_BUDGET, SMEM_LIMIT - extra_smem)
    return max(2, min(cfg.max_concurrent_steps, budget // stage_bytes(cfg, tiles_per_group, tile_k)))


# Upper bounds (inclusive) of M per bucket, in order. "small" ends at 256: above it the
# prefill kernel is faster (H200, kernel alone: M = 512 small 1.036 / prefill 1.002 ms;
# docs/PERFORMANCE.md); "mid" (the prefill kernel in groups of 2 splits) to 2048 (see BUCKETS).
# Which bucket serves changes no byte (every bucket gives the same bytes:
# tests/gpu/test_pallas_gpu.py, the ladder's B stage).
BUCKET_TABLE: tuple[tuple[int, str], ...] = ((64, "decode"), (256, "small"), (2048, "mid"), (1 << 62, "prefill"))
# Calls of at most this many rows (the decode bucket's) fold with DECODE_FOLD.
DECODE_ROWS = BUCKET_TABLE[0][0]


def select_bucket(n_rows: int, bucket: "str | ForwardConfig | None" = None) -> ForwardConfig:
    """The launch config for `n_rows` rows, or the forced `bucket` (a name or, for
    experiments, a `WgmmaForwardConfig` / `WsForwardConfig`)."""
    if isinstance(bucket, ForwardConfig):
        return bucket
    if bucket is not None and not isinstance(bucket, str):
        raise TypeError(f"bucket must be a bucket name or a WgmmaForwardConfig / WsForwardConfig, got {bucket!r}")
    if bucket is not None:
        if bucket not in BUCKETS:
            raise ValueError(f"unknown bucket {bucket!r}; known: {sorted(BUCKETS)}")
        return BUCKETS[bucket]
    for upper, name in BUCKET_TABLE:
        if n_rows <= upper:
            return BUCKETS[name]
    raise AssertionError("unreachable")


def fold_for(n_rows: int, cfg: FoldConfig | None = None) -> FoldConfig:
    """The fold config of a call of n_rows rows: `cfg` where given, else DECODE_FOLD at most
    DECODE_ROWS rows and FOLD above."""
    if cfg is not None:
        return cfg
    return DECODE_FOLD if n_rows <= DECODE_ROWS else FOLD


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


def describe(cfg) -> str:
    """The kernel and every field of the config (so probe records and ladder reports name each knob)."""
    fields = " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg) if f.name != "name")
    rows = f" rows/CTA={cfg.cta_rows}" if isinstance(cfg, ForwardConfig) else ""
    return f"{getattr(cfg, 'name', type(cfg).__name__)} ({type(cfg).__name__}):{rows} {fields}"


__all__ = [
    "ForwardConfig",
    "WgmmaForwardConfig",
    "WsForwardConfig",
    "FoldConfig",
    "DzConfig",
    "GradGemmConfig",
    "BUCKETS",
    "BUCKET_TABLE",
    "DECODE_ROWS",
    "FOLD",
    "DECODE_FOLD",
    "DZ",
    "DH_GEMM",
    "DW_GEMM",
    "select_bucket",
    "fold_for",
    "tiles_per_group",
    "padded_rows",
    "one_row_block",
    "logits_width",
    "persistent_ctas",
    "pipeline_stages",
    "stage_bytes",
    "logits_staging_bytes",
    "accumulator_copy_bytes",
    "default_num_sms",
    "describe",
]
