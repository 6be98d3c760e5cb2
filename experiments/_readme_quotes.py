"""Numbers experiments/README.md quotes in its text, rendered from the committed summaries.

Each entry renders a phrase the README must contain verbatim (whitespace aside);
tests/experiments/test_experiments_readme.py fails when a summary no longer gives the phrase, so a
number in the text cannot drift from its file unnoticed.
"""

from __future__ import annotations

import numpy as np

from experiments import _stats
from experiments._readme_stability import two
from experiments._tables import gains, load, pct, rnd

s = _stats.signed


def _pm(p: dict, digits: int = 3) -> str:
  """mean ± half-width of a paired comparison: −0.054 ± 0.036."""
  return f"{s(p['mean'], digits)} ± {rnd(p['half_width'], digits)}"


def _sd(xs) -> str:
  return f"{s(float(np.mean(xs)))} ± {rnd(_stats.sample_std(xs), 3)}"


def addition() -> list[str]:
  d = load("gspo_vs_grpo")
  g, r = d["gspo"], d["grpo"]
  end = _stats.paired(g["heldout_end"], r["heldout_end"])
  reward = _stats.paired(g["reward_last50"], r["reward_last50"])
  clip = lambda v: float(np.mean(v["clip_frac_token_mean"]))
  return [f"GSPO − GRPO {s(end['mean'])}, ±{rnd(end['half_width'], 3)}",
          f"{_pm(reward)} (p = {reward['p']:.2g})",
          f"{d['clip_ratio_gspo_over_grpo']:.0f}× more clipped ({rnd(clip(g), 2)} vs "
          f"{rnd(clip(r), 4)})"]


def addition_rerun() -> list[str]:
  """Section 1 run again (gspo_vs_grpo_rerun/summary.json)."""
  d = load("gspo_vs_grpo_rerun")
  g, r = d["gspo"], d["grpo"]
  lead = -np.subtract(g["heldout_end"], r["heldout_end"])
  end = _stats.paired(g["heldout_end"], r["heldout_end"])
  return [f"higher on every seed too, by {min(lead):.3f}–{max(lead):.3f}",
          f"GSPO − GRPO {s(end['mean'])}, ±{rnd(end['half_width'], 3)}",
          f"GSPO clips {d['clip_ratio_gspo_over_grpo']:.0f}× more tokens than GRPO here"]


def routing() -> list[str]:
  d = load("moe_routing")
  low = [d[f"{l}_lr0.0001"]["changed_fraction"] for l in ("gspo", "grpo")]
  high = [d[f"{l}_lr0.001"]["changed_fraction"] for l in ("gspo", "grpo")]
  rr = load("routing_replay")
  free, replay = (rr[v] for v in ("grpo_free", "grpo_replay"))
  gain = lambda v: " / ".join(s(x) for x in gains(v))
  return [f"{pct(min(low))}–{pct(max(low))} of expert choices change per update at lr 1e-4, "
          f"{pct(min(high))}–{pct(max(high))} at 1e-3",
          f"replay − free {_pm(_stats.paired(replay['heldout_end'], free['heldout_end']))}",
          f"gains {gain(free)} vs {gain(replay)}"]


def precision() -> list[str]:
  g = load("precision_gap")
  t = load("precision_training")
  smp, rec = t["gspo_sampler"], t["gspo_recompute"]
  clip = lambda v: rnd(float(np.mean(v["clip_frac_token_mean"])), 2)
  e = load("gspo_token_equivalence")
  clipped = float(np.mean(e["clip_frac_token"]["gspo"]))
  return [f"({g['responses']:,} responses, {g['tokens']:,} tokens, "
          f"{g['mean_response_length']:.1f} tokens per response.)",
          f"clips {clip(smp)} vs {clip(rec)} of tokens",
          f"{_pm(_stats.paired(smp['reward_last50'], rec['reward_last50']))}, not resolved)",
          f"{pct(clipped, 0)} of tokens are clipped",
          f"moved by at most {rnd(e['param_change_of_gspo'], 3)}"]


