"""Every table of experiments/README.md that comes from a committed summary, rendered from it.

    python -m experiments.readme_tables            # print every table
    python -m experiments.readme_tables --check    # exit 1 if the README's copy differs
    python -m experiments.readme_tables --write    # rewrite the README's marked tables

A table NAME sits in the README after `<!-- table: NAME -->`; a table whose numbers exist in
no committed file sits after `<!-- untraced: why -->` instead (tests/experiments/test_experiments_readme.py
requires one marker or the other before every table). Paired tables compare variants seed by
seed (`experiments/_stats.py`): the per-seed differences, their mean and the 95% t-interval.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np

from experiments import _results, _stats
from experiments._readme_async import async_staleness, async_staleness_comparisons, async_timeline
from experiments._readme_claim1 import (
  claim1_powered,
  claim1_powered_endpoints,
  claim1_powered_secondary,
)
from experiments._readme_depth import moe_depth, moe_depth_endpoints
from experiments._readme_replay_depth import (
  routing_replay_depth,
  routing_replay_depth_c,
  routing_replay_depth_c_descriptive,
  routing_replay_depth_c_endpoints,
  routing_replay_depth_descriptive,
  routing_replay_depth_endpoints,
)
from experiments._readme_stability import (
  clip_vs_length,
  multiturn,
  multiturn_comparisons,
  stability_grid,
  stability_seeds,
  stability_seeds_comparisons,
)
from experiments._tables import f3, frac, gains, load, mean_sd, paired_table, pct, seeds, table

README = os.path.join(_results.ROOT, "experiments", "README.md")


def gspo_vs_grpo(name: str = "gspo_vs_grpo") -> str:
  s = load(name)
  g, r = s["gspo"], s["grpo"]
  head = [""] + [f"seed {k}" for k in g["seeds"]] + ["held-out gain, mean ± sd"]
  pad = [""]
  return table(head, [
      ["start (both)", *map(f3, g["heldout_start"]), ""],
      [f"GSPO after {g['iterations']}", *map(f3, g["heldout_end"]), mean_sd(gains(g))],
      [f"GRPO after {r['iterations']}", *map(f3, r["heldout_end"]), mean_sd(gains(r))],
      ["GSPO train reward, last 50 iterations", *map(f3, g["reward_last50"]), *pad],
      ["GRPO train reward, last 50 iterations", *map(f3, r["reward_last50"]), *pad],
      ["GSPO fraction of tokens clipped (mean over training)",
       *map(frac, g["clip_frac_token_mean"]), *pad],
      ["GRPO fraction of tokens clipped", *map(frac, r["clip_frac_token_mean"]), *pad],
      ["training seconds GSPO / GRPO",
       *[f"{a:.0f} / {b:.0f}" for a, b in zip(g["train_seconds"], r["train_seconds"])], *pad]])


def gspo_vs_grpo_comparisons(name: str = "gspo_vs_grpo") -> list:
  s = load(name)
  g, r = s["gspo"], s["grpo"]
  # The paper predicts GSPO above GRPO: a resolved difference the other way says so.
  against = lambda a, b: ("against the paper" if _stats.resolved(_stats.paired(a, b))
                          and np.mean(np.subtract(a, b)) < 0 else "")
  return [(label, a, b, "GSPO", "GRPO", against(a, b)) for label, a, b in (
      ("held-out after 300, GSPO − GRPO", g["heldout_end"], r["heldout_end"]),
      ("train reward, last 50, GSPO − GRPO", g["reward_last50"], r["reward_last50"]))]


def gspo_vs_grpo_rerun() -> str:
  """Section 1's command run again for its Figure 1 view (gspo_vs_grpo_rerun/)."""
  return gspo_vs_grpo("gspo_vs_grpo_rerun")


def gspo_vs_grpo_rerun_comparisons() -> list:
  return gspo_vs_grpo_comparisons("gspo_vs_grpo_rerun")


def moe_routing() -> str:
  s = load("moe_routing")
  rows = []
  for lr in ("0.0001", "0.001"):
    for loss in ("gspo", "grpo"):
      c = s[f"{loss}_lr{lr}"]
      layers = " / ".join(pct(x) for x in c["changed_per_layer"])
      rows.append([loss.upper(), f"{float(lr):.0e}".replace("e-0", "e-"),
                   f"{pct(c['changed_fraction'])} ({layers})", f"{c['clip_frac_token']:.2f}"])
  return table(["update", "learning rate", "expert sets changed (mean of layers; per layer)",
                "tokens clipped in the update"], rows)


