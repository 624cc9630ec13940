"""End-to-end smoke test of the benchmark runner on CPU (tiny shape)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import baselines, cases, report, run, shapes
from detlogp_jax import xla_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("reference", "xla", "xla_chunked", "gemm")
MS = (1, 8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two sweeps, overlapped to use both CPU cores:
    the CLI as a subprocess (trainer entry, forward) and, meanwhile, the runner
    in process (serving entry = return_logits=True, with the backward)."""
    d = tmp_path_factory.mktemp("bench")
    out, png = d / "trainer_fwd.json", d / "trainer_fwd.png"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--shape=tiny",
        f"--m={','.join(map(str, MS))}",
        f"--backends={','.join(BACKENDS)}",
        "--warmup=1",
        "--iters=2",
        "--entry=trainer",
        "--mode=fwd",
        f"--out={out}",
        f"--plot={png}",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cfg = run.RunConfig(
            shape=shapes.get("tiny"),
            ms=MS,
            backends=BACKENDS,
            entry="serving",
            mode="fwd_bwd",
            warmup=1,
            iters=2,
            out=str(d / "serving_fwd_bwd.json"),
            plot=str(d / "serving_fwd_bwd.png"),
        )
        serving = run.execute(cfg)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    return {"cli": (json.loads(out.read_text()), png, stdout, stderr), "serving": (serving, cfg)}


@pytest.fixture(scope="module")
def trainer_fwd(runs):
    return runs["cli"]


@pytest.fixture(scope="module")
def serving_fwd_bwd(runs):
    return runs["serving"]


def test_floors_follow_the_device_or_the_flags():
    cfg = run.RunConfig(shape=shapes.get("tiny"), ms=(1, 64))
    assert run.ceilings(cfg) is None and run.floors(cfg) == []  # CPU: no known ceilings
    given = run.RunConfig(shape=shapes.get("tiny"), ms=(1, 64), hbm_tbps=1.0, peak_tflops=2.0)
    assert run.ceilings(given) == (1.0, 2.0) and [f["m"] for f in run.floors(given)] == [1, 64]
    assert run.KNOWN_CEILINGS["NVIDIA H200"] == (4.0, 790.0)


def _cases(doc):
    return {(c["backend"], c["m"]): c for c in doc["cases"]}


def _check_structure(doc):
    assert doc["schema"] == "detlogp-bench/1"
    env = doc["environment"]
    for key in ("device_kind", "platform", "jax_version", "command_line", "available_backends"):
        assert key in env
    assert doc["shape"] == {"name": "tiny", "d": 64, "v_real": 1000, "v_rows": 1024, "note": shapes.SHAPES["tiny"].note}
    # A CPU run has no known ceilings: no H200 floors drawn on it (--hbm_tbps / --peak_tflops add them).
    assert doc["ceilings"] is None and doc["floors"] == []
    got = _cases(doc)
    assert set(got) == {(b, m) for b in BACKENDS for m in MS}
    for (backend, m), c in got.items():
        assert c["status"] == "ok", c
        assert len(c["times_ms"]) == 2 and c["warmup_done"] == 1
        assert 0 < c["min_ms"] <= c["median_ms"] <= c["max_ms"]
        assert c["tflops"] > 0 and c["tbps"] > 0 and c["bytes_moved"] > 0
        assert c["compiled_memory"]["temp_bytes"] is not None
        assert c["time_vs_xla"] == pytest.approx(c["median_ms"] / got[("xla", m)]["median_ms"])
        assert c["run_to_run"] == "bitwise-identical"
        assert c["determinism"].startswith(("bitwise-invariant", "drift"))
    return got


@pytest.mark.slow
def test_cli_trainer_fwd(trainer_fwd):
    doc, png, stdout, stderr = trainer_fwd
    got = _check_structure(doc)
    assert png.exists() and png.stat().st_size > 1000
    assert "median_ms" in stdout and "xla_chunked" in stdout  # the printed table
    assert "M=8" in stderr  # progress lines
    assert doc["config"]["entry"] == "trainer" and doc["config"]["mode"] == "fwd"
    for m in MS:
        c = got[("xla_chunked", m)]
        assert c["lse_max_abs_diff_vs_xla"] < 1e-4 and c["logp_max_abs_diff_vs_xla"] < 1e-4
        ref = got[("reference", m)]
        assert ref["determinism"].startswith("bitwise-invariant")
        assert set(ref["determinism_detail"]) == {"logp", "lse"}
        assert got[("gemm", m)]["lse_max_abs_diff_vs_xla"] is None
        assert got[("xla", m)]["flops"] == 2 * m * 64 * 1024


