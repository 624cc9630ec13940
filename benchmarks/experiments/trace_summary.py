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
    for e in chosen:
        per_name[e["name"]][0] += 1
        per_name[e["name"]][1] += float(e["dur"])
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


def load_trace(trace_dir: str) -> dict:
    files = sorted(
        glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime
    )
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}/plugins/profile")
    with gzip.open(files[-1], "rb") as f:
        return json.load(f)
