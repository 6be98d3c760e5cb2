"""experiments/README.md's tables of claim 1 with power (experiments/preregistered.md, part 5),
rendered from experiments/results/claim1_powered/part5.json (`experiments/claim1_powered.py`).

The analysis as registered:
  analysis set  the first 8 seeds, in seed order, whose cold-start held-out accuracy lies in
                [0.25, 0.45] (fewer than 6 of seeds 0-9: the registration adds seeds 10+,
                which `analysis_set` reports as `short`);
  P1 (primary)  held-out accuracy after 40 iterations, GSPO − GRPO, paired over the set;
  P2            the same for GSPO-len − GRPO and GSPO-len − GSPO;
  secondary     the held-out gain averaged over the 8 evaluations (iterations 5-40) minus the
                cold start; training reward over the last 10 iterations; collapse counts
                (section 7's rule) by Fisher's exact test, two-sided.
Each paired comparison: mean, 95% Student-t interval (sd ddof 1, `_stats.paired`), verdict
by the interval only (`verdict`). Seeds outside the set are tabulated beside it, outside the
analysis.
"""

from __future__ import annotations

import json
import os

import numpy as np

from experiments import _results, _stats
from experiments._tables import f3, frac, table

NAME, FILE = "claim1_powered", "part5.json"
BAND = (0.25, 0.45)
SET_SIZE, MINIMUM = 8, 6
PRECISION = 0.05  # a half-width above this: "not resolved at this precision"
VARIANTS = ("gspo", "grpo", "gspo_len")
LABELS = {"gspo": "GSPO", "grpo": "GRPO", "gspo_len": "GSPO-len"}
# (a, b, what the paper predicts): P1, then P2's two.
COMPARISONS = (("gspo", "grpo", "the paper predicts GSPO above GRPO"),
               ("gspo_len", "grpo", ""), ("gspo_len", "gspo", ""))


def load() -> dict:
  with open(os.path.join(_results.RESULTS, NAME, FILE)) as f:
    return json.load(f)


def analysis_set(coldstarts: dict, band=BAND, size: int = SET_SIZE,
                 minimum: int = MINIMUM) -> dict:
  """The registered rule: the first `size` seeds in seed order whose cold start lies in
  `band` (both ends included). `coldstarts`: seed -> held-out accuracy (keys int or str).
  Returns the set, the seeds in the band left beyond it, the seeds out of the band, and
  `short` (fewer than `minimum` in the band: the registration would add seeds)."""
  acc = {int(k): float(v) for k, v in coldstarts.items()}
  in_band = [s for s in sorted(acc) if band[0] <= acc[s] <= band[1]]
  return {"seeds": in_band[:size], "beyond": in_band[size:],
          "out_of_band": [s for s in sorted(acc) if s not in in_band],
          "short": len(in_band) < minimum}


def verdict(p: dict, a: str, b: str, precision: float = PRECISION) -> str:
  """The registered wording: "a above b" / "b above a" when the 95% interval excludes zero,
  else "no difference resolved (±hw)", or "not resolved at this precision (±hw)" when the
  half-width exceeds `precision`."""
  if p["n"] < 2:
    return "one seed: no interval"
  hw = f"±{_stats.rnd(p['half_width'], 3)}"
  if _stats.resolved(p):
    return f"{a} above {b}" if p["mean"] > 0 else f"{b} above {a}"
  if p["half_width"] > precision:
    return f"not resolved at this precision ({hw})"
  return f"no difference resolved ({hw})"


def mean_gain(curve) -> float:
  """The held-out gain averaged over the evaluations after the cold start: mean accuracy
  at iterations 5..40 minus the accuracy at step 0."""
  start = [a for s, a in curve if s == 0]
  return float(np.mean([a for s, a in curve if s > 0]) - start[0])