def test_serving_fwd_bwd(serving_fwd_bwd):
    doc, cfg = serving_fwd_bwd
    got = _check_structure(doc)
    assert os.path.getsize(cfg.plot_path()) > 1000
    with open(cfg.out_path()) as f:
        assert json.load(f)["cases"] == json.loads(json.dumps(doc["cases"]))
    for m in MS:
        assert got[("xla_chunked", m)]["lse_max_abs_diff_vs_xla"] < 1e-4
        ref = got[("reference", m)]
        assert ref["determinism"].startswith("bitwise-invariant")
        assert set(ref["determinism_detail"]) == {"logp", "lse", "logits"}
        assert ref["grad_determinism"] is not None and "d_hidden" in ref["grad_determinism_detail"]
        assert got[("xla", m)]["flops"] == 6 * m * 64 * 1024


def test_chunked_baseline_matches_xla(v_rows=1000, vocab=900, block=256):
    """Shifted last block, padding rows and ignore_index, vs the materialized XLA lane."""
    kh, kw, kt = jax.random.split(jax.random.PRNGKey(1), 3)
    h = jax.random.normal(kh, (5, 32), jnp.float32)
    w = jax.random.normal(kw, (v_rows, 32), jnp.float32) * 0.5
    t = jax.random.randint(kt, (5,), 0, vocab).at[2].set(-100)
    chunked = jax.jit(
        lambda h, w, t: baselines.chunked_logp(h, w, t, vocab_size=vocab, inv_t=0.7, block=block, return_logits=True)
    )
    logp, lse, logits = chunked(h, w, t)
    inv_t = jnp.full((5,), 0.7, jnp.float32)
    xla = jax.jit(lambda h, w, t: xla_backend.forward(h, w, None, t, inv_t, vocab_size=vocab, return_logits=True))
    ref_logp, ref_lse, ref_logits = xla(h, w, t)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-4)
    np.testing.assert_allclose(logp, ref_logp, rtol=0, atol=1e-4)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4)
    assert float(logp[2]) == 0.0


def test_shapes():
    assert (shapes.get("qwen3_8b").v_rows, shapes.get("qwen3_8b").v_real) == (152064, 151936)
    assert shapes.get("llama3_8b").v_rows == 128512
    assert shapes.get("gpt_oss").v_rows == 201216 and shapes.get("gpt_oss").d == 2880
    assert shapes.get("gemma3").v_rows == 262144
    custom = shapes.get("custom", d=128, v_real=1000)
    assert (custom.d, custom.v_rows, custom.v_real) == (128, 1024, 1000)
    with pytest.raises(ValueError):
        shapes.get("custom", d=128)


def test_guard_skips_predicted_slow_cases():
    cfg = run.RunConfig(shape=shapes.get("tiny"), ms=(1, 1024), max_seconds_per_case=1.0)
    last = run.CaseResult("reference", 1, "ok", median_ms=1.0)
    assert run._predicted_skip(cfg, last, 1024) is not None
    assert run._predicted_skip(cfg, last, 8) is None
    assert run._predicted_skip(cfg, None, 1024) is None


def test_unknown_backend_rejected():
    with pytest.raises(ValueError):
        cases.CaseSpec("nope", shapes.get("tiny"))