def long() -> list[str]:
  d = load("gspo_vs_grpo_long")
  g, r = d["gspo"], d["grpo"]
  clip = lambda v, k: rnd(float(np.mean(v["clip_frac_token_mean"])), k)
  ratio = np.mean(g["clip_frac_token_mean"]) / np.mean(r["clip_frac_token_mean"])
  reward = _stats.paired(g["reward_last50"], r["reward_last50"])
  return [f"GSPO {_sd(gains(g))}, GRPO {_sd(gains(r))}; GSPO − GRPO "
          f"{_pm(_stats.paired(g['heldout_end'], r['heldout_end']))}",
          f"~{round(ratio, -2):.0f}× more tokens ({clip(g, 2)} vs {clip(r, 4)})",
          f"agree to {rnd(max(np.abs(reward['diffs'])), 3)} on every seed "
          f"(±{rnd(reward['half_width'], 3)})"]


def long_moe_bf16() -> list[str]:
  m = load("routing_replay_long")
  free, replay, gspo = (m[v] for v in ("grpo_free", "grpo_replay", "gspo_free"))
  p = lambda a, b: f"({_pm(_stats.paired(a['heldout_end'], b['heldout_end']))})"
  t = load("precision_training_long")
  smp, rec = t["gspo_sampler"], t["gspo_recompute"]
  outside = [load(f"precision_gap_long/coldstart_seed{k}")["sequences_outside_gspo_clip(3e-4,4e-4)"]
             for k in (0, 1, 2)]
  return [f"smallest {min(free['ratio_min_min']):.2g} → {rnd(min(replay['ratio_min_min']), 3)}",
          p(replay, free), p(gspo, free), p(gspo, replay),
          f"{s(float(np.mean(gains(smp))))} vs {s(float(np.mean(gains(rec))))}; paired "
          f"{_pm(_stats.paired(smp['heldout_end'], rec['heldout_end']))}",
          f"{pct(min(outside), 0)[:-1]}–{pct(max(outside), 0)}"]


def stability() -> list[str]:
  c = load("stability_map")["cells"]
  g, r = c["medium/gspo_mb16_lr0.0001"], c["medium/grpo_mb16_lr0.0001"]
  n = len(g["seeds"])
  kg, kr = sum(g["collapsed"]), sum(r["collapsed"])
  p = _stats.paired(g["heldout_end"], r["heldout_end"])
  seq = lambda length, mb: c[f"{length}/grpo_mb{mb}_lr0.0001"]["clip_frac_seq_mean"]
  s0 = lambda length, mb: seq(length, mb)[0]
  ratios = [c[f"{l}/gspo_mb{mb}_lr0.0001"]["clip_frac_token_mean"][0] /
            c[f"{l}/grpo_mb{mb}_lr0.0001"]["clip_frac_token_mean"][0]
            for l in ("short", "medium", "long") for mb in (4, 16)]
  return [f"GRPO collapsed on {kr} of {n} seeds, GSPO on none" if kg == 0 else "",
          f"Fisher exact p = {_stats.fisher_exact(kr, n, kg, n):.2g} two-sided, "
          f"{_stats.fisher_exact(kr, n, kg, n, one_sided=True):.2g} one-sided",
          f"{s(p['mean'])}, has a 95% interval of ±{rnd(p['half_width'], 3)}",
          f"(seed 0: {two(s0('medium', 4))} → {two(s0('long', 4))})",
          f"({two(np.mean(seq('medium', 16)))} → {two(np.mean(seq('long', 16)))}; seed 0 alone "
          f"{two(s0('medium', 16))} → {two(s0('long', 16))})",
          f"{min(ratios):.0f}–{max(ratios):.0f}× more tokens"]


def multiturn() -> list[str]:
  d = load("multiturn_tools")
  m = {v: s(float(np.mean(gains(d[v])))) for v in d}
  return [f"{m['gspo_token_turn']}, GSPO on the episode reward {m['gspo_episode']}, "
          f"GRPO {m['grpo_episode']}"]