def collapsed(curve, iterations: int) -> bool:
  """Section 7's rule on a held-out curve: every evaluation after iteration iterations / 2
  below the cold start's accuracy (step 0)."""
  start = [a for s, a in curve if s == 0][0]
  late = [a for s, a in curve if s > iterations / 2]
  return bool(late) and all(a < start for a in late)


def per_seed(d: dict) -> dict:
  """variant -> seed -> {end, gain, reward, collapsed, clip, start}."""
  out = {}
  for v in VARIANTS:
    c = d["variants"].get(v, {"seeds": []})
    out[v] = {s: {"start": c["heldout_start"][i], "end": c["heldout_end"][i],
                  "gain": mean_gain(c["heldout_curve"][i]), "reward": c["reward_last10"][i],
                  "collapsed": bool(c["collapsed"][i]), "clip": c["clip_frac_token_mean"][i],
                  "clip_seq": c["clip_frac_seq_mean"][i]}
              for i, s in enumerate(c["seeds"])}
  return out


ENDPOINTS = (("P1 / P2", "end", "held-out accuracy after 40 iterations"),
             ("secondary", "gain", "held-out gain, mean of the 8 evaluations − cold start"),
             ("secondary", "reward", "training reward, last 10 iterations"))


def comparisons(d: dict | None = None, seeds=None) -> list[dict]:
  """Every registered paired comparison over the analysis set (or `seeds`): endpoint, a, b,
  the `_stats.paired` result and its verdict."""
  d = d or load()
  runs = per_seed(d)
  seeds = analysis_set(d["coldstart_heldout"])["seeds"] if seeds is None else seeds
  out = []
  for tag, key, what in ENDPOINTS:
    for a, b, note in COMPARISONS:
      both = [s for s in seeds if s in runs[a] and s in runs[b]]
      p = _stats.paired([runs[a][s][key] for s in both], [runs[b][s][key] for s in both])
      name = ("P1" if (a, b) == ("gspo", "grpo") else "P2") if key == "end" else tag
      out.append({"endpoint": name, "key": key, "what": what, "a": a, "b": b, "seeds": both,
                  "paired": p, "verdict": verdict(p, LABELS[a], LABELS[b]),
                  "note": note if key == "end" else ""})
  return out


def fisher(d: dict | None = None, seeds=None) -> list[dict]:
  """Collapse counts over the analysis set per variant, and Fisher's exact test (two-sided)
  for each registered pair."""
  d = d or load()
  runs = per_seed(d)
  seeds = analysis_set(d["coldstart_heldout"])["seeds"] if seeds is None else seeds
  count = {v: (sum(runs[v][s]["collapsed"] for s in seeds if s in runs[v]),
               sum(s in runs[v] for s in seeds)) for v in VARIANTS}
  return [{"a": a, "b": b, "a_count": count[a], "b_count": count[b],
           "p": _stats.fisher_exact(*count[a], *count[b])} for a, b, _ in COMPARISONS]


def _set_label(s: int, chosen: dict) -> str:
  if s in chosen["seeds"]:
    return "yes"
  return "no: in the band, after the first 8" if s in chosen["beyond"] else "no: out of the band"


def claim1_powered() -> str:
  """Per seed (every run, the analysis set marked): cold start, held-out after 40 per
  variant, the paired differences, collapse."""
  d = load()
  runs, chosen = per_seed(d), analysis_set(d["coldstart_heldout"])
  rows = []
  for s in sorted(int(k) for k in d["coldstart_heldout"]):
    end = {v: runs[v][s]["end"] if s in runs[v] else None for v in VARIANTS}
    diff = lambda a, b: ("–" if end[a] is None or end[b] is None else
                         _stats.signed(end[a] - end[b]))
    rows.append([str(s), f3(d["coldstart_heldout"][str(s)]), _set_label(s, chosen),
                 *[f3(end[v]) if end[v] is not None else "not run" for v in VARIANTS],
                 *[diff(a, b) for a, b, _ in COMPARISONS],
                 " / ".join(("yes" if runs[v][s]["collapsed"] else "no") if s in runs[v] else "–"
                            for v in VARIANTS)])
  return table(["seed", "cold start (held-out)", "in the analysis set",
                *[f"{LABELS[v]} after 40" for v in VARIANTS],
                *[f"{LABELS[a]} − {LABELS[b]}" for a, b, _ in COMPARISONS],
                "collapsed (GSPO / GRPO / GSPO-len)"], rows)


