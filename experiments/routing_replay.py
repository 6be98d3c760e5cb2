"""Experiment 3 of the paper (second part): training an MoE policy with and without Routing
Replay.

The paper (section 5.3): after each update ~10% of a 48-layer MoE's activated experts change,
so GRPO's per-token ratios swing and GRPO only converges with Routing Replay (pi_theta's
forward reuses the experts pi_old chose); GSPO's sequence ratio does not need it. Three
variants, same tiny MoE, task, data and seeds:

  grpo_free:   GRPO, routing free (tracked: `routing_changed` is logged, nothing replayed)
  grpo_replay: GRPO with Routing Replay
  gspo_free:   GSPO, routing free (tracked)

and, on request, under a bfloat16 sampler (`rollout.sampler_dtype`), whose expert choices
differ from the float32 trainer's:

  grpo_replay_bf16: GRPO replaying pi_old's choices (the trainer's recomputed forward)
  grpo_r3_bf16:     GRPO replaying the sampler's own choices (Rollout Routing Replay, R3:
                    `routing=rollout_replay`)

    python -m experiments.routing_replay --quick                 # a few minutes on 2 CPU cores
    python -m experiments.routing_replay --seeds 0 1             # full
    python -m experiments.routing_replay --plot-only
    python -m experiments.routing_replay --task long --seeds 0 1 2   # configs/long_chain.py
    python -m experiments.routing_replay --task long --seeds 0 1 --variants grpo_replay_bf16 grpo_r3_bf16
    python -m experiments.routing_replay --task long --layers 8 --seeds 0 1 2 3   # deeper MoE

Writes under --out: runs/<variant>_seed<k>/, summary.json, reward.png, heldout.png,
routing_changed.png, clip_fraction.png, ratio_range.png.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import _runs
from experiments.moe_routing import DEPTHS, moe_model
from gspo_jax.config import LossConfig, TrainConfig

VARIANTS = {"grpo_free": ("grpo", "track"), "grpo_replay": ("grpo", "replay"),
            "gspo_free": ("gspo", "track"), "grpo_replay_bf16": ("grpo", "replay"),
            "grpo_r3_bf16": ("grpo", "rollout_replay")}
DEFAULT = ("grpo_free", "grpo_replay", "gspo_free")
COLOURS = {"grpo_free": "tab:orange", "grpo_replay": "tab:red", "gspo_free": "tab:blue",
           "grpo_replay_bf16": "tab:purple", "grpo_r3_bf16": "tab:green"}


def config(variant: str, seed: int, quick: bool, iterations: int | None, lr: float | None,
           task: str = "addition", layers: int = 2) -> TrainConfig:
  """The task's config file (`_runs.base_config`) with a Mixture-of-Experts model (8 experts,
  top-2, every layer; the task's vocabulary; `layers` deep at moe_routing.DEPTHS's width);
  eps unset, so each loss clips at its own (the paper's) range; lr None = 3e-4 on addition
  (where the results below were measured), the config file's elsewhere."""
  loss, routing = VARIANTS[variant]
  cfg = _runs.base_config(task, quick)
  cfg = dataclasses.replace(
      cfg, model=moe_model(cfg.model.vocab_size, layers, quick),
      optim=dataclasses.replace(cfg.optim, learning_rate=lr or (
          3e-4 if task == "addition" else cfg.optim.learning_rate)),
      loss=LossConfig(name=loss), routing=routing, seed=seed)
  if variant.endswith("_bf16"):
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                               sampler_dtype="bfloat16"))
  return dataclasses.replace(cfg, iterations=iterations) if iterations else cfg


def summarise(runs) -> dict:
  keys = ("clip_frac_token", "clip_frac_seq", "routing_changed", "ratio_max", "ratio_min",
          "skipped_updates", "approx_kl")
  out = {v: _runs.summarise(items, mean_keys=keys) for v, items in runs.items()}
  for v, items in runs.items():  # the extremes over training and their medians, per seed
    out[v]["ratio_max_max"] = [max(r["ratio_max"] for r in it["rows"]) for it in items]
    out[v]["ratio_min_min"] = [min(r["ratio_min"] for r in it["rows"]) for it in items]
    for key in ("ratio_min", "ratio_max"):
      out[v][f"{key}_median"] = [float(np.median([r[key] for r in it["rows"]])) for it in items]
  return out


def plot(runs, out: str) -> list[str]:
  return _runs.standard_plots(runs, out, COLOURS) + [
      _runs.plot_curves(runs, out, "routing_changed.png", "routing_changed",
                        "expert sets changed vs pi_old", smooth=10,
                        colours=COLOURS),
      _runs.plot_range(runs, out, "ratio_range.png", ("ratio_min", "ratio_max"),
                       "smallest and largest ratio in the update", colours=COLOURS)]


def add_args(parser) -> None:
  parser.add_argument("--lr", type=float, default=None,
                      help="default: 3e-4 on addition, else the config file's")
  parser.add_argument("--layers", type=int, default=2, choices=sorted(DEPTHS),
                      help="MoE layers, at about the 2-layer model's active parameters per token")



def main(argv=None):
  return _runs.main(
      argv, doc=__doc__, name="routing_replay", variants=VARIANTS, default_variants=DEFAULT,
      seeds=(0, 1),
      config=lambda v, seed, a: config(v, seed, a.quick, a.iterations, a.lr, a.task, a.layers),
      summarise=summarise, plot=plot, add_args=add_args)


if __name__ == "__main__":
  main()
