"""The main job's command line: `python -m detlogp_jax.validate` (`bash scripts/run.sh`).

    python -m detlogp_jax.validate [--backend reference|pallas_sm90|auto|xla]
        [--preset tiny|small|qwen3_8b] [--batch N] [--steps N] [--[no]strict]
        [--temperature 1.0 --top_k 0 --top_p 1.0 --min_p 0.0] [--seed 0] [--tp 1]
        [--out_dir DIR] [--name NAME] [--[no]baseline] [--time_reps 3] [--[no]png] [--[no]entropy]
        [--body batch_invariant|xla] [--body_backend auto|reference|pallas_sm90]
        [--[no]compare_xla_body] [--trainer_batch N]

Defaults: on a Hopper GPU `pallas_sm90`, `qwen3_8b`, 64 x 128, strict; elsewhere
`reference`, `small`, 16 x 32, strict. The report (.md, .json, .png) goes to a
new `./detlogp-results/<UTC timestamp>/` (untracked) unless --out_dir says
otherwise; its paths are printed first and last, then a one-line verdict.
Exit status 1 when a PASS/FAIL claim fails, 2 when strict mode refuses the run.
"""

from __future__ import annotations

import shlex
import sys

from detlogp_jax.apps import parity
from detlogp_jax.apps.report import render_markdown, report_paths
from detlogp_jax.backends import StrictModeError

__all__ = ["define_flags", "main", "entry"]


def define_flags():
    """Defines the absl flags (once) and returns FLAGS."""
    from absl import flags

    F = flags.FLAGS
    if "preset" in F:
        return F
    flags.DEFINE_enum(
        "backend",
        None,
        ["auto", "reference", "pallas_sm90", "xla"],
        "Backend of the contract lane (default: pallas_sm90 on a Hopper GPU, else reference).",
    )
    flags.DEFINE_enum(
        "preset", None, sorted(parity.PRESETS), "Model preset (default: qwen3_8b on a Hopper GPU, else small)."
    )
    flags.DEFINE_integer(
        "batch", None, "Sequences (rollout rows per decode step; default 64 on a Hopper GPU, else 16)."
    )
    flags.DEFINE_integer(
        "steps", None, "Decode steps (sampled tokens per sequence; default 128 on a Hopper GPU, else 32)."
    )
    flags.DEFINE_integer("tp", 1, "Tensor-parallel degree (needs sharding.linear_logp_tp for > 1).")
    flags.DEFINE_float("temperature", 1.0, "Sampling temperature (also the op's temperature).")
    flags.DEFINE_integer("top_k", 0, "Top-k (0 = off).")
    flags.DEFINE_float("top_p", 1.0, "Top-p (1 = off).")
    flags.DEFINE_float("min_p", 0.0, "Min-p (0 = off).")
    flags.DEFINE_integer("seed", 0, "Seed (model init, prompts, sampling keys, trainer order).")
    flags.DEFINE_string(
        "out_dir",
        None,
        f"Where the .md/.json/.png go (default: a new ./{parity.DEFAULT_RESULTS_DIR}/<UTC timestamp>/).",
    )
    flags.DEFINE_string("name", None, "Report basename (default validate_<platform>_<preset>).")
    flags.DEFINE_bool("strict", True, "Strict mode on the contract lane (no non-contract backend, no fallback).")
    flags.DEFINE_bool("baseline", True, "Also run the XLA materialized baseline lane.")
    flags.DEFINE_integer("time_reps", 3, "Timed calls per lane of the trainer's packed scoring (0: no timing).")
    flags.DEFINE_bool("png", True, "Also draw the PNG (needs matplotlib).")
    flags.DEFINE_bool(
        "entropy", None, "Also compare the entropy bytes (default: where the contract backend produces the entropy)."
    )
    flags.DEFINE_enum(
        "body",
        "batch_invariant",
        ["batch_invariant", "xla"],
        "The model body of both sides: detlogp_jax.body's invariant ops, or Flax's layers as XLA builds them.",
    )
    flags.DEFINE_enum(
        "body_backend", "auto", ["auto", "reference", "pallas_sm90"], "Backend of the invariant body's ops."
    )
    flags.DEFINE_bool(
        "compare_xla_body", True, "With the invariant body: also row (c), the plain XLA body on the same tokens."
    )
    flags.DEFINE_integer(
        "trainer_batch", None, "Sequences per trainer forward call (default batch // 2 + 1: another batch size)."
    )
    return F


