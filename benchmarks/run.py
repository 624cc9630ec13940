"""Benchmark runner: linear_logp backends vs XLA baselines vs the GEMM alone.

    python -m benchmarks.run --shape tiny --m 1,8,64 --backends reference,xla,xla_chunked,gemm
    python benchmarks/run.py --shape qwen3_8b --backends pallas_sm90,xla,xla_chunked,gemm
    python -m benchmarks.run --shape qwen3_8b --backends pallas_sm90 --weight_layout dv --ms 1,64,4096
    python -m benchmarks.run --shape qwen3_8b --backends pallas_sm90 --entropy --ms 1,4096,16384

Writes the JSON and the PNG into a new ./detlogp-results/<UTC stamp>/ (untracked) unless
--out_dir or --out says where. See benchmarks/README.md for the columns and the recommended
H200 commands.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import app, flags, logging

from benchmarks import cases, report, shapes, timing
from benchmarks.report import CaseResult
from detlogp_jax import backends as detlogp_backends
from detlogp_jax import contract

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MS = (1, 2, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}

FLAGS = flags.FLAGS
# absl.logging registers "-v" as a short alias of --verbosity; --v here is the vocab size
# (--verbosity itself stays available).
if "v" in FLAGS and FLAGS["v"].name == "verbosity":
    delattr(FLAGS, "v")
flags.DEFINE_enum(
    "shape", "qwen3_8b", sorted(shapes.SHAPES) + ["custom"], "lm_head shape by name (see benchmarks/shapes.py)."
)
flags.DEFINE_integer("d", None, "custom: hidden size D.")
flags.DEFINE_integer("v", None, "custom: weight rows (padded vocab); default canonical padding of --v_real.")
flags.DEFINE_integer("v_real", None, "custom: real vocabulary (vocab_size); default --v.")
flags.DEFINE_list("m", [str(m) for m in DEFAULT_MS], "Rows per call (M) to sweep.")
flags.DEFINE_alias("ms", "m")
flags.DEFINE_list(
    "backends", ["pallas_sm90", "xla", "xla_chunked", "gemm"], f"Backends, from {list(cases.ALL_BACKENDS)}."
)
flags.DEFINE_enum(
    "entry", "trainer", list(cases.ENTRIES), "trainer: logp+lse; serving: also FP32 logits (return_logits=True)."
)
flags.DEFINE_enum("mode", "fwd", list(cases.MODES), "fwd, or fwd_bwd = grad of sum(logp) w.r.t. hidden and weight.")
flags.DEFINE_integer("warmup", 5, "Warmup calls per case (after compilation).")
flags.DEFINE_integer("iters", 30, "Timed samples per case (a sample = --calls_per_sample calls, then one sync).")
flags.DEFINE_integer(
    "calls_per_sample",
    1,
    "Back-to-back calls per timed sample (1 = sync after every call); >1 hides host dispatch/sync latency at small M.",
)
flags.DEFINE_enum("dtype", "bf16", list(DTYPES), "hidden/weight dtype.")
flags.DEFINE_integer("seed", 0, "PRNG seed of the inputs.")
flags.DEFINE_string(
    "out_dir",
    None,
    "Folder for the JSON and the plot, named <shape>_<entry>_<mode>[_dv][_res-logits]_<device>.json / .png "
    "(default: a new ./detlogp-results/<UTC stamp>/, untracked).",
)
flags.DEFINE_string("out", None, "JSON path (overrides --out_dir for the JSON; the plot goes next to it).")
flags.DEFINE_string("plot", None, "PNG path (default: --out with .png; 'none' to skip).")
flags.DEFINE_float(
    "max_seconds_per_case",
    60.0,
    "Guard: warmup+timing budget per case; larger M of a backend predicted to exceed it are skipped.",
)
flags.DEFINE_float(
    "hbm_tbps",
    None,
    "HBM bandwidth (TB/s) for the memory floor in the plot; default: the measured ceiling of a known "
    "device (KNOWN_CEILINGS: the H200's 4.0), none elsewhere (a CPU run draws no floors).",
)
flags.DEFINE_float(
    "peak_tflops",
    None,
    "Dense bf16 peak (TFLOP/s) for the compute floor in the plot; default as for --hbm_tbps (the H200's 790).",
)

# Ceilings measured on a device kind (a large copy, a large bf16 GEMM): the plot's floors use them
# unless --hbm_tbps / --peak_tflops say otherwise; a device not listed gets no floors by default.
KNOWN_CEILINGS = {"NVIDIA H200": (4.0, 790.0)}
flags.DEFINE_integer("input_sets", 2, "Input sets (hidden, targets) rotated across calls; the weight is shared.")
flags.DEFINE_enum("gemm_out", "bf16", ["bf16", "f32"], "Output dtype of the GEMM-alone ceiling.")
flags.DEFINE_integer("chunk_block", 2048, "xla_chunked: vocab rows per block.")
flags.DEFINE_string(
    "tuning", "", 'JSON dict of bit-neutral knobs passed to linear_logp (e.g. \'{"bucket": "prefill"}\').'
)
flags.DEFINE_enum(
    "weight_layout",
    "vd",
    list(cases.WEIGHT_LAYOUTS),
    "vd: W [V_rows, D] (lm_head); dv: the [D, V_rows] Flax/Tunix kernel, made once before timing and read in place "
    "(library backends only).",
)
flags.DEFINE_enum(
    "residuals",
    "recompute",
    list(cases.RESIDUALS),
    "--mode fwd_bwd: what the forward keeps for the backward (linear_logp(residuals=...)). recompute: the backward "
    "recomputes the logits chunk by chunk (four GEMM passes); logits: the forward keeps its FP32 logits [M, V] "
    "(three passes, O(M * V) memory; compare temp_MB / peak_MB). Library backends; the xla lane ignores it.",
)
flags.DEFINE_bool(
    "entropy",
    False,
    "Also time every library backend with return_entropy=True (rows '<backend>+entropy', right after the "
    "backend's own case at each M, same inputs); records the time ratio and whether logp/lse bytes are "
    "unchanged. A backend whose registry entry does not declare the entropy is skipped with the reason.",
)


@dataclasses.dataclass
class RunConfig:
    shape: shapes.Shape
    ms: tuple[int, ...] = DEFAULT_MS
    backends: tuple[str, ...] = ("pallas_sm90", "xla", "xla_chunked", "gemm")
    entry: str = "trainer"
    mode: str = "fwd"
    warmup: int = 5
    iters: int = 30
    calls_per_sample: int = 1
    dtype: str = "bf16"
    seed: int = 0
    max_seconds_per_case: float = 60.0
    hbm_tbps: float | None = None  # None: KNOWN_CEILINGS of the device, else no floors
    peak_tflops: float | None = None
    input_sets: int = 2
    gemm_out: str = "bf16"
    chunk_block: int = 2048
    tuning: dict = dataclasses.field(default_factory=dict)
    weight_layout: str = "vd"  # "dv": the weight is the [D, V_rows] kernel (cases.make_weight)
    residuals: str = "recompute"  # "logits": linear_logp(residuals="logits") (mode fwd_bwd)
    entropy: bool = False  # also time each library backend with return_entropy=True ("<backend>+entropy")
    out: str | None = None  # the JSON path; None: the default name in out_dir
    out_dir: str | None = None  # None (and no out): a new ./detlogp-results/<UTC stamp>/, chosen once here
    plot: str | None = None  # None: next to out; "none": no plot
    command_line: str = ""

    def __post_init__(self):
        bad = [b for b in self.backends if b not in cases.ALL_BACKENDS]
        if bad:
            raise ValueError(f"unknown backends {bad}; choose from {cases.ALL_BACKENDS}")
        if not self.ms or min(self.ms) < 1:
            raise ValueError(f"M values must be >= 1, got {self.ms}")
        if self.iters < 1 or self.warmup < 0 or self.input_sets < 1 or self.calls_per_sample < 1:
            raise ValueError("need iters >= 1, warmup >= 0, input_sets >= 1, calls_per_sample >= 1")
        if self.weight_layout not in cases.WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout must be in {cases.WEIGHT_LAYOUTS}, got {self.weight_layout!r}")
        if self.residuals not in cases.RESIDUALS:
            raise ValueError(f"residuals must be in {cases.RESIDUALS}, got {self.residuals!r}")
        if self.residuals != "recompute" and self.mode != "fwd_bwd":
            raise ValueError(f"--residuals={self.residuals} changes only the backward: use it with --mode fwd_bwd")
        if not self.out and not self.out_dir:
            self.out_dir = report.default_out_dir()  # chosen once, so the JSON and the plot share it

    def spec(self, backend: str, entropy: bool = False) -> cases.CaseSpec:
        return cases.CaseSpec(
            backend,
            self.shape,
            self.entry,
            self.mode,
            self.gemm_out,
            self.chunk_block,
            tuple(sorted(self.tuning.items())),
            self.weight_layout,
            self.residuals,
            entropy,
        )

    def out_path(self) -> str:
        if self.out:
            return self.out
        layout = "" if self.weight_layout == "vd" else f"_{self.weight_layout}"
        res = "" if self.residuals == "recompute" else f"_res-{self.residuals}"
        name = f"{self.shape.name}_{self.entry}_{self.mode}{layout}{res}_{device_tag()}.json"
        return os.path.join(self.out_dir, name)

    def plot_path(self) -> str | None:
        if self.plot and self.plot.lower() == "none":
            return None
        return self.plot or os.path.splitext(self.out_path())[0] + ".png"


def config_from_flags() -> RunConfig:
    return RunConfig(
        shape=shapes.get(FLAGS.shape, d=FLAGS.d, v=FLAGS.v, v_real=FLAGS.v_real),
        ms=tuple(int(m) for m in FLAGS.m),
        backends=tuple(FLAGS.backends),
        entry=FLAGS.entry,
        mode=FLAGS.mode,
        warmup=FLAGS.warmup,
        iters=FLAGS.iters,
        calls_per_sample=FLAGS.calls_per_sample,
        dtype=FLAGS.dtype,
        seed=FLAGS.seed,
        max_seconds_per_case=FLAGS.max_seconds_per_case,
        hbm_tbps=FLAGS.hbm_tbps,
        peak_tflops=FLAGS.peak_tflops,
        input_sets=FLAGS.input_sets,
        gemm_out=FLAGS.gemm_out,
        chunk_block=FLAGS.chunk_block,
        tuning=json.loads(FLAGS.tuning) if FLAGS.tuning else {},
        weight_layout=FLAGS.weight_layout,
        residuals=FLAGS.residuals,
        entropy=FLAGS.entropy,
        out=FLAGS.out,
        out_dir=FLAGS.out_dir,
        plot=FLAGS.plot,
        command_line=" ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
    )


# --- environment ------------------------------------------------------------------------


def device_tag() -> str:
    kind = getattr(jax.devices()[0], "device_kind", jax.devices()[0].platform)
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def _git_commit() -> str | None:
    """HEAD's sha, '+dirty' when tracked files are modified; None outside a git checkout."""
    try:

        def git(*args):
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)

        head = git("rev-parse", "--verify", "HEAD")
        sha = head.stdout.strip()
        if head.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", sha):
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return None


