"""Markdown tables rendered from committed summaries: number formats, the loader, and the
paired-comparison table every section of experiments/README.md uses.

experiments/README.md marks each table it takes from a file with `<!-- table: NAME -->` on
the line before it; `experiments/readme_tables.py` renders NAME from experiments/results/
and tests/experiments/test_experiments_readme.py checks that the README's copy is the rendered one.
"""

from __future__ import annotations

import json
import os

import numpy as np

from experiments import _results, _stats
from experiments._stats import rnd


def load(name: str) -> dict:
  """experiments/results/<name>/summary.json."""
  with open(os.path.join(_results.RESULTS, name, "summary.json")) as f:
    return json.load(f)


def f3(x: float) -> str:
  return rnd(x, 3)


def frac(x: float | None) -> str:
  """A fraction as the README prints it: 3 decimals, 2 significant digits below 0.01,
  "0" for exactly zero, "–" when not measured."""
  if x is None:
    return "–"
  if x == 0:
    return "0"
  return rnd(x, 3) if abs(x) >= 0.01 else f"{x:.2g}"


def pct(x: float, digits: int = 1) -> str:
  return f"{100 * x:.{digits}f}%"


def seeds(xs, fmt=f3) -> str:
  """Per-seed values joined with " / "."""
  return " / ".join(fmt(x) for x in xs)


def gains(s: dict) -> list[float]:
  """Held-out end − start per seed of one variant's summary."""
  return list(np.subtract(s["heldout_end"], s["heldout_start"]))


def mean_sd(xs, digits: int = 3) -> str:
  """mean ± sample sd (ddof 1); the mean alone, with the seed count, under three seeds."""
  m = _stats.signed(float(np.mean(xs)), digits)
  if len(xs) < 3:
    return f"{m} ({len(xs)} seed{'s' if len(xs) > 1 else ''})"
  return f"{m} ± {_stats.sample_std(xs):.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def paired_rows(comparisons, digits: int = 3) -> list[list[str]]:
  """One row per (label, a, b, name_a, name_b, note): a − b per seed, the mean, the 95%
  t-interval's half-width and the verdict it supports (`_stats.verdict`), then the note."""
  rows = []
  for label, a, b, name_a, name_b, note in comparisons:
    p = _stats.paired(a, b)
    hw = "–" if p["n"] < 2 else f"±{p['half_width']:.{digits}f}"
    verdict = _stats.verdict(p, name_a, name_b, digits, width=False)
    rows.append([label, str(p["n"]), seeds(p["diffs"], lambda x: _stats.signed(x, digits)),
                 _stats.signed(p["mean"], digits), hw, verdict + (f"; {note}" if note else "")])
  return rows


PAIRED_HEADER = ["comparison (a − b)", "seeds", "a − b per seed", "mean", "95% interval",
                 "verdict"]


def paired_table(comparisons, digits: int = 3) -> str:
  return table(PAIRED_HEADER, paired_rows(comparisons, digits))
