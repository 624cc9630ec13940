"""Packages that stand above the op core, found by name: the core never imports them.

The distribution installs three top-level packages: `detlogp_jax` (the op core, its
integrations and apps), `pallas_kernels` (the Hopper backend, registered by name through
`detlogp_jax.backends`) and `sharding` (tensor parallelism). Code inside `detlogp_jax`
reaches the tensor-parallel package only through `tensor_parallel()`, and users may too:
`detlogp_jax.linear_logp_tp` / `linear_logp_local` / `tp_partials_and_fold` are its entry
points, loaded on first use.

`sharding` is a generic module name. `tensor_parallel()` checks that the module Python
finds under that name is this distribution's (it carries `DISTRIBUTION = "detlogp-jax"`);
when another `sharding` (a module of the user's project, earlier on sys.path) shadows it,
the call raises `ImportError` naming both, instead of failing later inside a stranger's
code. `docs/TENSOR_PARALLEL.md` ("Import name") says what to do then.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["DISTRIBUTION", "TP_ENTRY_POINTS", "TP_PACKAGE", "tensor_parallel"]

DISTRIBUTION = "detlogp-jax"
TP_PACKAGE = "sharding"
# The tensor-parallel package's entry points that `detlogp_jax` hands on as its own attributes.
TP_ENTRY_POINTS = ("linear_logp_tp", "linear_logp_local", "tp_partials_and_fold")


def tensor_parallel() -> ModuleType:
    """This distribution's tensor-parallel package (`sharding`), imported on first use.

    Raises ImportError when it is missing, or when the module found as `sharding` is not
    this distribution's (its file is named, with the fix)."""
    try:
        module = importlib.import_module(TP_PACKAGE)
    except ImportError as e:
        raise ImportError(
            f"detlogp-jax's tensor-parallel package {TP_PACKAGE!r} cannot be imported ({e}); reinstall detlogp-jax"
        ) from e
    if getattr(module, "DISTRIBUTION", None) != DISTRIBUTION:
        where = getattr(module, "__file__", None) or getattr(module, "__path__", None) or "an unknown location"
        raise ImportError(
            f"the module named {TP_PACKAGE!r} found at {where} is not detlogp-jax's tensor-parallel package: a "
            f"module of the same name earlier on sys.path shadows it. Rename that module, or run from a directory "
            f"where it is not importable, so that `import {TP_PACKAGE}` finds detlogp-jax's"
        )
    return module
