"""`python -m detlogp_jax.validate`: the RL parity validation, the project's main job.

The application lives in `detlogp_jax.apps` (parity: the run, claims: the
verdict, report: the files, cli: the flags); this module is its entry point and
keeps the old importable names. `--helpfull` for the flags.
"""

from detlogp_jax.apps.cli import entry, main  # noqa: F401
from detlogp_jax.apps.metrics import compare_logp  # noqa: F401
from detlogp_jax.apps.parity import PRESETS, ValidateConfig, run_validation  # noqa: F401
from detlogp_jax.apps.report import render_markdown, write_reports  # noqa: F401

if __name__ == "__main__":
    entry()
