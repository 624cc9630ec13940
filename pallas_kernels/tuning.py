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
  only: `WsForwardConfig` has no such field),
* `split_group`: the order of work items (0: row blocks fastest over all
  splits; G > 0: groups of G splits, the split fastest inside a group, so the
  CTAs running at once share both operands in L2),
* `logits_slots`: staging buffers per consumer warpgroup for the serving
  entry's FP32 logits TMA stores (stores overlap the next tiles' epilogue;
  chain-in-wgmma kernel only),
* the kernel itself: a `WgmmaForwardConfig` builds `sm90_forward_wgmma` (the
  chain runs in the wgmma warpgroups between tile groups); a `WsForwardConfig`
  builds `sm90_forward_ws`, which hands each finished accumulator through
  shared memory to `epilogue_wgs` (1 or 2) dedicated epilogue warpgroups, so
  the next group's wgmmas run while the chain of the previous one does; the
  operations and their order per tile are the same,
* `cluster` (ws kernel): 2 pairs CTAs into a cluster that works on two
  adjacent row blocks of the same split at once; each CTA loads half of every
  weight K slice and multicasts it to both (TMA `.multicast::cluster`), so the
  weight bytes read from L2 per CTA halve. The data each wgmma reads is the
  same, only how it reaches shared memory differs (H200: same bytes but
  slower, M=4096 8.49 vs 8.10 ms;
  benchmarks/results/h200_2026-11-30d/probe_cluster.jsonl),

* `mma_stagger` (ws kernel): the second wgmma warpgroup starts that many K slices after the
  first, so that their group ends (a wgmma_wait(0) and the accumulator's copy into the
  hand-off buffer) do not leave the tensor cores idle together (off in every bucket; timed by
  `benchmarks.experiments.probe_kernel --groups stagger15`),

selected by an M bucket (`decode`, `small`, `prefill`). `tiles_per_group`
(the wgmma N width in 64-column tiles) is derived from the split geometry
ONLY (never from M or the bucket), so every bucket issues the same wgmma
instruction shape for a given vocabulary.