def test_gemm_remat_lane_runs_four_gemms_with_the_gemm_lanes_gradients():
    """gemm_remat (the recompute mode's floor): the GEMM-alone loss under jax.checkpoint compiles
    to four dots where the gemm lane has three, its gradients are the gemm lane's bytes (the
    recomputed logits are the forward's), and it is refused outside fwd_bwd."""
    import re

    sh = shapes.get("tiny")
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.standard_normal((64, sh.d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((sh.v_rows, sh.d)) / 8, jnp.bfloat16)
    t = jnp.zeros((64,), jnp.int32)
    got = {}
    for b in ("gemm", "gemm_remat"):
        f = jax.jit(cases.build(cases.CaseSpec(b, sh, mode="fwd_bwd")))
        hlo = f.lower(h, w, t).compile().as_text()
        got[b] = (len(re.findall(r"\bdot\(", hlo)), f(h, w, t))
    assert got["gemm"][0] == 3 and got["gemm_remat"][0] == 4, {b: n for b, (n, _) in got.items()}
    for k in ("d_hidden", "d_weight"):
        a, r = np.asarray(got["gemm"][1][k], np.float32), np.asarray(got["gemm_remat"][1][k], np.float32)
        assert np.array_equal(a.view(np.uint32), r.view(np.uint32)), k
    with pytest.raises(ValueError, match="fwd_bwd"):
        cases.CaseSpec("gemm_remat", sh, mode="fwd")


def test_progress_log_parser_rebuilds_cases():
    from benchmarks import from_log

    text = (
        "[    94.8s] (31/39) pallas_sm90 M=4096   median    8.8707 ms  [7.5816, 9.1274]   575.20 TFLOP/s  "
        "compile 4.7s  bitwise-invariant\n"
        "[    96.1s] (32/39) xla         M=4096   median    8.8722 ms  [7.9215, 9.0426]   575.10 TFLOP/s  "
        "compile 0.9s  drift (max_abs_diff=2.86e-05 in logp,lse)\nnoise line\n"
    )
    cases = from_log.parse(text)
    assert [(c.backend, c.m) for c in cases] == [("pallas_sm90", 4096), ("xla", 4096)]
    assert cases[0].median_ms == 8.8707 and cases[0].min_ms == 7.5816 and cases[0].max_ms == 9.1274
    assert cases[1].determinism.startswith("drift")
    assert abs(cases[0].time_vs_xla - 8.8707 / 8.8722) < 1e-12


def test_trace_summary_prefers_device_threads():
    """benchmarks.experiments.trace_summary.summarize: device-stream events only when there are any, per-call means, span."""
    from benchmarks.experiments import trace_summary

    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
    ]
    ev = [
        {"ph": "X", "pid": 1, "tid": 1, "name": "host_op", "ts": 0, "dur": 1000},
        {"ph": "X", "pid": 2, "tid": 7, "name": "fwd_kernel", "ts": 10, "dur": 300},
        {"ph": "X", "pid": 2, "tid": 7, "name": "fold", "ts": 320, "dur": 30},
        {"ph": "X", "pid": 2, "tid": 7, "name": "fwd_kernel", "ts": 400, "dur": 310},
        {"ph": "X", "pid": 2, "tid": 7, "name": "fold", "ts": 720, "dur": 40},
    ]
    s = trace_summary.summarize({"traceEvents": meta + ev}, calls=2)
    assert s["scope"] == "device"
    assert [r["name"] for r in s["rows"]] == ["fwd_kernel", "fold"]
    assert s["rows"][0]["us_per_call"] == 305.0 and s["rows"][1]["count"] == 2
    assert s["span_us_per_call"] == (760 - 10) / 2 and s["busy_us_per_call"] == 340.0
    host = trace_summary.summarize({"traceEvents": meta[:1] + ev[:1]}, calls=1)
    assert host["scope"] == "host" and host["rows"][0]["name"] == "host_op"


def test_trace_summary_tells_repeated_kernels_apart():
    """Two kernels of one name per call (Mosaic calls every Pallas kernel `kernel_mosaic_gpu_kernel`) get
    one row each, by launch order within the call, or by HLO op where the trace names one."""
    from benchmarks.experiments import trace_summary

    meta = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    k = "kernel_mosaic_gpu_kernel"
    ev = [
        {"ph": "X", "pid": 2, "tid": 7, "name": k, "ts": t, "dur": d}
        for t, d in ((0, 290), (300, 5), (400, 292), (700, 7))
    ]
    s = trace_summary.summarize({"traceEvents": meta + ev}, calls=2)
    assert {r["name"]: r["us_per_call"] for r in s["rows"]} == {f"{k}#1": 291.0, f"{k}#2": 6.0}
    for e, op in zip(ev, ("fwd", "fold", "fwd", "fold")):
        e["args"] = {"hlo_op": op}
    s = trace_summary.summarize({"traceEvents": meta + ev}, calls=2)
    assert {r["name"]: r["count"] for r in s["rows"]} == {f"{k} [fwd]": 2, f"{k} [fold]": 2}


