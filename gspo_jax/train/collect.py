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
keeps `rollout.prompts_per_iter` groups (`gspo_jax/rollout/dynamic_sampling.py`).

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

from gspo_jax.parallel import sharding
from gspo_jax.tasks import text
from gspo_jax.train.programs import sampler_configs
from gspo_jax.train.step import Batch


@dataclasses.dataclass
class RolloutResult:
  batch: Batch                     # on device (prepare may still be running)
  rewards_BxG: jax.Array           # global, row-sharded
  stats: dict[str, Any]            # host-side: rewards, accuracy, reward parts, timings
  device_stats: dict[str, jax.Array]   # from the sampler program: lengths, truncation, entropy


@dataclasses.dataclass
class Launched:
  """A rollout whose device work is dispatched (`launch`) and whose scoring is not done
  yet (`finish`). `batch` is None when `prepare` was left to the caller (`launch(...,
  prepare=False)`: an asynchronous run's pi_old at the trainer's version)."""
  step: int                        # the iteration whose data this is
  examples: list                   # this process's rows of the prompts
  prompts_BxP: jax.Array
  lens_B: jax.Array
  rollout: Any                     # `sampling.Rollout`
  device_stats: dict[str, jax.Array]
  batch: Batch | None
  mesh: Any                        # where the rollout lives
  t0: float                        # the sampler's dispatch (perf_counter)
  phases: dict[str, float]


def launch(run, params, key, step: int, ref_params=None, *, programs=None, mesh=None,
           prepare: bool = True, wait: bool = True) -> Launched:
  """Dispatch the sampler for iteration `step` (a host int) and, with `prepare`, pi_old /
  pi_ref right behind it; nothing waits for the device unless `cfg.profile_phases`.

  `run` is a `gspo_jax.train.run.Run`; `params` and `key` are the policy's and the run's
  (TrainState.params, TrainState.key). `programs` / `mesh`: another placement's (the
  asynchronous sampler's own devices, `gspo_jax.train.pipeline`), default the run's. `wait`:
  wait for `params` first (see below); an asynchronous run does not, its sampler time
  comes from its timeline."""
  cfg, programs, mesh = run.cfg, programs or run.programs, mesh or run.layout.mesh
  B = cfg.rollout.sampled_prompts  # prompts_per_iter + oversample (dynamic sampling)
  # Data position = a pure function of (seed, iteration): resume is exact.
  examples = sharding.local_part(run.task.train_batch(cfg.seed, step, B), mesh)
  prompts_l, lens_l = run.encode_prompts([e.prompt for e in examples])
  prompts, lens = sharding.feed(prompts_l, mesh, B), sharding.feed(lens_l, mesh, B)
  # The sampler reads the parameters the previous update writes, so it cannot start before
  # that update ends: waiting for them here cost the loop no measurable time
  # (docs/update_speed.md) and keeps the update's tail out of time_sample (the sampler's own
  # time, what sample_tokens_per_s divides by).
  if wait:
    jax.block_until_ready(params)
  t0 = time.perf_counter()
  rollout, device_stats = programs.sample(params, prompts, lens, key, step)
  phases = {}
  if cfg.profile_phases:  # prepare timed alone: it no longer overlaps the host's scoring
    jax.block_until_ready(rollout)
    phases["time_sample"] = time.perf_counter() - t0
  batch = None
  if prepare:
    t1 = time.perf_counter()
    batch = programs.prepare(params, ref_params, rollout, prompts, lens)
    if cfg.profile_phases:
      jax.block_until_ready(batch)
      phases["time_prepare"] = time.perf_counter() - t1
  return Launched(step, examples, prompts, lens, rollout, device_stats, batch, mesh, t0, phases)


def finish(run, launched: Launched, log=print, *, rows_mesh=None) -> RolloutResult:
  """Wait for a launched rollout's tokens, decode and score them on the host (while
  `prepare` runs), and feed the rewards back, onto `rows_mesh` (default: where the rollout
  is). The result's `batch` is `launched.batch` (None if not prepared)."""
  cfg, tok, L = run.cfg, run.tok, launched
  B = cfg.rollout.sampled_prompts
  tokens, mask = sharding.to_host(L.rollout.tokens_BxGxT), sharding.to_host(L.rollout.mask_BxGxT)
  time_sample = L.phases.get("time_sample", time.perf_counter() - L.t0)
  t0 = time.perf_counter()
  b, G, T = tokens.shape
  texts = text.decode_completions(tok, tokens.reshape(b * G, T), mask.reshape(b * G, T))
  rewards, correct, parts = run.task.score_batch([e for e in L.examples for _ in range(G)],
                                                 texts, log=log)
  rewards_BxG = sharding.feed(np.asarray(rewards, np.float32).reshape(b, G),
                              rows_mesh or L.mesh, B)
  all_rewards, all_correct = sharding.gather_rows(rewards), sharding.gather_rows(correct)
  stats = {"reward_mean": all_rewards.mean(), "reward_std": all_rewards.std(),
           "accuracy": all_correct.mean(), "time_sample": time_sample,
           "time_score": time.perf_counter() - t0, **L.phases}
  stats.update({k: sharding.gather_rows(v).mean() for k, v in parts.items()})
  position = run.task.position(L.step, B)
  if position is not None:
    stats["data_epoch"], stats["data_index"] = position
  return RolloutResult(L.batch, rewards_BxG, stats, L.device_stats)


def rollout_step(run, params, key, step: int, ref_params=None, log=print) -> RolloutResult:
  """Sample, score and prepare the update batch of iteration `step` (a host int): `launch`
  then `finish`, on the run's own devices."""
  return finish(run, launch(run, params, key, step, ref_params), log=log)


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
