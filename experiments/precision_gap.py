"""Experiment 4 of the paper (first part): how far a bfloat16 sampler's likelihoods are from a
float32 trainer's at theta = theta_old, per token vs per sequence.

The same parameters sample in bfloat16 (parameters and activations cast) and are rescored
teacher-forced in float32. With no update in between every importance ratio should be 1;
the precision gap alone moves it. GRPO's per-token ratio and GSPO's length-normalised
sequence ratio s_i = exp(mean_t log r_it) see that gap differently: averaging over the
response shrinks it. We report the spread of both log-ratios and the fraction that falls
outside each method's clip range; for an MoE policy also how many of the sampler's expert
choices the float32 trainer would not make (the gap Rollout Routing Replay closes).

    python -m experiments.precision_gap [--quick] [--run RUN_DIR] [--prompts 256]

RUN_DIR: a training run directory (default: the GSPO seed-0 run of gspo_vs_grpo, if present;
otherwise a cold-started model is trained here). Writes
runs/results/precision_gap[_quick]/summary.json and log_ratio_hist.png (with --record, the
run and the output under experiments/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _plots, _results
from gspo_jax.objectives import losses
from gspo_jax.parallel import sharding
from gspo_jax.train import programs, step
from gspo_jax.train.run import load_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The GSPO seed-0 run of gspo_vs_grpo.py, from the same place this run writes to (--record
# or not).
DEFAULT_RUN = os.path.join("gspo_vs_grpo", "runs", "gspo_seed0")


def bf16_sampler(run, dtype: str = "bfloat16"):
  """The run's rollout sampler, run by a copy of the policy with parameters and activations
  in bfloat16 (the cast inside the program, as `rollout.sampler_dtype="bfloat16"` does):
  (params, prompts_BxP, lens_B, key) -> Rollout. For an MoE policy the rollout also
  carries the sampler's expert choices per MoE layer (as under R3)."""
  scfg, _ = programs.sampler_configs(run.tok, run.cfg)
  if run.cfg.model.num_experts:
    scfg = dataclasses.replace(scfg, record_experts=True)
  return run.programs.make_sampler(scfg, dtype=dtype)


def measure(run, prompts: int, dtype: str = "bfloat16") -> dict:
  """The gap between a `dtype` sampler and the float32 trainer at theta = theta_old (a
  float32 sampler is the control: its gap is float32 rounding)."""
  mesh = run.layout.mesh
  sharding.check_rows("--prompts", prompts, mesh)
  examples = run.task.sample(np.random.default_rng([run.cfg.seed, 99]), prompts, "train")
  ids, lens = (sharding.feed(x, mesh, prompts)
               for x in run.encode_prompts([e.prompt for e in examples]))
  rollout = bf16_sampler(run, dtype)(run.state.params, ids, lens, jax.random.key(0))
  rows = step.Batch(ids, lens, rollout.tokens_BxGxT, rollout.mask_BxGxT, rollout.logp_BxGxT)
  # pi_old as the float32 trainer recomputes it (teacher forcing at the run's temperature).
  # The trainer routes freely: its own expert choices, compared with the sampler's below.
  rescore = jax.jit(lambda p, r: step.policy_logprobs(p, run.graphdef, r, run.programs.step_cfg))
  B, G, L = rollout.tokens_BxGxT.shape
  flat = lambda x: np.asarray(x).reshape(B * G, L)
  trainer_logp, router = rescore(run.state.params, rows)
  f32, bf16, mask = flat(trainer_logp), flat(rollout.logp_BxGxT), flat(rollout.mask_BxGxT)
  experts = {}
  if rollout.experts is not None:
    # Fraction of (response token, MoE layer) expert sets the bf16 sampler chose that the
    # float32 trainer's router does not choose for the same tokens (what R3 replays), over
    # the tokens the sampler fed to its decoder: those followed by a counted token (the
    # last token of a response predicts nothing; its slot holds placeholder experts).
    fed = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], 1)
    experts["expert_sets_differ_sampler_vs_trainer"] = float(step.routing_changed(
        router.indices, rollout.experts, jnp.asarray(fed)))
  m = mask > 0
  token_lr = (f32 - bf16)[m]                       # log r_it, trainer over sampler
  seq_lr = np.asarray(losses.sequence_log_ratio(jnp.asarray(f32), jnp.asarray(bf16),
                                                jnp.asarray(mask)))
  seq_lr = seq_lr[mask.sum(1) > 0]
  outside = lambda lr, lo, hi: float(np.mean((np.exp(lr) < 1 - lo) | (np.exp(lr) > 1 + hi)))
  return {
      "responses": int(len(seq_lr)), "tokens": int(m.sum()),
      "mean_response_length": float(m.sum() / len(seq_lr)),
      "token_log_ratio_std": float(token_lr.std()),
      "token_log_ratio_max_abs": float(np.abs(token_lr).max()),
      "seq_log_ratio_std": float(seq_lr.std()),
      "seq_log_ratio_max_abs": float(np.abs(seq_lr).max()),
      # The paper's clip ranges.
      "tokens_outside_grpo_clip(0.2,0.27)": outside(token_lr, 0.2, 0.27),
      "sequences_outside_gspo_clip(3e-4,4e-4)": outside(seq_lr, 3e-4, 4e-4),
      "tokens_outside_gspo_clip_if_per_token(3e-4,4e-4)": outside(token_lr, 3e-4, 4e-4),
      **experts,
  }, token_lr, seq_lr


def plot(token_lr, seq_lr, out: str) -> str:
  """log_ratio_hist.png: token and sequence log-ratios, each at its own scale with its
  method's clip band marked (`_plots.log_ratio_hist`)."""
  return _plots.log_ratio_hist(token_lr, seq_lr, out)


def main(argv=None):
  parser = argparse.ArgumentParser(description="bf16 sampler vs f32 trainer log-ratio spread")
  parser.add_argument("--quick", action="store_true", help="16 prompts")
  parser.add_argument("--run", default=None, help=f"training run (default {DEFAULT_RUN} under "
                      "runs/results/, or experiments/results/ with --record)")
  parser.add_argument("--prompts", type=int, default=256)
  parser.add_argument("--out", default=None)
  _results.add_record_arg(parser)
  args = parser.parse_args(argv)
  out = _results.out_path(args, "precision_gap_quick" if args.quick else "precision_gap")
  os.makedirs(out, exist_ok=True)
  run_dir = args.run or os.path.join(_results.results_dir(args.record), DEFAULT_RUN)
  if not os.path.exists(os.path.join(run_dir, "config.json")):
    raise SystemExit(f"no training run at {run_dir}: run `python -m experiments.gspo_vs_grpo` first, or "
                     "pass --run")
  run = load_run(run_dir)
  summary, token_lr, seq_lr = measure(run, 16 if args.quick else args.prompts)
  summary["run"] = os.path.relpath(run_dir, ROOT)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  path = plot(token_lr, seq_lr, out)
  print(json.dumps(summary, indent=2))
  print("wrote", os.path.join(out, "summary.json"), path)
  return summary


if __name__ == "__main__":
  main()
