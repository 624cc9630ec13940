"""`python -m detlogp_jax.golden`: replay (or record) the golden fingerprints.

The tool lives in `detlogp_jax.apps.golden` (its records ship as package data);
this module is its entry point and keeps the old names. `--help` for the flags.
"""

import sys

from detlogp_jax.apps.golden import (  # noqa: F401
    CASES,
    Case,
    entropy_key,
    fingerprint_case,
    load,
    main,
    make_inputs,
    platform_key,
    replay,
)

if __name__ == "__main__":
    sys.exit(main())