One frozen config per kernel, each checked when it is made (`__post_init__`):
`WgmmaForwardConfig`, `WsForwardConfig` (both `ForwardConfig`s, the fields the
two forward kernels share), `FoldConfig` (`sm90_fold`) and `DzConfig`
(`sm90_dz`). The shipped values are `BUCKETS`, `FOLD` and `DZ`.
"""

from __future__ import annotations

import dataclasses
import math

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
        # Three consumer warpgroups pass interpret mode but are not validated on
        # a GPU: probe1.jsonl (h200_2026-11-30b) reports "DIFFERENT" for them, but
        # that probe compared whole [n_local, n_pad] arrays and 192 rows per CTA
        # pads M=4096 to 4224 rows, so the shapes alone differed (fixed in
        # benchmarks/experiments/probe_kernel.py since); whether the bytes match is unknown.
        _require(self.num_compute_wgs in (1, 2), self, f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
        _require_int(self, "max_concurrent_steps", 1)
        _require_int(self, "ctas_per_sm", 1)
        _require_int(self, "split_group", 0)

    @property
    def cta_rows(self) -> int:
        return self.block_m * self.num_compute_wgs

    @property
    def ctas_per_cluster(self) -> int:
        return 1

    @property
    def row_quantum(self) -> int:
        """Rows the kernel's input is padded to a multiple of (a cluster's row blocks)."""
        return self.cta_rows * self.ctas_per_cluster


@dataclasses.dataclass(frozen=True)
class WgmmaForwardConfig(ForwardConfig):
    """The chain-in-wgmma forward kernel (`sm90_forward_wgmma`)."""

    delay_release: int = 0  # 1: wgmma_wait(1) and release the pipeline slot one step later
    logits_slots: int = 2  # serving entry: SMEM staging tiles per consumer warpgroup

    def __post_init__(self):
        super().__post_init__()
        _require(self.delay_release in (0, 1), self, f"delay_release must be 0 or 1, got {self.delay_release}")
        _require_int(self, "logits_slots", 1)


# Registers per thread (setmaxnreg bounds) a wgmma warpgroup may ask for.
MIN_REGISTERS, MAX_REGISTERS = 24, 232


@dataclasses.dataclass(frozen=True)
class WsForwardConfig(ForwardConfig):
    """The forward kernel with dedicated epilogue warpgroups (`sm90_forward_ws`)."""

    epilogue_wgs: int = 1  # warpgroups running the chain (num_compute_wgs must be a multiple of it)
    mma_registers: int = 0  # registers per wgmma-warpgroup thread (0: auto)
    epilogue_slices: int = 2  # 8-column slices per step of the chain's exp loop
    tile_k: int = 64  # K slice per pipeline stage (64: 128B swizzle, 32: 64B)
    auto_barriers: bool = False  # keep Pallas's automatic warpgroup barriers (timing only)
    cluster: int = 1  # CTAs per cluster sharing each weight K slice by TMA multicast
    # The hand-off buffers' layout: "slices" (each tile as eight [block_m, 8] slices) or
    # "swizzled" (two [block_m, 32] halves, 128B swizzle: the logits leave in 2 TMA boxes per tile
    # instead of 8, the accumulator copy is 2 stores per tile; epilogue_slices 4 or 8). Same bytes.
    handoff: str = "slices"
    # The second wgmma warpgroup starts its first K slice after the first has issued its
    # mma_stagger-th (0: together). Each group ends with a wgmma_wait(0) and the accumulator's
    # copy into the hand-off buffer, a gap in the tensor core's work when both warpgroups end
    # their groups at once; staggered, one runs wgmmas while the other copies. The leading one
    # then has mma_stagger fewer pipeline slots of lookahead (a slot is refilled when both have
    # released it), so it must be below the pipeline depth. The wgmma sequence per accumulator
    # is unchanged (same bytes); not yet timed on the H200 (probe_kernel's stagger15 group).
    mma_stagger: int = 0

    def __post_init__(self):
        super().__post_init__()
        _require(
            self.epilogue_wgs in (1, 2) and self.num_compute_wgs % self.epilogue_wgs == 0,
            self,
            f"need 1 or 2 epilogue warpgroups, num_compute_wgs ({self.num_compute_wgs}) a multiple of them; "
            f"got {self.epilogue_wgs}",
        )
        _require(
            self.mma_registers == 0
            or (
                _is_int(self.mma_registers)
                and self.mma_registers % 8 == 0
                and MIN_REGISTERS <= self.mma_registers <= MAX_REGISTERS
            ),
            self,
            f"mma_registers must be 0 or a multiple of 8 in [{MIN_REGISTERS}, {MAX_REGISTERS}], "
            f"got {self.mma_registers}",
        )
        _require(
            self.epilogue_slices in (1, 2, 4, 8),
            self,
            f"epilogue_slices must be 1, 2, 4 or 8, got {self.epilogue_slices}",
        )
        _require(self.tile_k in (32, 64), self, f"tile_k must be 32 or 64, got {self.tile_k}")
        _require(isinstance(self.auto_barriers, bool), self, f"auto_barriers must be a bool, got {self.auto_barriers}")
        _require(self.cluster in (1, 2), self, f"cluster must be 1 or 2, got {self.cluster}")
        _require_int(self, "mma_stagger", 0)
        _require(
            self.mma_stagger == 0 or self.num_compute_wgs == 2,
            self,
            f"mma_stagger needs two wgmma warpgroups, got num_compute_wgs={self.num_compute_wgs}",
        )
        _require(
            self.handoff == "slices" or (self.handoff == "swizzled" and self.epilogue_slices in (4, 8)),
            self,
            f"handoff must be 'slices', or 'swizzled' with epilogue_slices 4 or 8; got {self.handoff!r} "
            f"with epilogue_slices={self.epilogue_slices}",
        )

    @property
    def ctas_per_cluster(self) -> int:
        return self.cluster


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """The split fold (`sm90_fold`); every field is bit-neutral (see its module docstring)."""

    staged: bool = True  # all partials of a CTA's rows in SMEM (else one row per thread, 128 rows per CTA)
    rows: int = 32  # staged: rows per CTA (8, 16, 32 or 64)
    chunk: int = 64  # staged: splits per TMA copy (a multiple of 128 / rows in (0, 256]; raised to
    # ceil(n_split / 32) at least)
    unroll: int | None = None  # splits per loop trip (staged: of the chain, 32; else of both passes, 8)

    def __post_init__(self):
        _require(isinstance(self.staged, bool), self, f"staged must be a bool, got {self.staged}")
        # rows = 128 would not fit in SMEM. (Until the twenty-first session only 32 / 64, for
        # TMA rows of a multiple of 128 bytes; 8 and 16 rows, 32- / 64-byte TMA rows, lower and
        # gave the 32-row fold's bytes on the H200: benchmarks/results/h200_2026-12-03e/call5_fold_rows.log.)
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
    align = 32 if getattr(cfg, "handoff", "slices") == "swizzled" else 8
    if return_logits and want_cols % align == 0:
        return want_cols
    return -(-v_rows // align) * align


def padded_rows(n_rows: int, cfg: ForwardConfig) -> int:
    """Rows of the padded operands for n_rows real rows (at least one row block per cluster CTA)."""
    q = cfg.row_quantum
    return max(-(-n_rows // q), 1) * q


def one_row_block(n_rows: int, cfg: ForwardConfig) -> bool:
    """Whether n_rows real rows leave part of the config's one row block empty (a decode call:
    its rows may go in unpadded, `wrapper._launch(unpadded=)`; never with a cluster, whose
    quantum is two row blocks)."""
    return n_rows < padded_rows(n_rows, cfg) == cfg.cta_rows


def persistent_ctas(n_pad: int, n_local: int, cfg: ForwardConfig, max_ctas: int) -> int:
    """Persistent CTA count: one per work item, at most max_ctas (e.g. SMs * ctas_per_sm),
    rounded down to whole clusters (at least one)."""
    work = (n_pad // cfg.cta_rows) * n_local
    cl = cfg.ctas_per_cluster
    return max(cl, min(max_ctas, work) // cl * cl)


@dataclasses.dataclass(frozen=True)
class GradGemmConfig:
    """The backward's in-place gradient GEMMs (`sm90_grad_gemm`): dh += dz @ W_c and dW_c = dz.T @ h.

    A CTA computes a [tile_m, tile_n] output tile over K in 64-wide steps (one FP32
    accumulator per element, K ascending); its two consumer warpgroups split the tile's rows
    (wg_split "m": [tile_m / 2, tile_n] each, wgmma N = tile_n) or its columns ("n": [tile_m,
    tile_n / 2] each). Work items (output tiles) are ordered in groups of `col_group` column
    tiles, the column tile fastest inside a group (0: row tiles fastest). tile_m,
    max_concurrent_steps, col_group and cluster change only where and when each element's sum
    over K runs; tile_n and wg_split also set the wgmma instruction's N (whether that changes a
    byte was not measured). The backward is deterministic (same bytes run to run), not part of
    the frozen contract."""

    tile_m: int = 128
    tile_n: int = 256
    wg_split: str = "m"
    max_concurrent_steps: int = 4  # pipeline depth
    col_group: int = 8  # work order (see above)
    # None: one CTA per tile. "m" / "n": 2-CTA clusters on two tiles adjacent in rows (sharing B) /
    # columns (sharing A), each CTA loading half of the shared operand's blocks and multicasting
    # them to both (what cuBLAS's dW kernel does). The shipped DH_GEMM / DW_GEMM take "m" (below);
    # an output that does not tile by the cluster's two tiles runs without it
    # (`sm90_grad_gemm._config`: the same bytes).
    cluster: str | None = None
    # Staging boxes ([64, 64] of the output) per consumer warpgroup for the epilogue's TMA stores:
    # 2 (shipped) alternate, and the tile's stores are waited out before the next tile; a whole
    # tile's worth (4 at [64, 256] per warpgroup) lets them drain under the next tile's K walk
    # (fits next to 3 stages with a bf16 output; H200, walk10: no faster, twelfth session).
    # (One wgmma group in flight per consumer warpgroup, `wgmma_wait(1)` with the slot released a
    # step later, was built here and in DzConfig in the twelfth session and timed in the
    # thirteenth: no faster, and the dh GEMM's bytes moved on the H200, 26 / 203 rows at M =
    # 4096 / 16384 in cluster "m", so it was taken out; benchmarks/results/h200_2026-12-02c/
    # call1_probe_walk10.log.)
    out_slots: int = 2

    def __post_init__(self):
        _require(self.wg_split in ("m", "n"), self, f"wg_split must be 'm' or 'n', got {self.wg_split!r}")
        _require_int(self, "out_slots", 2)
        _require(self.cluster in (None, "m", "n"), self, f"cluster must be None, 'm' or 'n', got {self.cluster!r}")
        wm, wn = self.wg_tile
        _require(
            wm in (64, 128), self, f"a warpgroup's rows (tile_m, halved for wg_split 'm') must be 64 or 128, got {wm}"
        )
        _require(wn in (64, 128, 256), self, f"a warpgroup's columns (wgmma N) must be 64, 128 or 256, got {wn}")
        _require_int(self, "max_concurrent_steps", 1)
        _require_int(self, "col_group", 0)

    @property
    def wg_tile(self) -> tuple[int, int]:
        """(rows, columns) of one consumer warpgroup's accumulator."""
        if self.wg_split == "m":
            return self.tile_m // 2, self.tile_n
        return self.tile_m, self.tile_n // 2

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """(rows, columns) of the output a cluster covers (a CTA's tile without a cluster)."""
        return (self.tile_m * (2 if self.cluster == "m" else 1), self.tile_n * (2 if self.cluster == "n" else 1))