_EXPERIMENTS_DRY_RUN = r"""
import dataclasses
import json
import numpy as np
from benchmarks.experiments import chain_stand_ins, gemm_ceiling, kernel_timing as kt, power_probe, probe_kernel
from pallas_kernels import tile_math, tuning

planned = []
real_chain = tile_math.chain_tile_sliced

class Recorder:
    def __init__(self, *a):
        self.rows, self.w = [], np.zeros((2, 3), np.float32)
    def sets(self, m):
        return [(None, None)] * 2
    dv_sets = sets
    def kernel(self, group, name, m, cfg, **kw):
        assert isinstance(cfg, (tuning.WgmmaForwardConfig, tuning.WsForwardConfig)), cfg
        if group in ("chain18", "shape19"):  # a stand-in's lane is built with the stand-in installed, the others not
            stand_in = [f for tag, f in chain_stand_ins.STAND_INS.items() if name.endswith(tag)]
            assert tile_math.chain_tile_sliced is (stand_in[0] if stand_in else real_chain), name
        kt.forward_build(cfg)
        planned.append([group, name, m, type(cfg).__name__])
    def generic(self, *a, **kw):
        pass
    def record(self, *a, **kw):
        pass

probe_kernel.Probe = Recorder
groups = "decode,small,prefill,large,serving,epi,epi_large,epi_small,epi_next,ws,decode_ws,decode7,small7,mid12,ceiling18,chain18,shape19,depth19"
probe_kernel.FLAGS(["probe_kernel", "--groups=" + groups])
probe_kernel.main([])
assert tile_math.chain_tile_sliced is real_chain
assert sum(g == "chain18" for g, *_ in planned) == 4 * (2 + len(chain_stand_ins.STAND_INS))
assert sum(g == "ceiling18" for g, *_ in planned) == 5 * 2
assert sum(g == "shape19" for g, *_ in planned) == 3 * 3
assert sum(g == "depth19" for g, *_ in planned) == 2 * 5
assert kt.CHAIN_IN_WGMMA == tuning.WgmmaForwardConfig("prefill-chain", block_m=64, num_compute_wgs=2,
                                                     max_concurrent_steps=5, split_group=4)
print(json.dumps(planned))
"""


def _run_on_cpu(args):
    """`python <args>` from the repo root on the CPU platform (a subprocess: the experiments'
    absl flags, e.g. --out and --m, share names with benchmarks.run's); asserts it succeeded."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_kernel_experiments_plan_valid_configs():
    """benchmarks.experiments imports on CPU and every forward variant probe_kernel would time is a
    valid config of one kernel (configs are checked when made, so a bad variant would end the whole
    GPU run before its first timing). In a subprocess: the experiments' absl flags (--out, --m)
    share names with benchmarks.run's."""
    proc = _run_on_cpu(["-c", _EXPERIMENTS_DRY_RUN])
    planned = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(planned) > 50
    kinds = {k for *_, k in planned}
    assert kinds == {"WgmmaForwardConfig", "WsForwardConfig"}