def _ratios(v: dict, i: int) -> str:
  return f"[{v['ratio_min_mean'][i]:.2f}, {v['ratio_max_mean'][i]:.2f}]"


def routing_replay(name: str = "routing_replay", variants=("grpo_free", "grpo_replay",
                                                          "gspo_free")) -> str:
  s = load(name)
  labels = {"grpo_free": "GRPO, free routing", "grpo_replay": "GRPO, Routing Replay",
            "gspo_free": "GSPO, free routing (sequence ratio)",
            "grpo_replay_bf16": "GRPO, bf16 sampler, replay π_old's experts",
            "grpo_r3_bf16": "GRPO, bf16 sampler, replay the sampler's experts (R3)"}
  rows = []
  for v in variants:
    c = s[v]
    k = range(len(c["seeds"]))
    changed = ("0 by construction" if c["routing_changed_mean"][0] is None else
               seeds(c["routing_changed_mean"], lambda x: pct(x, 2)))
    rows.append([
        labels[v], " / ".join(f"{c['heldout_start'][i]:.3f} → {c['heldout_end'][i]:.3f}" for i in k),
        mean_sd(gains(c)), seeds(c["reward_last50"]), seeds(c["clip_frac_token_mean"], frac),
        seeds(c["clip_frac_seq_mean"], frac), changed, " / ".join(_ratios(c, i) for i in k),
        f"{min(c['ratio_min_min']):.2g} … {max(c['ratio_max_max']):.3g}"])
  return table(["variant", "held-out start → end, per seed", "gain, mean ± sd",
                "train reward (last 50 iterations)", "tokens clipped",
                "responses with a clipped token", "expert sets changed",
                "[smallest, largest] ratio per update, mean over iterations",
                "smallest … largest ratio, all seeds"], rows)


def _replay_comparisons(s: dict) -> list:
  free, replay, gspo = s["grpo_free"], s["grpo_replay"], s["gspo_free"]
  return [
      ("held-out end, GRPO replay − GRPO free", replay["heldout_end"], free["heldout_end"],
       "replay", "free", ""),
      ("held-out end, GSPO free − GRPO free", gspo["heldout_end"], free["heldout_end"],
       "GSPO", "GRPO free", ""),
      ("held-out end, GSPO free − GRPO replay", gspo["heldout_end"], replay["heldout_end"],
       "GSPO", "GRPO replay", "")]


def routing_replay_comparisons() -> list:
  return _replay_comparisons(load("routing_replay"))


def precision_gap() -> str:
  s = load("precision_gap")
  return table(["", "per token, log r_it (GRPO's ratio)", "per sequence, mean_t log r_it (GSPO's)"], [
      ["std", f"{s['token_log_ratio_std']:.4f}", f"{s['seq_log_ratio_std']:.4f}"],
      ["max \\|·\\|", f"{s['token_log_ratio_max_abs']:.3f}", f"{s['seq_log_ratio_max_abs']:.3f}"],
      ["outside the method's clip range",
       f"{pct(s['tokens_outside_grpo_clip(0.2,0.27)'])} of tokens outside [0.8, 1.27]",
       f"{pct(s['sequences_outside_gspo_clip(3e-4,4e-4)'])} of responses outside "
       "[1 − 3e-4, 1 + 4e-4]"]])


TRAINING_LABELS = {
    "gspo_recompute": "GSPO, π_old recomputed", "gspo_sampler": "GSPO, π_old = bf16 sampler",
    "gspo_corrected": "GSPO, bf16 sampler + correction",
    "grpo_recompute": "GRPO, π_old recomputed", "grpo_sampler": "GRPO, π_old = bf16 sampler",
    "grpo_corrected": "GRPO, bf16 sampler + correction"}


def precision_training() -> str:
  s = load("precision_training")
  rows = []
  for v in ("gspo_recompute", "gspo_sampler", "grpo_recompute", "grpo_sampler"):
    c = s[v]
    rows.append([TRAINING_LABELS[v], ", ".join(map(str, c["seeds"])),
                 ", ".join(f"{a:.3f} → {b:.3f}" for a, b in zip(c["heldout_start"], c["heldout_end"])),
                 ", ".join(map(f3, c["reward_last50"])),
                 ", ".join(map(frac, c["clip_frac_token_mean"]))])
  return table(["variant", "seeds", "held-out start → end", "train reward, last 50 iterations",
                "tokens clipped (mean over training)"], rows)


