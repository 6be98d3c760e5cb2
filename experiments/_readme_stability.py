"""experiments/README.md's tables of section 7 (the stability map) and section 8 (multi-turn),
rendered from their committed summaries (the rest: experiments/readme_tables.py)."""

from __future__ import annotations

import numpy as np

from experiments import _stats
from experiments._tables import f3, frac, gains, load, mean_sd, table

LENGTHS = ("long", "medium", "short")   # the README's order
TOKENS = {"short": 33, "medium": 63, "long": 113}


def _cell(s: dict, length: str, loss: str, mb: int, lr: str) -> dict:
  return s["cells"][f"{length}/{loss}_mb{mb}_lr{lr}"]


def _seed0(c: dict, key: str):
  return c[key][c["seeds"].index(0)]


def two(x: float) -> str:
  """Two significant digits with trailing zeros kept (0.50, 0.070), "0" for zero."""
  return "0" if x == 0 else f"{x:#.2g}"


def stability_grid() -> str:
  """Every cell on seed 0: start → end, clip fractions, collapsed."""
  s = load("stability_map")
  rows = []
  for length in LENGTHS:
    for lr in ("0.0001", "0.0003"):
      start = _seed0(_cell(s, length, "gspo", 1, lr), "heldout_start")
      rows.append([f"**{length}, lr {float(lr):.0e}** (start {f3(start)})".replace("e-0", "e-"),
                   "", "", "", ""])
      for mb in (1, 4, 16):
        for loss in ("gspo", "grpo"):
          c = _cell(s, length, loss, mb, lr)
          rows.append([f"{loss.upper()}, {mb} minibatch{'es' if mb > 1 else ''}",
                       f3(_seed0(c, "heldout_end")), two(_seed0(c, "clip_frac_token_mean")),
                       two(_seed0(c, "clip_frac_seq_mean")),
                       "**yes**" if _seed0(c, "collapsed") else "no"])
  return table(["cell (seed 0)", "held-out after 20", "tokens clipped",
                "responses with a clipped token", "collapsed"], rows)


def stability_seeds() -> str:
  """The 16-minibatch cells at lr 1e-4 that ran on three seeds."""
  s = load("stability_map")
  rows = []
  for length in ("medium", "long"):
    ref = _cell(s, length, "gspo", 16, "0.0001")
    rows.append([f"{length}, start", *map(f3, ref["heldout_start"]), "", ""])
    for loss in ("gspo", "grpo"):
      c = _cell(s, length, loss, 16, "0.0001")
      rows.append([loss.upper(), *map(f3, c["heldout_end"]),
                   f"**{sum(c['collapsed'])} of {len(c['collapsed'])}**", mean_sd(gains(c))])
  return table(["cell", "seed 0", "seed 1", "seed 2", "collapsed", "gain, mean ± sd"], rows)


def stability_seeds_comparisons() -> list:
  s = load("stability_map")
  cmp = []
  for length in ("medium", "long"):
    g, r = (_cell(s, length, loss, 16, "0.0001") for loss in ("gspo", "grpo"))
    kg, kr, n = sum(g["collapsed"]), sum(r["collapsed"]), len(g["collapsed"])
    fisher = (f"collapsed GRPO {kr} of {n}, GSPO {kg} of {n}: Fisher exact p = "
              f"{_stats.fisher_exact(kr, n, kg, n):.2g} two-sided, "
              f"{_stats.fisher_exact(kr, n, kg, n, one_sided=True):.2g} one-sided")
    cmp.append((f"{length}, held-out after 20, GSPO − GRPO", g["heldout_end"], r["heldout_end"],
                "GSPO", "GRPO", fisher))
  return (cmp)


def clip_vs_length() -> str:
  """What clip_vs_length.png plots: seed 0 at 4 minibatches, the mean over the seeds run at
  16 (three at medium and long, one at short), lr 1e-4, short / medium / long."""
  s = load("stability_map")

  def row(loss: str, key: str) -> list[str]:
    out = []
    for mb, agg in ((4, lambda c: _seed0(c, key)), (16, lambda c: _seed0(c, key)),
                    (16, lambda c: float(np.mean(c[key])))):
      out.append(" / ".join(two(agg(_cell(s, length, loss, mb, "0.0001")))
                            for length in ("short", "medium", "long")))
    return out

  n16 = " / ".join(str(len(_cell(s, l, "gspo", 16, "0.0001")["seeds"]))
                   for l in ("short", "medium", "long"))
  return table(["", "4 minibatches, seed 0", "16 minibatches, seed 0",
                f"16 minibatches, mean of {n16} seeds (the plot)"], [
      ["GSPO, tokens clipped (= responses clipped)", *row("gspo", "clip_frac_token_mean")],
      ["GRPO, tokens clipped", *row("grpo", "clip_frac_token_mean")],
      ["GRPO, responses with a clipped token", *row("grpo", "clip_frac_seq_mean")]])


MULTITURN = {"gspo_token_turn": "GSPO-token, per-turn credit", "gspo_episode": "GSPO, episode reward",
             "grpo_episode": "GRPO, episode reward"}


def multiturn() -> str:
  s = load("multiturn_tools")
  t = s["gspo_token_turn"]
  arrow = lambda a, b: [f"{x:.3f} → {y:.3f}" for x, y in zip(a, b)]
  rows = [["start (all)", *map(f3, t["heldout_start"]), ""]]
  rows += [[f"{label}, after {s[v]['iterations']}", *map(f3, s[v]["heldout_end"]),
            mean_sd(gains(s[v]))] for v, label in MULTITURN.items()]
  rows += [
      ["well-formed calls per episode, first → last 20 iterations (GSPO-token)",
       *arrow(t["tool_calls_first20"], t["tool_calls_last20"]), ""],
      ["malformed calls per episode, first → last 20 (GSPO-token)",
       *arrow(t["malformed_calls_first20"], t["malformed_calls_last20"]), ""],
      ["fraction of tokens clipped, mean (GSPO-token / GSPO / GRPO)",
       *[" / ".join(frac(s[v]["clip_frac_token_mean"][i]) for v in MULTITURN)
         for i in range(len(t["seeds"]))], ""]]
  return table(["", *[f"seed {k}" for k in t["seeds"]], "held-out gain, mean ± sd"], rows)


def multiturn_comparisons() -> list:
  s = load("multiturn_tools")
  end = {v: s[v]["heldout_end"] for v in MULTITURN}
  return ([
      ("held-out, GSPO-token per turn − GSPO episode", end["gspo_token_turn"], end["gspo_episode"],
       "GSPO-token", "GSPO", ""),
      ("held-out, GSPO-token per turn − GRPO", end["gspo_token_turn"], end["grpo_episode"],
       "GSPO-token", "GRPO", "")])