def test_dv_weight_layout_sweep():
    """--weight_layout dv (with the --ms alias): the weight is the [D, V_rows] kernel made once
    (the transpose of the vd weight); library backends read it in place with the same logp/lse
    bytes as the vd sweep's, the [V, D]-only baselines are skipped with a reason."""
    try:
        run.FLAGS(["run", "--shape=tiny", "--ms=1,8", "--weight_layout=dv", "--backends=reference,xla_chunked"])
        cfg = run.config_from_flags()
    finally:
        run.FLAGS.unparse_flags()
    assert cfg.ms == (1, 8) and cfg.weight_layout == "dv" and cfg.out_path().endswith("_dv_cpu.json")
    cfg = run.RunConfig(**{**cfg.__dict__, "warmup": 1, "iters": 2, "backends": ("reference", "xla", "xla_chunked")})
    w_vd = run.make_weight(dataclasses.replace(cfg, weight_layout="vd"))
    w_dv = run.make_weight(cfg)
    assert w_dv.shape == (64, 1024) and np.array_equal(np.asarray(w_dv), np.asarray(w_vd).T)
    doc = run.run(cfg)
    assert doc["config"]["weight_layout"] == "dv"
    got = _cases(doc)
    for m in (1, 8):
        assert got[("xla_chunked", m)]["status"] == "skipped" and "[V, D]" in got[("xla_chunked", m)]["note"]
        for b in ("reference", "xla"):
            assert got[(b, m)]["status"] == "ok", got[(b, m)]
        assert got[("reference", m)]["determinism"].startswith(("bitwise-invariant", "trivial"))
        h, t = run.make_inputs(cfg, m)[0]
        spec = cfg.spec("reference")
        dv = jax.jit(cases.build(spec))(h, w_dv, t)
        vd = jax.jit(cases.build(dataclasses.replace(spec, weight_layout="vd")))(h, w_vd, t)
        for k in ("logp", "lse"):
            assert np.array_equal(np.asarray(dv[k]).view(np.uint32), np.asarray(vd[k]).view(np.uint32)), k


def test_residuals_option_for_fwd_bwd():
    """--residuals logits (fwd_bwd): the library backends run linear_logp(residuals="logits"),
    with the recompute mode's logp/lse bytes and gradients within the f32 accuracy; the
    runner reports temp/peak memory per case; the option is refused outside fwd_bwd."""
    try:
        run.FLAGS(["run", "--shape=tiny", "--ms=8", "--mode=fwd_bwd", "--residuals=logits", "--backends=reference,xla"])
        cfg = run.config_from_flags()
    finally:
        run.FLAGS.unparse_flags()
    assert cfg.residuals == "logits" and cfg.out_path().endswith("_fwd_bwd_res-logits_cpu.json")
    assert cfg.spec("reference").residuals == "logits"
    with pytest.raises(ValueError, match="fwd_bwd"):
        run.RunConfig(shape=shapes.get("tiny"), mode="fwd", residuals="logits")
    with pytest.raises(ValueError, match="residuals"):
        cases.CaseSpec("reference", shapes.get("tiny"), mode="fwd_bwd", residuals="saved")
    cfg = run.RunConfig(**{**cfg.__dict__, "warmup": 1, "iters": 2, "dtype": "f32"})
    doc = run.run(cfg)
    assert doc["config"]["residuals"] == "logits"
    got = _cases(doc)
    for b in ("reference", "xla"):
        c = got[(b, 8)]
        assert c["status"] == "ok" and c["run_to_run"] == "bitwise-identical", c
        assert c["compiled_memory"]["temp_bytes"] is not None and "peak_bytes_in_use" in c["device_memory"]
    w = run.make_weight(cfg)
    h, t = run.make_inputs(cfg, 8)[0]
    spec = cfg.spec("reference")
    a = jax.jit(cases.build(spec))(h, w, t)
    r = jax.jit(cases.build(dataclasses.replace(spec, residuals="recompute")))(h, w, t)
    for k in ("logp", "lse"):
        assert np.array_equal(np.asarray(a[k]).view(np.uint32), np.asarray(r[k]).view(np.uint32)), k
    for k in ("d_hidden", "d_weight"):
        x, y = np.asarray(a[k], np.float64), np.asarray(r[k], np.float64)
        assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(y), k


