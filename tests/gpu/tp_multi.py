"""Tensor parallelism on several GPUs (issue 19): bytes, speed and gradients at every TP degree.

    OUT=$OUT PYTHONPATH=. python3 tests/gpu/tp_multi.py                      # everything, on all GPUs
    PYTHONPATH=. python3 tests/gpu/tp_multi.py --tp 2 --tp_dp none --shape qwen3_8b --layout vd \\
        --m 1,64,4096 --mode speed                                            # the old tp_x2.py table
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu PYTHONPATH=. \\
        python tests/gpu/tp_multi.py --backend reference --shape tiny --m 1,64 --grad_m 64 --pieces_m 64 \\
        --iters 3                                                             # CPU dry run

For each shape (Qwen3-8B lm_head D=4096, V_pad=152064, real 151936; Llama-3-8B D=4096,
V_pad = canonical_padded_vocab(128256) = 128512; `tiny` D=64, V_pad=1024 for CPU), weight layout
([V, D] "vd" and the [D, V] kernel "dv") and M, the single-device `linear_logp` on device 0 is
computed once; then `sharding.linear_logp_tp` runs on every mesh: TP = 1, 2, 4, ... (every power
of two up to the device count) and TP x DP meshes (2x2, 4x2 where they fit; rows sharded over
"dp"). Targets include every TP-8 shard edge, 0, the last real id and -100. Strict mode is on.

Modes (`--mode`, comma-separated or `all`):
  bytes  logp/lse bytes of every mesh vs one device (rows differing, max_abs_diff), and the entropy's
         (`linear-logp-entropy-v1`) with --entropy (default: where the backend declares it; every
         forward then returns it, on one device and on the meshes, so the times include it:
         --entropy off times logp/lse alone);
  speed  time per call of the pure-TP meshes next to TP=1 (the single-device call), the scaling
         efficiency TP1_ms / (devices x TPk_ms); the pieces of one TP call at --pieces_m (local
         partials, all_gather of the partials, fold, each timed alone; optional profiler trace);
         forward+backward time at --grad_m;
  grad   d hidden, d weight of sum(g_lp * logp + g_lse * lse) (+ 0.01 sum(g_lse * entropy) with
         --entropy) under every mesh vs one device
         (documented tolerance: relative Frobenius error < 1e-2 for bf16 operands, max abs
         error <= 1e-5 * max(1, scale) for f32) and run-to-run bitwise identical.

Each phase (forward, pieces, backward) has a share of --budget_s; a group (one shape, layout and M:
its programs are compiled together, in --compile_workers threads) that does not fit is skipped and
listed. The JSON (--out, default $OUT/tp_multi.json) is rewritten after every row; a table ends
the log. Exit 0 when no row differs, every gradient is within tolerance and nothing failed.
Defaults can also come from the environment: TPM_MODE, TPM_TP, TPM_TP_DP, TPM_SHAPES, TPM_LAYOUTS,
TPM_M, TPM_GRAD_M, TPM_PIECES_M, TPM_BACKEND, TPM_BUDGET_S, TPM_COMPILE_WORKERS.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.shapes import get as get_shape  # noqa: E402 (no JAX import)

N_BLOCKS = 8  # = contract.TP_MAX: every TP shard of a canonical V_pad is a whole number of blocks
SHAPES = ("qwen3_8b", "llama3_8b", "tiny")
GRAD_TOL = {"bfloat16": ("rel_fro", 1e-2), "float32": ("max_abs_over_scale", 1e-5)}


def log(*a):
    print(*a, flush=True)


# --- inputs (numpy only: the multi-process launcher generates its own shards with these) -------------


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _shape_seed(shape) -> int:
    return zlib.crc32(shape.name.encode())


def weight_block(shape, b: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Rows [b * V_pad/8, (b+1) * V_pad/8) of the [V_pad, D] weight (vd layout)."""
    rows = shape.v_rows // N_BLOCKS
    rng = np.random.default_rng([seed, _shape_seed(shape), b])
    x = rng.standard_normal((rows, shape.d), dtype=np.float32)
    x *= np.float32(5.12 / np.sqrt(shape.d))  # 0.08 at D = 4096 (as tp_x2): logits of std ~10
    return x.astype(np_dtype(dtype))


def weight_rows(shape, first_block: int, n_blocks: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Blocks [first_block, first_block + n_blocks) as one [rows, D] array (generated in threads)."""
    assert shape.v_rows % (64 * N_BLOCKS) == 0, f"{shape.name}: V_pad {shape.v_rows} is not canonical"
    blocks = range(first_block, first_block + n_blocks)
    with concurrent.futures.ThreadPoolExecutor(min(n_blocks, 8)) as ex:
        parts = list(ex.map(lambda b: weight_block(shape, b, dtype, seed), blocks))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def weight_shard(shape, layout: str, tp: int, rank: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Rank `rank`'s shard of the TP-`tp` weight: [V_pad/tp, D] (vd) or [D, V_pad/tp] (dv)."""
    per = N_BLOCKS // tp
    w = weight_rows(shape, rank * per, per, dtype, seed)
    return w if layout == "vd" else np.ascontiguousarray(w.T)


def hidden_host(shape, m: int, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, _shape_seed(shape), 1_000_000 + m])
    return (rng.standard_normal((m, shape.d), dtype=np.float32) * 2).astype(np_dtype(dtype))