_FLAG_NAMES = (
    "backend",
    "preset",
    "batch",
    "steps",
    "tp",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "out_dir",
    "name",
    "strict",
    "baseline",
    "time_reps",
    "png",
    "entropy",
    "body",
    "body_backend",
    "compare_xla_body",
    "trainer_batch",
)


def _config_from_flags(F) -> parity.ValidateConfig:
    command = " ".join(["python", "-m", "detlogp_jax.validate"] + [shlex.quote(a) for a in sys.argv[1:]])
    return parity.ValidateConfig(
        backend=F.backend,
        preset=F.preset,
        batch=F.batch,
        steps=F.steps,
        tp=F.tp,
        temperature=F.temperature,
        top_k=F.top_k,
        top_p=F.top_p,
        min_p=F.min_p,
        seed=F.seed,
        out_dir=F.out_dir or "default",
        name=F.name,
        strict=F.strict,
        baseline=F.baseline,
        time_reps=F.time_reps,
        png=F.png,
        entropy=F.entropy,
        body=F.body,
        body_backend=F.body_backend,
        compare_xla_body=F.compare_xla_body,
        trainer_batch=F.trainer_batch,
        command=command,
    )


def _print_paths(when: str, files: dict) -> None:
    shown = {k: v for k, v in files.items() if v}
    print(
        f"[validate] report {when}: " + ", ".join(shown[k] for k in ("markdown", "json", "png") if k in shown),
        flush=True,
    )


def main(argv) -> int:
    """Runs the validation from the flags; prints the paths, the Markdown, the paths again and the verdict."""
    from absl import flags

    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    cfg = parity.resolve_config(_config_from_flags(flags.FLAGS))
    print(
        f"[validate] backend={cfg.backend} preset={cfg.preset} batch={cfg.batch} steps={cfg.steps} strict={cfg.strict} "
        f"body={cfg.body} (ops: {cfg.body_backend}) trainer_batch={cfg.trainer_batch}",
        flush=True,
    )
    _print_paths("to be written", report_paths(cfg.out_dir, cfg.name))
    try:
        report = parity.run_validation(cfg)
    except StrictModeError as e:
        print(
            f"[validate] strict mode refused: {e}\n[validate] (--nostrict runs a non-contract or "
            "fallback lane; its rows then carry no contract claim)",
            file=sys.stderr,
        )
        return 2
    print(render_markdown(report), flush=True)
    _print_paths("written", report["files"])
    if report.get("png_note"):
        print(f"[validate] {report['png_note']}")
    print(report["verdict"], flush=True)
    return 0 if report["ok"] else 1


def entry() -> None:
    """`python -m detlogp_jax.validate`: absl flag parsing, then `main` (--help lists these flags)."""
    from absl import app

    F = define_flags()
    for name in _FLAG_NAMES:  # key flags of the main module: what --help shows
        F.register_key_flag_for_module(sys.argv[0], F[name])
    asked_help = any(a.split("=")[0] in _HELP_FLAGS for a in sys.argv[1:])
    try:
        app.run(main)
    except SystemExit as e:  # absl exits 1 after printing the help a user asked for: that is a success
        if asked_help and e.code == 1:
            raise SystemExit(0) from None
        raise


_HELP_FLAGS = frozenset({"-h", "--help", "-?", "--helpshort", "--helpfull", "--helpxml"})