def precision_training_comparisons() -> list:
  s = load("precision_training")
  cmp = []
  for loss in ("gspo", "grpo"):
    a, b = s[f"{loss}_sampler"], s[f"{loss}_recompute"]
    for key, what in (("heldout_end", "held-out end"), ("reward_last50", "train reward, last 50")):
      cmp.append((f"{what}, {loss.upper()} sampler − recomputed", a[key], b[key], "sampler",
                  "recomputed", ""))
  return cmp


def gspo_token_equivalence() -> str:
  s = load("gspo_token_equivalence")
  d, cos = s["max_param_diff_vs_gspo"], s["grad_cosine_vs_gspo_step1"]
  small = lambda x: "0" if x == 0 else (f"{x:.4f}" if x < 0.01 else f"{x:.3f}")
  at = lambda xs: " / ".join(small(xs[i - 1]) for i in (1, 10, 50))
  return table(["", "max \\|params − GSPO params\\| after step 1 / 10 / 50",
                "gradient cosine with GSPO at step 1"], [
      ["GSPO-token, per-sequence A_i", at(d["gspo_token"]) + " (bit for bit)",
       f"{cos['gspo_token']:.3f}"],
      [f"GSPO-token, A_i + {s['bonus']} on the first token", at(d["gspo_token_bonus"]),
       f"{cos['gspo_token_bonus']:.3f}"]])


def long() -> str:
  s = load("gspo_vs_grpo_long")
  g, r = s["gspo"], s["grpo"]
  head = [""] + [f"seed {k}" for k in g["seeds"]] + ["held-out gain, mean ± sd"]
  return table(head, [
      ["start (both)", *map(f3, g["heldout_start"]), ""],
      ["GSPO after 40", *map(f3, g["heldout_end"]), mean_sd(gains(g))],
      ["GRPO after 40", *map(f3, r["heldout_end"]), mean_sd(gains(r))],
      ["GSPO train reward, mean of 40 iterations", *map(f3, g["reward_last50"]), ""],
      ["GRPO train reward, mean of 40 iterations", *map(f3, r["reward_last50"]), ""],
      ["GSPO fraction of tokens clipped", *map(frac, g["clip_frac_token_mean"]), ""],
      ["GRPO fraction of tokens clipped", *map(frac, r["clip_frac_token_mean"]), ""],
      ["GRPO fraction of responses with a clipped token", *map(frac, r["clip_frac_seq_mean"]), ""]])


def long_comparisons() -> list:
  s = load("gspo_vs_grpo_long")
  g, r = s["gspo"], s["grpo"]
  return ([
      ("held-out after 40, GSPO − GRPO", g["heldout_end"], r["heldout_end"], "GSPO", "GRPO", ""),
      ("train reward, GSPO − GRPO", g["reward_last50"], r["reward_last50"], "GSPO", "GRPO", "")])


LONG_LOSSES = ("gspo", "grpo", "luspo", "gmpo", "cispo", "sapo")


def long_losses() -> str:
  s = load("gspo_vs_grpo_long")
  rows = []
  for loss in LONG_LOSSES:
    c = s[loss]
    two = slice(0, 2)  # seeds 0 and 1, which every loss ran
    rows.append([loss.upper(), seeds(c["heldout_end"][two]),
                 _stats.signed(float(np.mean(gains(c)[two]))), seeds(c["reward_last50"][two]),
                 frac(float(np.mean(c["clip_frac_token_mean"][two])))])
  return table(["loss", "held-out after 40, seed 0 / 1", "gain, mean of 2",
                "train reward, mean of 40 (seed 0 / 1)", "tokens clipped, mean of 2"], rows)


def long_losses_comparisons() -> list:
  s = load("gspo_vs_grpo_long")
  g = s["gspo"]["heldout_end"][:2]
  return ([(f"held-out after 40, {loss.upper()} − GSPO", s[loss]["heldout_end"][:2],
                        g, loss.upper(), "GSPO", "") for loss in LONG_LOSSES[1:]])


