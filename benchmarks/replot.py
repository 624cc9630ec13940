"""Draw the plot of a `benchmarks.run` JSON document after the fact (e.g. a run made with
`--plot none` on the device): the same figure `benchmarks.run` draws, from the document alone.

  python -m benchmarks.replot --json benchmarks/results/h200/forward/fwd.json
  (writes fwd.png into a new ./detlogp-results/<UTC stamp>/, untracked; --png FILE to choose)
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags

from benchmarks import report

FLAGS = flags.FLAGS
flags.DEFINE_string("json", None, "A benchmarks.run JSON document.")
flags.DEFINE_string("png", None, "Output PNG (default: <json name>.png in a new ./detlogp-results/<UTC stamp>/).")


def replot(json_path: str, png_path: str | None = None) -> str:
    """Writes the document's plot (time per call vs M per backend, the floors) and returns its path."""
    with open(json_path) as f:
        doc = json.load(f)
    fields = {f.name for f in dataclasses.fields(report.CaseResult)}
    cases = [report.CaseResult(**{k: v for k, v in c.items() if k in fields}) for c in doc["cases"]]
    cfg, env = doc.get("config", {}), doc.get("environment", {})
    title = (
        f"{doc.get('shape', {}).get('name', '?')} {cfg.get('entry', '?')} {cfg.get('mode', '?')}"
        + ("" if cfg.get("residuals", "recompute") == "recompute" else f" residuals={cfg['residuals']}")
        + (f" weight_layout={cfg['weight_layout']}" if cfg.get("weight_layout", "vd") != "vd" else "")
        + f" on {env.get('device_kind', '?')}"
    )
    out = png_path or os.path.join(report.default_out_dir(), os.path.splitext(os.path.basename(json_path))[0] + ".png")
    report.plot(
        cases,
        doc.get("floors", []),
        out,
        title,
        *(doc.get("ceilings") or (cfg.get("hbm_tbps"), cfg.get("peak_tflops"))),
    )
    return out


def main(argv):
    del argv
    if not FLAGS.json:
        raise app.UsageError("--json is required")
    print(f"wrote {replot(FLAGS.json, FLAGS.png)}")


if __name__ == "__main__":
    app.run(main)
