"""Case results, the printed table, the JSON document and the plot."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Sequence

SCHEMA = "detlogp-bench/1"
# Where the benchmark commands write when no path is given: a new folder under this one, relative to
# the working directory. It is in .gitignore, so no default run writes over a tracked file.
DEFAULT_RESULTS_DIR = "detlogp-results"


def default_out_dir(root: str = DEFAULT_RESULTS_DIR) -> str:
    """A new folder name `<root>/<UTC stamp>` (suffixed -2, -3, ... if taken); not created here."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, n = os.path.join(root, stamp), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{stamp}-{n}")
    return path


@dataclasses.dataclass
class CaseResult:
    """One (backend, M) measurement. Times are per call, device-synchronized."""

    backend: str
    m: int
    status: str  # "ok" | "skipped" | "error"
    note: str = ""
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    times_ms: list[float] = dataclasses.field(default_factory=list)
    warmup_done: int = 0
    truncated: bool = False  # fewer warmups/iterations than asked (per-case guard)
    compile_s: float | None = None
    flops: float | None = None  # model FLOPs (2*M*D*V_rows fwd, x3 for fwd_bwd)
    bytes_moved: int | None = None  # arguments + outputs, from the actual arrays
    tflops: float | None = None  # flops / median time
    tbps: float | None = None  # bytes_moved / median time
    time_vs_xla: float | None = None  # median_ms / xla median_ms at the same M (< 1: faster)
    lse_max_abs_diff_vs_xla: float | None = None
    logp_max_abs_diff_vs_xla: float | None = None
    compiled_memory: dict = dataclasses.field(default_factory=dict)  # XLA memory_analysis
    device_memory: dict = dataclasses.field(default_factory=dict)  # allocator stats after the case
    determinism: str | None = None  # probe row alone (M=1) vs at M//2 in the batch: logp/lse/logits
    determinism_detail: dict = dataclasses.field(default_factory=dict)
    grad_determinism: str | None = None  # same probe on d_hidden (fwd_bwd only)
    grad_determinism_detail: dict = dataclasses.field(default_factory=dict)
    run_to_run: str | None = None  # same inputs twice: "bitwise-identical" | "differs"
    # Entropy cases ("<backend>+entropy", benchmarks.run --entropy): median time over the same
    # backend's case without the entropy at the same M, and whether its logp/lse bytes are that case's.
    entropy_time_ratio: float | None = None
    entropy_same_logp_lse: bool | None = None
    # The same ratio from interleaved samples of the two compiled cases (timing.paired_ratios:
    # with, without, alternating which goes first): median and [min, max] over the pairs.
    entropy_paired_ratio: float | None = None
    entropy_paired_min_max: list[float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fill_cross_backend(cases: Sequence[CaseResult], rows: dict[tuple[str, int], dict]) -> None:
    """time_vs_xla and lse/logp differences vs the xla case at the same M."""
    import numpy as np

    xla = {c.m: c for c in cases if c.backend == "xla" and c.status == "ok"}
    for c in cases:
        ref = xla.get(c.m)
        if c.status != "ok" or ref is None:
            continue
        c.time_vs_xla = c.median_ms / ref.median_ms
        mine, theirs = rows.get((c.backend, c.m), {}), rows.get(("xla", c.m), {})
        for field in ("lse", "logp"):
            if field in mine and field in theirs:
                with np.errstate(invalid="ignore"):
                    d = np.abs(mine[field].astype(np.float64) - theirs[field].astype(np.float64))
                d = d[np.isfinite(d)]
                setattr(c, f"{field}_max_abs_diff_vs_xla", float(d.max()) if d.size else 0.0)


def fill_entropy_ratios(cases: Sequence[CaseResult], rows: dict[tuple[str, int], dict]) -> None:
    """entropy_time_ratio / entropy_same_logp_lse of each "<backend>+entropy" case vs "<backend>"."""
    import numpy as np

    by_key = {(c.backend, c.m): c for c in cases if c.status == "ok"}
    for c in cases:
        if c.status != "ok" or not c.backend.endswith("+entropy"):
            continue
        base = by_key.get((c.backend[: -len("+entropy")], c.m))
        if base is None:
            continue
        c.entropy_time_ratio = c.median_ms / base.median_ms
        mine, theirs = rows.get((c.backend, c.m), {}), rows.get((base.backend, c.m), {})
        fields = [f for f in ("logp", "lse") if f in mine and f in theirs]
        if fields:
            c.entropy_same_logp_lse = all(
                np.asarray(mine[f]).tobytes() == np.asarray(theirs[f]).tobytes() for f in fields
            )


def format_entropy_summary(cases: Sequence[CaseResult]) -> str:
    """One line per entropy case: time with / without the entropy, and the logp/lse bytes check."""
    lines = []
    for c in cases:
        if c.entropy_time_ratio is None:
            continue
        same = {True: "logp/lse bytes unchanged", False: "logp/lse BYTES CHANGED", None: "logp/lse not compared"}
        paired = ""
        if c.entropy_paired_ratio is not None:
            lo, hi = c.entropy_paired_min_max
            paired = f"; interleaved pairs {c.entropy_paired_ratio:.4f}x [{lo:.4f}, {hi:.4f}]"
        lines.append(
            f"entropy {c.backend[: -len('+entropy')]} M={c.m}: {c.entropy_time_ratio:.4f}x "
            f"({c.median_ms:.4f} ms with, {c.median_ms / c.entropy_time_ratio:.4f} ms without){paired}; "
            f"{same[c.entropy_same_logp_lse]}"
        )
    return "\n".join(lines)


def _fmt(x, spec: str, empty: str = "-") -> str:
    return empty if x is None else format(x, spec)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


TABLE_COLUMNS = (
    ("backend", 12),
    ("M", 6),
    ("median_ms", 10),
    ("min_ms", 9),
    ("max_ms", 9),
    ("TFLOP/s", 8),
    ("TB/s", 7),
    ("t/t_xla", 7),
    ("lse_dxla", 8),
    ("temp_MB", 8),
    ("peak_MB", 8),
    ("determinism", 0),
)


def _row(c: CaseResult) -> list[str]:
    if c.status != "ok":
        return [c.backend, str(c.m)] + [f"{c.status}: {c.note}"]
    return [
        c.backend,
        str(c.m),
        _fmt(c.median_ms, ".4f"),
        _fmt(c.min_ms, ".4f"),
        _fmt(c.max_ms, ".4f"),
        _fmt(c.tflops, ".2f"),
        _fmt(c.tbps, ".3f"),
        _fmt(c.time_vs_xla, ".2f"),
        _fmt(c.lse_max_abs_diff_vs_xla, ".1e"),
        _mb(c.compiled_memory.get("temp_bytes")),
        _mb(c.device_memory.get("peak_bytes_in_use")),
        (c.determinism or "-")
        + (f"; grad {c.grad_determinism}" if c.grad_determinism else "")
        + ("" if not c.truncated else " [truncated]"),
    ]


def format_table(cases: Sequence[CaseResult]) -> str:
    """One line per backend x M, ordered by backend then M."""
    order = {b: i for i, b in enumerate(dict.fromkeys(c.backend for c in cases))}
    lines = ["  ".join(name.rjust(w) if w else name for name, w in TABLE_COLUMNS)]
    for c in sorted(cases, key=lambda c: (order[c.backend], c.m)):
        cells = _row(c)
        widths = [w for _, w in TABLE_COLUMNS][: len(cells)]
        lines.append("  ".join(cell.rjust(w) if w else cell for cell, w in zip(cells, widths)))
    return "\n".join(lines)


def write_json(doc: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")


_STYLES = {
    "pallas_sm90": dict(color="tab:red", marker="o", lw=2),
    "reference": dict(color="tab:purple", marker="v"),
    "xla": dict(color="tab:blue", marker="s"),
    "xla_chunked": dict(color="tab:green", marker="^"),
    "gemm": dict(color="black", marker="x", ls="--"),
    "gemm_remat": dict(color="dimgray", marker="+", ls="--"),
}


def plot(
    cases: Sequence[CaseResult], floors: Sequence[dict], path: str, title: str, hbm_tbps: float, peak_tflops: float
) -> None:
    """Time per call vs M (log-log): a line per backend, GEMM alone dashed, the two floors dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for backend in dict.fromkeys(c.backend for c in cases):
        ok = sorted((c.m, c.median_ms) for c in cases if c.backend == backend and c.status == "ok")
        if ok:
            label = {"gemm": "gemm (GEMM alone)", "gemm_remat": "gemm_remat (GEMM alone, logits recomputed)"}.get(
                backend, backend
            )
            ax.plot([m for m, _ in ok], [t for _, t in ok], label=label, **_STYLES.get(backend, {}))
    if floors:
        ms = [f["m"] for f in floors]
        floor_style = dict(ls=":", marker="_", markersize=16)  # the marker keeps a single-M floor visible
        ax.plot(
            ms,
            [f["hbm_floor_ms"] for f in floors],
            color="gray",
            label=f"HBM floor (min bytes / {hbm_tbps:g} TB/s)",
            **floor_style,
        )
        ax.plot(
            ms,
            [f["compute_floor_ms"] for f in floors],
            color="tab:orange",
            label=f"compute floor (FLOPs / {peak_tflops:g} TFLOP/s)",
            **floor_style,
        )
    shown = [c.median_ms for c in cases if c.status == "ok"] + [f["hbm_floor_ms"] for f in floors]
    if shown:  # keep the compute floor at tiny M from squashing the measured lines
        ax.set_ylim(0.5 * min(shown), 2.0 * max(shown))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (rows per call)")
    ax.set_ylabel("time per call (ms, median)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
