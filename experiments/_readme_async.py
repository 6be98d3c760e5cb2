"""experiments/README.md's tables of the asynchronous pipeline (docs/async.md), rendered from
experiments/results/async_timeline/summary.json."""

from __future__ import annotations

from experiments._tables import load, table


def async_timeline() -> str:
  s = load("async_timeline")
  rows = []
  for k in ("k0", "k1"):
    c = s[k]
    rows.append([k[1:], str(c["iterations_timed"]), f"{c['time_iteration_mean_s']:.2f}",
                 f"{c['weight_copy_bytes'] / 2**20:.2f} MiB",
                 f"{c['time_weight_copy_mean_ms']:.0f}",
                 f"{100 * c['sampling_during_update_share']:.1f}%",
                 f"{100 * c['scoring_during_update_share']:.1f}%"])
  return table(["max_staleness", "iterations timed", "seconds per iteration (mean)",
                "weight copy per iteration", "weight copy ms (mean)",
                "update time with the sampler running", "update time with the host scoring"],
               rows)


def _cells():
  return load("async_staleness")["cells"]


def async_staleness() -> str:
  """Per variant: held-out gain (mean ± sd over seeds), collapses, responses clipped and the
  sampler-trainer KL (means over seeds of each run's mean over iterations)."""
  from experiments._tables import mean_sd
  import numpy as np
  rows = []
  for loss, label in (("gspo", "GSPO"), ("grpo", "GRPO"), ("gspo_tis", "GSPO + TIS")):
    for k in (0, 1, 2, 4):
      c = _cells().get(f"{loss}_k{k}")
      if c is None:
        continue
      rows.append([label, str(k), str(len(c["seeds"])), mean_sd(c["heldout_gain"]),
                   f"{sum(c['collapsed'])} of {len(c['seeds'])}",
                   f"{np.mean(c['clip_frac_seq_mean']):.3f}",
                   f"{np.mean(c['sampler_trainer_kl_mean']):.2e}"])
  return table(["loss", "max_staleness", "seeds", "held-out gain, mean ± sd", "collapsed",
                "responses clipped (mean)", "sampler–trainer KL per token (mean)"], rows)


def async_staleness_comparisons() -> list:
  """The preregistered analyses A1 (gain, k − 0), A2 (clip fraction, k − 0) and A3 (gain,
  GSPO + TIS − GSPO), paired over seeds."""
  cells, out = _cells(), []

  def pick(a, b, key):
    seeds = sorted(set(cells[a]["seeds"]) & set(cells[b]["seeds"]))
    get = lambda c: [c[key][c["seeds"].index(s)] for s in seeds]
    return get(cells[a]), get(cells[b])

  names = {"gspo": "GSPO", "grpo": "GRPO", "gspo_tis": "GSPO + TIS"}
  for key, what in (("heldout_gain", "held-out gain"), ("clip_frac_seq_mean", "clipped")):
    for loss, name in names.items():
      for k in (1, 2, 4):
        a, b = f"{loss}_k{k}", f"{loss}_k0"
        if a in cells and b in cells:
          out.append((f"{name}, {what}: k = {k} − k = 0", *pick(a, b, key), f"k = {k}",
                      "k = 0", ""))
  for k in (1, 2, 4):
    a, b = f"gspo_tis_k{k}", f"gspo_k{k}"
    if a in cells and b in cells:
      out.append((f"held-out gain at k = {k}: GSPO + TIS − GSPO", *pick(a, b, "heldout_gain"),
                  "GSPO + TIS", "GSPO", ""))
  return out
