"""TP over processes (issue 19, item 2): one JAX process per GPU on one host vs one process, one GPU.

    OUT=$OUT PYTHONPATH=. python3 tests/gpu/tp_multiprocess.py --n 8          # nvidia-h200-x8 (or --n 2, 4)
    PYTHONPATH=. python tests/gpu/tp_multiprocess.py --n 2 --platform cpu --backend reference \\
        --shape tiny --m 1,64                                                   # CPU dry run

The launcher (this file without --role) never initialises JAX itself. It
1. runs one reference process (`--role ref`, one GPU: CUDA_VISIBLE_DEVICES=0; on CPU one CPU
   device) that computes single-device `linear_logp` logp/lse for every (layout, M), times it and
   saves the results to a temporary folder;
2. starts N worker processes (`--role worker`): `jax.distributed.initialize` with a coordinator on
   a free local port, process i driving GPU i (jax's local device assignment,
   `local_device_ids=[i]`, every GPU visible; `--visible cuda` uses CUDA_VISIBLE_DEVICES=i
   instead; on CPU one CPU device per process). Each worker builds the global 1 x N "tp" mesh over
   all processes' devices, generates and passes only its own weight shard (the other ranks'
   entries are None: `assemble_shards`), and calls `sharding.linear_logp_tp` under strict mode:
   jitted on the assembled global weight, timed with a fixed number of calls (every process runs
   the same calls: the collectives keep them in step), and at the first M also eagerly with the
   shard list itself.
   Every worker compares its logp/lse bytes (and the entropy's, with --entropy: by default where
   the backend declares it; both sides then return it) with the saved single-process result;
   process 0 prints its report;
3. collects the workers' reports, prints a table and writes --out (default
   $OUT/tp_multiprocess.json). Exit 0 when every process on every (layout, M) has 0 rows
   differing. --timeout_s bounds the reference and the workers together.

Inputs are those of tests/gpu/tp_multi.py (the same seeds, weight generated in 8 row blocks so
that a rank generates only its own shard; targets at the TP-8 shard edges).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import tp_multi as T  # noqa: E402 (numpy-only helpers: inputs, comparisons)

from benchmarks.shapes import get as get_shape  # noqa: E402


def log(*a):
    print(*a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="launcher", choices=("launcher", "ref", "worker"))
    p.add_argument("--n", type=int, default=0, help="processes = TP degree (default: the GPUs present)")
    p.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    p.add_argument(
        "--visible",
        default="jax",
        choices=("jax", "cuda"),
        help="GPU per process: local_device_ids or CUDA_VISIBLE_DEVICES",
    )
    p.add_argument("--shape", default="qwen3_8b", choices=T.SHAPES)
    p.add_argument("--layouts", default="vd", help="vd,dv (dv is skipped where the backend lacks it)")
    p.add_argument("--m", default="1,64,4096")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--backend", default="pallas_sm90")
    p.add_argument(
        "--entropy",
        default="auto",
        choices=("auto", "on", "off"),
        help="also compare the entropy's bytes (auto: if the backend declares it); the times then include it",
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout_s", type=float, default=300.0, help="the reference and the workers together")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--pid", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    a.layout_list = [x.strip() for x in a.layouts.split(",") if x.strip()]
    a.ms = [int(x) for x in a.m.split(",") if x.strip()]
    if a.out is None and os.environ.get("OUT") and a.role == "launcher":
        a.out = os.path.join(os.environ["OUT"], "tp_multiprocess.json")
    return a


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def _child_env(a, pid=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    # NVLink multicast stays off (the device machines' rule; XLA's NCCL reads these too)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if a.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        flags.append("--xla_force_host_platform_device_count=1")
    elif pid is None or a.visible == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(pid or 0)
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _timed(fn, iters, warmup, calls):
    """Fixed counts (never adaptive: every process must run the same calls)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(calls)])
        ts.append((time.perf_counter() - t0) * 1e3 / calls)
    return T.ms_stats(ts)


def _layouts(a):
    from detlogp_jax import backends

    be = backends.get(a.backend)
    return [x for x in a.layout_list if be.reads(x)], [x for x in a.layout_list if not be.reads(x)]


# --- role: reference (one process, one device) ------------------------------------------------------