# M-bucketed launch table. Every entry must give identical bytes (tested).
# Both ws buckets hand tiles to the epilogue as two swizzled [bm, 32] halves, 8 slices per
# epilogue step (ninth session; same bytes; H200, kernel alone, against the eight-slice
# hand-off with 2 slices per step: M = 4096 7.754 vs 7.857 ms, 16384 30.89 vs 31.13, 512 0.983
# vs 0.980, decode M = 1 0.302 vs 0.306, M = 64 0.306 vs 0.310; the serving entry at M = 4096
# 8.601 vs 8.678; benchmarks/results/h200_2026-12-01e/call1_probe_handoff8_chunk7.log).
BUCKETS: dict[str, ForwardConfig] = {
    # One row block of 64; the 264 splits spread over all SMs (2 per CTA),
    # deep TMA pipeline to keep ~4 TB/s of weight streaming in flight. The chain
    # runs in a dedicated epilogue warpgroup (sm90_forward_ws: 5 stages of 32 KiB
    # + 48 KiB hand-off), so the weight stream does not pause between tile groups
    # (H200, kernel-only, M = 1/8/64: 0.304/0.305/0.305 ms vs 0.332/0.327/0.331 ms
    # with the chain in the wgmma warpgroup at 6 stages;
    # benchmarks/results/h200_2026-11-30d/probe_decode_ws.jsonl).
    "decode": WsForwardConfig(
        "decode",
        block_m=64,
        num_compute_wgs=1,
        max_concurrent_steps=5,
        ctas_per_sm=1,
        epilogue_wgs=1,
        epilogue_slices=8,
        handoff="swizzled",
    ),
    # Two consumer warpgroups, 64 rows each, the chain between tile groups (sm90_forward_wgmma).
    "small": WgmmaForwardConfig("small", block_m=64, num_compute_wgs=2, max_concurrent_steps=4, ctas_per_sm=1),
    # Large M: 2 x 64 rows per CTA in two wgmma warpgroups plus one dedicated
    # epilogue warpgroup fed through shared memory (sm90_forward_ws: 3 stages of
    # 40 KiB + 96 KiB of hand-off buffers), so the chain of a tile group runs
    # under the next group's wgmmas (H200, kernel-only: M=4096 7.90 vs 8.62 ms,
    # M=16384 31.2 vs 35.3 ms for the chain in the wgmma warpgroups;
    # benchmarks/results/h200_2026-11-30c/probe_ws3.jsonl). Work items in groups
    # of 4 splits so the CTAs running at once share hidden rows in L2.
    "prefill": WsForwardConfig(
        "prefill",
        block_m=64,
        num_compute_wgs=2,
        max_concurrent_steps=3,
        ctas_per_sm=1,
        split_group=4,
        epilogue_wgs=1,
        epilogue_slices=8,
        handoff="swizzled",
    ),
}
# The prefill kernel with work items in groups of 2 splits (a bit-neutral work order: the same
# bytes, the probe's bits column) for 256 < M <= 2048, where it was faster (H200, kernel alone,
# split_group 2 vs 4: M = 384 0.755 vs 0.770 ms, 512 0.986 vs 1.005,
# 768 1.399 vs 1.467, 1024 1.913 vs 1.920, 2048 3.714 vs 3.861; 4096 7.741 vs 7.701, so prefill
# keeps 4 there; benchmarks/results/h200_2026-12-02c/call2_probe_mid12.log).
BUCKETS["mid"] = dataclasses.replace(BUCKETS["prefill"], name="mid", split_group=2)

