"""Benchmark runner of the batch-invariant body (`detlogp_jax.body`) against plain XLA.

    python -m benchmarks.body --ops=gemm --out=/tmp/body_gemm.json                 # H200, Qwen3-8B
    python -m benchmarks.body --ops=gemm --m=1,64,4096 --gemm_proj=q,down --lanes=ours,xla
    python -m benchmarks.body --shape=tiny --m=1,8 --lanes=ours,xla                # CPU smoke run
    python -m benchmarks.body --ops=attention --out=/tmp/body_attention.json       # H200, Qwen3-8B heads
    python -m benchmarks.body --ops=attention --shape=tiny --attn_lanes=ours,xla   # CPU smoke run

GEMM lanes, per projection of a Qwen3-8B layer (q [4096 -> 4096], k / v [4096 -> 1024],
o [4096 -> 4096], gate / up [4096 -> 12288], down [12288 -> 4096]; projections of one shape
are timed once and labelled together, e.g. "q/o") and per M (rows = batch x tokens):
* ours: `body.matmul(x, w)` (backend --backend, "auto": pallas_sm90 on a Hopper GPU,
  the reference elsewhere), W [K, N] (--layout kn, a Flax / Tunix kernel) or [N, K] (nk);
* xla: plain `jnp.dot(x, w)` in bf16, what a Flax / Tunix model runs today;
* cublas: torch.matmul on the same GPU (cuBLAS's bf16 GEMM; skipped without torch + CUDA).
A sample is --calls_per_sample back-to-back calls then one `jax.block_until_ready` (torch:
`torch.cuda.synchronize`), divided; --iters samples per lane after --warmup calls, rotating
over 3 distinct operand sets (W of 3 layers: decode streams weights from memory, not from L2).
Each lane reports median / min / max ms; `ours/xla` is the median of --iters paired ratios
(`benchmarks.timing.paired_ratios`: the two lanes sampled alternately in the same run). Bars
(issue 40): ours/xla <= 1.05 at M <= 64, <= 1.10 at M >= 512.

Attention lanes (--ops attention), causal GQA over a KV cache at the Qwen3-8B heads (Hq = 32,
Hkv = 8, Dh = 128, bf16), per case of --attn_cases: "decode" (B = 64 sequences, one query each,
over a cache of 4096 slots, positions spread over the last 1024), "prefill" (8 x 1024 queries
over their own 1024 keys) and "prefill_long" (1 x 4096):
* ours: `body.attention` (backend --backend: pallas_sm90 on a Hopper GPU, the reference
  elsewhere);
* xla: `body.attention(..., backend="xla")`, plain einsum + masked softmax (what a Flax /
  Tunix model runs);
* cudnn: `jax.nn.dot_product_attention(..., implementation="cudnn")` (prefill: is_causal; decode:
  key_value_seq_lengths = position + 1); skipped where cuDNN is not there.
Same sampling as the GEMM lanes (3 operand sets); `ours/xla` and `ours/cudnn` are medians of
paired ratios. No bars yet: the first H200 numbers set them.

A JSON with every sample goes to --out (none by default); tables close the run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

# Not grabbing 75% of the GPU's memory up front: the cuBLAS lane's torch shares the device.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import timing
from detlogp_jax import body
from detlogp_jax.body import backends as body_backends

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMM_SHAPES = {
    "qwen3_8b": {
        "q": (4096, 4096),
        "k": (4096, 1024),
        "v": (4096, 1024),
        "o": (4096, 4096),
        "gate": (4096, 12288),
        "up": (4096, 12288),
        "down": (12288, 4096),
    },
    "tiny": {
        "q": (128, 128),
        "k": (128, 64),
        "v": (128, 64),
        "o": (128, 128),
        "gate": (128, 256),
        "up": (128, 256),
        "down": (256, 128),
    },
}
GEMM_LANES = ("ours", "xla", "cublas")
N_SETS = 3
# Attention: heads (Hq, Hkv, Dh) and cases (B sequences, T queries each, S cache slots) per --shape.
ATTN_HEADS = {"qwen3_8b": (32, 8, 128), "tiny": (4, 2, 64)}
ATTN_CASES = {
    "qwen3_8b": {"decode": (64, 1, 4096), "prefill": (8, 1024, 1024), "prefill_long": (1, 4096, 4096)},
    "tiny": {"decode": (4, 1, 256), "prefill": (2, 64, 64), "prefill_long": (1, 128, 128)},
}
ATTN_LANES = ("ours", "xla", "cudnn")

FLAGS = flags.FLAGS
flags.DEFINE_list("ops", ["gemm"], "Body ops to time: gemm, attention, layer.")
flags.DEFINE_list("layer_cases", ["decode", "prefill", "train"], "Layer cases: decode, prefill, train (fwd+bwd).")
flags.DEFINE_enum("shape", "qwen3_8b", sorted(GEMM_SHAPES), "Layer shapes by model.")
flags.DEFINE_list("attn_cases", list(ATTN_CASES["qwen3_8b"]), "Attention cases: decode, prefill, prefill_long.")
flags.DEFINE_list("attn_lanes", list(ATTN_LANES), f"Attention lanes, from {list(ATTN_LANES)}.")
flags.DEFINE_string(
    "attn_config",
    None,
    "ours where pallas_sm90 serves: force this launch config of the Hopper attention kernel "
    "(pallas_kernels.body.attention_config.CONFIGS; bit-neutral), else its default choice.",
)
flags.DEFINE_list("gemm_proj", ["q", "k", "v", "o", "gate", "up", "down"], "Projections (same shapes timed once).")
flags.DEFINE_list("m", ["1", "8", "64", "512", "4096", "8192"], "Rows per call (M).")
flags.DEFINE_list("lanes", list(GEMM_LANES), f"GEMM lanes, from {list(GEMM_LANES)}.")
flags.DEFINE_enum("layout", "kn", ["kn", "nk"], "ours: W [K, N] (kn) or [N, K] (nk); xla / cublas read W [K, N].")
flags.DEFINE_string("backend", "auto", "ours: the body backend (auto, pallas_sm90, reference).")
flags.DEFINE_integer("warmup", 5, "Warmup calls per lane after compilation.")
flags.DEFINE_integer("iters", 20, "Timed samples per lane (and paired ratio samples).")
flags.DEFINE_integer("calls_per_sample", 10, "Back-to-back calls per sample (hides host dispatch latency).")
flags.DEFINE_float("max_seconds_per_case", 20.0, "Guard: timing budget of one lane at one (shape, M).")
flags.DEFINE_integer("seed", 0, "PRNG seed of the operands.")
flags.DEFINE_string("out", None, "JSON path (none: no file is written).")


@dataclasses.dataclass
class LaneResult:
    op: str
    proj: str
    k: int
    n: int
    m: int
    lane: str
    served_by: str
    median_ms: float | None
    min_ms: float | None
    max_ms: float | None
    samples_ms: list
    compile_s: float | None = None
    note: str = ""


def _stats(samples):
    return (statistics.median(samples), min(samples), max(samples)) if samples else (None, None, None)


def _gemm_groups(shape: str, projs) -> dict[tuple[int, int], str]:
    """(K, N) -> label of the projections of that shape, in the order first named."""
    table = GEMM_SHAPES[shape]
    unknown = [p for p in projs if p not in table]
    if unknown:
        raise app.UsageError(f"unknown projections {unknown} for --shape={shape}; known: {sorted(table)}")
    groups: dict[tuple[int, int], list[str]] = {}
    for p in projs:
        groups.setdefault(table[p], []).append(p)
    return {kn: "/".join(names) for kn, names in groups.items()}


def _operand_sets(k: int, n: int, m_max: int, layout: str, seed: int):
    """N_SETS (x [m_max, K], W [K, N], W in ours' layout) triples of bf16 device arrays."""
    sets = []
    for i in range(N_SETS):
        kx, kw = jax.random.split(jax.random.key(seed * 1000 + i))
        x = jax.random.normal(kx, (m_max, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        sets.append((x, w, w if layout == "kn" else jnp.asarray(w.T)))
    return sets


def _torch_lane():
    """torch.matmul on CUDA, or (None, why not)."""
    try:
        import torch
    except Exception as e:  # pragma: no cover - depends on the machine
        return None, f"torch does not import: {type(e).__name__}"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device here"
    return torch, ""


def _time_torch(torch, pairs, warmup: int, iters: int, calls: int, budget_s: float):
    """Samples (ms per call) of torch.matmul over the rotating operand pairs."""
    start = time.perf_counter()
    for i in range(max(1, warmup)):
        torch.matmul(*pairs[i % len(pairs)])
    torch.cuda.synchronize()
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        for j in range(calls):
            torch.matmul(*pairs[(i + j) % len(pairs)])
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
        if time.perf_counter() - start > budget_s:
            break
    return samples


def _time_jax(fn, arg_sets, calls: int):
    compiled, compile_s = timing.compile_case(fn, arg_sets[0])
    t, first = timing.time_case(
        compiled,
        arg_sets,
        warmup=FLAGS.warmup,
        iters=FLAGS.iters,
        budget_s=FLAGS.max_seconds_per_case,
        calls_per_sample=calls,
    )
    return compiled, compile_s, t.times_ms, first


def run_gemm() -> tuple[list[LaneResult], list[dict]]:
    """Every GEMM lane at every (projection shape, M); returns (lane results, ratio rows)."""
    ms = sorted(int(m) for m in FLAGS.m)
    lanes = [lane for lane in FLAGS.lanes if lane in GEMM_LANES]
    torch, torch_why = _torch_lane() if "cublas" in lanes else (None, "")
    results, ratios = [], []
    layout = FLAGS.layout
    ours = lambda x, w: body.matmul(x, w, w_layout=layout, backend=FLAGS.backend)
    xla = lambda x, w: jnp.dot(x, w)
    for (k, n), label in _gemm_groups(FLAGS.shape, FLAGS.gemm_proj).items():
        sets = _operand_sets(k, n, ms[-1], layout, FLAGS.seed)
        for m in ms:
            xs = [(x[:m], w, w_ours) for x, w, w_ours in sets]
            served = body_backends.resolve("matmul", FLAGS.backend, xs[0][0], xs[0][2], layout).name
            compiled, firsts = {}, {}
            for lane in lanes:
                res = LaneResult("gemm", label, k, n, m, lane, "", None, None, None, [])
                if lane == "cublas":
                    res.served_by = "torch.matmul (cuBLAS)"
                    if torch is None:
                        res.note = torch_why
                    else:
                        tp = [tuple(torch.from_dlpack(a) for a in (x, w)) for x, w, _ in xs]
                        res.samples_ms = _time_torch(
                            torch, tp, FLAGS.warmup, FLAGS.iters, FLAGS.calls_per_sample, FLAGS.max_seconds_per_case
                        )
                else:
                    fn, args = (
                        (ours, [(x, wo) for x, _, wo in xs]) if lane == "ours" else (xla, [(x, w) for x, w, _ in xs])
                    )
                    res.served_by = served if lane == "ours" else "jnp.dot"
                    try:
                        compiled[lane], res.compile_s, res.samples_ms, firsts[lane] = _time_jax(
                            fn, args, FLAGS.calls_per_sample
                        )
                    except Exception as e:  # a lane that fails to build or run is reported; the rest go on
                        res.note = f"failed: {type(e).__name__}: {str(e)[:300]}"
                res.median_ms, res.min_ms, res.max_ms = _stats(res.samples_ms)
                results.append(res)
                print(_lane_line(res), flush=True)
            if "ours" in compiled and "xla" in compiled:
                medians = {r.lane: r.median_ms for r in results[-len(lanes) :]}
                ratios.append(_ratio_row(label, k, n, m, compiled, firsts, xs, layout, medians))
    return results, ratios


def _ratio_row(label, k, n, m, compiled, firsts, xs, layout, medians):
    """ours/xla of one (shape, M): the median of paired samples of both compiled lanes on the
    same operands ("kn"), else (the lanes read different W arrays) the ratio of the medians."""
    # paired_ratios gives both lanes the same argument tuples: ours reads its own layout's W.
    if layout == "kn":
        paired = timing.paired_ratios(
            compiled["xla"],
            compiled["ours"],
            [(x, w) for x, w, _ in xs],
            pairs=FLAGS.iters,
            calls_per_sample=FLAGS.calls_per_sample,
        )
    else:
        paired = []
    diff = float(jnp.max(jnp.abs(firsts["ours"].astype(jnp.float32) - firsts["xla"].astype(jnp.float32))))
    bar = 1.05 if m <= 64 else (1.10 if m >= 512 else None)
    ratio = statistics.median(paired) if paired else medians["ours"] / medians["xla"]
    return dict(
        op="gemm",
        proj=label,
        k=k,
        n=n,
        m=m,
        ours_over_xla=ratio,
        paired_samples=paired,
        bar=bar,
        passes=None if bar is None or ratio is None else bool(ratio <= bar),
        max_abs_diff_vs_xla=diff,
    )


# --- attention ---------------------------------------------------------------------------------


def _attn_positions(b: int, t: int, s: int):
    """[B, T] int32 query positions: decode (T = 1) spreads its sequences over the cache's last
    1024 slots (each a different length); a prefill's queries are 0 .. T - 1 (T == S)."""
    if t == 1:
        span = min(1024, s)
        return jnp.asarray((s - 1 - (np.arange(b) * 97) % span)[:, None], jnp.int32)
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _attn_operand_sets(b, t, s, heads, seed):
    """N_SETS (q, k, v, q_positions, kv_start) tuples of device arrays (bf16 q / k / v)."""
    hq, hkv, dh = heads
    pos = _attn_positions(b, t, s)
    sets = []
    for i in range(N_SETS):
        kq, kk, kv = jax.random.split(jax.random.key(seed * 1000 + 500 + i), 3)
        q = jax.random.normal(kq, (b, t, hq, dh), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (b, s, hkv, dh), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (b, s, hkv, dh), jnp.float32).astype(jnp.bfloat16)
        sets.append((q, k, v, pos, jnp.zeros((b,), jnp.int32)))
    return sets


def _cudnn_lane(decode: bool):
    """jax.nn.dot_product_attention on cuDNN for this case, or (None, why not)."""
    if jax.devices()[0].platform != "gpu":
        return None, "cuDNN needs a CUDA GPU"

    def fn(q, k, v, pos, ks):
        del ks  # every benchmark sequence starts at slot 0
        if decode:  # one query at position p attends slots 0 .. p
            lengths = pos[:, 0] + 1
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    return fn, ""


def run_attention() -> tuple[list[LaneResult], list[dict]]:
    """Every attention lane at every case; returns (lane results, ratio rows)."""
    cases = ATTN_CASES[FLAGS.shape]
    unknown = [c for c in FLAGS.attn_cases if c not in cases]
    if unknown:
        raise app.UsageError(f"unknown --attn_cases {unknown}; known: {sorted(cases)}")
    heads = ATTN_HEADS[FLAGS.shape]
    lanes = [lane for lane in FLAGS.attn_lanes if lane in ATTN_LANES]
    results, ratios = [], []
    for case in FLAGS.attn_cases:
        b, t, s = cases[case]
        sets = _attn_operand_sets(b, t, s, heads, FLAGS.seed)
        q, k, v, pos, ks = sets[0]
        served = body_backends.resolve("attention", FLAGS.backend, q, k, v).name
        fns = {
            "ours": lambda q, k, v, p, ks: body.attention(q, k, v, q_positions=p, kv_start=ks, backend=FLAGS.backend),
            "xla": lambda q, k, v, p, ks: body.attention(q, k, v, q_positions=p, kv_start=ks, backend="xla"),
        }
        if FLAGS.attn_config and served == "pallas_sm90":
            from pallas_kernels.body import attention as pallas_attention

            def forced(q, k, v, p, ks):
                return pallas_attention.attention(
                    q,
                    k,
                    v,
                    q_positions=p,
                    kv_start=ks,
                    scale=heads[2] ** -0.5,
                    out_dtype=q.dtype,
                    config=FLAGS.attn_config,
                )

            fns["ours"] = forced
            served = f"pallas_sm90 (config {FLAGS.attn_config})"
        by = {"ours": served, "xla": "body.attention(backend='xla')", "cudnn": "jax.nn.dot_product_attention (cuDNN)"}
        label = f"{case} B={b} T={t} S={s}"
        compiled, firsts = {}, {}
        for lane in lanes:
            res = LaneResult("attention", case, s, heads[0] * heads[2], b * t, lane, by[lane], None, None, None, [])
            res.note = label
            fn, why = (fns[lane], "") if lane != "cudnn" else _cudnn_lane(t == 1)
            if fn is None:
                res.note = f"{label}; skipped: {why}"
            else:
                try:
                    compiled[lane], res.compile_s, res.samples_ms, firsts[lane] = _time_jax(
                        fn, sets, FLAGS.calls_per_sample
                    )
                except Exception as e:  # a lane that fails to build or run is reported; the rest go on
                    res.note = f"{label}; failed: {type(e).__name__}: {str(e)[:300]}"
            res.median_ms, res.min_ms, res.max_ms = _stats(res.samples_ms)
            results.append(res)
            print(_lane_line(res), flush=True)
        if "ours" in compiled:
            row = dict(op="attention", proj=case, b=b, t=t, s=s, m=b * t, bar=None, passes=None)
            for other in ("xla", "cudnn"):
                if other not in compiled:
                    row[f"ours_over_{other}"], row[f"paired_samples_{other}"] = None, []
                    row[f"max_abs_diff_vs_{other}"] = None
                    continue
                paired = timing.paired_ratios(
                    compiled[other], compiled["ours"], sets, pairs=FLAGS.iters, calls_per_sample=FLAGS.calls_per_sample
                )
                row[f"ours_over_{other}"] = statistics.median(paired)
                row[f"paired_samples_{other}"] = paired
                diff = jnp.abs(firsts["ours"].astype(jnp.float32) - firsts[other].astype(jnp.float32))
                row[f"max_abs_diff_vs_{other}"] = float(jnp.max(diff))
            ratios.append(row)
    return results, ratios


def _attn_table(results, ratios) -> str:
    med = {(r.proj, r.lane): r.median_ms for r in results if r.op == "attention"}
    fmt = lambda v, spec=".4f": "-" if v is None else format(v, spec)
    lines = [
        f"{'case':13s} {'B':>3s} {'T':>5s} {'S':>5s} {'ours ms':>9s} {'xla ms':>9s} {'cudnn ms':>9s} "
        f"{'ours/xla':>8s} {'ours/cudnn':>10s}"
    ]
    for row in ratios:
        c = row["proj"]
        lines.append(
            f"{c:13s} {row['b']:3d} {row['t']:5d} {row['s']:5d} {fmt(med.get((c, 'ours'))):>9s} "
            f"{fmt(med.get((c, 'xla'))):>9s} {fmt(med.get((c, 'cudnn'))):>9s} "
            f"{fmt(row['ours_over_xla'], '.3f'):>8s} {fmt(row['ours_over_cudnn'], '.3f'):>10s}"
        )
    return "\n".join(lines)


def _lane_line(r: LaneResult) -> str:
    if r.op in ("attention", "layer"):
        if r.median_ms is None:
            return f"[{r.op}] {r.lane:6s} {r.note}"
        return (
            f"[{r.op}] {r.lane:6s} {r.note}: median {r.median_ms:.4f} ms "
            f"(min {r.min_ms:.4f}, max {r.max_ms:.4f}, {len(r.samples_ms)} samples) by {r.served_by}"
        )
    if r.median_ms is None:
        return f"[{r.op}] {r.proj:8s} M={r.m:<5d} {r.lane:6s} skipped: {r.note}"
    return (
        f"[{r.op}] {r.proj:8s} M={r.m:<5d} {r.lane:6s} median {r.median_ms:.4f} ms "
        f"(min {r.min_ms:.4f}, max {r.max_ms:.4f}, {len(r.samples_ms)} samples) by {r.served_by}"
    )


def _table(results, ratios) -> str:
    med = {(r.proj, r.m, r.lane): r.median_ms for r in results}
    fmt = lambda v, spec=".4f": "-" if v is None else format(v, spec)
    lines = [f"{'proj':9s} {'M':>5s} {'ours ms':>9s} {'xla ms':>9s} {'cublas ms':>9s} {'ours/xla':>8s} {'bar':>5s} ok"]
    for row in ratios:
        if row["op"] != "gemm":
            continue
        p, m = row["proj"], row["m"]
        ok = {True: "PASS", False: "FAIL", None: "-"}[row["passes"]]
        lines.append(
            f"{p:9s} {m:5d} {fmt(med.get((p, m, 'ours'))):>9s} {fmt(med.get((p, m, 'xla'))):>9s} "
            f"{fmt(med.get((p, m, 'cublas'))):>9s} {fmt(row['ours_over_xla'], '.3f'):>8s} "
            f"{fmt(row['bar'], '.2f'):>5s} {ok}"
        )
    return "\n".join(lines)


def _meta() -> dict:
    dev = jax.devices()[0]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        commit = ""
    return dict(
        when=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=getattr(dev, "device_kind", dev.platform),
        platform=dev.platform,
        jax=jax.__version__,
        commit=commit,
        flags={f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])},
    )


# --- whole layers --------------------------------------------------------------------------------

LAYER_CASES = {  # (B sequences, T tokens per call, S cache slots)
    "qwen3_8b": {"decode": (64, 1, 4096), "prefill": (8, 1024, 1024), "train": (8, 1024, 1024)},
    "tiny": {"decode": (4, 1, 128), "prefill": (2, 64, 64), "train": (2, 64, 64)},
}
LAYER_BARS = {"decode": 1.15, "prefill": 1.15, "train": 1.3}  # issue 40's bars vs plain XLA


def _layer_operands(case, b, t, s, shape, seed):
    """N_SETS argument tuples of one layer case (bf16 activations and caches; decode positions
    spread over the cache's last slots)."""
    sets = []
    for i in range(N_SETS):
        kx, kk, kv = jax.random.split(jax.random.key(seed * 1000 + 900 + i), 3)
        x = jax.random.normal(kx, (b, t, shape.d), jnp.float32).astype(jnp.bfloat16)
        if case != "decode":
            sets.append((x,))
            continue
        cache = (shape.n_layers, b, s, shape.hkv, shape.dh)
        kc = jax.random.normal(kk, cache, jnp.float32).astype(jnp.bfloat16)
        vc = jax.random.normal(kv, cache, jnp.float32).astype(jnp.bfloat16)
        sets.append((x, kc, vc, _attn_positions(b, 1, s)[:, 0]))
    return sets


def _rel_diff(a, b) -> float:
    """max |a - b| / (1 + max |b|) in f32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b))) / (1.0 + float(jnp.max(jnp.abs(b))))


def run_layer() -> tuple[list[LaneResult], list[dict]]:
    """A stack of Qwen3-8B-shaped layers (`benchmarks.body_layer`): a decode step, a prefill and
    the trainer's fwd+bwd, ours (--backend) vs plain XLA on the same weights."""
    from benchmarks import body_layer

    shape = body_layer.SHAPES[FLAGS.shape]
    params = body_layer.init_params(shape, FLAGS.seed)
    make = {"decode": body_layer.decode_step, "prefill": body_layer.prefill, "train": body_layer.trainer_fwd_bwd}
    results, ratios = [], []
    for case, (b, t, s) in LAYER_CASES[FLAGS.shape].items():
        if case not in FLAGS.layer_cases:
            continue
        sets = [(params,) + a for a in _layer_operands(case, b, t, s, shape, FLAGS.seed)]
        compiled, firsts, label = {}, {}, f"{case} B={b} T={t} S={s} layers={shape.n_layers}"
        for lane in ("ours", "xla"):
            res = LaneResult(
                "layer",
                case,
                s,
                shape.d,
                b * t,
                lane,
                FLAGS.backend if lane == "ours" else "plain jnp",
                None,
                None,
                None,
                [],
            )
            res.note = label
            try:
                compiled[lane], res.compile_s, res.samples_ms, firsts[lane] = _time_jax(
                    make[case](lane, FLAGS.backend, shape), sets, FLAGS.calls_per_sample
                )
            except Exception as e:  # a lane that fails to build or run is reported; the rest go on
                res.note = f"{label}; failed: {type(e).__name__}: {str(e)[:300]}"
            res.median_ms, res.min_ms, res.max_ms = _stats(res.samples_ms)
            results.append(res)
            print(_lane_line(res), flush=True)
        if len(compiled) == 2:
            paired = timing.paired_ratios(
                compiled["xla"], compiled["ours"], sets, pairs=FLAGS.iters, calls_per_sample=FLAGS.calls_per_sample
            )
            ratio, bar = statistics.median(paired), LAYER_BARS[case]
            leaves = zip(jax.tree.leaves(firsts["ours"]), jax.tree.leaves(firsts["xla"]))
            rel = max(_rel_diff(o, x) for o, x in leaves)
            ratios.append(
                dict(
                    rel_diff_vs_xla=rel,
                    op="layer",
                    proj=case,
                    m=b * t,
                    ours_over_xla=ratio,
                    paired_samples=paired,
                    bar=bar,
                    passes=ratio <= bar,
                )
            )
    return results, ratios


OPS = {"gemm": run_gemm, "attention": run_attention, "layer": run_layer}


def main(argv):
    del argv
    unknown = [op for op in FLAGS.ops if op not in OPS]
    if unknown:
        raise app.UsageError(f"unknown --ops {unknown}; known: {sorted(OPS)}")
    t0 = time.perf_counter()
    results, ratios = [], []
    for op in FLAGS.ops:
        r, q = OPS[op]()
        results += r
        ratios += q
    report = dict(meta=_meta(), lanes=[dataclasses.asdict(r) for r in results], ratios=ratios)
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\n=== body benchmark ({report['meta']['device']}, {time.perf_counter() - t0:.0f} s) ===")
    if "gemm" in FLAGS.ops:
        print(_table(results, ratios))
    if "attention" in FLAGS.ops:
        print(_attn_table(results, ratios))
    for row in (r for r in ratios if r["op"] == "layer"):
        print(f"layer {row['proj']:8s} M={row['m']:<6d} ours/xla {row['ours_over_xla']:.3f} (bar {row['bar']:.2f}) ")
    if FLAGS.out:
        print(f"JSON: {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