def role_ref(a):
    import jax

    import detlogp_jax as dl

    shape = get_shape(a.shape)
    dev = jax.devices()[0]
    layouts, missing = _layouts(a)
    res = {"device": dev.device_kind, "platform": dev.platform, "n_local_devices": len(jax.devices()), "rows": []}
    res["skipped_layouts"] = missing
    w_vd = jax.device_put(T.weight_rows(shape, 0, T.N_BLOCKS, a.dtype, a.seed), dev)
    ent = T.entropy_on(a.entropy, a.backend)
    res["entropy"] = bool(ent)
    ekw = {"return_entropy": True} if ent else {}
    for layout in layouts:
        w = w_vd if layout == "vd" else jax.jit(lambda x: x.T)(w_vd)
        f = jax.jit(
            lambda h, w, t: T.outputs(
                dl.linear_logp(
                    h,
                    w,
                    t,
                    vocab_size=shape.v_real,
                    padded_vocab_size=shape.v_rows,
                    backend=a.backend,
                    weight_layout=layout,
                    **ekw,
                ),
                ent,
            )
        )
        for m in a.ms:
            h = jax.device_put(T.hidden_host(shape, m, a.dtype, a.seed), dev)
            t = jax.device_put(T.targets_host(shape, m, a.seed), dev)
            with dl.strict_mode():
                out = [np.asarray(x) for x in jax.device_get(f(h, w, t))]
                prov = dl.last_provenance()
                ms = _timed(lambda: f(h, w, t), a.iters, a.warmup, 10 if m <= 512 else 1)
            arrays = dict(logp=out[0], lse=out[1], **({"entropy": out[2]} if ent else {}))
            np.savez(os.path.join(a.workdir, f"ref_{layout}_{m}.npz"), **arrays)
            res["rows"].append(dict(layout=layout, m=m, ms=ms, backend=prov and prov.backend))
            log(f"ref {layout} M={m}: {ms['median']:.3f} ms (backend {prov and prov.backend})")
    with open(os.path.join(a.workdir, "ref.json"), "w") as fh:
        json.dump(res, fh, indent=1)


# --- role: worker (one of N processes) ---------------------------------------------------------------


def role_worker(a):
    import jax

    if a.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    local = [a.pid] if (a.platform == "gpu" and a.visible == "jax") else None
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{a.port}",
        num_processes=a.n,
        process_id=a.pid,
        local_device_ids=local,
        initialization_timeout=int(min(a.timeout_s, 300)),
    )
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import detlogp_jax as dl
    from sharding import assemble_shards, linear_logp_tp

    res = {"pid": a.pid, "rows": [], "ok": False}
    out_path = os.path.join(a.workdir, f"worker_{a.pid}.json")
    try:
        assert jax.process_count() == a.n, (jax.process_count(), a.n)
        assert len(jax.devices()) == a.n and len(jax.local_devices()) == 1, (jax.devices(), jax.local_devices())
        shape = get_shape(a.shape)
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        flat = list(mesh.devices.reshape(-1))
        rank = next(r for r, d in enumerate(flat) if d.process_index == jax.process_index())
        res.update(rank=rank, device=str(jax.local_devices()[0]), device_kind=jax.local_devices()[0].device_kind)
        rep = NamedSharding(mesh, P())

        def replicated(x):
            return jax.make_array_from_callback(x.shape, rep, lambda idx: x[idx])

        layouts, _ = _layouts(a)
        for layout in layouts:
            t0 = time.perf_counter()
            mine = T.weight_shard(shape, layout, a.n, rank, a.dtype, a.seed)  # only this rank's rows
            shards = [mine if r == rank else None for r in range(a.n)]
            v_axis = 0 if layout == "vd" else 1
            w_global = assemble_shards(shards, mesh, "tp", axis=v_axis)
            gen_s = time.perf_counter() - t0
            ent = T.entropy_on(a.entropy, a.backend)
            kw = dict(
                mesh=mesh,
                tp_axis="tp",
                vocab_size=shape.v_real,
                padded_vocab_size=shape.v_rows,
                backend=a.backend,
                weight_layout=layout,
                **({"return_entropy": True} if ent else {}),
            )
            f = jax.jit(lambda h, w, t: T.outputs(linear_logp_tp(h, w, t, **kw), ent))
            for m in a.ms:
                ref = np.load(os.path.join(a.workdir, f"ref_{layout}_{m}.npz"))
                h = replicated(T.hidden_host(shape, m, a.dtype, a.seed))
                t = replicated(T.targets_host(shape, m, a.seed))
                with dl.strict_mode():
                    if m == a.ms[0]:  # the shard-list path (None for the other ranks), once per layout
                        eager = linear_logp_tp(h, shards, t, **kw)
                        lp_e, lse_e = (np.asarray(x.addressable_data(0)) for x in (eager.logp, eager.lse))
                        shard_list = T.rows_differ(lp_e, ref["logp"]) + T.rows_differ(lse_e, ref["lse"])
                    else:
                        shard_list = 0
                    out = [np.asarray(x.addressable_data(0)) for x in f(h, w_global, t)]
                    prov = dl.last_provenance()
                    lp, lse = out[0], out[1]
                    ms = _timed(lambda: f(h, w_global, t), a.iters, a.warmup, 10 if m <= 512 else 1)
                row = dict(
                    layout=layout,
                    m=m,
                    logp_rows_differ=T.rows_differ(lp, ref["logp"]),
                    lse_rows_differ=T.rows_differ(lse, ref["lse"]),
                    shard_list_rows_differ=shard_list if m == a.ms[0] else None,
                    max_abs_diff=T.max_abs_diff(lp, ref["logp"]),
                    entropy_rows_differ=T.rows_differ(out[2], ref["entropy"]) if ent else None,
                    ms=ms,
                    weight_shard_s=round(gen_s, 2),
                    backend=prov and prov.backend,
                )
                res["rows"].append(row)
                if a.pid == 0:
                    log(
                        f"process 0/{a.n} {layout} M={m}: logp rows differing {row['logp_rows_differ']}, lse "
                        f"{row['lse_rows_differ']}, entropy {_na(row['entropy_rows_differ'])}, shard-list call "
                        f"{_na(row['shard_list_rows_differ'])}; "
                        f"{ms['median']:.3f} ms per call"
                    )
        res["ok"] = True
    except Exception:
        res["error"] = traceback.format_exc()[-4000:]
        log(res["error"])
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1)
    jax.distributed.shutdown()
    return 0 if res["ok"] else 1