def claim1_powered() -> list[str]:
  """Section 12 and the summary's claim-1 row (experiments/_readme_claim1.py)."""
  from experiments import _readme_claim1 as c1
  d = c1.load()
  cmp = {(c["key"], c["a"], c["b"]): c for c in c1.comparisons(d)}
  iv = lambda c: (f"{s(c['paired']['mean'])} (95% interval {s(c['paired']['low'])} to "
                  f"{s(c['paired']['high'])})")
  chosen = c1.analysis_set(d["coldstart_heldout"])
  cold = [d["coldstart_heldout"][str(k)] for k in chosen["seeds"]]
  fish = {(f["a"], f["b"]): f for f in c1.fisher(d)}
  count = lambda v: "{} of {}".format(*fish[("gspo", "grpo")][f"{v}_count"])
  prov = d["provenance"]
  return [f"GSPO − GRPO {iv(cmp[('end', 'gspo', 'grpo')])}",
          f"GSPO-len − GRPO {iv(cmp[('end', 'gspo_len', 'grpo')])}",
          f"GSPO-len − GSPO {iv(cmp[('end', 'gspo_len', 'gspo')])}",
          f"mean gain over the 8 evaluations {_pm(cmp[('gain', 'gspo', 'grpo')]['paired'])}",
          f"training reward over the last 10 iterations "
          f"{_pm(cmp[('reward', 'gspo', 'grpo')]['paired'])}",
          f"paired sd {rnd(cmp[('end', 'gspo', 'grpo')]['paired']['sd'], 3)}",
          f"cold starts {rnd(min(cold), 3)}–{rnd(max(cold), 3)}",
          f"GSPO collapsed on {count('a')} seeds, GRPO on {count('b')}",
          f"load averages {prov['load_1min_range'][0]:.1f}–{prov['load_1min_range'][1]:.1f}",
          f"{prov['run_seconds_range'][0]:.0f}–{prov['run_seconds_range'][1]:.0f} s per run"]


def replay_depth(stage: str = "B") -> list[str]:
  """Section 13 (stage B, stage_b.json) or 14 (stage C, stage_c.json), as
  experiments/_readme_replay_depth.py reads them."""
  from experiments import _readme_replay_depth as rd
  r = rd.load(stage=stage)["runs"]
  lo = lambda v: min(r[v]["ratio_min_extreme"])
  hi = lambda v: max(r[v]["ratio_max_extreme"])
  clip = lambda *vs: [x for v in vs for x in r[v]["clip_frac_token_median"]]
  grpo = clip("grpo_free", "grpo_replay")
  return [f"from {lo('grpo_free'):.2g} to {hi('grpo_free'):.3g} without replay and from "
          f"{lo('grpo_replay'):.2g} to {hi('grpo_replay'):.2g} with it",
          f"within {lo('gspo_free'):.2f}–{hi('gspo_free'):.2f} while it clips "
          f"{100 * min(clip('gspo_free')):.1f}–{100 * max(clip('gspo_free')):.1f}% of tokens",
          f"GRPO's {100 * min(grpo):.2f}–{100 * max(grpo):.2f}%"]


def replay_depth_c() -> list[str]:
  """Section 14 and the summary's row 3 (stage C, stage_c.json): stage B's phrases and the
  two B1 comparisons the summary gives."""
  from experiments import _readme_replay_depth as rd
  b1 = {(c["a"], c["b"]): c for c in rd.load(stage="C")["B1_heldout_end"]}
  pair = lambda a, b: (f"{_stats.signed(b1[a, b]['mean'])} (95% interval "
                       f"{_stats.signed(b1[a, b]['low'])} to {_stats.signed(b1[a, b]['high'])})")
  return replay_depth("C") + [f"replay − free {pair('grpo_replay', 'grpo_free')}",
                              f"GSPO free − GRPO free {pair('gspo_free', 'grpo_free')}"]


def quotes() -> list[str]:
  """Every phrase the README must contain."""
  return [q for f in (addition, addition_rerun, routing, precision, long, long_moe_bf16, stability, multiturn,
                      claim1_powered, replay_depth, replay_depth_c) for q in f() if q]