def environment(cfg: RunConfig) -> dict:
    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": getattr(dev, "device_kind", dev.platform),
        "device_count": jax.device_count(),
        "compute_capability": getattr(dev, "compute_capability", None),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "numpy_version": np.__version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": cfg.command_line,
        "git_commit": _git_commit(),
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "available_backends": list(detlogp_backends.available()),
        "contract_id": contract.CONTRACT_ID,
    }


# --- inputs ---------------------------------------------------------------------------------


def make_weight(cfg: RunConfig) -> jax.Array:
    return cases.make_weight(cfg.shape, DTYPES[cfg.dtype], cfg.seed, cfg.weight_layout)


def make_inputs(cfg: RunConfig, m: int) -> list[tuple[jax.Array, jax.Array]]:
    return cases.make_inputs(cfg.shape, DTYPES[cfg.dtype], cfg.seed, m, cfg.input_sets)


# --- one case -------------------------------------------------------------------------------


class _ProbeCache:
    """The M=1 executable of each backend, for the batch-invariance probe."""

    def __init__(self):
        self._compiled = {}

    def get(self, backend, fn, args):
        if backend not in self._compiled:
            self._compiled[backend] = timing.compile_case(fn, args)[0]
        return self._compiled[backend]

    def put(self, backend, compiled):
        self._compiled.setdefault(backend, compiled)