# --- role: launcher ------------------------------------------------------------------------------------


def _wait(procs, timeout_s):
    """Waits for every (name, Popen, log); kills the rest (by handle) when one fails or time runs out."""
    deadline = time.monotonic() + timeout_s
    failed = None
    while any(p.poll() is None for _, p, _ in procs):
        bad = [(n, p) for n, p, _ in procs if p.poll() not in (None, 0)]
        if bad or time.monotonic() > deadline:
            failed = f"{bad[0][0]} exited with {bad[0][1].returncode}" if bad else f"timeout after {timeout_s:.0f}s"
            time.sleep(2.0 if bad else 0.0)  # let the others write their reports
            for _, p, _ in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for n, p, _ in procs:
        p.wait()
        if p.returncode and failed is None:
            failed = f"{n} exited with {p.returncode}"
    return failed


def _tail(path, n=3000):
    try:
        return open(path).read()[-n:]
    except OSError:
        return ""


def launcher(a):
    n = a.n or (_gpu_count() if a.platform == "gpu" else 2)
    if n < 1:
        raise SystemExit("no GPU found: give --n, or --platform cpu")
    a.n = n
    work = a.workdir or tempfile.mkdtemp(prefix="detlogp_tpmp_")
    os.makedirs(work, exist_ok=True)
    common = [
        "--n",
        str(n),
        "--platform",
        a.platform,
        "--visible",
        a.visible,
        "--shape",
        a.shape,
        "--layouts",
        a.layouts,
        "--m",
        a.m,
        "--dtype",
        a.dtype,
        "--backend",
        a.backend,
        "--entropy",
        a.entropy,
        "--iters",
        str(a.iters),
        "--warmup",
        str(a.warmup),
        "--seed",
        str(a.seed),
        "--timeout_s",
        str(a.timeout_s),
        "--workdir",
        work,
    ]
    me = os.path.abspath(__file__)
    doc = dict(
        command="python3 tests/gpu/tp_multiprocess.py " + " ".join(sys.argv[1:]),
        n_processes=n,
        platform=a.platform,
        visible=a.visible,
        shape=a.shape,
        backend=a.backend,
        dtype=a.dtype,
        workdir=work,
        rows=[],
    )
    t0 = time.perf_counter()
    log(f"reference: one process, one device ({a.platform}), shape {a.shape}, layouts {a.layouts}, M {a.m}")
    ref_log = os.path.join(work, "ref.log")
    with open(ref_log, "w") as fh:
        p = subprocess.Popen(
            [sys.executable, me, "--role", "ref"] + common, env=_child_env(a), stdout=fh, stderr=subprocess.STDOUT
        )
        failed = _wait([("reference", p, ref_log)], a.timeout_s)
    ref_s = time.perf_counter() - t0
    log(_tail(ref_log, 1500).rstrip())
    if failed:
        doc["error"] = f"reference process: {failed}"
        return _finish(a, doc, t0, False)
    ref = json.load(open(os.path.join(work, "ref.json")))
    doc["device"] = ref["device"]
    doc["entropy"] = ref.get("entropy", False)
    doc["skipped_layouts"] = ref["skipped_layouts"]
    for lay in ref["skipped_layouts"]:
        log(f"NOTE: backend {a.backend} does not read layout {lay!r} here: skipped")

    port = _free_port()
    log(f"workers: {n} processes, coordinator 127.0.0.1:{port}, TP={n} over processes")
    procs = []
    for pid in range(n):
        wlog = os.path.join(work, f"worker_{pid}.log")
        fh = open(wlog, "w")
        procs.append(
            (
                f"worker {pid}",
                subprocess.Popen(
                    [sys.executable, me, "--role", "worker", "--pid", str(pid), "--port", str(port)] + common,
                    env=_child_env(a, pid),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                ),
                wlog,
            )
        )
    failed = _wait(procs, max(a.timeout_s - ref_s, 10.0))
    log(_tail(os.path.join(work, "worker_0.log"), 2000).rstrip())
    reports = []
    for pid in range(n):
        path = os.path.join(work, f"worker_{pid}.json")
        reports.append(
            json.load(open(path)) if os.path.exists(path) else {"pid": pid, "ok": False, "error": "no report"}
        )
    ok = failed is None and all(r.get("ok") for r in reports)
    if failed:
        doc["error"] = f"workers: {failed}"
        for pid in range(n):
            if not reports[pid].get("ok"):
                log(f"--- worker {pid} log tail:\n{_tail(os.path.join(work, f'worker_{pid}.log'))}")
    ref_ms = {(r["layout"], r["m"]): r["ms"] for r in ref["rows"]}
    if all(r.get("ok") for r in reports):
        for i, row0 in enumerate(reports[0]["rows"]):
            per = [r["rows"][i] for r in reports]
            keys = ("logp_rows_differ", "lse_rows_differ", "entropy_rows_differ", "shard_list_rows_differ")
            row = dict(layout=row0["layout"], m=row0["m"], tp=n, processes=n)
            row.update({k: None if per[0][k] is None else max(p[k] for p in per) for k in keys})
            row["max_abs_diff"] = max(p["max_abs_diff"] for p in per)
            row["ms"] = row0["ms"]  # process 0's; every process runs the same calls
            row["ms_all_processes"] = [p["ms"]["median"] for p in per]
            row["tp1_ms"] = ref_ms.get((row0["layout"], row0["m"]))
            row["efficiency"] = T._eff(row["tp1_ms"], row["ms"], n)
            row["backend"] = row0["backend"]
            doc["rows"].append(row)
            if any(row[k] for k in keys if row[k] is not None):
                ok = False
    doc["reports"] = reports
    return _finish(a, doc, t0, ok)


