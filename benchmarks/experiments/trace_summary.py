"""Summaries of JAX profiler traces (Chrome trace format), for benchmarks/experiments/trace_calls.py.

No absl flags here, so tests and other tools can import it.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os


def summarize(trace: dict, calls: int) -> dict:
    """Per-name totals of complete ('X') events on device threads (or, without any, on all threads)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    proc_names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device_pids = {pid for pid, name in proc_names.items() if "/device:" in name and "CPU" not in name.upper()}
    scope = "device" if device_pids else "host"
    chosen = [e for e in events if (e["pid"] in device_pids) or not device_pids]
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for name, dur in _split_repeated(chosen, calls):
        per_name[name][0] += 1
        per_name[name][1] += dur
    rows = sorted(
        ({"name": n, "count": c, "total_us": t, "us_per_call": t / max(calls, 1)} for n, (c, t) in per_name.items()),
        key=lambda r: -r["total_us"],
    )
    span_us = None
    if chosen:
        start = min(float(e["ts"]) for e in chosen)
        end = max(float(e["ts"]) + float(e["dur"]) for e in chosen)
        span_us = (end - start) / max(calls, 1)
    busy = sum(r["total_us"] for r in rows) / max(calls, 1)
    return {
        "scope": scope,
        "calls": calls,
        "span_us_per_call": span_us,
        "busy_us_per_call": busy,
        "rows": rows,
        "processes": sorted(set(proc_names.values())),
    }


def _split_repeated(events: list, calls: int):
    """(name, duration) per event; a name launched k > 1 times per call (e.g. two Pallas kernels that
    Mosaic both calls `kernel_mosaic_gpu_kernel`) is told apart by its HLO op when the trace names
    one, else by its launch order within the call ("name#1", "name#2", ...)."""
    by_name = collections.defaultdict(list)
    for e in events:
        by_name[e["name"]].append(e)
    for name, evs in by_name.items():
        ops = {str(e.get("args", {}).get("hlo_op", "")) for e in evs}
        per_call = len(evs) // max(calls, 1)
        if len(ops) > 1:
            for e in evs:
                yield f"{name} [{e.get('args', {}).get('hlo_op', '')}]", float(e["dur"])
        elif per_call > 1 and len(evs) == per_call * calls:
            for i, e in enumerate(sorted(evs, key=lambda e: float(e["ts"]))):
                yield f"{name}#{i % per_call + 1}", float(e["dur"])
        else:
            for e in evs:
                yield name, float(e["dur"])


def load_trace(trace_dir: str) -> dict:
    files = sorted(
        glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime
    )
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}/plugins/profile")
    with gzip.open(files[-1], "rb") as f:
        return json.load(f)
