"""The parity validation's files: Markdown, JSON and a PNG of the per-step rows.

`write_all(report, out_dir, name)` writes `<out_dir>/<name>.png` (when
matplotlib imports; else the report says why there is none), then `.json` and
`.md`, both naming all three files. Nothing else is written; `out_dir` is
created if missing. matplotlib is imported lazily and draws with its Agg
canvas (no pyplot, no display, no global backend switch).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["report_paths", "render_markdown", "write_png", "write_all", "write_reports"]


def report_paths(out_dir: str, name: str) -> dict[str, str]:
    """The three paths a run writes under out_dir: markdown, json, png."""
    base = os.path.join(out_dir, name)
    return {"markdown": base + ".md", "json": base + ".json", "png": base + ".png"}


def _fmt(x) -> str:
    if isinstance(x, float):
        return "0.0" if x == 0 else f"{x:.3g}"
    return str(x)


def _timing_line(t: dict | None) -> str:
    if not t:
        return "Op time per call: not measured (time_reps=0)."
    xla = f"{t['xla_ms']:.3f} ms" if t.get("xla_ms") is not None else "not run (no baseline lane)"
    ratio = f" ({t['op_ms'] / t['xla_ms']:.2f}x XLA's)" if t.get("xla_ms") else ""
    return (
        f"Op time per call (the trainer's packed scoring, {t['rows_per_call']} rows, median of {t['reps']}): "
        f"op {t['op_ms']:.3f} ms{ratio}, XLA materialized {xla}."
    )


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: command, claims, rows, provenance, files, timings, verdict."""
    m, c = report["model"], report["config"]
    prov = report["provenance"]
    lines = [
        f"# RL parity validation: {c['preset']} on {report['platform']['device_kind']}",
        "",
        "Command:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Date (UTC): {report['date_utc']}; code {report.get('git_rev') or 'unknown'}; JAX {report['platform']['jax_version']}; "
        f"platform {report['platform']['platform']} ({report['platform']['n_devices']} device(s)).",
        "",
        f"Model: random toy NNX decoder LM, D={m['d_model']}, vocab {m['vocab_size']} (padded {m['padded_vocab_size']}), "
        f"{m['n_layers']} block(s), {m['dtype']}, prompt {m['prompt_len']} + {c['steps']} sampled tokens, TP={m['tp']}, "
        f"body {m.get('body', 'xla')}"
        + (f" (ops: {', '.join(f'{k} {v}' for k, v in m['body_ops'].items())})" if m.get("body_ops") else "")
        + ". "
        f"Sampling program: {report['sampling_program']}.",
        f"Rollout: {report['shapes']['rollout_rows_per_step']} rows per decode step; trainer: its own forward of the "
        f"sequences in a shuffled order, {report['shapes'].get('trainer_sequences_per_forward')} per call, then "
        f"{report['shapes']['trainer_rows']} rows scored in one packed, shuffled batch.",
        "",
        "## Claims",
        "",
        "| # | claim | status | evidence |",
        "|---|---|---|---|",
    ]
    for i, cl in enumerate(report["claims"], 1):
        lines.append(f"| {i} | {cl['claim']} | **{cl['status']}** | {cl['evidence']} |")
    lines += [
        "",
        "## Rows (rollout logp vs trainer logp of the same sampled tokens)",
        "",
        "| lane | backend | check | rows | mismatch_count | max_abs_diff | max \\|K3\\| |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['lane']} | {r['backend']} | {r['check']} | {r['rows']} | {r['mismatch_count']} | "
            f"{_fmt(r['max_abs_diff'])} | {_fmt(r['max_abs_k3'])} |"
        )
    if report.get("entropy_rows"):
        lines += [
            "",
            "Entropy (rollout vs trainer, the op's per-row entropy of the same rows):",
            "",
            "| check | rows | mismatch_count | max_abs_diff |",
            "|---|---|---|---|",
        ]
        for r in report["entropy_rows"]:
            lines.append(f"| {r['check']} | {r['rows']} | {r['mismatch_count']} | {_fmt(r['max_abs_diff'])} |")
    hd, xh = report["hidden_state_drift"], report.get("xla_body_hidden_drift")
    lines += [
        "",
        f"Hidden states (rollout decode vs trainer full-sequence forward): {hd['rows_differ']}/{hd['rows']} rows differ "
        f"in bytes, max_abs_diff {_fmt(hd['max_abs_diff'])}"
        + (
            f"; with the plain XLA body on the same tokens {xh['rows_differ']}/{xh['rows']}, "
            f"max_abs_diff {_fmt(xh['max_abs_diff'])}."
            if xh
            else "."
        ),
        f"Replay of the sampler's processed logprob: {report['replay']['bit_exact']}/{report['replay']['rows']} bit-exact.",
        "",
        "K3 = rho - 1 - log(rho), rho = exp(logp_trainer - logp_rollout), in float64 from the float32 values.",
        "",
        "## Provenance (`last_provenance()` at each call site)",
        "",
        "| call site | backend | contract id | fallback | requested |",
        "|---|---|---|---|---|",
    ]
    for role, p in prov.items():
        lines.append(f"| {role} | {p['backend']} | {p['contract_id']} | {p['fallback']} | {p['requested_backend']} |")
    f = report["fingerprints"]
    lines += [
        "",
        f"Fingerprints: rollout `{f['rollout']}`, trainer `{f['trainer']}` (equal: {f['equal']}). "
        f"Fallbacks: {report['fallbacks'] or 'none'}. Strict mode: {c['strict']}.",
        "",
        _timing_line(report.get("op_timing")),
        "",
        f"Timings (s): {report.get('timings_s')}",
        "",
    ]
    files = report.get("files")
    if files:
        png = (
            f"`{os.path.basename(files['png'])}` (per decode step: rollout-vs-trainer mismatch count and max |K3| "
            "of each lane and check" + (", op vs XLA time per call)" if report.get("op_timing") else ")")
            if files.get("png")
            else f"none ({report.get('png_note')})"
        )
        lines += [
            "## Files",
            "",
            f"This report `{os.path.basename(files['markdown'])}`, the data `{os.path.basename(files['json'])}`, "
            f"the plot {png}.",
            "",
        ]
    lines += ["## Verdict", "", report["verdict"], ""]
    return "\n".join(lines)