# The fold's and the dz kernel's shipped configs; the gradient GEMMs' (dh: FP32
# in and out, so one stage fewer for its FP32 staging tiles). Both GEMMs run in 2-CTA
# clusters on row-adjacent tiles multicasting the B operand (eleventh session; the same dh / dW
# bytes as without, 0 rows differing; H200, the recompute backward alone at the Qwen3-8B head:
# M = 4096 23.90 vs 24.29 ms, 16384 96.22 vs 96.89; the column-adjacent pair 24.34 / 96.78;
# benchmarks/results/h200_2026-12-02/call1_probe_walk10.log).
FOLD = FoldConfig()
# Whether `pallas_kernels.forward` (the op core's unsharded path) folds inside the forward kernel
# (`forward(single_launch=None)`'s default; bit-neutral: the same fold program on the same
# operands). Off: on the H200 it gives the two launches' bytes (M = 1, 64, 300; nineteenth and
# twentieth sessions, docs/PERF_NOTES.md) but is not faster at decode (the fold's latency stays),
# and its fold is emitted once per 32-row block (slow compiles at larger M). It may be turned on
# when it is faster and `SINGLE_PYTEST=1 DECODE_STAGES=single bash tests/gpu/h200_decode.sh`, the
# ladder and the golden replay pass with it. Read at trace time.
SINGLE_LAUNCH = False
# Whether `pallas_kernels.forward` passes a call's rows unpadded where they fit one row block
# (`forward(unpadded=None)`'s default; bit-neutral: the real rows see the same values): a decode
# call hands the kernels its [N] targets / inv_t and N-row hidden as they are (scalar loads, a
# hidden box of N rounded up to 8 rows) and the fold writes [N]: no pads, no output slices
# (`wrapper._launch(unpadded=)`). On since the twenty-first session (H200: golden replay 5/5 +
# 5/5, the unpadded GPU test at M = 1, 3, 13, 40, 0 rows differing from the padded call at
# M = 1, 8; M=1 traced: device busy 282.8 vs 290.4 us; benchmarks/results/h200_2026-12-03e/).
# Calls of several row blocks stay padded (their `unpadded=True` path, TMA's zero fill of the
# last block's box, is not timed). Read at trace time.
UNPADDED_ROWS = True
# The fold `pallas_kernels.forward` runs for a call of at most 64 rows when no fold_cfg is given
# (None: `FOLD`). FoldConfig(rows=8) lets 16 threads share a row's splits instead of 4 (bit-neutral:
# the contract's chain and its order are unchanged): H200, M=1 traced, the fold 3.66-3.70 us vs
# 5.06 with 32 rows (16 rows: 4.01), logp / lse / entropy bytes equal to the 32-row fold at
# M = 1, 8, 40 (benchmarks/results/h200_2026-12-03e/call5_fold_rows.log, call6_trace_m1_fold*.log).
# On since the twenty-second session: with it the golden replay 5/5 + 5/5 and the fused-forward
# GPU test at M=1 (every bucket) passed, M=1 traced busy 280.5 us (kernel 276.7 + fold 3.78;
# benchmarks/results/h200_2026-12-04/call1_*). None restores the 32-row fold. Read at trace time.
DECODE_FOLD: "FoldConfig | None" = FoldConfig(rows=8)
DZ = DzConfig()
DH_GEMM = GradGemmConfig(max_concurrent_steps=3, cluster="m")
DW_GEMM = GradGemmConfig(cluster="m")

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
# prefill kernel is faster (H200, kernel alone, benchmarks/results/h200_2026-12-01c/
# call3_probe_small7_residual7.log: M = 256 small 0.536 / prefill 0.555 ms, M = 512 1.036 / 1.002 ms,
# M = 1024 1.907 / 1.870 ms); "mid" (the prefill kernel in groups of 2 splits) to 2048 (see
# BUCKETS). Which bucket serves changes no byte (every bucket gives the same bytes:
# tests/gpu/test_pallas_gpu.py, the ladder's B stage).
BUCKET_TABLE: tuple[tuple[int, str], ...] = ((64, "decode"), (256, "small"), (2048, "mid"), (1 << 62, "prefill"))


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
    "BUCKETS",
    "BUCKET_TABLE",
    "FOLD",
    "DZ",
    "select_bucket",
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