def run_case(
    cfg: RunConfig,
    backend: str,
    m: int,
    weight,
    inputs,
    probes: _ProbeCache,
    entropy: bool = False,
    keep: dict | None = None,
) -> tuple[CaseResult, dict]:
    """Compiles, times and probes one (backend, M) (with `entropy`: the "<backend>+entropy"
    case, return_entropy=True). Returns (result, small per-row outputs); `keep`, if given,
    receives the compiled case under its label (for the interleaved entropy pairs)."""
    spec = cfg.spec(backend, entropy)
    label = spec.label
    fn = cases.build(spec)
    arg_sets = [(h, weight, t) for h, t in inputs]
    h0, t0 = inputs[0]
    why = cases.unsupported_reason(backend, h0, weight, cfg.weight_layout, entropy)
    if why:
        return CaseResult(label, m, "skipped", note=why), {}

    compiled, compile_s = timing.compile_case(fn, arg_sets[0])
    if m == 1:
        probes.put(label, compiled)
    if keep is not None:
        keep[label] = compiled
    tm, first = timing.time_case(
        compiled,
        arg_sets,
        warmup=cfg.warmup,
        iters=cfg.iters,
        budget_s=cfg.max_seconds_per_case,
        calls_per_sample=cfg.calls_per_sample,
    )

    again = compiled(*arg_sets[0])
    run_to_run = "bitwise-identical" if timing.same_bytes(first, again) else "differs"
    del again

    p = m // 2
    h1, t1 = timing.row_inputs(h0, t0, p)
    alone = probes.get(label, fn, (h1, weight, t1))(h1, weight, t1)
    det = timing.compare_rows(first, alone, p, cases.FORWARD_ROW_FIELDS)
    grad_det = timing.compare_rows(first, alone, p, cases.GRAD_ROW_FIELDS)
    del alone

    sec = tm.median_ms / 1e3
    flops = cases.flops(spec, m)
    nbytes = timing.tree_nbytes(arg_sets[0]) + timing.tree_nbytes(first)
    rows = {f: np.asarray(first[f]) for f in ("logp", "lse") if f in first}
    del first
    result = CaseResult(
        label,
        m,
        "ok",
        median_ms=tm.median_ms,
        min_ms=tm.min_ms,
        max_ms=tm.max_ms,
        times_ms=tm.times_ms,
        warmup_done=tm.warmup_done,
        truncated=tm.truncated,
        compile_s=compile_s,
        flops=flops,
        bytes_moved=nbytes,
        tflops=flops / sec / 1e12,
        tbps=nbytes / sec / 1e12,
        compiled_memory=timing.compiled_memory(compiled),
        device_memory=timing.device_memory(),
        determinism=timing.summarize(det, trivial=m == 1),
        determinism_detail=det,
        grad_determinism=timing.summarize(grad_det, trivial=m == 1),
        grad_determinism_detail=grad_det,
        run_to_run=run_to_run,
    )
    return result, rows