def test_entropy_cases_in_the_same_run(monkeypatch):
    """--entropy: each library backend's case is followed by its '<backend>+entropy' case (same M,
    same inputs) with the time ratio and a logp/lse bytes check, and returns the entropy; a
    backend that does not declare the entropy is skipped with the reason; baselines get no entropy case."""
    from detlogp_jax import backends

    try:
        run.FLAGS(["run", "--shape=tiny", "--ms=1", "--entropy", "--backends=reference,gemm"])
        cfg = run.config_from_flags()
    finally:
        run.FLAGS.unparse_flags()
    assert cfg.entropy
    cfg = run.RunConfig(**{**cfg.__dict__, "warmup": 1, "iters": 2})
    doc = run.run(cfg)
    got = _cases(doc)
    assert set(got) == {("reference", 1), ("reference+entropy", 1), ("gemm", 1)}
    c = got[("reference+entropy", 1)]
    assert c["status"] == "ok" and c["entropy_same_logp_lse"] is True
    assert c["entropy_time_ratio"] == pytest.approx(c["median_ms"] / got[("reference", 1)]["median_ms"])
    assert got[("reference", 1)]["entropy_time_ratio"] is None
    lo, hi = c["entropy_paired_min_max"]  # the interleaved pairs of the two compiled cases
    assert 0 < lo <= c["entropy_paired_ratio"] <= hi
    assert got[("reference", 1)]["entropy_paired_ratio"] is None
    summary = run.report.format_entropy_summary([run.CaseResult(**x) for x in doc["cases"]])
    assert "entropy reference M=1:" in summary and "interleaved pairs" in summary
    h, t = run.make_inputs(cfg, 1)[0]
    w = run.make_weight(cfg)
    out = jax.jit(cases.build(cfg.spec("reference", entropy=True)))(h, w, t)
    assert out["entropy"].shape == (1,) and np.asarray(out["entropy"])[0] > 0
    be = backends.get("pallas_sm90")
    assert be.entropy  # validated on the H200: the runner times its entropy case directly
    unset = type(be)(**{**be.__dict__, "available": lambda: True, "entropy": False})  # an entry without it
    monkeypatch.setitem(backends._LOADED, "pallas_sm90", unset)
    why = cases.unsupported_reason("pallas_sm90", jnp.zeros((1, 64), jnp.bfloat16), w.astype(jnp.bfloat16), "vd", True)
    assert "does not declare the entropy" in why
    with pytest.raises(ValueError, match="library backend"):
        cases.CaseSpec("gemm", shapes.get("tiny"), entropy=True)