def edge_targets(shape) -> list[int]:
    """0, the TP-2 edge, the last real id, every TP-8 shard edge (last id of a shard, first of the
    next) inside the real vocab, and the ignore index."""
    v, vocab = shape.v_rows, shape.v_real
    out = [0, v // 2 - 1, v // 2, vocab - 1]
    for k in range(1, N_BLOCKS):
        out += [k * v // N_BLOCKS - 1, k * v // N_BLOCKS]
    out = list(dict.fromkeys(t for t in out if t < vocab))
    return out + [-100]


def targets_host(shape, m: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng([seed, _shape_seed(shape), 2_000_000 + m])
    t = rng.integers(0, shape.v_real, m).astype(np.int32)
    special = edge_targets(shape)
    t[: min(m, len(special))] = special[: min(m, len(special))]
    return t


def cotangents_host(m: int, seed: int = 0):
    rng = np.random.default_rng([seed, 3_000_000 + m])
    return rng.standard_normal(m).astype(np.float32), rng.standard_normal(m).astype(np.float32)


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def rows_differ(a, b) -> int:
    d = bits(a) != bits(b)
    return int(d.reshape(d.shape[0], -1).any(axis=1).sum()) if d.ndim else int(d)


def max_abs_diff(a, b) -> float:
    with np.errstate(invalid="ignore"):
        d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


def ms_stats(times_ms) -> dict | None:
    if not times_ms:
        return None
    return {
        "median": float(np.median(times_ms)),
        "min": float(min(times_ms)),
        "max": float(max(times_ms)),
        "n": len(times_ms),
    }


# --- configuration ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshCfg:
    tp: int
    dp: int = 1

    @property
    def label(self) -> str:
        return f"tp{self.tp}" if self.dp == 1 else f"tp{self.tp}xdp{self.dp}"

    @property
    def n_devices(self) -> int:
        return self.tp * self.dp


def _env(name, default):
    return os.environ.get(name, default)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", default=_env("TPM_MODE", "all"), help="bytes,speed,grad or all")
    p.add_argument("--tp", default=_env("TPM_TP", "auto"), help="TP degrees (auto: powers of two up to the devices)")
    p.add_argument(
        "--tp_dp", default=_env("TPM_TP_DP", "auto"), help="TPxDP meshes, e.g. 2x2,4x2 (auto: those that fit; none)"
    )
    p.add_argument("--shape", "--shapes", dest="shapes", default=_env("TPM_SHAPES", "qwen3_8b,llama3_8b"))
    p.add_argument("--layout", "--layouts", dest="layouts", default=_env("TPM_LAYOUTS", "vd,dv"))
    p.add_argument("--m", default=_env("TPM_M", "1,64,4096,16384"), help="rows per call (forward)")
    p.add_argument("--grad_m", default=_env("TPM_GRAD_M", "4096"), help="rows for gradients and fwd+bwd timing")
    p.add_argument(
        "--pieces_m", type=int, default=int(_env("TPM_PIECES_M", "4096")), help="rows for the pieces of one TP call"
    )
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--backend", default=_env("TPM_BACKEND", "pallas_sm90"))
    p.add_argument(
        "--entropy",
        default=_env("TPM_ENTROPY", "auto"),
        choices=("auto", "on", "off"),
        help="forwards also return the entropy and its bytes are compared (auto: if the backend declares it)",
    )
    p.add_argument("--budget_s", type=float, default=float(_env("TPM_BUDGET_S", "480")), help="all phases together")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time_budget_s", type=float, default=3.0, help="per timed case")
    p.add_argument(
        "--compile_workers",
        type=int,
        default=int(_env("TPM_COMPILE_WORKERS", str(max(1, min(8, (os.cpu_count() or 2) // 2))))),
        help="threads compiling one group's programs (1: one after another)",
    )
    p.add_argument(
        "--trace_dir", default=None, help="jax.profiler trace of 5 TP calls per degree at --pieces_m, summarised"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default $OUT/tp_multi.json if $OUT is set)")
    a = p.parse_args(argv)
    modes = {x.strip() for x in a.mode.split(",") if x.strip()}
    a.modes = {"bytes", "speed", "grad"} if "all" in modes else modes
    if not a.modes <= {"bytes", "speed", "grad"}:
        p.error(f"--mode: unknown {sorted(a.modes - {'bytes', 'speed', 'grad'})}")
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    a.layouts = [s.strip() for s in a.layouts.split(",") if s.strip()]
    a.ms = [int(x) for x in a.m.split(",") if x.strip()]
    a.grad_ms = [int(x) for x in a.grad_m.split(",") if x.strip()]
    for s in a.shapes:
        if s not in SHAPES:
            p.error(f"--shape {s!r}: one of {SHAPES}")
    for lay in a.layouts:
        if lay not in ("vd", "dv"):
            p.error(f"--layout {lay!r}: vd or dv")
    if a.out is None and os.environ.get("OUT"):
        a.out = os.path.join(os.environ["OUT"], "tp_multi.json")
    return a


def mesh_configs(args, n_dev: int) -> list[MeshCfg]:
    if args.tp == "auto":
        tps = [k for k in (1, 2, 4, 8) if k <= n_dev]
    else:
        tps = [int(x) for x in args.tp.split(",") if x.strip()]
    if args.tp_dp == "auto":
        tpdp = [(t, d) for t, d in ((2, 2), (4, 2)) if t * d <= n_dev]
    elif args.tp_dp in ("none", ""):
        tpdp = []
    else:
        tpdp = [tuple(int(v) for v in x.lower().split("x")) for x in args.tp_dp.split(",") if x.strip()]
    cfgs = [MeshCfg(t) for t in tps] + [MeshCfg(t, d) for t, d in tpdp]
    too_big = [c.label for c in cfgs if c.n_devices > n_dev]
    if too_big:
        raise SystemExit(f"meshes {too_big} need more than the {n_dev} devices present")
    return cfgs


def entropy_on(choice: str, backend: str) -> bool:
    """--entropy: "on", "off", or "auto" (on where the backend declares the entropy)."""
    from detlogp_jax import backends

    return choice == "on" or (choice == "auto" and backends.get(backend).entropy)


def outputs(o, entropy: bool) -> tuple:
    """(logp, lse) of a forward's output, and its entropy with `entropy`."""
    return (o.logp, o.lse, o.entropy) if entropy else (o.logp, o.lse)


# --- the run ---------------------------------------------------------------------------------------


class Run:
    """Holds the JSON document; rows are appended and the file rewritten as they come."""

    def __init__(self, args, devs):
        import jax

        self.args = args
        self.doc = {
            "command": "python3 tests/gpu/tp_multi.py " + " ".join(sys.argv[1:]),
            "device": devs[0].device_kind,
            "platform": devs[0].platform,
            "n_devices": len(devs),
            "jax": jax.__version__,
            "backend": args.backend,
            "dtype": args.dtype,
            "modes": sorted(args.modes),
            "shapes": args.shapes,
            "layouts": args.layouts,
            "notes": [],
            "rows": [],
            "skipped": [],
            "not_applicable": [],
        }

    def note(self, msg):
        log(f"NOTE: {msg}")
        self.doc["notes"].append(msg)

    def add(self, row):
        self.doc["rows"].append(row)
        self.flush()

    def skip(self, what, why):
        log(f"SKIP {what}: {why}")
        self.doc["skipped"].append({"what": what, "why": why})
        self.flush()

    def na(self, what, why):
        self.doc["not_applicable"].append({"what": what, "why": why})

    def flush(self):
        if self.args.out:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            tmp = self.args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=1)
            os.replace(tmp, self.args.out)


class Budget:
    """Phase deadlines: each active phase gets its share of the total plus what earlier phases left."""

    # The first (layout, shape)'s forward, the pieces and the backward come first; the other
    # forwards run last and get whatever the earlier phases left.
    SHARES = {"fwd": 0.30, "pieces": 0.12, "bwd": 0.27, "fwd_rest": 0.31}

    def __init__(self, total_s, phases):
        self.t0 = time.perf_counter()
        self.total = total_s
        w = sum(self.SHARES[p] for p in phases) or 1.0
        self.alloc = {p: total_s * self.SHARES[p] / w for p in phases}
        self.deadline = self.t0

    def start(self, phase):
        now = time.perf_counter()
        self.deadline = min(now + self.alloc.get(phase, 0.0) + max(0.0, self._carry(now)), self.t0 + self.total)

    def _carry(self, now):
        # what the finished phases did not use
        return (self.deadline - now) if self.deadline > now else 0.0

    def left(self):
        return self.deadline - time.perf_counter()


def _compile_group(items, workers):
    """items: [(key, jitted, args)], lowered here (strict mode is a trace-time context), compiled in
    threads. Returns {key: (compiled | Exception, seconds, provenance)}."""
    import detlogp_jax as dl

    lowered, out = {}, {}
    for key, fn, args in items:
        t0 = time.perf_counter()
        try:
            low = fn.lower(*args)
            lowered[key] = (low, time.perf_counter() - t0, dl.last_provenance())
        except Exception as e:  # reported per row
            out[key] = (e, time.perf_counter() - t0, None)

    def comp(key):
        low, dt, prov = lowered[key]
        t0 = time.perf_counter()
        try:
            return key, low.compile(), dt + time.perf_counter() - t0, prov
        except Exception as e:
            return key, e, dt + time.perf_counter() - t0, prov

    keys = list(lowered)
    if workers > 1 and len(keys) > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as ex:
            results = list(ex.map(comp, keys))
        # a compile that failed in a thread is tried once more alone
        results = [comp(k) if isinstance(c, Exception) else (k, c, dt, prov) for k, c, dt, prov in results]
    else:
        results = [comp(k) for k in keys]
    for key, c, dt, prov in results:
        out[key] = (c, dt, prov)
    return out


def _err(e) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-800:]


class Suite:
    def __init__(self, args):
        import jax

        self.args = args
        self.devs = jax.devices()
        self.run = Run(args, self.devs)
        self.cfgs = mesh_configs(args, len(self.devs))
        self.ok = True
        self.meshes = {c: self._mesh(c) for c in self.cfgs}
        self.ref_fwd = {}  # (shape, layout, m) -> (logp, lse, ms stats | None, entropy | None)
        self.fwd_ms = {}  # (shape, layout, m, label) -> ms stats
        self.keep = {}  # compiled TP forwards kept for the pieces phase / trace: label -> (compiled, args)
        self._w_host = {}
        self.entropy = entropy_on(args.entropy, args.backend)
        self.run.doc["entropy"] = bool(self.entropy)

    # -- meshes and placement
    def _mesh(self, c: MeshCfg):
        from jax.sharding import Mesh

        if c.dp == 1:
            return Mesh(np.array(self.devs[: c.tp]), ("tp",))
        return Mesh(np.array(self.devs[: c.n_devices]).reshape(c.dp, c.tp), ("dp", "tp"))

    def _row_axes(self, c):
        return () if c.dp == 1 else ("dp",)

    def _put_rows(self, c, x):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        spec = P() if c.dp == 1 else P("dp", *([None] * (x.ndim - 1)))
        return jax.device_put(x, NamedSharding(self.meshes[c], spec))

    def _put_weight(self, c, w0, layout):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        spec = P("tp", None) if layout == "vd" else P(None, "tp")
        return jax.device_put(w0, NamedSharding(self.meshes[c], spec))

    def weight0(self, shape, layout):
        """The weight on device 0 in `layout` (generated once per shape on the host)."""
        import jax
        import jax.numpy as jnp

        if shape.name not in self._w_host:
            t0 = time.perf_counter()
            self._w_host[shape.name] = weight_rows(shape, 0, N_BLOCKS, self.args.dtype, self.args.seed)
            log(f"  generated the {shape.name} weight [{shape.v_rows}, {shape.d}] in {time.perf_counter() - t0:.1f}s")
        w = jax.device_put(self._w_host[shape.name], self.devs[0])
        return w if layout == "vd" else jax.jit(jnp.transpose)(w)

    # -- the functions under test
    def f_single(self, shape, layout):
        import jax

        import detlogp_jax as dl

        a = self.args
        return jax.jit(
            lambda h, w, t: self._outputs(
                dl.linear_logp(
                    h,
                    w,
                    t,
                    vocab_size=shape.v_real,
                    padded_vocab_size=shape.v_rows,
                    backend=a.backend,
                    weight_layout=layout,
                    **self._entropy_kw(),
                )
            )
        )

    def _entropy_kw(self):
        return {"return_entropy": True} if self.entropy else {}

    def _outputs(self, o):
        return outputs(o, self.entropy)

    def _tp_call(self, c, shape, layout):
        from sharding import linear_logp_tp

        mesh, row_axes, a = self.meshes[c], self._row_axes(c), self.args
        return lambda h, w, t: linear_logp_tp(
            h,
            w,
            t,
            mesh=mesh,
            tp_axis="tp",
            row_axes=row_axes,
            vocab_size=shape.v_real,
            padded_vocab_size=shape.v_rows,
            backend=a.backend,
            weight_layout=layout,
            **self._entropy_kw(),
        )

    def f_tp(self, c, shape, layout):
        import jax

        call = self._tp_call(c, shape, layout)
        return jax.jit(lambda h, w, t: self._outputs(call(h, w, t)))

    @staticmethod
    def _vg(call):
        import jax
        import jax.numpy as jnp

        def loss(h, w, t, g_lp, g_lse):
            o = call(h, w, t)
            out = jnp.sum(o.logp * g_lp) + jnp.sum(o.lse * g_lse)
            if getattr(o, "entropy", None) is not None:  # with --entropy: an entropy bonus term too
                out = out + 0.01 * jnp.sum(o.entropy * g_lse)
            return out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def vg_single(self, shape, layout):
        import detlogp_jax as dl

        a = self.args
        return self._vg(
            lambda h, w, t: dl.linear_logp(
                h,
                w,
                t,
                vocab_size=shape.v_real,
                padded_vocab_size=shape.v_rows,
                backend=a.backend,
                weight_layout=layout,
                **self._entropy_kw(),
            )
        )

    def vg_tp(self, c, shape, layout):
        return self._vg(self._tp_call(c, shape, layout))

    # -- timing
    def time(self, compiled, args, m):
        from benchmarks.timing import time_case

        a = self.args
        timing, _ = time_case(
            compiled,
            [args],
            warmup=a.warmup,
            iters=a.iters,
            budget_s=a.time_budget_s,
            calls_per_sample=10 if m <= 512 else 1,
        )
        return ms_stats(timing.times_ms)

    # -- phase 1: forward bytes (+ time) -------------------------------------------------------------
    def pairs(self):
        """(layout, shape) in the order they run: layout-major, so both shapes' [V, D] come first."""
        return [(lay, s) for lay in self.args.layouts for s in self.args.shapes]

    def phase_fwd(self, budget, phase, pairs):
        import jax

        a = self.args
        speed = "speed" in a.modes
        cfgs = self.cfgs if "bytes" in a.modes else [c for c in self.cfgs if c.dp == 1]
        budget.start(phase)
        last_group_s = 0.0
        for layout, sname in pairs:
            # one (layout, shape): its weight is placed once for every mesh
            shape = get_shape(sname)
            w0 = None
            w_cfg = {}
            for m in a.ms:
                what = f"fwd {sname} {layout} M={m}"
                if budget.left() < max(5.0, last_group_s):
                    self.run.skip(what, f"phase budget ({budget.left():.0f}s left, last group {last_group_s:.0f}s)")
                    continue
                g0 = time.perf_counter()
                log(f"--- {what}: single device + {[c.label for c in cfgs]}")
                if w0 is None:
                    w0 = self.weight0(shape, layout)
                h, t = hidden_host(shape, m, a.dtype, a.seed), targets_host(shape, m, a.seed)
                args0 = (jax.device_put(h, self.devs[0]), w0, jax.device_put(t, self.devs[0]))
                items = [("ref", self.f_single(shape, layout), args0)]
                run_cfgs = []
                for c in cfgs:
                    if m % c.dp:
                        self.run.na(f"{what} {c.label}", f"M={m} not divisible by dp={c.dp}")
                        continue
                    if c not in w_cfg:
                        w_cfg[c] = self._put_weight(c, w0, layout)
                    items.append(
                        (c, self.f_tp(c, shape, layout), (self._put_rows(c, h), w_cfg[c], self._put_rows(c, t)))
                    )
                    run_cfgs.append(c)
                comp = _compile_group(items, a.compile_workers)
                ref = self._ref_row(shape, layout, m, comp["ref"], args0, speed)
                if ref is None:
                    continue
                for c, (_, fn, args) in zip(run_cfgs, items[1:]):
                    self._fwd_row(shape, layout, m, c, comp[c], args, ref, speed)
                last_group_s = time.perf_counter() - g0
                log(f"--- {what}: {last_group_s:.1f}s")
            del w0, w_cfg

    def _ref_row(self, shape, layout, m, comp, args, speed):
        import jax

        compiled, cs, prov = comp
        row = dict(kind="ref", tp=1, dp=1, config="single", shape=shape.name, layout=layout, m=m)
        row["compile_s"] = round(cs, 2)
        if isinstance(compiled, Exception):
            row.update(status="error", error=_err(compiled))
            self.ok = False
            self.run.add(row)
            log(f"  single device FAILED: {row['error']}")
            return None
        out = [np.asarray(x) for x in jax.device_get(compiled(*args))]
        lp, lse, ent = out[0], out[1], (out[2] if self.entropy else None)
        row.update(backend=prov and prov.backend, fallback=prov and prov.fallback, status="ok")
        row["ms"] = self.time(compiled, args, m) if speed else None
        other = self.ref_fwd.get((shape.name, "vd" if layout == "dv" else "dv", m))
        if other is not None:  # the two layouts' single-device bytes (informational)
            row["rows_differ_other_layout"] = rows_differ(lp, other[0]) + rows_differ(lse, other[1])
        self.ref_fwd[(shape.name, layout, m)] = (lp, lse, row["ms"], ent)
        self.run.add(row)
        log(f"  single device: backend {row['backend']} compile {cs:.1f}s" + _fmt_ms(row["ms"]))
        return lp, lse, row["ms"], ent

    def _fwd_row(self, shape, layout, m, c, comp, args, ref, speed):
        import jax

        compiled, cs, prov = comp
        row = dict(kind="fwd", tp=c.tp, dp=c.dp, config=c.label, shape=shape.name, layout=layout, m=m)
        row["compile_s"] = round(cs, 2)
        try:
            if isinstance(compiled, Exception):
                raise compiled
            out = [np.asarray(x) for x in jax.device_get(compiled(*args))]
            lp, lse = out[0], out[1]
            row.update(
                backend=prov and prov.backend,
                fallback=prov and prov.fallback,
                logp_rows_differ=rows_differ(lp, ref[0]),
                lse_rows_differ=rows_differ(lse, ref[1]),
                max_abs_diff=max_abs_diff(lp, ref[0]),
                lse_max_abs_diff=max_abs_diff(lse, ref[1]),
                status="ok",
            )
            if self.entropy:
                row["entropy_rows_differ"] = rows_differ(out[2], ref[3])
                row["entropy_max_abs_diff"] = max_abs_diff(out[2], ref[3])
            if row["logp_rows_differ"] or row["lse_rows_differ"] or row.get("entropy_rows_differ"):
                self.ok = False
            if speed:
                row["ms"] = self.time(compiled, args, m)
                row["tp1_ms"] = ref[2]
                row["efficiency"] = _eff(ref[2], row["ms"], c.n_devices)
                self.fwd_ms[(shape.name, layout, m, c.label)] = row["ms"]
            if m == self.args.pieces_m and shape.name == self.args.shapes[0] and layout == self.args.layouts[0]:
                if c.dp == 1:
                    self.keep[c.label] = (compiled, args)
        except Exception as e:
            row.update(status="error", error=_err(e))
            self.ok = False
        self.run.add(row)
        if row["status"] == "ok":
            log(
                f"  {c.label:10s} logp rows differing {row['logp_rows_differ']} lse {row['lse_rows_differ']} "
                + (f"entropy {row['entropy_rows_differ']} " if "entropy_rows_differ" in row else "")
                + f"max_abs_diff {row['max_abs_diff']:.3g} compile {cs:.1f}s"
                + _fmt_ms(row.get("ms"))
                + (f" eff {row['efficiency']:.2f}" if row.get("efficiency") else "")
            )
        else:
            log(f"  {c.label:10s} FAILED: {row['error']}")

    # -- phase 2: where the time goes ----------------------------------------------------------------
    def phase_pieces(self, budget):
        a = self.args
        budget.start("pieces")
        shape, layout, m = get_shape(a.shapes[0]), a.layouts[0], a.pieces_m
        last_s = 0.0
        for c in sorted((c for c in self.cfgs if c.dp == 1), key=lambda c: -c.tp):  # the largest TP first
            what = f"pieces {shape.name} {layout} M={m} {c.label}"
            if budget.left() < max(5.0, last_s):
                self.run.skip(what, f"phase budget ({budget.left():.0f}s left, last one {last_s:.0f}s)")
                continue
            g0 = time.perf_counter()
            if c.label not in self.keep:
                self.run.skip(what, f"no forward at M={m} for this mesh (add {m} to --m)")
                continue
            try:
                self._pieces(shape, layout, m, c)
                last_s = time.perf_counter() - g0
            except Exception as e:
                self.ok = False
                self.run.add(
                    dict(
                        kind="pieces",
                        tp=c.tp,
                        dp=1,
                        config=c.label,
                        shape=shape.name,
                        m=m,
                        status="error",
                        error=_err(e),
                    )
                )
                log(f"  {what} FAILED: {_err(e)}")

    def _pieces(self, shape, layout, m, c):
        import jax
        import jax.numpy as jnp
        from jax import lax
        from jax.sharding import PartitionSpec as P

        from detlogp_jax import backends, inputs

        a = self.args
        be = backends.get(a.backend)
        mesh, tp = self.meshes[c], c.tp
        shard = shape.v_rows // tp
        lkw = {} if layout == "vd" else {"weight_layout": layout}
        wspec = P("tp", None) if layout == "vd" else P(None, "tp")
        compiled_fwd, (h, w, t) = self.keep[c.label]
        t32 = self._put_rows(c, np.asarray(inputs.narrow_targets(np.asarray(t), shape.v_real)))
        inv_t = self._put_rows(c, np.ones(m, np.float32))

        def call(off, hh, ww, tt, it):
            mm, ss, zt, own, _ = be.partials(
                hh,
                ww,
                None,
                tt,
                it,
                vocab_size=shape.v_real,
                padded_vocab_size=shape.v_rows,
                col_offset=off,
                shard_cols=shard,
                return_logits=False,
                **lkw,
            )
            return mm, ss, zt, own

        def local_body(hh, ww, tt, it):
            if tp == 1:
                mm, ss, zt, own = call(0, hh, ww, tt, it)
            else:
                r = lax.axis_index("tp")
                mm, ss, zt, own = lax.switch(r, [functools.partial(call, k * shard) for k in range(tp)], hh, ww, tt, it)
            return mm, ss, zt[None], own[None]

        def gather_body(mm, ss, zt, own):
            g = lambda x, ax, tiled: lax.all_gather(x, "tp", axis=ax, tiled=tiled)
            return g(mm, 1, True), g(ss, 1, True), g(zt[0], 0, False), g(own[0], 0, False)

        def fold_body(m_all, s_all, zt_all, own_all, tt, it):
            z = jnp.zeros_like(zt_all[0])
            for r in range(tp):
                z = jnp.where(own_all[r], zt_all[r], z)
            return be.fold(m_all, s_all, z, tt, it, shape.v_real)

        split = (P(None, "tp"), P(None, "tp"), P("tp"), P("tp"))
        sm = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))
        local = sm(local_body, (P(), wspec, P(), P()), split)
        gather = sm(gather_body, split, (P(),) * 4)
        fold = sm(fold_body, (P(),) * 6, (P(), P()))
        import detlogp_jax as dl

        with dl.strict_mode():
            c_local = local.lower(h, w, t32, inv_t).compile()
            parts = c_local(h, w, t32, inv_t)
            c_gather = gather.lower(*parts).compile()
            gathered = c_gather(*parts)
            c_fold = fold.lower(*gathered, t32, inv_t).compile()
            lp, lse = jax.device_get(c_fold(*gathered, t32, inv_t))
        ref = self.ref_fwd[(shape.name, layout, m)]
        row = dict(kind="pieces", tp=tp, dp=1, config=c.label, shape=shape.name, layout=layout, m=m, status="ok")
        row["local_ms"] = self.time(c_local, (h, w, t32, inv_t), m)
        row["gather_ms"] = self.time(c_gather, tuple(parts), m)
        row["fold_ms"] = self.time(c_fold, tuple(gathered) + (t32, inv_t), m)
        row["total_ms"] = self.fwd_ms.get((shape.name, layout, m, c.label))
        row["sum_of_pieces_ms"] = sum(row[k]["median"] for k in ("local_ms", "gather_ms", "fold_ms"))
        row["tp1_ms"] = ref[2]
        row["pieces_rows_differ"] = rows_differ(lp, ref[0]) + rows_differ(
            lse, ref[1]
        )  # the pieces chained == one device
        if row["pieces_rows_differ"]:
            self.ok = False
        if self.args.trace_dir:
            row["trace"] = self._trace(compiled_fwd, (h, w, t), c.label)
        self.run.add(row)
        tot = row["total_ms"]["median"] if row["total_ms"] else float("nan")
        tr = row.get("trace")
        if tr and "top" in tr:
            log(
                f"  trace {c.label} ({tr['scope']} events, {tr['calls']} calls): busy {tr['busy_us_per_call_all_devices']:.1f} "
                f"us per call over all devices, span {tr['span_us_per_call'] or 0:.1f} us; top: "
                + "; ".join(f"{r['name'][:40]} {r['us_per_call']:.1f} us" for r in tr["top"][:4])
            )
        log(
            f"  pieces {c.label}: local {row['local_ms']['median']:.3f} ms, all_gather {row['gather_ms']['median']:.3f} ms, "
            f"fold {row['fold_ms']['median']:.3f} ms (sum {row['sum_of_pieces_ms']:.3f}; whole call {tot:.3f}); "
            f"chained pieces vs one device: {row['pieces_rows_differ']} rows differ"
        )

    def _trace(self, compiled, args, label, calls=5):
        """A jax.profiler trace of `calls` TP calls, summarised per event name on the device threads
        (benchmarks/experiments/trace_summary.py): the raw trace stays in --trace_dir."""
        import jax

        from benchmarks.experiments.trace_summary import load_trace, summarize

        d = os.path.join(self.args.trace_dir, label)
        try:
            jax.block_until_ready(compiled(*args))
            with jax.profiler.trace(d):
                jax.block_until_ready([compiled(*args) for _ in range(calls)])
            sm = summarize(load_trace(d), calls)
        except Exception as e:  # a trace is optional
            return {"dir": d, "error": _err(e)}
        top = [
            dict(name=r["name"][:160], count=r["count"], us_per_call=round(r["us_per_call"], 2))
            for r in sm["rows"][:15]
        ]
        return {
            "dir": d,
            "scope": sm["scope"],
            "calls": calls,
            "busy_us_per_call_all_devices": sm["busy_us_per_call"],
            "span_us_per_call": sm["span_us_per_call"],
            "top": top,
        }

    # -- phase 3: gradients and fwd+bwd time ---------------------------------------------------------
    def phase_bwd(self, budget):
        import jax

        a = self.args
        grad, speed = "grad" in a.modes, "speed" in a.modes
        cfgs = self.cfgs if grad else [c for c in self.cfgs if c.dp == 1]
        pairs = self.pairs() if grad else self.pairs()[:1]
        budget.start("bwd")
        last_group_s = 0.0
        for layout, sname in pairs:
            shape = get_shape(sname)
            w0, w_cfg = None, {}
            for m in a.grad_ms:
                what = f"fwd+bwd {sname} {layout} M={m}"
                if budget.left() < max(5.0, last_group_s):
                    self.run.skip(what, f"phase budget ({budget.left():.0f}s left, last group {last_group_s:.0f}s)")
                    continue
                g0 = time.perf_counter()
                log(f"--- {what}: single device + {[c.label for c in cfgs]}")
                if w0 is None:
                    w0 = self.weight0(shape, layout)
                h, t = hidden_host(shape, m, a.dtype, a.seed), targets_host(shape, m, a.seed)
                g_lp, g_lse = cotangents_host(m, a.seed)
                d0 = lambda x: jax.device_put(x, self.devs[0])
                args0 = (d0(h), w0, d0(t), d0(g_lp), d0(g_lse))
                items = [("ref", self.vg_single(shape, layout), args0)]
                run_cfgs = []
                for c in cfgs:
                    if m % c.dp:
                        self.run.na(f"{what} {c.label}", f"M={m} not divisible by dp={c.dp}")
                        continue
                    if c not in w_cfg:
                        w_cfg[c] = self._put_weight(c, w0, layout)
                    pr = functools.partial(self._put_rows, c)
                    items.append((c, self.vg_tp(c, shape, layout), (pr(h), w_cfg[c], pr(t), pr(g_lp), pr(g_lse))))
                    run_cfgs.append(c)
                comp = _compile_group(items, a.compile_workers)
                compiled, cs, prov = comp["ref"]
                row = dict(kind="ref_fwd_bwd", tp=1, dp=1, config="single", shape=sname, layout=layout, m=m)
                row["compile_s"] = round(cs, 2)
                if isinstance(compiled, Exception):
                    row.update(status="error", error=_err(compiled))
                    self.ok = False
                    self.run.add(row)
                    log(f"  single device FAILED: {row['error']}")
                    continue
                ref_val, ref_g = compiled(*args0)
                row.update(
                    status="ok", backend=prov and prov.backend, ms=self.time(compiled, args0, m) if speed else None
                )
                self.run.add(row)
                log(f"  single device fwd+bwd: compile {cs:.1f}s" + _fmt_ms(row["ms"]))
                for c, (_, fn, args) in zip(run_cfgs, items[1:]):
                    self._grad_row(shape, layout, m, c, comp[c], args, ref_g, row["ms"], speed)
                del ref_g
                last_group_s = time.perf_counter() - g0
                log(f"--- {what}: {last_group_s:.1f}s")
            del w0, w_cfg

    def _grad_row(self, shape, layout, m, c, comp, args, ref_g, tp1_ms, speed):
        import jax

        from benchmarks.timing import same_bytes

        compiled, cs, prov = comp
        row = dict(kind="fwd_bwd", tp=c.tp, dp=c.dp, config=c.label, shape=shape.name, layout=layout, m=m)
        row["compile_s"] = round(cs, 2)
        kind, tol = GRAD_TOL[self.args.dtype]
        try:
            if isinstance(compiled, Exception):
                raise compiled
            _, g1 = compiled(*args)
            _, g2 = compiled(*args)
            row["repeat_bitwise"] = bool(same_bytes(g1, g2))
            del g2
            row.update(tol_kind=kind, tol=tol, backend=prov and prov.backend)
            ok = row["repeat_bitwise"]
            for name, got, want in zip(("hidden", "weight"), g1, ref_g):
                st = {k: float(v) for k, v in _grad_cmp(jax.device_put(got, self.devs[0]), want).items()}
                st["rel_fro"] = st.pop("diff_norm") / max(st.pop("ref_norm"), 1e-30)
                st["bitwise_equal_single"] = st["elems_differ"] == 0
                err = st["rel_fro"] if kind == "rel_fro" else st["max_abs"] / max(1.0, st["scale"])
                st["within_tol"] = bool(np.isfinite(err) and err <= tol)
                ok = ok and st["within_tol"]
                row[f"d{name}"] = st
            row["within_tol"] = bool(ok)
            row["status"] = "ok"
            if not ok:
                self.ok = False
            if speed:
                row["ms"] = self.time(compiled, args, m)
                row["tp1_ms"] = tp1_ms
                row["efficiency"] = _eff(tp1_ms, row["ms"], c.n_devices)
        except Exception as e:
            row.update(status="error", error=_err(e))
            self.ok = False
        self.run.add(row)
        if row["status"] == "ok":
            dh, dw = row["dhidden"], row["dweight"]
            log(
                f"  {c.label:10s} grads: dh rel {dh['rel_fro']:.2e} max {dh['max_abs']:.2e}, "
                f"dw rel {dw['rel_fro']:.2e} max {dw['max_abs']:.2e} ({kind} tol {tol:g}: "
                f"{'ok' if row['within_tol'] else 'FAIL'}), repeat bitwise {row['repeat_bitwise']}"
                + _fmt_ms(row.get("ms"))
                + (f" eff {row['efficiency']:.2f}" if row.get("efficiency") else "")
            )
        else:
            log(f"  {c.label:10s} FAILED: {row['error']}")

    # -- driver
    def main(self):
        import detlogp_jax as dl
        from detlogp_jax import backends

        a = self.args
        log(
            f"devices: {len(self.devs)} x {self.devs[0].device_kind} ({self.devs[0].platform}); backend {a.backend}; "
            f"modes {sorted(a.modes)}; meshes {[c.label for c in self.cfgs]}; shapes {a.shapes}; layouts {a.layouts}; "
            f"M {a.ms}; grad M {a.grad_ms}; budget {a.budget_s:.0f}s"
        )
        if "dv" in a.layouts and not backends.get(a.backend).reads("dv"):
            a.layouts = [x for x in a.layouts if x != "dv"]
            self.run.doc["layouts"] = a.layouts
            self.run.note(
                f"backend {a.backend} does not read the [D, V] layout here (layouts "
                f"{sorted(x.name for x in backends.get(a.backend).layouts)}): dv skipped"
            )
        if not a.layouts:
            self.run.note("no layout left to run")
            self.run.flush()
            return 1
        phases = ["fwd"] + (["pieces"] if "speed" in a.modes else []) + (["bwd"] if a.modes & {"grad", "speed"} else [])
        phases += ["fwd_rest"] if len(self.pairs()) > 1 else []
        budget = Budget(a.budget_s, phases)
        t0 = time.perf_counter()
        with dl.strict_mode():
            self.phase_fwd(budget, "fwd", self.pairs()[:1])
            if "pieces" in phases:
                self.phase_pieces(budget)
            if "bwd" in phases:
                self.phase_bwd(budget)
            if "fwd_rest" in phases:
                self.phase_fwd(budget, "fwd_rest", self.pairs()[1:])
        self.run.doc["seconds"] = round(time.perf_counter() - t0, 1)
        self.run.doc["complete"] = not self.run.doc["skipped"]
        self.run.doc["pass"] = self.ok
        self.run.flush()
        print_tables(self.run.doc)
        return 0 if self.ok else 1


def _eff(tp1, ms, n_devices):
    if not tp1 or not ms:
        return None
    return tp1["median"] / (n_devices * ms["median"])


def _fmt_ms(ms):
    return f" {ms['median']:.3f} ms [{ms['min']:.3f}, {ms['max']:.3f}]" if ms else ""


def _cell(ms):
    return f"{ms['median']:.3f}" if ms else "-"


def print_tables(doc):
    rows = doc["rows"]
    fwd = [r for r in rows if r["kind"] == "fwd"]
    ent = doc.get("entropy", False)
    log(
        "\n== forward: linear_logp_tp vs one device (logp/lse"
        + ("/entropy" if ent else "")
        + " rows differing; ms per call"
        + (", with the entropy" if ent else "")
        + "; efficiency)"
    )
    log(
        "| shape | layout | mesh | M | logp rows differing | lse rows differing | entropy rows differing | max_abs_diff "
        "| TP=1 ms | ms | efficiency |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in fwd:
        if r["status"] != "ok":
            log(f"| {r['shape']} | {r['layout']} | {r['config']} | {r['m']} | ERROR | | | | | | |")
            continue
        eff = f"{r['efficiency']:.2f}" if r.get("efficiency") else "-"
        log(
            f"| {r['shape']} | {r['layout']} | {r['config']} | {r['m']} | {r['logp_rows_differ']} | "
            f"{r['lse_rows_differ']} | {r.get('entropy_rows_differ', '-')} | {r['max_abs_diff']:.3g} | "
            f"{_cell(r.get('tp1_ms'))} | {_cell(r.get('ms'))} | {eff} |"
        )
    pcs = [r for r in rows if r["kind"] == "pieces" and r["status"] == "ok"]
    if pcs:
        log("\n== where the time goes (ms, medians; each piece timed alone)")
        log("| mesh | M | local partials | all_gather | fold | sum | whole call | TP=1 |")
        log("|---|---|---|---|---|---|---|---|")
        for r in pcs:
            log(
                f"| {r['config']} | {r['m']} | {_cell(r['local_ms'])} | {_cell(r['gather_ms'])} | {_cell(r['fold_ms'])} | "
                f"{r['sum_of_pieces_ms']:.3f} | {_cell(r['total_ms'])} | {_cell(r['tp1_ms'])} |"
            )
    bwd = [r for r in rows if r["kind"] == "fwd_bwd"]
    if bwd:
        log("\n== gradients (vs one device) and fwd+bwd time")
        log(
            "| shape | layout | mesh | M | dh rel_fro | dw rel_fro | within tol | repeat bitwise | TP=1 ms | ms | efficiency |"
        )
        log("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in bwd:
            if r["status"] != "ok":
                log(f"| {r['shape']} | {r['layout']} | {r['config']} | {r['m']} | ERROR | | | | | | |")
                continue
            eff = f"{r['efficiency']:.2f}" if r.get("efficiency") else "-"
            log(
                f"| {r['shape']} | {r['layout']} | {r['config']} | {r['m']} | {r['dhidden']['rel_fro']:.2e} | "
                f"{r['dweight']['rel_fro']:.2e} | {r['within_tol']} | {r['repeat_bitwise']} | "
                f"{_cell(r.get('tp1_ms'))} | {_cell(r.get('ms'))} | {eff} |"
            )
    eff = [
        (r["kind"], r["shape"], r["layout"], r["config"], r["efficiency"])
        for r in fwd + bwd
        if r.get("efficiency") and r["m"] == 4096 and r["tp"] > 1
    ]
    if eff:
        log("\nscaling efficiency TP1_ms / (devices x ms) at M=4096 (target >= 0.85):")
        for kind, shape, layout, cfg, e in eff:
            log(f"  {kind:7s} {shape} {layout} {cfg:9s} {e:.2f} {'ok' if e >= 0.85 else 'below target'}")
    for n in doc["notes"]:
        log(f"note: {n}")
    if doc["skipped"]:
        log(f"\n{len(doc['skipped'])} skipped (see 'skipped' in the JSON), e.g.:")
        for s in doc["skipped"][:12]:
            log(f"  {s['what']}: {s['why']}")
    errors = [r for r in rows if r.get("status") == "error"]
    differ = [
        r
        for r in fwd
        if r["status"] == "ok" and (r["logp_rows_differ"] or r["lse_rows_differ"] or r.get("entropy_rows_differ"))
    ]
    bad_g = [r for r in bwd if r["status"] == "ok" and not r["within_tol"]]
    verdict = "PASS" if not (errors or differ or bad_g) else "FAIL"
    log(
        f"\n{verdict}: {len(fwd)} forward rows ({len(differ)} with differing bytes), {len(bwd)} gradient rows "
        f"({len(bad_g)} outside tolerance), {len(errors)} errors, {len(doc['skipped'])} skipped"
        + (
            ""
            if not doc["skipped"]
            else " (INCOMPLETE: re-run the skipped groups, e.g. with TPM_SHAPES/TPM_LAYOUTS/TPM_M)"
        )
    )


def _grad_cmp_impl(a, b):
    import jax.numpy as jnp
    from jax import lax

    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    d = a32 - b32
    width = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    differ = lax.bitcast_convert_type(a, width) != lax.bitcast_convert_type(b, width)
    return {
        "diff_norm": jnp.sqrt(jnp.sum(d * d)),
        "ref_norm": jnp.sqrt(jnp.sum(b32 * b32)),
        "max_abs": jnp.max(jnp.abs(d)),
        "scale": jnp.max(jnp.abs(b32)),
        "elems_differ": jnp.sum(differ.astype(jnp.int32)),
    }


def _grad_cmp(a, b):
    import jax

    return jax.device_get(jax.jit(_grad_cmp_impl)(a, b))


def main(argv=None):
    args = parse_args(argv)
    return Suite(args).main()


if __name__ == "__main__":
    sys.exit(main())
