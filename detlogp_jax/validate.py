"""`python -m detlogp_jax.validate`: the RL parity validation, the project's main job.

Rollout decode vs trainer re-scoring of the same sampled tokens; the report goes to a new
./detlogp-results/<UTC stamp>/ unless --out_dir. The application lives in detlogp_jax.apps
(parity: the run, claims: the verdict, report: the files, cli: the flags and defaults).
"""

from detlogp_jax.apps.cli import entry, main  # noqa: F401  (and the old importable names)
from detlogp_jax.apps.metrics import compare_logp  # noqa: F401
from detlogp_jax.apps.parity import PRESETS, ValidateConfig, run_validation  # noqa: F401
from detlogp_jax.apps.report import render_markdown, write_reports  # noqa: F401

if __name__ == "__main__":
    entry()
