"""pytest setup: the repository root on sys.path, XLA's CPU thread pool wide enough for Pallas
interpret mode and its executions run inline, a per-test watchdog, GPU tests skipped without a
Hopper GPU.
Shared helpers live in tests/helpers.py."""

import faulthandler
import os
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Pallas Mosaic GPU interpret mode runs every warpgroup of a block as its own XLA CPU execution;
# their barrier waits are host callbacks that block, and XLA runs some of those callbacks on its
# intra-op thread pool, sized by default to the CPUs this process may use. With one CPU (in principle
# with two, when two waiting callbacks hold both threads) a waiting callback holds the pool while
# the warpgroup it waits for needs a pool thread: a deadlock (`taskset -c 0`: 3 of 5 runs of
# test_kernel_entropy_multi_tile_splits[prefill-True] hung; with this setting 5 of 5 passed).
# XLA reads the pool size from NPROC; 32 threads cover the 5 warpgroups x 4 warps of our largest
# kernel, and idle pool threads cost nothing. Must be set before jax makes its CPU client.
os.environ.setdefault("NPROC", "32")

# The same interpret mode also runs each warpgroup's XLA CPU execution from its own Python thread
# while the kernel's outer execution waits for them. With the CPU client's async dispatch (jax's
# default) an execution can be queued on the client's work runner instead of running on the
# calling thread; a full-suite run hung that way once (an interpret-mode forward: the outer
# execution on a runner thread waiting in the interpreter's thread map, one warpgroup thread
# waiting at a barrier, three in XLA's execute with no Python frame above it; not reproduced in
# 12 runs of the test alone). Every CPU execution runs inline on its caller here (the bytes do not
# depend on it). Must be set before jax makes its CPU client.
import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

# A test that runs longer than this is stopped with every thread's Python stack printed, so a hang
# fails within minutes instead of using up a CI job's time limit. 0 turns the watchdog off.
TEST_TIMEOUT_S = float(os.environ.get("DETLOGP_TEST_TIMEOUT_S", "1200"))


def _has_hopper():
    from pallas_kernels import is_available  # the backend's own rule: a CUDA GPU of cc 9.x

    return is_available()


def _sweep_tails(items):
    """The test tiers' rule for sweeps: of a parametrized test's cases, the first one collected is
    in the fast tier and the others are in the slow tier (`slow`), unless the test is marked
    `every_case` (each case checks a path of its own). docs/TESTING.md, "Test tiers"."""
    seen = set()
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None or not hasattr(item, "callspec") or "every_case" in item.keywords:
            continue
        key = (item.module.__name__ if item.module else "", fn.__qualname__)
        if key in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(key)


def pytest_collection_modifyitems(config, items):
    _sweep_tails(items)
    if _has_hopper():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _stop_hung_test(item):
    """The watchdog's action: output capture off, every thread's stack to stderr, exit code 3."""
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n[watchdog] {item.nodeid} ran past {TEST_TIMEOUT_S:.0f} s; the threads' stacks:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(3)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TEST_TIMEOUT_S <= 0:
        return (yield)
    timer = threading.Timer(TEST_TIMEOUT_S, _stop_hung_test, args=(item,))
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()