def test_replot_draws_a_recorded_document(tmp_path, monkeypatch):
    """benchmarks.replot redraws a recorded runner document (one made with --plot none) as a PNG,
    by default into a new untracked ./detlogp-results/<stamp>/, never next to the recorded JSON."""
    from benchmarks import replot

    src = os.path.join(ROOT, "benchmarks", "results", "h200", "forward", "fwd.json")
    out = replot.replot(src, str(tmp_path / "fwd.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    monkeypatch.chdir(tmp_path)
    out = replot.replot(src)
    parts = os.path.relpath(out, tmp_path).split(os.sep)
    assert parts[0] == report.DEFAULT_RESULTS_DIR and parts[2] == "fwd.png" and len(parts) == 3, out
    assert os.path.getsize(out) > 1000 and os.path.dirname(os.path.abspath(out)) != os.path.dirname(src)


def test_default_output_is_a_new_untracked_folder(tmp_path, monkeypatch):
    """Without --out / --out_dir the runner writes into a new ./detlogp-results/<UTC stamp>/ (in
    .gitignore), chosen once per run, so the JSON and the plot land together; a second folder of the
    same second gets a suffix. --out_dir and --out say where instead."""
    monkeypatch.chdir(tmp_path)
    cfg = run.RunConfig(shape=shapes.get("tiny"))
    parts = cfg.out_path().split(os.sep)
    assert parts[0] == report.DEFAULT_RESULTS_DIR and len(parts) == 3 and parts[2] == "tiny_trainer_fwd_cpu.json"
    assert cfg.out_path() == cfg.out_path() and cfg.plot_path() == cfg.out_path()[: -len(".json")] + ".png"
    os.makedirs(cfg.out_dir)
    assert run.RunConfig(shape=shapes.get("tiny")).out_dir == cfg.out_dir + "-2"
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/" + report.DEFAULT_RESULTS_DIR + "/" in f.read().split()
    assert run.RunConfig(shape=shapes.get("tiny"), out_dir="mine").out_path() == os.path.join(
        "mine", "tiny_trainer_fwd_cpu.json"
    )
    assert run.RunConfig(shape=shapes.get("tiny"), out="x/y.json").plot_path() == "x/y.png"
    try:
        run.FLAGS(["run", "--shape=tiny", "--out_dir=there"])
        assert run.config_from_flags().out_path() == os.path.join("there", "tiny_trainer_fwd_cpu.json")
    finally:
        run.FLAGS.unparse_flags()


def test_lowering_checks_say_what_the_kernel_plans_rely_on():
    """benchmarks.experiments.lowering_checks (Mosaic GPU facts docs/KERNEL_DESIGN.md relies on): global semaphores, a
    TMA box past a [1, D] array and whole swizzled halves lower; a column slice of a swizzled ref
    does not (why the swizzled hand-off slices halves in registers)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from benchmarks.experiments import lowering_checks as lc

    got = {name: check() for name, check in lc.CHECKS.items()}
    assert got["semaphores"] == got["oob_rows"] == got["swizzled_halves"] == "lowers", got
    assert got["swizzled_column_slice"].startswith("refused"), got


@pytest.mark.slow
def test_handoff_check_runs_and_agrees_in_interpret_mode(capsys):
    """benchmarks.experiments.handoff_check (the H200 check that found the swizzled hand-off's
    missing barriers, docs/KERNEL_DESIGN.md "The bias"): on the CPU its first case with the shipped swizzled
    hand-off agrees with the chain-in-wgmma kernel in both entries (interpret mode cannot show
    the race; this keeps the script working for the GPU)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from benchmarks.experiments import handoff_check

    assert handoff_check.main(["--interpret", "--only", "swz8"]) == 0
    out = capsys.readouterr().out
    assert out.count(" same ") == 2 and "DIFF" not in out, out


@pytest.mark.slow
def test_mosaic_ir_hashes_lowers_every_forward_variant_at_the_small_shape(monkeypatch):
    """benchmarks.mosaic_ir_hashes (the restructure guard) builds every forward variant at its small
    shape with the static arguments the wrapper would pass (the ninth session's swizzled buckets
    crashed it: a 1000-column logits width, not a multiple of 32): one 16-hex digest per variant,
    distinct names, and the trainer / serving modules differ."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from benchmarks import mosaic_ir_hashes as mh

    monkeypatch.setattr(mh, "SHAPES", [s for s in mh.SHAPES if s[1] == 72])
    # _capture_modules wraps Mosaic's serializer for the process: restored after the test.
    monkeypatch.setattr(mh.mosaic_core, "_run_serde_pass", mh.mosaic_core._run_serde_pass)
    monkeypatch.setattr(mh, "_captured", [])
    mh._capture_modules()
    got = dict((name, digest) for name, digest in mh.forward_hashes())
    assert len(got) == 4 * len(mh._forward_configs()), sorted(got)
    assert all(len(d) == 16 and int(d, 16) >= 0 for d in got.values())
    for name in got:
        if "logits=False" in name:
            assert got[name] != got[name.replace("logits=False", "logits=True")], name


def test_mosaic_ir_hashes_fold_selector_prints_the_fold_lines(monkeypatch, capsys):
    """`python -m benchmarks.mosaic_ir_hashes fold` (the guard cited for sm90_fold's restructure):
    exactly the two fold lines of the base and entropy sets, in their order, each a 16-hex
    digest, all distinct; an unknown selector is refused."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from benchmarks import mosaic_ir_hashes as mh

    monkeypatch.setattr(mh.mosaic_core, "_run_serde_pass", mh.mosaic_core._run_serde_pass)
    monkeypatch.setattr(mh, "_captured", [])
    mh.main(["fold"])
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("  ", 1)[1] for line in lines]
    assert names == ["fold staged", "fold entropy staged"]
    digests = [line.split("  ", 1)[0] for line in lines]
    assert len(set(digests)) == 2 and all(len(d) == 16 and int(d, 16) >= 0 for d in digests)
    with pytest.raises(SystemExit, match="unknown"):
        mh.main(["folds"])


def test_mosaic_ir_hashes_body_set_names_the_body_kernels(monkeypatch):
    """`python -m benchmarks.mosaic_ir_hashes body`: its first lines are the body GEMM's buckets
    at the q/o projection ([K, N] layout), one distinct 16-hex digest per bucket (the launch
    geometry is in the module)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    import itertools

    from benchmarks import mosaic_ir_hashes as mh
    from pallas_kernels.body import matmul_config as mc

    monkeypatch.setattr(mh.mosaic_core, "_run_serde_pass", mh.mosaic_core._run_serde_pass)
    monkeypatch.setattr(mh, "_captured", [])
    mh._capture_modules()
    got = dict((name, digest) for name, digest in itertools.islice(mh.body_hashes(), len(mc.BUCKETS)))
    assert [n.split()[-1] for n in got] == sorted(mc.BUCKETS), list(got)
    assert all(n.startswith("body gemm q/o kn M=") for n in got), list(got)
    assert len(set(got.values())) == len(got) and all(len(d) == 16 for d in got.values())


@pytest.mark.slow
def test_chain_stand_ins_replace_the_chain_only_inside_the_block(monkeypatch):
    """benchmarks.experiments.chain_stand_ins (probe_kernel's chain18, power_probe --stand_ins):
    the prefill kernel built inside `replaced_chain(stand_in)` lowers for CUDA at the small shape
    as a module of its own for each stand-in, the real chain is back after the block (also when
    the block raises), and the kernel built after it is the shipped module again."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    import pallas_kernels as pk
    from benchmarks import mosaic_ir_hashes as mh
    from benchmarks.experiments import chain_stand_ins
    from pallas_kernels import tile_math, tuning

    monkeypatch.setattr(mh.mosaic_core, "_run_serde_pass", mh.mosaic_core._run_serde_pass)
    monkeypatch.setattr(mh, "_captured", [])
    mh._capture_modules()
    cfg = tuning.BUCKETS["prefill"]
    m, d, v, v_rows = 72, 192, 1000, 1024
    n_pad = tuning.padded_rows(m, cfg)
    args = [mh._sds((n_pad, d), jnp.bfloat16), mh._sds((v_rows, d), jnp.bfloat16)]
    args += [mh._sds((n_pad,), jnp.int32), mh._sds((n_pad,), jnp.float32)]
    static = dict(
        n_pad=n_pad, d=d, lg_cols=tuning.logits_width(cfg, v, v_rows, False), geom=pk.shard_geometry(v, v_rows)
    )
    static.update(cfg=cfg, has_bias=False, return_logits=False, num_ctas=132, interpret=False, interpret_params=None)

    def digest():
        mh._lower(mh._forward_build(cfg), args, lg_rows=m, **static)
        return mh._take()

    real = tile_math.chain_tile_sliced
    shipped = digest()
    digests = []
    for stand_in in chain_stand_ins.STAND_INS.values():
        with chain_stand_ins.replaced_chain(stand_in):
            assert tile_math.chain_tile_sliced is stand_in
            digests.append(digest())
        assert tile_math.chain_tile_sliced is real
    assert len({shipped, *digests}) == 1 + len(digests), (shipped, digests)
    with pytest.raises(RuntimeError, match="inside"):
        with chain_stand_ins.replaced_chain(chain_stand_ins.one_slice):
            raise RuntimeError("inside")
    assert tile_math.chain_tile_sliced is real
    assert digest() == shipped


def test_call_overhead_times_each_lane(tmp_path):
    """benchmarks.experiments.call_overhead (the decode call's host / device split) runs its
    timing plumbing on the CPU (the GEMM lane of the tiny shape) and writes one JSON line per
    lane and M, in order, with every timing field and positive times."""
    out = tmp_path / "overhead.jsonl"
    _run_on_cpu(
        ["-m", "benchmarks.experiments.call_overhead", "--shape=tiny", "--m=1,8", "--lanes=gemm"]
        + ["--samples=3", "--calls=3", f"--out={out}"]
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["m"], r["lane"]) for r in rows] == [(1, "gemm"), (8, "gemm")]
    timings = {"enqueue_us", "single_us", "sample10_us", "sample100_us", "gap10_us"}
    for r in rows:
        assert timings <= set(r) and r["mode"] == "fwd" and r["shape"] == "tiny", r
        assert all(r[k] > 0 for k in timings - {"gap10_us"})
