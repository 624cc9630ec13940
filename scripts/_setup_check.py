"""Helper of scripts/_env.sh (stdlib + jax only; prints one line).

python scripts/_setup_check.py probe 0.11.2
    Can this interpreter serve DETLOGP_PLATFORM=system on a GPU machine? Prints
    "gpu <what it has>" when it imports jax == the given version and jax.devices()[0]
    is a GPU, else "no <why not>". Always exits 0 (a crash reads as "no").

python scripts/_setup_check.py check
    The line printed before every run: Python, jax version and platform, devices, and the
    backend `linear_logp` will use (`detlogp_jax.backends.preferred()`). Reads
    DETLOGP_CHECK_PLATFORM (the resolved platform), DETLOGP_CHECK_WHERE (venv or system
    interpreter, for messages), DETLOGP_CHECK_WANT_GPU ("1": fail unless jax sees a GPU),
    DETLOGP_CHECK_DRIVER (nvidia-smi's driver version, or empty). Exit 0 with the line on
    stdout; exit 3 with a one-line "error: ..." on stdout when the interpreter cannot serve.
"""

from __future__ import annotations

import collections
import os
import platform
import sys


def _first_line(err: BaseException, limit: int = 160) -> str:
    text = (str(err).strip().splitlines() or [""])[0]
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def probe(want_version: str) -> int:
    try:
        import jax
    except Exception as err:  # noqa: BLE001 - any import failure means "cannot serve"
        print(f"no has no jax ({_first_line(err, 80)})")
        return 0
    version = getattr(jax, "__version__", "?")
    if version != want_version:
        print(f"no has jax {version}, not {want_version}")
        return 0
    try:
        devices = jax.devices()
    except Exception as err:  # noqa: BLE001
        print(f"no has jax {version}, which cannot start: {_first_line(err)}")
        return 0
    first = devices[0]
    if first.platform == "gpu":
        print(f"gpu has jax {version} on {len(devices)}x {first.device_kind}")
    else:
        print(f"no has jax {version}, which sees {first.platform} and no GPU")
    return 0


def check() -> int:
    setup = os.environ.get("DETLOGP_CHECK_PLATFORM", "?")
    where = os.environ.get("DETLOGP_CHECK_WHERE", sys.executable)
    want_gpu = os.environ.get("DETLOGP_CHECK_WANT_GPU") == "1"
    driver = os.environ.get("DETLOGP_CHECK_DRIVER", "")
    venv = setup != "system"
    rebuild = (
        f"remove the {where} and rerun to rebuild it"
        if venv
        else ("install jax there, or unset DETLOGP_PLATFORM to let the setup build a venv")
    )

    try:
        import jax
    except Exception as err:  # noqa: BLE001
        print(f"error: {where} cannot import jax ({_first_line(err)}); {rebuild}")
        return 3
    try:
        devices = jax.devices()
        default = jax.default_backend()
    except Exception as err:  # noqa: BLE001
        devices, default, why = [], None, _first_line(err)
    else:
        why = f"it sees {default} only"

    if want_gpu and default != "gpu":
        if driver:
            print(
                f"error: this machine has an NVIDIA GPU (driver {driver}) but jax in {where} "
                f"(platform {setup}) does not see it ({why}); fix the CUDA setup, or set "
                "DETLOGP_PLATFORM=cpu to run on CPU"
            )
        else:
            print(
                f"error: DETLOGP_PLATFORM={setup} but jax in {where} sees no GPU ({why}; "
                "nvidia-smi finds none either); set DETLOGP_PLATFORM=cpu, or unset it for auto"
            )
        return 3
    if default is None:
        print(f"error: jax in {where} cannot start ({why}); {rebuild}")
        return 3

    try:
        import detlogp_jax

        backend = detlogp_jax.backends.preferred()
    except Exception as err:  # noqa: BLE001
        print(f"error: detlogp_jax does not import in {where} ({_first_line(err)}); {rebuild}")
        return 3

    kinds = collections.Counter(d.device_kind for d in devices)
    devs = ", ".join(f"{n}x {k}" for k, n in kinds.items())
    note = ""
    if getattr(jax, "__version__", "") != os.environ.get("DETLOGP_CHECK_JAX", jax.__version__):
        note = f" (warning: the locks pin jax {os.environ['DETLOGP_CHECK_JAX']})"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"check: Python {platform.python_version()}, jax {jax.__version__}{note} on {default} "
        f"({devs}; {cpus} host CPUs), linear_logp backend {backend} [{setup}, {where}]"
    )
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "probe":
        try:
            return probe(argv[2] if len(argv) > 2 else "")
        except Exception as err:  # noqa: BLE001 - the probe never fails the setup
            print(f"no probe crashed ({_first_line(err, 80)})")
            return 0
    if len(argv) == 2 and argv[1] == "check":
        return check()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