def _predicted_skip(cfg: RunConfig, last: CaseResult | None, m: int) -> str | None:
    """Skip a larger M when the last M's time, scaled linearly, would blow the guard."""
    if last is None or last.median_ms is None or m <= last.m:
        return None
    per_call = last.median_ms / 1e3 * m / last.m
    if per_call * 3 > cfg.max_seconds_per_case:  # first warmup + one timed call + the re-run
        return f"predicted {per_call:.1f} s/call at M={m} exceeds --max_seconds_per_case={cfg.max_seconds_per_case:g}"
    return None


def _log(t_start: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t_start:8.1f}s] {msg}", file=sys.stderr, flush=True)


def _progress_line(i: int, n: int, r: CaseResult) -> str:
    head = f"({i}/{n}) {r.backend:<11} M={r.m:<6}"
    if r.status != "ok":
        return f"{head} {r.status}: {r.note}"
    return (
        f"{head} median {r.median_ms:9.4f} ms  [{r.min_ms:.4f}, {r.max_ms:.4f}]  {r.tflops:7.2f} TFLOP/s  "
        f"compile {r.compile_s:.1f}s  {r.determinism}" + (" [truncated]" if r.truncated else "")
    )


# --- the sweep ------------------------------------------------------------------------------


def ceilings(cfg: RunConfig) -> tuple[float, float] | None:
    """(HBM TB/s, bf16 TFLOP/s) for the plot's floors: the flags, else the device's known
    ceilings (`KNOWN_CEILINGS`), else None (no floors: e.g. a CPU run)."""
    known = KNOWN_CEILINGS.get(getattr(jax.devices()[0], "device_kind", ""), (None, None))
    hbm = cfg.hbm_tbps if cfg.hbm_tbps is not None else known[0]
    peak = cfg.peak_tflops if cfg.peak_tflops is not None else known[1]
    return None if hbm is None or peak is None else (hbm, peak)


def floors(cfg: RunConfig) -> list[dict]:
    """The HBM and compute floors per M for the device's ceilings (`ceilings`); [] without them."""
    ceil = ceilings(cfg)
    if ceil is None:
        return []
    hbm_tbps, peak_tflops = ceil
    spec = cfg.spec("xla")
    item = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    return [
        {
            "m": m,
            "hbm_floor_ms": cases.min_bytes(spec, m, item) / (hbm_tbps * 1e12) * 1e3,
            "compute_floor_ms": cases.flops(spec, m) / (peak_tflops * 1e12) * 1e3,
        }
        for m in cfg.ms
    ]


