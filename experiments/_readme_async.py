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