def claim1_powered_secondary() -> str:
  """Per seed: the mean held-out gain over the 8 evaluations, the training reward over the
  last 10 iterations, and (descriptive) the fraction of tokens clipped."""
  d = load()
  runs, chosen = per_seed(d), analysis_set(d["coldstart_heldout"])
  rows = []
  for s in sorted(int(k) for k in d["coldstart_heldout"]):
    cell = lambda key, fmt: " / ".join(fmt(runs[v][s][key]) if s in runs[v] else "–"
                                       for v in VARIANTS)
    rows.append([str(s), "yes" if s in chosen["seeds"] else "no", cell("gain", _stats.signed),
                 cell("reward", f3), cell("clip", frac), cell("clip_seq", frac)])
  return table(["seed", "in the set", "held-out gain, mean of 8 evaluations (GSPO / GRPO / GSPO-len)",
                "training reward, last 10 (GSPO / GRPO / GSPO-len)",
                "tokens clipped, mean over training (same order)",
                "responses with a clipped token (same order)"], rows)


def claim1_powered_endpoints() -> str:
  """The registered paired comparisons over the analysis set, then the collapse counts."""
  rows = []
  for c in comparisons():
    p = c["paired"]
    rows.append([c["endpoint"], c["what"], f"{LABELS[c['a']]} − {LABELS[c['b']]}", str(p["n"]),
                 " / ".join(_stats.signed(x) for x in p["diffs"]), _stats.signed(p["mean"]),
                 f"[{_stats.signed(p['low'])}, {_stats.signed(p['high'])}]",
                 f"±{_stats.rnd(p['half_width'], 3)}",
                 c["verdict"] + (f"; {c['note']}" if c["note"] else "")])
  # Descriptive, not registered (fixed before the outcomes were read): P1 over every seed run.
  d = load()
  every = sorted(int(k) for k in d["coldstart_heldout"])
  c = [x for x in comparisons(d, every) if x["key"] == "end" and x["a"] == "gspo"][0]
  p = c["paired"]
  rows.append(["descriptive, not registered", "held-out after 40, every seed run",
               "GSPO − GRPO", str(p["n"]), " / ".join(_stats.signed(x) for x in p["diffs"]),
               _stats.signed(p["mean"]), f"[{_stats.signed(p['low'])}, {_stats.signed(p['high'])}]",
               f"±{_stats.rnd(p['half_width'], 3)}", c["verdict"]])
  for f in fisher():
    (ka, na), (kb, nb) = f["a_count"], f["b_count"]
    rows.append(["secondary", "collapses (section 7's rule)",
                 f"{LABELS[f['a']]} vs {LABELS[f['b']]}", str(na), f"{ka} of {na} vs {kb} of {nb}",
                 "–", "–", "–", f"Fisher exact p = {f['p']:.2g} (two-sided)"])
  return table(["endpoint", "what", "a − b", "seeds", "per seed", "mean", "95% interval",
                "half-width", "verdict"], rows)


def figure_comparisons() -> list:
  """(label, a, b) per registered paired comparison, for `_plots.paired` (figures.py)."""
  d = load()
  runs = per_seed(d)
  out = []
  for c in comparisons(d):
    short = {"end": "held-out after 40", "gain": "mean held-out gain",
             "reward": "reward, last 10"}[c["key"]]
    out.append((f"{c['endpoint']}: {short}, {LABELS[c['a']]} − {LABELS[c['b']]}",
                [runs[c["a"]][s][c["key"]] for s in c["seeds"]],
                [runs[c["b"]][s][c["key"]] for s in c["seeds"]]))
  return out
