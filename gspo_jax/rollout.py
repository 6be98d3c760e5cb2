"""One rollout of a training iteration: prompts -> G responses each -> rewards; and the
kind of rollout a run makes (`Groups` here, multi-turn `Episodes` in
`gspo_jax.multiturn.rollout`), chosen once at setup (`Run.rollout`).

Shapes: the package legend (docs/shapes.md); the cold start's demonstrations
are one row per prompt (`tokens_BxT`).

A kind of rollout gives every phase what it needs of it, so no phase asks which kind it has:
  collect(run, params, key, step, ref_params, log) -> RolloutResult      the training loop
  responder(run, n) -> (params, prompts_BxP, lens_B, key, examples) -> (tokens_BxGxT,
      shown_BxGxT): greedy responses (n None, G = 1) or n sampled ones    evaluation, pass@k
  demonstrations(run, examples) -> (tokens_BxT, mask_BxT) of the solutions  the cold start

The device work is dispatched without waiting: the sampler, then `prepare` (pi_old and
pi_ref by teacher forcing) right behind it. The host waits only for the sampled tokens,
decodes and scores them (user reward functions run in Python) while `prepare` runs, and
feeds the rewards back; the update program turns them into advantages. The rewards fed back
are the task's own: `truncation="overlong"` shapes them inside the update, where the
lengths already are (`step.update`), so `reward_mean` here stays comparable across modes.
With `rollout.oversample` (dynamic sampling) B is `rollout.sampled_prompts`: every sampled
group is prepared and scored, the host statistics describe all of them, and the update
keeps `rollout.prompts_per_iter` groups (`gspo_jax/dynamic_sampling.py`).

Multi-host: each process encodes its rows of the prompt batch, decodes and scores the
responses on its own devices, and feeds its rows of the rewards back; the host metrics are
gathered over processes, the rollout statistics come from the sampler program itself.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from gspo_jax import sharding, text
from gspo_jax.programs import sampler_configs
from gspo_jax.step import Batch


@dataclasses.dataclass
class RolloutResult:
  batch: Batch                     # on device (prepare may still be running)
  rewards_BxG: jax.Array           # global, row-sharded
  stats: dict[str, Any]            # host-side: rewards, accuracy, reward parts, timings
  device_stats: dict[str, jax.Array]   # from the sampler program: lengths, truncation, entropy


def rollout_step(run, params, key, step: int, ref_params=None, log=print) -> RolloutResult:
  """Sample, score and prepare the update batch of iteration `step` (a host int).

  `run` is a `gspo_jax.run.Run`; `params` and `key` are the policy's and the run's
  (TrainState.params, TrainState.key)."""
  cfg, tok, mesh = run.cfg, run.tok, run.layout.mesh
  B = cfg.rollout.sampled_prompts  # prompts_per_iter + oversample (dynamic sampling)
  # Data position = a pure function of (seed, iteration): resume is exact.
  examples = sharding.local_part(run.task.train_batch(cfg.seed, step, B), mesh)
  prompts_l, lens_l = run.encode_prompts([e.prompt for e in examples])
  prompts, lens = sharding.feed(prompts_l, mesh, B), sharding.feed(lens_l, mesh, B)
  # The sampler reads the parameters the previous update writes, so it cannot start before
  # that update ends: waiting for them here cost the loop no measurable time
  # (docs/update_speed.md) and keeps the update's tail out of time_sample (the sampler's own
  # time, what sample_tokens_per_s divides by).
  jax.block_until_ready(params)
  t0 = time.perf_counter()
  rollout, device_stats = run.programs.sample(params, prompts, lens, key, step)
  phases = {}
  if cfg.profile_phases:  # prepare timed alone: it no longer overlaps the host's scoring
    jax.block_until_ready(rollout)
    phases["time_sample"] = time.perf_counter() - t0
  t1 = time.perf_counter()
  batch = run.programs.prepare(params, ref_params, rollout, prompts, lens)
  if cfg.profile_phases:
    jax.block_until_ready(batch)
    phases["time_prepare"] = time.perf_counter() - t1
  tokens, mask = sharding.to_host(rollout.tokens_BxGxT), sharding.to_host(rollout.mask_BxGxT)
  time_sample = phases.get("time_sample", time.perf_counter() - t0)
  t0 = time.perf_counter()
  b, G, T = tokens.shape
  texts = text.decode_completions(tok, tokens.reshape(b * G, T), mask.reshape(b * G, T))
  rewards, correct, parts = run.task.score_batch([e for e in examples for _ in range(G)], texts,
                                                 log=log)
  rewards_BxG = sharding.feed(np.asarray(rewards, np.float32).reshape(b, G), mesh, B)
  all_rewards, all_correct = sharding.gather_rows(rewards), sharding.gather_rows(correct)
  stats = {"reward_mean": all_rewards.mean(), "reward_std": all_rewards.std(),
           "accuracy": all_correct.mean(), "time_sample": time_sample,
           "time_score": time.perf_counter() - t0, **phases}
  stats.update({k: sharding.gather_rows(v).mean() for k, v in parts.items()})
  position = run.task.position(step, B)
  if position is not None:
    stats["data_epoch"], stats["data_index"] = position
  return RolloutResult(batch, rewards_BxG, stats, device_stats)


@dataclasses.dataclass(frozen=True)
class Groups:
  """Single-turn groups: the group sampler's G responses per prompt (`Programs.sample`),
  greedy evaluation with `Programs.greedy`, demonstrations as one completion each."""

  def collect(self, run, params, key, step: int, ref_params=None, log=print) -> RolloutResult:
    return rollout_step(run, params, key, step, ref_params, log=log)

  def responder(self, run, n: int | None = None) -> Callable:
    if n is None:
      sampler = run.programs.greedy
    else:  # sampled like the rollouts (temperature, top-p, top-k of cfg.rollout)
      rollout_cfg, _ = sampler_configs(run.tok, run.cfg)
      sampler = run.programs.make_sampler(dataclasses.replace(rollout_cfg, group_size=n))

    def respond(params, prompts_BxP, lens_B, key, examples):
      del examples
      out = sampler(params, prompts_BxP, lens_B, key)
      return out.tokens_BxGxT, out.mask_BxGxT
    return respond

  def demonstrations(self, run, examples):
    return text.encode_completions(run.tok, [run.task.demonstration(e) for e in examples],
                                   run.cfg.rollout.max_new_tokens)