def _na(x):
    return "-" if x is None else x


def _finish(a, doc, t0, ok):
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    doc["pass"] = bool(ok)
    log(f"\n== TP over {doc['n_processes']} processes vs one process, one device ({doc.get('device', '?')})")
    log(
        "| layout | M | processes | logp rows differing | lse rows differing | entropy rows differing | shard-list call "
        "| TP=1 ms | ms | efficiency |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        eff = f"{r['efficiency']:.2f}" if r.get("efficiency") else "-"
        log(
            f"| {r['layout']} | {r['m']} | {r['processes']} | {r['logp_rows_differ']} | {r['lse_rows_differ']} | "
            f"{_na(r.get('entropy_rows_differ'))} | {_na(r['shard_list_rows_differ'])} | {T._cell(r['tp1_ms'])} | "
            f"{T._cell(r['ms'])} | {eff} |"
        )
    if doc.get("error"):
        log(f"error: {doc['error']}")
    log(f"{'PASS' if ok else 'FAIL'}: multi-process TP={doc['n_processes']} bytes == one process ({doc['seconds']}s)")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0 if ok else 1


def main(argv=None):
    a = parse_args(argv)
    if a.role == "ref":
        os.makedirs(a.workdir, exist_ok=True)
        role_ref(a)
        return 0
    if a.role == "worker":
        return role_worker(a)
    return launcher(a)


if __name__ == "__main__":
    sys.exit(main())
