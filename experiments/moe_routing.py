"""Experiment 3 of the paper (first part): how many expert choices of an MoE policy change
after one policy update, for the same rollout data.

The paper reports ~10% of activated experts changing after each update of a 48-layer MoE,
which is what makes GRPO's per-token ratios volatile. Here: a tiny MoE (8 experts, top-2,
every layer) is cold-started on 2-digit addition, one rollout batch is sampled, then one
GSPO and one GRPO update (4 minibatches, paper clip ranges) are taken from the same state;
we compare each (response token, MoE layer)'s top-k expert set before and after.

    python experiments/moe_routing.py [--quick]

Writes experiments/results/moe_routing[_quick]/summary.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gspo_jax import coldstart, configlib, sharding  # noqa: E402
from gspo_jax import train as T  # noqa: E402
from gspo_jax.models.config import tiny_moe  # noqa: E402

CLIP = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


def config(quick: bool, lr: float) -> T.TrainConfig:
  cfg = configlib.load_config(os.path.join(ROOT, "configs", "addition_tiny.py"))
  return dataclasses.replace(
      cfg, model=tiny_moe(vocab_size=32, hidden=128, num_experts=8, experts_per_token=2,
                          moe_mlp_dim=64, num_heads=4, num_kv_heads=2, head_dim=32),
      sft=dataclasses.replace(cfg.sft, steps=20 if quick else 300, target_accuracy=0.0),
      rollout=dataclasses.replace(cfg.rollout, prompts_per_iter=16 if quick else 64),
      optim=dataclasses.replace(cfg.optim, learning_rate=lr, warmup_steps=0),
      mesh=sharding.MeshConfig(num_devices=1))


def expert_sets(params, graphdef, batch: T.Batch) -> np.ndarray:
  """Sorted top-k experts of every (row, response position, MoE layer): (L, R, T, K)."""
  model = nnx.merge(graphdef, params)
  P = batch.prompts_RxP.shape[1]
  T_ = batch.tokens_RxT.shape[1]
  seq = jnp.concatenate([batch.prompts_RxP, batch.tokens_RxT], axis=1)
  lens = batch.prompt_lens_R
  pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(P), (len(lens), P)),
                         lens[:, None] + jnp.arange(T_)[None, :]], axis=1)
  valid = jnp.concatenate([jnp.arange(P)[None, :] < lens[:, None],
                           jnp.ones_like(batch.tokens_RxT, bool)], axis=1)
  indices = jax.jit(lambda s, p, v: model(s, p, v).router.indices)(seq, pos, valid)
  return np.sort(np.stack([np.asarray(i)[:, P:] for i in indices]), axis=-1)


def run(quick: bool, lrs, out: str) -> dict:
  results = {}
  run_dir = os.path.join(out, "runs", "setup")  # the task tokenizer (ignored by git)
  for lr in lrs:
    base = T.setup(config(quick, lr), run_dir)
    params = coldstart.cold_start(base.state.params, base.graphdef, base.task, base.tok,
                                  base.cfg, mesh=base.layout.mesh, log=lambda *a: None)
    base.state = base.programs.init(params)
    batch, stats = T.rollout_step(base, base.state)
    mask = np.asarray(batch.mask_RxT) > 0
    before = expert_sets(base.state.params, base.graphdef, batch)
    for loss, (lo, hi) in CLIP.items():
      run = base.reconfigure(dataclasses.replace(base.cfg, loss=loss, eps_low=lo, eps_high=hi))
      new, metrics = run.programs.update(jax.tree.map(jnp.copy, base.state), batch)
      after = expert_sets(new.params, run.graphdef, batch)
      changed = np.any(before != after, axis=-1)              # (L, R, T): top-k set changed
      per_layer = [float(changed[l][mask].mean()) for l in range(changed.shape[0])]
      results[f"{loss}_lr{lr:g}"] = {
          "changed_fraction": float(np.mean(per_layer)), "changed_per_layer": per_layer,
          "clip_frac_token": float(metrics["clip_frac_token"]),
          "reward_mean": float(stats["reward_mean"]), "tokens": int(mask.sum())}
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description="expert-choice changes after one MoE update")
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 1e-3])
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  out = args.out or os.path.join(ROOT, "experiments", "results",
                                 "moe_routing_quick" if args.quick else "moe_routing")
  os.makedirs(out, exist_ok=True)
  summary = run(args.quick, args.lrs[:1] if args.quick else args.lrs, out)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary, indent=2))
  return summary


if __name__ == "__main__":
  main()