def long_moe() -> str:
  return routing_replay("routing_replay_long")


def long_moe_comparisons() -> list:
  return _replay_comparisons(load("routing_replay_long"))


def long_moe_bf16() -> str:
  return routing_replay("routing_replay_long", ("grpo_replay_bf16", "grpo_r3_bf16"))


def long_moe_gap() -> str:
  """The bf16 sampler against the float32 trainer at the three MoE cold starts."""
  rows = []
  for k in (0, 1, 2):
    g = load(f"precision_gap_long/moe_coldstart_seed{k}")
    rows.append([f"seed {k}", pct(g["expert_sets_differ_sampler_vs_trainer"], 2),
                 f"{g['token_log_ratio_std']:.2g}", f"{g['token_log_ratio_max_abs']:.3g}",
                 pct(g["sequences_outside_gspo_clip(3e-4,4e-4)"], 0)])
  return table(["MoE cold start", "expert sets the sampler chose that the trainer does not",
                "per-token log-ratio std", "largest \\|log-ratio\\|",
                "responses outside GSPO's [1 − 3e-4, 1 + 4e-4]"], rows)


def long_bf16() -> str:
  s, f32 = load("precision_training_long"), load("gspo_vs_grpo_long")
  rows = []
  for loss in ("gspo", "grpo"):
    variants = [(f"{loss.upper()}, float32 sampler (section 6)", f32[loss])] + [
        (TRAINING_LABELS[f"{loss}_{v}"], s[f"{loss}_{v}"]) for v in ("recompute", "sampler", "corrected")]
    for label, c in variants:
      pad = ["–"] * (3 - len(c["seeds"]))
      seq = ("= tokens" if loss == "gspo" else
             " / ".join([*map(frac, c["clip_frac_seq_mean"]), *pad]))
      rows.append([label, " / ".join([*map(f3, c["heldout_end"]), *pad]), mean_sd(gains(c)),
                   " / ".join([*map(f3, c["reward_last50"]), *pad]),
                   " / ".join([*map(frac, c["clip_frac_token_mean"]), *pad]), seq])
  return table(["variant", "held-out, seed 0 / 1 / 2", "gain, mean ± sd", "train reward, mean of 40",
                "tokens clipped", "responses with a clipped token"], rows)


def long_bf16_comparisons() -> list:
  s, f32 = load("precision_training_long"), load("gspo_vs_grpo_long")
  cmp = []
  for loss in ("gspo", "grpo"):
    L = loss.upper()
    rec, smp, cor = (s[f"{loss}_{v}"] for v in ("recompute", "sampler", "corrected"))
    cmp += [(f"held-out, {L} bf16 recomputed − float32", rec["heldout_end"], f32[loss]["heldout_end"],
             "bf16", "float32", ""),
            (f"held-out, {L} π_old = sampler − recomputed", smp["heldout_end"], rec["heldout_end"],
             "sampler", "recomputed", ""),
            (f"held-out, {L} corrected − recomputed", cor["heldout_end"], rec["heldout_end"][:2],
             "corrected", "recomputed", "")]
  return cmp


def long_bf16_gap() -> str:
  s = load("precision_training_long")
  loss = np.subtract(s["gspo_sampler"]["heldout_end"], s["gspo_recompute"]["heldout_end"])
  rows = []
  for k in (0, 1, 2):
    g = load(f"precision_gap_long/coldstart_seed{k}")
    rows.append([f"seed {k}", f"{g['token_log_ratio_std']:.2g}", f"{g['seq_log_ratio_std']:.2g}",
                 pct(g["sequences_outside_gspo_clip(3e-4,4e-4)"], 0),
                 pct(g["tokens_outside_grpo_clip(0.2,0.27)"], 3), _stats.signed(float(loss[k]))])
  return table(["cold start", "per-token log-ratio std", "per-sequence log-ratio std",
                "responses outside GSPO's [1 − 3e-4, 1 + 4e-4]", "tokens outside GRPO's [0.8, 1.27]",
                "GSPO held-out, π_old = sampler − recomputed"], rows)


