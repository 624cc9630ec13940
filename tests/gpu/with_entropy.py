"""Runs a module as `python -m` does, with the pallas_sm90 entry declaring the entropy.

    python3 tests/gpu/with_entropy.py -m detlogp_jax.golden --backend pallas_sm90 --record --out F
    python3 tests/gpu/with_entropy.py -m benchmarks.run --entropy ...

For validation while `pallas_kernels.backend.ENTROPY_VALIDATED` is False (a kernel
change that touches the statistic sets it False until this validation passes): the
attribute is set to True in this process before the registry first loads the
pallas_sm90 entry, so `linear_logp(return_entropy=True, backend="pallas_sm90")` is
served by the kernels (`partials(..., return_entropy=True)`, `fold(..., a=A)`) exactly
as it will be after the flip. Nothing is written anywhere; other processes keep the
shipped entry (entropy refused, `auto` falls back to reference).
"""

from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def check_usage(argv: list[str], script: str) -> None:
    """`-m MODULE [ARGS...]` or a usage error naming `script`."""
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit(f"usage: python3 tests/gpu/{script} -m MODULE [ARGS...]")


def run_module(argv: list[str], banner: str) -> None:
    """Runs `argv[1]` as `python -m` would, with argv[2:] as its arguments, after printing banner."""
    module = argv[1]
    sys.argv = [module] + argv[2:]
    print(f"{banner}; -m {module}")
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    check_usage(argv, "with_entropy.py")
    import pallas_kernels.backend as pallas_backend
    from detlogp_jax import backends

    pallas_backend.ENTROPY_VALIDATED = True
    be = backends.get("pallas_sm90")
    if not be.entropy:  # loaded before the attribute was set (cannot happen from a fresh process)
        raise SystemExit("the pallas_sm90 entry was loaded before ENTROPY_VALIDATED could be set")
    run_module(argv, "with_entropy: pallas_sm90 declares the entropy (ENTROPY_VALIDATED=True in this process)")


if __name__ == "__main__":
    main(sys.argv[1:])
