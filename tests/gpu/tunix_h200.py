"""detlogp_jax.integrations.tunix on one H200: a GRPO step under patch(), and per_token_logps vs
Tunix's own compute_per_token_logps at a Qwen3-8B-sized lm_head (speed and peak memory).

    # once, on a machine with PyPI (the H200 has no network): build the wheelhouse
    pip wheel --no-deps -w .whl/tunix -r tests/gpu/tunix_h200_wheels.txt
    # on the H200 (carry .whl/tunix; python3 is the image's, with JAX 0.11.2 + CUDA 13):
    python3 -m pip install --no-index --no-deps .whl/tunix/*.whl
    PYTHONPATH=. python3 tests/gpu/tunix_h200.py $OUT/tunix_h200.json            # everything
    PYTHONPATH=. python3 tests/gpu/tunix_h200.py $OUT/x.json --cases grpo        # one group

Not a pytest file (it is not collected): one JSON object goes to the path argument.

Cases (each in its own subprocess, so `memory_stats()["peak_bytes_in_use"]` is that case's peak):

* grpo-{tied,untied}: one GRPO step (RLCluster + GRPOLearner, vanilla rollout with logprobs,
  reference model, beta=0.04) of a tiny bf16 Qwen3 under `patch(backend=...)`; records the loss,
  the step's wall time and the op's provenance for that head (which backend served it).
* head-{dv,vd}-{ours,tunix}-{fwd,bwd}: a 1-layer Qwen3 with the Qwen3-8B dims (D=4096,
  V=151936, 32 heads x 128, 8 KV heads, F=12288), bf16; B x (P + C) tokens; "ours" is
  `per_token_logps` (stop_gradient) / its value_and_grad over all parameters, "tunix" is
  `tunix.rl.common.compute_per_token_logps` (stop_gradient=True) / its value_and_grad
  (stop_gradient=False). dv = the untied [D, V] kernel (Qwen3-8B), vd = tied [V, D] table.
  "ourslogits" (bwd only): ours with residuals="logits" (the op keeps its FP32 logits for the
  backward: three GEMM passes, as Tunix's path, instead of four).
  Timing: benchmarks.timing.compile_case + time_case (device-synchronized wall clock, median of
  the samples after warmup); memory: the process's peak_bytes_in_use after the timed calls and
  XLA's memory_analysis of the executable.
* diff-{dv,vd}: max |ours - tunix| over the completion positions (bf16 model: Tunix's head writes
  bf16 logits before its FP32 log-softmax, the op keeps the FP32 accumulator; expect ~1e-2).

Wheels to carry (tests/gpu/tunix_h200_wheels.txt: google-tunix 0.1.7 and the packages of
requirements/cpu.lock + requirements/tunix.lock that the image does not have, plus
safetensors 0.7.0: tunix asks safetensors<0.8 and the image has 0.8.0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

B, P, C = 4, 128, 384  # 1536 completion rows per call
QWEN3_8B = dict(
    num_layers=1,
    vocab_size=151936,
    embed_dim=4096,
    hidden_dim=12288,
    num_heads=32,
    head_dim=128,
    num_kv_heads=8,
    norm_eps=1e-6,
    rope_theta=1_000_000,
)
if os.environ.get("TUNIX_H200_SMALL") == "1":  # a CPU dry run of the script's plumbing: tiny shapes
    B, P, C = 2, 8, 8
    QWEN3_8B.update(vocab_size=20000, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2)
BACKEND = os.environ.get("TUNIX_H200_BACKEND", "auto")
HEAD_CASES = [
    f"head-{lay}-{impl}-{mode}" for lay in ("dv", "vd") for impl in ("ours", "tunix") for mode in ("fwd", "bwd")
] + [f"head-{lay}-ourslogits-bwd" for lay in ("dv", "vd")]
ALL_CASES = ["grpo-tied", "grpo-untied", *HEAD_CASES, "diff-dv", "diff-vd"]


def _qwen3(tied: bool, dims: dict, dtype):
    from flax import nnx
    from tunix.models.qwen3 import model as q3

    cfg = q3.ModelConfig(use_tied_embedding=tied, dtype=dtype, param_dtype=dtype, **dims)
    return q3.Qwen3(cfg, rngs=nnx.Rngs(0))


def _batch(vocab: int):
    import numpy as np

    rng = np.random.default_rng(0)
    prompt = rng.integers(3, vocab, (B, P)).astype(np.int32)
    comp = rng.integers(3, vocab, (B, C)).astype(np.int32)
    for i in range(B):
        prompt[i, : 8 * i] = 0
        comp[i, C - 16 * i :] = 0
    return prompt, comp


def _provenance(model):
    """Which backend serves the op for this model's head: one eager call of the op on a few rows,
    then `last_provenance()` (compact: backend, fallback, layout, platform, vocab sizes)."""
    import jax.numpy as jnp

    import detlogp_jax as dl
    from detlogp_jax.integrations import tunix as dt

    w, layout = dt.head_weight(model)
    d = w.shape[1] if layout == "vd" else w.shape[0]
    dt.token_logps(model, jnp.zeros((8, d), w.dtype), jnp.zeros((8,), jnp.int32), backend=BACKEND)
    p = dl.last_provenance()
    keys = ("backend", "fallback", "weight_layout", "platform", "device_kind", "vocab_size", "padded_vocab_size")
    return {k: getattr(p, k) for k in keys}, layout


def case_grpo(tied: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.interpreters import pxla
    from tunix.rl import rl_cluster as rl_lib
    from tunix.rl.grpo import grpo_learner as grpo_lib
    from tunix.rl.rollout import base_rollout

    from detlogp_jax.integrations import tunix as dt
    from tests.tunix_models import WordTokenizer

    dims = dict(QWEN3_8B, vocab_size=8192, embed_dim=256, hidden_dim=512, num_heads=4, head_dim=64, num_kv_heads=2)
    if os.environ.get("TUNIX_H200_SMALL") == "1":
        dims.update(vocab_size=512, embed_dim=32, hidden_dim=64, head_dim=8)
    actor, ref = _qwen3(tied, dims, jnp.bfloat16), _qwen3(tied, dims, jnp.bfloat16)
    before = jax.tree.map(jnp.copy, nnx.state(actor, nnx.Param))
    mesh = pxla.thread_resources.env.physical_mesh
    cc = rl_lib.ClusterConfig(
        role_to_mesh={rl_lib.Role.ACTOR: mesh, rl_lib.Role.REFERENCE: mesh, rl_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_lib.RLTrainingConfig(actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=1),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=16, max_prompt_length=8, kv_cache_size=32, temperature=0.8, return_logprobs=True
        ),
    )
    prov, layout = _provenance(actor)
    t0 = time.perf_counter()
    with dt.patch(backend=BACKEND):
        cluster = rl_lib.RLCluster(actor=actor, reference=ref, tokenizer=WordTokenizer(), cluster_config=cc)
        learner = grpo_lib.GRPOLearner(
            rl_cluster=cluster,
            algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04),
            reward_fns=lambda prompts, completions, **kw: [float(len(c)) for c in completions],
        )
        learner.train([{"prompts": np.array(["w5 w6 w7", "w9 w10"])}])
        record = dt.rollout_record(cluster.rollout._sampler)
    wall = time.perf_counter() - t0
    losses = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    after = nnx.state(cluster.actor_trainer.model, nnx.Param)
    moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), before, after)))
    return {
        "layout": layout,
        "provenance": prov,
        "loss": [float(x) for x in losses],
        "params_moved_max_abs": moved,
        "wall_s_incl_compile": wall,
        "rollout_record": record._asdict() if record is not None else None,
    }


def _head_fns(model, impl: str, mode: str, prompt, comp):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.rl import common

    from detlogp_jax.integrations import tunix as dt

    gd, st = nnx.split(model)
    mask = jnp.asarray(comp != 0, jnp.float32)

    def logps(st, p, c, stop):
        if impl in ("ours", "ourslogits"):
            residuals = "logits" if impl == "ourslogits" else "recompute"
            return dt.per_token_logps(
                nnx.merge(gd, st),
                p,
                c,
                pad_id=0,
                eos_id=2,
                temperature=0.7,
                stop_gradient=stop,
                backend=BACKEND,
                residuals=residuals,
            )
        return common.compute_per_token_logps(gd, st, p, c, 0, 2, stop_gradient=stop, temperature=0.7)

    if mode == "fwd":
        fn = lambda st, p, c: logps(st, p, c, True)
    else:
        fn = jax.value_and_grad(lambda st, p, c: jnp.sum(logps(st, p, c, False) * mask))
    return fn, (st, jnp.asarray(prompt), jnp.asarray(comp))


def case_head(layout: str, impl: str, mode: str) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks import timing

    model = _qwen3(layout == "vd", QWEN3_8B, jnp.bfloat16)
    prompt, comp = _batch(QWEN3_8B["vocab_size"])
    fn, args = _head_fns(model, impl, mode, prompt, comp)
    compiled, compile_s = timing.compile_case(fn, args)
    t, _ = timing.time_case(compiled, [args], warmup=3, iters=10, budget_s=120.0)
    out = {
        "rows": B * C,
        "tokens": B * (P + C),
        "compile_s": compile_s,
        "median_ms": t.median_ms,
        "min_ms": t.min_ms,
        "max_ms": t.max_ms,
        "samples": len(t.times_ms),
        "truncated": t.truncated,
        "device_memory": timing.device_memory(),
        "compiled_memory": timing.compiled_memory(compiled),
        "param_bytes": timing.tree_nbytes(args[0]),
    }
    if impl != "tunix":
        out["provenance"] = _provenance(model)[0]
    del jax
    return out


def case_diff(layout: str) -> dict:
    import jax.numpy as jnp
    import numpy as np

    model = _qwen3(layout == "vd", QWEN3_8B, jnp.bfloat16)
    prompt, comp = _batch(QWEN3_8B["vocab_size"])
    vals = {}
    for impl in ("ours", "tunix"):
        fn, args = _head_fns(model, impl, "fwd", prompt, comp)
        import jax

        vals[impl] = np.asarray(jax.jit(fn)(*args))
    mask = comp != 0
    d = np.abs(vals["ours"].astype(np.float64) - vals["tunix"].astype(np.float64))[mask]
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "positions": int(mask.sum())}


def run_case(name: str) -> dict:
    if name.startswith("grpo-"):
        return case_grpo(name == "grpo-tied")
    if name.startswith("head-"):
        _, layout, impl, mode = name.split("-")
        return case_head(layout, impl, mode)
    if name.startswith("diff-"):
        return case_diff(name.split("-")[1])
    raise ValueError(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON output path")
    ap.add_argument(
        "--cases", default="all", help="comma list of case names or prefixes (grpo, head, diff); default all"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case subprocess")
    args = ap.parse_args()
    if args.one:
        try:
            res = {"ok": True, **run_case(args.one)}
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        with open(args.out, "w") as f:
            json.dump(res, f)
        return 0

    want = [c.strip() for c in args.cases.split(",")] if args.cases != "all" else ["all"]
    cases = [c for c in ALL_CASES if "all" in want or any(c == w or c.startswith(w + "-") for w in want)]
    env = dict(
        os.environ,
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p),
    )
    report = {"backend": BACKEND, "shape": {"B": B, "P": P, "C": C, **QWEN3_8B}, "cases": {}}
    try:
        import importlib.metadata as md

        import jax

        import detlogp_jax as dl
        from detlogp_jax.integrations import tunix as dt

        report["env"] = {
            "packages": {
                p: md.version(p) for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "google-tunix")
            },
            "devices": [str(d) for d in jax.devices()],
            "tunix": dt.tunix_version(),
            "detlogp_jax": dl.__version__,
        }
    except Exception as e:
        report["env"] = {"error": repr(e)}
    for name in cases:
        tmp = f"{args.out}.{name}.json"
        t0 = time.perf_counter()
        try:
            r = subprocess.run(
                [sys.executable, os.path.abspath(__file__), tmp, "--one", name],
                env=env,
                timeout=args.timeout,
                capture_output=True,
                text=True,
            )
            res = json.load(open(tmp)) if os.path.exists(tmp) else {"ok": False, "error": f"rc={r.returncode}"}
            if not res.get("ok"):
                res["stderr_tail"] = r.stderr[-3000:]
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": f"timed out after {args.timeout}s"}
        res["case_wall_s"] = time.perf_counter() - t0
        report["cases"][name] = res
        if os.path.exists(tmp):
            os.remove(tmp)
        brief = {k: res.get(k) for k in ("ok", "median_ms", "max_abs_diff", "loss", "error") if k in res}
        print(f"{name}: {brief} peak={res.get('device_memory', {}).get('peak_bytes_in_use')}", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(c.get("ok") for c in report["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