def lora_curve() -> str:
  """experiments/lora_curve.py's runs: held-out accuracy at each evaluation, full
  fine-tuning beside LoRA, with their wall time, peak memory and update state ("—": not
  recorded)."""
  s = load("lora_curve")
  mib = lambda b: f"{b / 2**20:,.1f} MiB" if b else "—"
  steps = sorted({int(p[0]) for v in ("full", "lora") for p in s[v]["heldout_curve"]})
  rows = []
  for variant in ("full", "lora"):
    c, lc = s[variant], s[variant]["lora"]
    acc = {int(k): a for k, a in c["heldout_curve"]}
    label = ("full fine-tuning" if variant == "full" else
             f"LoRA r = {lc['rank']}, α = {lc['alpha']:g}" +
             (f", {lc['base_dtype']} base" if lc["base_dtype"] else ""))
    rows.append([label, f"{c['learning_rate']:g}", *(f3(acc[k]) if k in acc else "—"
                                                      for k in steps),
                 "—" if c["train_seconds"] is None else f"{c['train_seconds'] / 60:.1f} min",
                 "—" if c["peak_rss_mib"] is None else f"{c['peak_rss_mib'] / 1024:.1f} GiB",
                 mib(c["update_state_bytes"]), mib(c["frozen_base_bytes"])])
  return table(["run", "learning rate", *(f"held-out, step {k}" for k in steps), "wall time",
                "peak RSS", "update state", "frozen base"], rows)


TABLES = {f.__name__: f for f in (
    gspo_vs_grpo, gspo_vs_grpo_rerun, moe_routing, routing_replay, precision_gap, precision_training,
    gspo_token_equivalence, long, long_losses, long_moe, long_moe_bf16, long_moe_gap, long_bf16,
    long_bf16_gap, stability_grid, stability_seeds, clip_vs_length, multiturn, lora_curve,
    async_timeline, async_staleness, moe_depth, moe_depth_endpoints, claim1_powered,
    claim1_powered_endpoints, claim1_powered_secondary, routing_replay_depth,
    routing_replay_depth_endpoints, routing_replay_depth_descriptive, routing_replay_depth_c,
    routing_replay_depth_c_endpoints, routing_replay_depth_c_descriptive)}
# Paired comparisons: the README's `<name>_paired` table and the figure
# experiments/results/<dir>/paired.png (experiments/figures.py) come from the same list.
PAIRED = {  # name -> (results dir, comparisons)
    "gspo_vs_grpo": ("gspo_vs_grpo", gspo_vs_grpo_comparisons),
    "gspo_vs_grpo_rerun": ("gspo_vs_grpo_rerun", gspo_vs_grpo_rerun_comparisons),
    "routing_replay": ("routing_replay", routing_replay_comparisons),
    "precision_training": ("precision_training", precision_training_comparisons),
    "long": ("gspo_vs_grpo_long", long_comparisons),
    "long_losses": ("gspo_vs_grpo_long", long_losses_comparisons),
    "long_moe": ("routing_replay_long", long_moe_comparisons),
    "long_bf16": ("precision_training_long", long_bf16_comparisons),
    "stability_seeds": ("stability_map", stability_seeds_comparisons),
    "multiturn": ("multiturn_tools", multiturn_comparisons),
    "async_staleness": ("async_staleness", async_staleness_comparisons)}
for _name, (_, _cmp) in PAIRED.items():
  TABLES[f"{_name}_paired"] = (lambda c: lambda: paired_table(c()))(_cmp)

MARKED = re.compile(r"<!-- table: (\w+) -->\n((?:\|.*\n?)+)")


def readme_tables(text: str) -> dict[str, str]:
  """NAME -> the table after `<!-- table: NAME -->` in `text`."""
  return {m.group(1): m.group(2).rstrip("\n") for m in MARKED.finditer(text)}


def rewrite(text: str) -> str:
  """`text` with every marked table replaced by its rendering."""
  return MARKED.sub(lambda m: f"<!-- table: {m.group(1)} -->\n{TABLES[m.group(1)]()}\n", text)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if the README differs")
  parser.add_argument("--write", action="store_true", help="rewrite the README's tables")
  args = parser.parse_args(argv)
  text = open(README, encoding="utf-8").read()
  if args.write:
    open(README, "w", encoding="utf-8").write(rewrite(text))
    return 0
  if args.check:
    bad = [n for n, t in readme_tables(text).items() if t != TABLES[n]()]
    print("differ from their files:", *bad) if bad else print("every marked table matches")
    return 1 if bad else 0
  for name, f in TABLES.items():
    print(f"<!-- table: {name} -->\n{f()}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
