"""Experiment 3 of the paper (first part): how many expert choices of an MoE policy change
after one policy update, for the same rollout data.

The paper reports ~10% of activated experts changing after each update of a 48-layer MoE,
which is what makes GRPO's per-token ratios volatile. Here: a tiny MoE (8 experts, top-2,
every layer) is cold-started on 2-digit addition, one rollout batch is sampled, then one
GSPO and one GRPO update (4 minibatches, each loss's own clip range, the paper's) are taken
from the same state; we compare each (response token, MoE layer)'s top-k expert set before
and after, on the same inputs.

    python -m experiments.moe_routing [--quick]

Writes runs/results/moe_routing[_quick]/summary.json (experiments/results/ with --record).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _results
from gspo_jax import coldstart, configlib, evaluate, programs, sharding, step
from gspo_jax.config import LossConfig, TrainConfig
from gspo_jax.models.config import tiny_moe
from gspo_jax.rollout import rollout_step
from gspo_jax.run import setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOSSES = ("gspo", "grpo")


def config(quick: bool, lr: float) -> TrainConfig:
  cfg = configlib.load_config(os.path.join(ROOT, "configs", "addition_tiny.py"))
  # --quick: a 4x narrower model, small batches (every step runs, nothing is learned).
  width = dict(hidden=32, moe_mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=16) if (
      quick) else dict(hidden=128, moe_mlp_dim=64, num_heads=4, num_kv_heads=2, head_dim=32)
  return dataclasses.replace(
      cfg, model=tiny_moe(vocab_size=32, num_experts=8, experts_per_token=2, **width),
      sft=dataclasses.replace(cfg.sft, steps=20 if quick else 300, target_accuracy=0.0,
                              batch_size=16 if quick else cfg.sft.batch_size),
      rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=8 if quick else 64),
      optim=dataclasses.replace(cfg.optim, learning_rate=lr, warmup_steps=0),
      loss=dataclasses.replace(cfg.loss, eps_low=None, eps_high=None),
      mesh=sharding.MeshConfig(num_devices=1))


def expert_sets(graphdef, cfg: TrainConfig):
  """(params, batch) -> the sorted top-k experts of every (MoE layer, row, response
  position): (L, R, T, K), rows R = B*G in (prompt, response) order, from the trainer's own
  teacher-forced forward (`step.policy_logprobs`)."""
  scfg = programs.step_config(cfg)
  route = jax.jit(lambda p, rows: step.policy_logprobs(p, graphdef, rows, scfg)[1].indices)

  def sets(params, batch: step.Batch) -> np.ndarray:
    P = batch.prompts_BxP.shape[1]
    return np.sort(np.stack([np.asarray(i)[:, P:] for i in route(params, batch)]), axis=-1)

  return sets


def run(quick: bool, lrs, out: str) -> dict:
  results = {}
  run_dir = os.path.join(out, "runs", "setup")  # the task tokenizer (ignored by git)
  for lr in lrs:
    base = setup(config(quick, lr), run_dir)
    probe = lambda params, examples: evaluate.evaluate(base, params, examples)["accuracy"]
    base.state = base.programs.init(coldstart.cold_start(base, probe_accuracy=probe,
                                                         log=lambda *a: None))
    r = rollout_step(base, base.state.params, base.state.key, 0)
    B, G, T = r.batch.tokens_BxGxT.shape
    mask = np.asarray(r.batch.mask_BxGxT).reshape(B * G, T) > 0
    # Routing depends on the parameters only (not on the loss): one program for all.
    sets = expert_sets(base.graphdef, base.cfg)
    before = sets(base.state.params, r.batch)
    for loss in LOSSES:
      run = base.reconfigure(dataclasses.replace(base.cfg, loss=LossConfig(name=loss)))
      # The update donates its state: each loss starts from its own copy of the same one.
      new, metrics = run.programs.update(jax.tree.map(jnp.copy, base.state), r.batch,
                                         r.rewards_BxG)
      after = sets(new.params, r.batch)
      changed = np.any(before != after, axis=-1)              # (L, R, T): top-k set changed
      per_layer = [float(changed[l][mask].mean()) for l in range(changed.shape[0])]
      results[f"{loss}_lr{lr:g}"] = {
          "changed_fraction": float(np.mean(per_layer)), "changed_per_layer": per_layer,
          "clip_frac_token": float(metrics["clip_frac_token"]),
          "reward_mean": float(r.stats["reward_mean"]), "tokens": int(mask.sum())}
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description="expert-choice changes after one MoE update")
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 1e-3])
  parser.add_argument("--out", default=None)
  _results.add_record_arg(parser)
  args = parser.parse_args(argv)
  out = _results.out_path(args, "moe_routing_quick" if args.quick else "moe_routing")
  os.makedirs(out, exist_ok=True)
  summary = run(args.quick, args.lrs[:1] if args.quick else args.lrs, out)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))
  return summary


if __name__ == "__main__":
  main()
