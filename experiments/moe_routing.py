"""Experiment 3 of the paper (first part): how many expert choices of an MoE policy change
after one policy update, for the same rollout data.

The paper reports ~10% of activated experts changing after each update of a 48-layer MoE,
which is what makes GRPO's per-token ratios volatile. Here: a tiny MoE (8 experts, top-2,
every layer) is cold-started on 2-digit addition, one rollout batch is sampled, then one
GSPO and one GRPO update (4 minibatches, each loss's own clip range, the paper's) are taken
from the same state; we compare each (response token, MoE layer)'s top-k expert set before
and after, on the same inputs.

    python -m experiments.moe_routing [--quick]
    python -m experiments.moe_routing --layers 2 4 8 16 --minibatches 4 16 --seeds 0 1 2 3

The depth sweep (experiments/preregistered.md, part 4) keeps the active matmul parameters
per token within 7% of the 2-layer model's by narrowing the width as layers are added
(`DEPTHS`), and also reports the fraction of response tokens whose experts changed in any
layer and the tokens' |log-ratio| after the update, split by whether their routing changed.

Writes runs/results/moe_routing[_quick]/summary.json (experiments/results/ with --record):
one entry per update, "<loss>_lr<lr>", with "_L<layers>_mb<minibatches>_seed<seed>" added
unless those are the original experiment's 2, 4 and 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _results
from gspo_jax import evaluate
from gspo_jax.config import LossConfig, TrainConfig
from gspo_jax.models.config import tiny_moe
from gspo_jax.parallel import sharding
from gspo_jax.train import coldstart, programs, step
from gspo_jax.train.collect import rollout_step
from gspo_jax.train.run import setup
from gspo_jax.utils import configlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOSSES = ("gspo", "grpo")
# Layers -> widths at about the 2-layer model's active matmul parameters per token (199k;
# 4 layers +7%, 8 layers +1%, 16 layers -4%, tests/experiments/test_experiments_figures.py): attention
# heads of 32 (22 at 16 layers) and expert MLPs half the width, 8 experts, top-2.
DEPTHS = {
    2: dict(hidden=128, num_heads=4, num_kv_heads=2, head_dim=32, moe_mlp_dim=64),
    4: dict(hidden=96, num_heads=3, num_kv_heads=1, head_dim=32, moe_mlp_dim=48),
    8: dict(hidden=64, num_heads=2, num_kv_heads=1, head_dim=32, moe_mlp_dim=32),
    16: dict(hidden=44, num_heads=2, num_kv_heads=1, head_dim=22, moe_mlp_dim=22)}
QUICK_WIDTH = dict(hidden=32, moe_mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=16)
DEFAULT = (2, 4, 0)  # (layers, minibatches, seed) of the original experiment


def moe_model(vocab_size: int, layers: int = 2, quick: bool = False):
  """The experiments' MoE: 8 experts, top-2, every layer, at `DEPTHS[layers]`'s width
  (--quick: a 4x narrower model at any depth; every step runs, nothing is learned)."""
  width = QUICK_WIDTH if quick else DEPTHS[layers]
  return tiny_moe(vocab_size=vocab_size, num_experts=8, experts_per_token=2, num_layers=layers,
                  **width)


def config(quick: bool, lr: float, layers: int = 2, minibatches: int = 4,
           seed: int = 0) -> TrainConfig:
  cfg = configlib.load_config(os.path.join(ROOT, "configs", "addition_tiny.py"))
  return dataclasses.replace(
      cfg, model=moe_model(32, layers, quick), num_minibatches=minibatches, seed=seed,
      sft=dataclasses.replace(cfg.sft, steps=20 if quick else 300, target_accuracy=0.0,
                              batch_size=16 if quick else cfg.sft.batch_size),
      rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=8 if quick else 64),
      optim=dataclasses.replace(cfg.optim, learning_rate=lr, warmup_steps=0),
      loss=dataclasses.replace(cfg.loss, eps_low=None, eps_high=None),
      mesh=sharding.MeshConfig(num_devices=1))


def expert_sets(graphdef, cfg: TrainConfig):
  """Two functions of (params, batch), both from the trainer's own teacher-forced forward
  (`step.policy_logprobs`): the sorted top-k experts of every (MoE layer, row, response
  position), (L, R, T, K), and the response log-probs, (R, T); rows R = B*G in (prompt,
  response) order."""
  scfg = programs.step_config(cfg)
  forward = jax.jit(lambda p, rows: step.policy_logprobs(p, graphdef, rows, scfg))

  def sets(params, batch: step.Batch) -> np.ndarray:
    P = batch.prompts_BxP.shape[1]
    indices = forward(params, batch)[1].indices
    return np.sort(np.stack([np.asarray(i)[:, P:] for i in indices]), axis=-1)

  def logp(params, batch: step.Batch) -> np.ndarray:
    out = np.asarray(forward(params, batch)[0])
    return out.reshape(-1, out.shape[-1])

  return sets, logp


def changes(before: np.ndarray, after: np.ndarray, logp_before, logp_after,
            mask: np.ndarray) -> dict:
  """What one update changed on the same rows: `before` / `after` the (L, R, T, K) expert
  sets, `logp_*` the (R, T) log-probs, `mask` the (R, T) response tokens. Per layer and in
  any layer, the fraction of response tokens whose top-k set changed; the tokens' mean and
  median |log pi_new - log pi_old|, split by whether any layer's set changed (None when no
  token falls on that side)."""
  changed = np.any(before != after, axis=-1)              # (L, R, T): top-k set changed
  per_layer = [float(changed[l][mask].mean()) for l in range(changed.shape[0])]
  flipped = changed.any(axis=0)[mask]
  lr = np.abs(np.asarray(logp_after) - np.asarray(logp_before))[mask]
  stat = lambda f, sel: float(f(lr[sel])) if sel.any() else None
  return {"changed_fraction": float(np.mean(per_layer)), "changed_per_layer": per_layer,
          "changed_any_layer": float(flipped.mean()),
          "abs_log_ratio_mean_flipped": stat(np.mean, flipped),
          "abs_log_ratio_mean_kept": stat(np.mean, ~flipped),
          "abs_log_ratio_median_flipped": stat(np.median, flipped),
          "abs_log_ratio_median_kept": stat(np.median, ~flipped)}


def run(quick: bool, lrs, out: str, layers=(2,), minibatches=(4,), seeds=(0,)) -> dict:
  results = {}
  run_dir = os.path.join(out, "runs", "setup")  # the task tokenizer (ignored by git)
  for L, seed in ((L, seed) for L in layers for seed in seeds):
    # Each (layers, seed)'s results are kept as they finish, so a sweep cut short (a
    # session's end) resumes where it stopped; they depend on nothing else.
    part = os.path.join(out, "runs", "parts", f"L{L}_seed{seed}_mb{'-'.join(map(str, minibatches))}"
                        f"_lr{'-'.join(f'{x:g}' for x in lrs)}{'_quick' if quick else ''}.json")
    if os.path.exists(part):
      with open(part) as f:
        results.update(json.load(f))
      continue
    mine = {}
    start = None
    for lr in lrs:
      # One setup per learning rate (the optimiser holds it); the minibatch count and the
      # loss only change the update program (`Run.reconfigure`).
      base = setup(config(quick, lr, L, minibatches[0], seed), run_dir)
      probe = lambda params, examples: evaluate.evaluate(base, params, examples)["accuracy"]
      # The cold start depends on the model and seed only (its own SFT settings, not the
      # RL learning rate or minibatches): made once per (layers, seed), copied for each.
      if start is None:
        start = coldstart.cold_start(base, probe_accuracy=probe, log=lambda *a: None)
      base.state = base.programs.init(jax.tree.map(jnp.copy, start))
      # The rollout depends on the cold start and the key only: the same for every update.
      r = rollout_step(base, base.state.params, base.state.key, 0)
      B, G, T = r.batch.tokens_BxGxT.shape
      mask = np.asarray(r.batch.mask_BxGxT).reshape(B * G, T) > 0
      # Routing depends on the parameters only (not on the loss): one program for all.
      sets, logp = expert_sets(base.graphdef, base.cfg)
      before, logp_before = sets(base.state.params, r.batch), logp(base.state.params, r.batch)
      for mb, loss in ((mb, loss) for mb in minibatches for loss in LOSSES):
        suffix = "" if (L, mb, seed) == DEFAULT else f"_L{L}_mb{mb}_seed{seed}"
        run = base.reconfigure(dataclasses.replace(base.cfg, num_minibatches=mb,
                                                   loss=LossConfig(name=loss)))
        # The update donates its state: each starts from its own copy of the same one.
        new, metrics = run.programs.update(jax.tree.map(jnp.copy, base.state), r.batch,
                                           r.rewards_BxG)
        found = changes(before, sets(new.params, r.batch), logp_before,
                        logp(new.params, r.batch), mask)
        mine[f"{loss}_lr{lr:g}{suffix}"] = {
            **found, "clip_frac_token": float(metrics["clip_frac_token"]),
            "reward_mean": float(r.stats["reward_mean"]), "tokens": int(mask.sum())}
    os.makedirs(os.path.dirname(part), exist_ok=True)
    with open(part + ".tmp", "w") as f:
      json.dump(mine, f)
    os.replace(part + ".tmp", part)
    results.update(mine)
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description="expert-choice changes after one MoE update")
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 1e-3])
  parser.add_argument("--layers", nargs="+", type=int, default=[2], choices=sorted(DEPTHS))
  parser.add_argument("--minibatches", nargs="+", type=int, default=[4])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument("--out", default=None)
  _results.add_record_arg(parser)
  args = parser.parse_args(argv)
  out = _results.out_path(args, "moe_routing_quick" if args.quick else "moe_routing")
  os.makedirs(out, exist_ok=True)
  started, load = time.time(), os.getloadavg()
  summary = run(args.quick, args.lrs[:1] if args.quick else args.lrs, out, args.layers,
                args.minibatches, args.seeds)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  with open(os.path.join(out, "provenance.json"), "w") as f:
    json.dump(_results.provenance(started, load), f, indent=2)
  print(json.dumps(summary, indent=2))
  return summary


if __name__ == "__main__":
  main()
