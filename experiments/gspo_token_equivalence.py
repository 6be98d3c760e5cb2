"""Experiment 5 of the paper: GSPO-token equals GSPO when advantages are per sequence.

On one fixed rollout batch of the tiny transformer (responses sampled once, pi_old = the
sampling policy, so every step after the first is off-policy and clipping is active), we
take N AdamW steps three ways and compare the parameters after each step:

  A. GSPO with per-sequence advantages A_i;
  B. GSPO-token with the same A_i broadcast to every token  -> must equal A (float tolerance);
  C. GSPO-token with token-level advantages A_i + a format bonus on the first token
     (A_it = A_i + 0.5 [t = 0])                             -> differs from A, and we show how.

    python -m experiments.gspo_token_equivalence [--quick] [--steps 50]

Writes runs/results/gspo_token_equivalence[_quick]/{summary.json, param_diff.png}
(experiments/results/ with --record).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments import _plots, _results
from gspo_jax.models import config, transformer
from gspo_jax.objectives import losses
from gspo_jax.objectives.advantages import group_advantages
from gspo_jax.rollout import sampling
from gspo_jax.rollout.teacher_forcing import response_logprobs

B, G, P, T = 8, 4, 6, 8
BONUS = 0.5


def rollout(model):
  """A fixed batch: 8 prompts x 4 sampled responses, random rewards -> group advantages."""
  rng = np.random.default_rng(0)
  prompts = rng.integers(4, 60, (B, P)).astype(np.int32)
  lens = rng.integers(2, P + 1, B).astype(np.int32)
  cfg = sampling.SamplerConfig(group_size=G, max_new_tokens=T, eos_id=1, pad_id=0,
                               max_prompt_len=P)
  r = sampling.sample_groups(model, prompts, lens, jax.random.key(1), cfg)
  rewards = rng.normal(size=(B, G)).astype(np.float32)
  return (jnp.repeat(jnp.asarray(prompts), G, 0), jnp.repeat(jnp.asarray(lens), G, 0),
          r.tokens_BxGxT.reshape(B * G, T), r.mask_BxGxT.reshape(B * G, T),
          r.logp_BxGxT.reshape(B * G, T), group_advantages(rewards).reshape(-1))


def make_step(graphdef, tx, variant: str):
  def loss_fn(params, prompts, lens, tokens, mask, old, adv):
    model = nnx.merge(graphdef, params)
    logp = response_logprobs(model, prompts, lens, tokens[:, None])[0][:, 0]
    if variant == "gspo":
      return losses.gspo_loss(logp, old, adv, mask)
    adv_tok = jnp.broadcast_to(adv[:, None], mask.shape)
    if variant == "gspo_token_bonus":
      adv_tok = adv_tok + BONUS * (jnp.arange(mask.shape[1]) == 0)[None, :]
    return losses.gspo_token_loss(logp, old, adv_tok, mask)

  @jax.jit
  def step(params, opt_state, batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics, grads

  return step


def max_diff(a, b) -> float:
  return float(max(jnp.max(jnp.abs(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def cosine(a, b) -> float:
  va = jnp.concatenate([x.ravel() for x in jax.tree.leaves(a)])
  vb = jnp.concatenate([x.ravel() for x in jax.tree.leaves(b)])
  return float(va @ vb / (jnp.linalg.norm(va) * jnp.linalg.norm(vb)))


def run(steps: int) -> dict:
  model = transformer.create(config.tiny(), seed=0)
  batch = rollout(model)
  graphdef, params0 = nnx.split(model, nnx.Param)
  tx = optax.adamw(1e-3)
  states, history = {}, {"gspo_token": [], "gspo_token_bonus": []}
  cos_first = {}
  clip = {k: [] for k in ("gspo", "gspo_token", "gspo_token_bonus")}
  for variant in clip:
    states[variant] = (params0, tx.init(params0), make_step(graphdef, tx, variant))
  for i in range(steps):
    grads = {}
    for variant, (params, opt_state, step) in states.items():
      params, opt_state, metrics, g = step(params, opt_state, batch)
      states[variant] = (params, opt_state, step)
      grads[variant] = g
      clip[variant].append(float(metrics["clip_frac_token"]))
    for variant in history:
      history[variant].append(max_diff(states[variant][0], states["gspo"][0]))
    if i == 0:
      cos_first = {v: cosine(grads[v], grads["gspo"]) for v in history}
  drift = max_diff(states["gspo"][0], params0)
  return {"steps": steps, "batch": {"B": B, "G": G, "P": P, "T": T}, "bonus": BONUS,
          "max_param_diff_vs_gspo": history, "param_change_of_gspo": drift,
          "grad_cosine_vs_gspo_step1": cos_first, "clip_frac_token": clip}


def plot(summary: dict, out: str) -> str:
  fig, ax = _plots.figure()
  steps = np.arange(1, summary["steps"] + 1)
  labels = {"gspo_token": "GSPO-token, per-sequence A_i",
            "gspo_token_bonus": f"GSPO-token, A_i + {BONUS} on token 0"}
  for k, label in labels.items():
    ax.plot(steps, np.maximum(summary["max_param_diff_vs_gspo"][k], 1e-12), marker=".", label=label)
  ax.set_yscale("log")
  ax.set_xlabel("AdamW step on the same batch")
  ax.set_ylabel("max |params - GSPO params| (floored at 1e-12)")
  return _plots.save(fig, ax, out, "param_diff.png")


def main(argv=None):
  parser = argparse.ArgumentParser(description="GSPO-token vs GSPO (paper section 4.3)")
  parser.add_argument("--quick", action="store_true", help="3 steps")
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--out", default=None)
  _results.add_record_arg(parser)
  args = parser.parse_args(argv)
  out = _results.out_path(args, "gspo_token_equivalence_quick" if args.quick
                          else "gspo_token_equivalence")
  os.makedirs(out, exist_ok=True)
  summary = run(3 if args.quick else args.steps)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  path = plot(summary, out)
  print(json.dumps({k: v for k, v in summary.items() if k != "clip_frac_token"}, indent=2))
  print("wrote", os.path.join(out, "summary.json"), path)
  return summary


if __name__ == "__main__":
  main()