def run(cfg: RunConfig) -> dict:
    """Runs the sweep; returns the JSON document (nothing written)."""
    t_start = time.perf_counter()
    skipped_backends = {b: r for b in cfg.backends if (r := cases.unavailable_reason(b))}
    for b, r in skipped_backends.items():
        _log(t_start, f"skipping backend {b}: {r}")
    todo = [b for b in cfg.backends if b not in skipped_backends]
    # With --entropy each library backend's case is followed by its "+entropy" case (same M, inputs).
    plan = [(b, False) for b in todo]
    if cfg.entropy:
        plan = [x for b in todo for x in ([(b, False), (b, True)] if b in cases.LIBRARY_BACKENDS else [(b, False)])]
    s = cfg.shape
    _log(
        t_start,
        f"shape {s.name}: D={s.d} V_rows={s.v_rows} V_real={s.v_real} {cfg.dtype}; entry={cfg.entry} mode={cfg.mode}; "
        f"weight_layout={cfg.weight_layout}; residuals={cfg.residuals}; "
        + ("entropy cases: yes; " if cfg.entropy else "")
        + f"M={list(cfg.ms)}; backends={todo}; device={jax.devices()[0].device_kind}",
    )
    weight = make_weight(cfg)
    results, rows, last = [], {}, {}
    probes = _ProbeCache()
    n, i = len(cfg.ms) * len(plan), 0
    for m in cfg.ms:
        inputs = make_inputs(cfg, m)
        kept = {}  # compiled cases of this M: an entropy case is timed again interleaved with its base
        for backend, entropy in plan:
            i += 1
            label = cfg.spec(backend, entropy).label
            why = _predicted_skip(cfg, last.get(label), m)
            if why:
                r, case_rows = CaseResult(label, m, "skipped", note=why), {}
            else:
                try:
                    keep = kept if cfg.entropy else None  # only an entropy run times pairs
                    r, case_rows = run_case(cfg, backend, m, weight, inputs, probes, entropy, keep=keep)
                    base = kept.get(backend) if entropy else None
                    if r.status == "ok" and base is not None:
                        ratios = timing.paired_ratios(
                            base,
                            kept[label],
                            [(h, weight, t) for h, t in inputs],
                            pairs=cfg.iters,
                            calls_per_sample=cfg.calls_per_sample,
                        )
                        r.entropy_paired_ratio = float(np.median(ratios))
                        r.entropy_paired_min_max = [float(min(ratios)), float(max(ratios))]
                    if entropy:
                        kept.clear()  # the pair is done: free both executables
                except Exception as e:  # OOM, lowering errors, ...: record and go on
                    msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    r, case_rows = CaseResult(label, m, "error", note=msg), {}
            if r.status == "ok":
                last[label] = r
            rows[(label, m)] = case_rows
            results.append(r)
            _log(t_start, _progress_line(i, n, r))
        del inputs
    report.fill_cross_backend(results, rows)
    report.fill_entropy_ratios(results, rows)
    return {
        "schema": report.SCHEMA,
        "environment": environment(cfg),
        "config": {
            **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("shape", "command_line")},
            "out": cfg.out_path(),
            "plot": cfg.plot_path(),
        },
        "shape": dataclasses.asdict(cfg.shape),
        "ceilings": ceilings(cfg),
        "floors": floors(cfg),
        "skipped_backends": skipped_backends,
        "cases": [r.as_dict() for r in results],
        "wall_s": time.perf_counter() - t_start,
    }


def execute(cfg: RunConfig) -> dict:
    """Runs the sweep, writes the JSON (and the plot), prints the table. Returns the document."""
    doc = run(cfg)
    results = [CaseResult(**c) for c in doc["cases"]]
    report.write_json(doc, cfg.out_path())
    plot_path = cfg.plot_path()
    if plot_path and results:
        env = doc["environment"]
        s = cfg.shape
        title = (
            f"{s.name} (D={s.d}, V={s.v_rows}/{s.v_real}) {cfg.dtype} {cfg.entry} {cfg.mode}"
            + ("" if cfg.weight_layout == "vd" else f" weight_layout={cfg.weight_layout}")
            + ("" if cfg.residuals == "recompute" else f" residuals={cfg.residuals}")
            + f" on {env['device_kind']}"
        )
        hbm_tbps, peak_tflops = ceilings(cfg) or (None, None)
        report.plot(results, doc["floors"], plot_path, title, hbm_tbps, peak_tflops)
    print(report.format_table(results))
    entropy_lines = report.format_entropy_summary(results)
    if entropy_lines:
        print(entropy_lines)
    for b, r in doc["skipped_backends"].items():
        print(f"skipped backend {b}: {r}")
    print(f"wrote {cfg.out_path()}" + (f" and {plot_path}" if plot_path else "") + f" ({doc['wall_s']:.1f} s)")
    return doc


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep stderr to the progress lines
    execute(config_from_flags())


if __name__ == "__main__":
    app.run(main)
