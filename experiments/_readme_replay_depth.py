"""experiments/README.md's tables of the Routing Replay runs on the deep MoE
(experiments/preregistered.md, part 4: stage B at 16 layers, stage C at 4), rendered from
experiments/results/routing_replay_depth/stage_b.json and
experiments/results/routing_replay_depth_L4/stage_c.json (`experiments/routing_replay_depth.py`,
which computes the registered analysis once every run has finished).

As registered:
  B1 (primary)  held-out accuracy after 40 iterations, paired over the seeds: (i) GRPO
                replay − GRPO free, (ii) GSPO free − GRPO free, (iii) GSPO free − GRPO
                replay; 95% t-intervals, paired p and their Holm adjustment. "GRPO needs
                Routing Replay" counts as reproduced only if (i)'s interval lies above zero.
  B2            collapses (section 7's rule), GRPO free against each of the others, Fisher.
  B3            training reward, mean of the 40 iterations, paired as B1.
Verdicts are worded by the interval alone (`_stats.verdict`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from experiments import _results, _stats
from experiments._tables import f3, frac, seeds, table

NAME, FILE = "routing_replay_depth", "stage_b.json"
# stage -> (results folder, analysis file); stage C's depth is stage_c_depth.json's L = 4.
STAGES = {"B": (NAME, FILE), "C": ("routing_replay_depth_L4", "stage_c.json")}
VARIANTS = ("grpo_free", "grpo_replay", "gspo_free")
LABELS = {"grpo_free": "GRPO free", "grpo_replay": "GRPO replay", "gspo_free": "GSPO free"}
# What the paper predicts for each registered comparison (a, b).
PREDICTS = {("grpo_replay", "grpo_free"): "the paper predicts above 0 (GRPO needs Routing Replay)",
            ("gspo_free", "grpo_free"): "the paper predicts above 0",
            ("gspo_free", "grpo_replay"): "the paper predicts not below 0"}


def load(path: str | None = None, stage: str = "B") -> dict:
  with open(path or os.path.join(_results.RESULTS, *STAGES[stage])) as f:
    return json.load(f)


def _interval(p: dict) -> str:
  return f"[{_stats.signed(p['low'])}, {_stats.signed(p['high'])}]"


def routing_replay_depth(d: dict | None = None) -> str:
  """Per seed: the shared cold start, then per variant (GRPO free / GRPO replay / GSPO free)
  held-out after 40 iterations, mean training reward and whether it collapsed."""
  d = d or load()
  runs = d["runs"]
  rows = []
  for i, s in enumerate(d["seeds"]):
    cell = lambda key, fmt: " / ".join(fmt(runs[v][key][i]) for v in VARIANTS)
    rows.append([str(s), f3(runs["grpo_free"]["heldout_start"][i]), cell("heldout_end", f3),
                 cell("reward_mean", f3),
                 cell("collapsed", lambda c: "yes" if c else "no")])
  order = " / ".join(LABELS[v] for v in VARIANTS)
  return table(["seed", "cold start (held-out)", f"held-out after 40 ({order})",
                "training reward, mean of 40 (same order)", "collapsed (same order)"], rows)


def routing_replay_depth_endpoints(d: dict | None = None) -> str:
  """B1 and B3 (each comparison: per-seed a − b, mean, 95% interval, p, Holm's p for B1,
  the verdict and the paper's prediction), then B2's collapse counts and Fisher p."""
  d = d or load()
  rows = []
  for tag, what, key in (("B1", "held-out after 40", "B1_heldout_end"),
                         ("B3", "training reward, mean of 40", "B3_reward_mean")):
    for c in d[key]:
      a, b = c["a"], c["b"]
      rows.append([tag, what, f"{LABELS[a]} − {LABELS[b]}", str(c["n"]),
                   seeds(c["diffs"], _stats.signed), _stats.signed(c["mean"]), _interval(c),
                   f"{c['p']:.2g}" + (f" (Holm {c['p_holm']:.2g})" if "p_holm" in c else ""),
                   _stats.verdict(c, LABELS[a], LABELS[b]) + f"; {PREDICTS[(a, b)]}"])
  b2 = d["B2_collapses"]
  k, n = b2["collapsed"], b2["n"]
  for v in ("grpo_replay", "gspo_free"):
    rows.append(["B2", "collapses (section 7's rule)", f"{LABELS['grpo_free']} vs {LABELS[v]}",
                 str(n), f"{k['grpo_free']} of {n} vs {k[v]} of {n}", "–", "–",
                 f"{b2['fisher_p'][v]:.2g}", "Fisher exact, two-sided"])
  return table(["endpoint", "what", "a − b", "seeds", "per seed", "mean", "95% interval",
                "p", "verdict"], rows)


def routing_replay_depth_descriptive(d: dict | None = None) -> str:
  """Per variant, over its seeds: the median over iterations of expert sets changed,
  approx KL and the tokens clipped (per seed), and the smallest and largest ratio of any
  update."""
  d = d or load()
  rows = []
  for v in VARIANTS:
    r = d["runs"][v]
    changed = r.get("routing_changed_median")
    rows.append([LABELS[v],
                 "0 by construction" if changed is None or changed[0] is None
                 else seeds(changed, frac),
                 seeds(r["approx_kl_median"], lambda x: f"{x:.2g}"),
                 seeds(r["clip_frac_token_median"], frac),
                 f"{min(r['ratio_min_extreme']):.3g} … {max(r['ratio_max_extreme']):.3g}",
                 f"{np.median(r['ratio_min_median']):.4f} … "
                 f"{np.median(r['ratio_max_median']):.4f}"])
  return table(["variant", "expert sets changed vs π_old, median over iterations, per seed",
                "approx KL, median, per seed", "tokens clipped, median, per seed",
                "smallest … largest ratio, all seeds and updates",
                "median over seeds of the per-update smallest … largest"], rows)


def figure_comparisons(d: dict | None = None) -> list:
  """(label, a, b) per paired comparison of B1 and B3, for `_plots.paired`."""
  d = d or load()
  runs = d["runs"]
  out = []
  for tag, key, field in (("B1", "B1_heldout_end", "heldout_end"),
                          ("B3", "B3_reward_mean", "reward_mean")):
    for c in d[key]:
      out.append((f"{tag}: {LABELS[c['a']]} − {LABELS[c['b']]}", runs[c["a"]][field],
                  runs[c["b"]][field]))
  return out


# Stage C's tables (section 14): the same renderings of stage_c.json.
def routing_replay_depth_c() -> str:
  return routing_replay_depth(load(stage="C"))


def routing_replay_depth_c_endpoints() -> str:
  return routing_replay_depth_endpoints(load(stage="C"))


def routing_replay_depth_c_descriptive() -> str:
  return routing_replay_depth_descriptive(load(stage="C"))