# key, label, color, line style, marker (hollow circles under crosses: coinciding series stay visible)
_SERIES = (
    ("contract_a", "contract lane (a) operator", "C0", "-", "o"),
    ("contract_b", "contract lane (b) end to end", "C0", "--", "o"),
    ("body_xla", "contract lane (c) end to end, plain XLA body", "C2", ":", "s"),
    ("xla_a", "XLA lane (a) operator", "C3", "-", "x"),
    ("xla_b", "XLA lane (b) end to end", "C3", "--", "x"),
)


def write_png(report: dict[str, Any], path: str) -> tuple[str | None, str]:
    """Draws the per-step rows (and the op-vs-XLA timing, if measured) into `path`.

    Returns (path, "") or (None, why not): without matplotlib nothing is drawn.
    Panels: mismatch count per decode step (of `batch` rows), max |K3| per step
    (symlog: exact zeros stay visible), and time per call of the trainer's
    packed scoring, op vs XLA.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except Exception as e:  # pragma: no cover - matplotlib is an optional dependency (extra "bench")
        return None, f"matplotlib unavailable ({type(e).__name__}: {e}); no PNG written"
    steps, timing = report["per_step"], report.get("op_timing")
    n_panels = 3 if timing else 2
    fig = Figure(figsize=(5.2 * n_panels, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax_m, ax_k = fig.add_subplot(1, n_panels, 1), fig.add_subplot(1, n_panels, 2)
    for key, label, color, style, marker in _SERIES:
        if key not in steps:
            continue
        x = range(1, len(steps[key]["mismatch"]) + 1)
        kw = dict(
            color=color,
            linestyle=style,
            marker=marker,
            markersize=6 if marker in "os" else 5,
            markerfacecolor="none" if marker in "os" else color,
            label=label,
        )
        ax_m.plot(x, steps[key]["mismatch"], **kw)
        ax_k.plot(x, steps[key]["max_abs_k3"], **kw)
    B = report["shapes"]["rollout_rows_per_step"]
    ax_m.set(title=f"rows whose logp bytes differ (of {B} per step)", xlabel="decode step", ylabel="mismatch count")
    ax_m.set_ylim(-0.05 * B, 1.05 * B)
    ax_k.set_yscale("symlog", linthresh=1e-15)
    ax_k.set(title="max |K3| per step", xlabel="decode step", ylabel="max |K3| (symlog)")
    fig.legend(*ax_m.get_legend_handles_labels(), loc="outside lower center", ncols=3, fontsize=8)
    if timing:
        ax_t = fig.add_subplot(1, n_panels, 3)
        names, vals = ["op (" + str(report["rows"][0]["backend"]) + ")"], [timing["op_ms"]]
        if timing.get("xla_ms") is not None:
            names.append("XLA materialized")
            vals.append(timing["xla_ms"])
        bars = ax_t.bar(names, vals, color=["C0", "C3"][: len(vals)])
        ax_t.bar_label(bars, labels=[f"{v:.3g} ms" for v in vals])
        ax_t.margins(y=0.15)
        ax_t.set(title=f"time per call, {timing['rows_per_call']} rows (median of {timing['reps']})", ylabel="ms")
    fig.suptitle(
        f"RL parity: {report['config']['preset']} on {report['platform']['device_kind']}, "
        f"{B} x {report['config']['steps']}, body {report['config'].get('body', 'xla')}",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    return path, ""


def write_all(report: dict[str, Any], out_dir: str, name: str, png: bool = True) -> dict[str, str | None]:
    """Writes the PNG (optional), JSON and Markdown of `report`; returns their paths (png None if not drawn)."""
    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, str | None] = report_paths(out_dir, name)
    if png:
        files["png"], note = write_png(report, files["png"])
        if note:
            report["png_note"] = note
    else:
        files["png"], report["png_note"] = None, "not requested (png=False)"
    report["files"] = files
    with open(files["json"], "w") as fh:
        json.dump(report, fh, indent=2, default=str)
        fh.write("\n")
    with open(files["markdown"], "w") as fh:
        fh.write(render_markdown(report))
    return files


write_reports = write_all  # the former name (detlogp_jax.validate.write_reports)
