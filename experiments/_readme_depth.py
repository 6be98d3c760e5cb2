"""experiments/README.md's tables of the MoE depth sweep (experiments/preregistered.md, part 4,
stage A), rendered from experiments/results/moe_depth/summary.json (`moe_routing.py` with
--layers 2 4 8 16 --minibatches 4 16 --seeds 0 1 2 3 --lrs 1e-4 1e-3).

The endpoints as registered, for the GRPO update at lr 1e-4 and 16 minibatches:
  A1  per seed, the least-squares slope of `changed_any_layer` on log2(layers);
  A2  per seed, in the 16-layer model, the slope of `changed_per_layer` on the layer index;
  A3  per seed, in the 16-layer model, log(median |log-ratio| of tokens whose routing flipped
      / that of tokens whose routing did not) (a seed with no flipped token is left out);
each summarised by its mean over seeds and the 95% Student-t interval (`_stats.paired`
against zeros), "supported" when the interval lies above zero.
"""

from __future__ import annotations

import math

import numpy as np

from experiments import _stats
from experiments._tables import load, table

DEFAULT = (2, 4, 0)   # moe_routing.DEFAULT: its keys carry no suffix


def key(loss: str, lr: float, layers: int, minibatches: int, seed: int) -> str:
  suffix = "" if (layers, minibatches, seed) == DEFAULT else \
      f"_L{layers}_mb{minibatches}_seed{seed}"
  return f"{loss}_lr{lr:g}{suffix}"


def _axes(s: dict, loss: str, lr: float, mb: int):
  """(depths, seeds) present in `s` for this loss, lr and minibatch count."""
  found = [(L, seed) for L in (2, 4, 8, 16) for seed in range(16)
           if key(loss, lr, L, mb, seed) in s]
  return sorted({L for L, _ in found}), sorted({seed for _, seed in found})


def endpoints(s: dict, loss: str = "grpo", lr: float = 1e-4, mb: int = 16) -> dict:
  """{"A1": ..., "A2": ..., "A3": ...}: each `_stats.paired(values, 0)` plus the per-seed
  values; A2 and A3 on the deepest depth present."""
  depths, seeds = _axes(s, loss, lr, mb)
  get = lambda L, seed: s[key(loss, lr, L, mb, seed)]
  a1 = [float(np.polyfit(np.log2(depths), [get(L, seed)["changed_any_layer"] for L in depths],
                         1)[0]) for seed in seeds]
  deep = depths[-1]
  a2 = [float(np.polyfit(np.arange(deep), get(deep, seed)["changed_per_layer"], 1)[0])
        for seed in seeds]
  a3, a3_seeds = [], []
  for seed in seeds:
    c = get(deep, seed)
    flipped, kept = c["abs_log_ratio_median_flipped"], c["abs_log_ratio_median_kept"]
    if flipped is not None and kept is not None and flipped > 0 and kept > 0:
      a3.append(math.log(flipped / kept))
      a3_seeds.append(seed)
  out = {}
  empty = {"n": 0, "diffs": [], "mean": float("nan"), "sd": float("nan"),
           "half_width": float("nan"), "p": float("nan"), "low": float("nan"),
           "high": float("nan")}
  for name, values, used in (("A1", a1, seeds), ("A2", a2, seeds), ("A3", a3, a3_seeds)):
    out[name] = {**(_stats.paired(values, [0.0] * len(values)) if values else empty),
                 "seeds": used, "values": values}
  out["depths"], out["deepest"] = depths, deep
  return out


def moe_depth() -> str:
  """Per depth, loss, minibatch count and lr: the mean (sd) over seeds of the share of
  response tokens whose top-2 set changed in any layer, and the mean per-layer share."""
  s = load("moe_depth")
  rows = []
  for lr in (1e-4, 1e-3):
    for mb in (16, 4):
      for loss in ("grpo", "gspo"):
        depths, seeds = _axes(s, loss, lr, mb)
        for L in depths:
          cs = [s[key(loss, lr, L, mb, seed)] for seed in seeds]
          ms = lambda k: (f"{np.mean([c[k] for c in cs]):.4f} "
                          f"({_stats.sample_std([c[k] for c in cs]):.4f})")
          rows.append([f"{lr:g}", str(mb), loss.upper(), str(L), str(len(cs)),
                       ms("changed_any_layer"), ms("changed_fraction"),
                       ms("clip_frac_token")])
  return table(["lr", "minibatches", "loss", "layers", "seeds",
                "changed in any layer, mean (sd)", "changed per layer, mean (sd)",
                "tokens clipped, mean (sd)"], rows)


def moe_depth_endpoints() -> str:
  e = endpoints(load("moe_depth"))
  names = {"A1": "any-layer change per doubling of depth (slope on log2 layers)",
           "A2": f"per-layer change per layer, {e['deepest']} layers (slope on the index)",
           "A3": f"log(median abs log-ratio, flipped / kept), {e['deepest']} layers"}
  rows = []
  for k in ("A1", "A2", "A3"):
    p = e[k]
    verdict = ("supported" if _stats.resolved(p) and p["mean"] > 0 else
               "contradicted" if _stats.resolved(p) else "not resolved")
    rows.append([k, names[k], str(p["n"]), f"{p['mean']:.4g}",
                 f"[{p['low']:.4g}, {p['high']:.4g}]", verdict,
                 ", ".join(f"{v:.4g}" for v in p["values"])])
  return table(["endpoint", "what", "seeds", "mean", "95% interval", "verdict", "per seed"],
               rows)
