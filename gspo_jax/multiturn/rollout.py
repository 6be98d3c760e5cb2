"""One rollout of a multi-turn training iteration: prompts -> G episodes each (the model's
turns and the environment's observations) -> rewards, and the update batch.

Shapes: the package legend (docs/shapes.md); G counts episodes, T is
the episode token budget, U = multiturn.max_turns.

The multi-turn kind of rollout (`Episodes`, `Run.rollout` when `multiturn.env` is set):
the operations of `gspo_jax.train.collect.Groups` for whole episodes. The episodes' model tokens
are the batch's mask, so `prepare` (pi_old, pi_ref by teacher forcing over the whole
episode) and the losses are the single-turn ones. The rewards are the environment's: per
episode (`multiturn.credit="episode"`: the sum of the turn rewards, one advantage per
episode) or per turn ("turn": rewards_BxGxU, which the update turns into per-token
advantages with the batch's `turn_BxGxT`). Single process: the host reads every row
between turns.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.multiturn import envs
from gspo_jax.multiturn import programs as P
from gspo_jax.multiturn.episodes import EpisodeResult, run_episodes
from gspo_jax.parallel import sharding
from gspo_jax.rollout import sampling
from gspo_jax.tasks import text
from gspo_jax.train.collect import RolloutResult
from gspo_jax.utils import rng


def sample_episodes(run, programs, params, prompts_BxP, lens_B, key, examples
                    ) -> EpisodeResult:
  """Episodes of `programs` (an EpisodePrograms of the run) for this batch of prompts, one
  Example per prompt (each repeated G times for its episodes)."""
  if jax.process_count() > 1:
    raise ValueError("multi-turn episodes run in a single process (the host reads every row "
                     "between turns)")
  env = envs.load_env(run.cfg.multiturn.env)
  ecfg = programs.cfg
  rows = [e for e in examples for _ in range(ecfg.sampler.group_size)]
  start, resume, finish = programs.bound(params)
  return run_episodes(start, resume, finish, prompts_BxP, lens_B, key, rows, env, run.tok, ecfg)


def episode_texts(tok, episodes) -> list[str]:
  """Each episode's whole text (model turns and observations), row-major (B*G)."""
  tokens = np.asarray(episodes.tokens_BxGxT)
  shown = np.asarray(episodes.mask_BxGxT) + np.asarray(episodes.obs_mask_BxGxT)
  T = tokens.shape[-1]
  return text.decode_completions(tok, tokens.reshape(-1, T), shown.reshape(-1, T))


def episode_rollout_step(run, params, key, step: int, ref_params=None, log=print
                         ) -> RolloutResult:
  """Sample, score and prepare the update batch of iteration `step` (see the module
  docstring); `stats` adds accuracy (the task's `is_correct` on each whole episode), the
  mean turns per episode and the outcome counts per episode (`env/<name>`)."""
  del log
  cfg, mesh = run.cfg, run.layout.mesh
  B = cfg.rollout.prompts_per_iter
  examples = run.task.train_batch(cfg.seed, step, B)
  prompts_l, lens_l = run.encode_prompts([e.prompt for e in examples])
  prompts, lens = sharding.feed(prompts_l, mesh, B), sharding.feed(lens_l, mesh, B)
  jax.block_until_ready(params)  # the previous update's tail stays out of time_sample
  t0 = time.perf_counter()
  got = sample_episodes(run, run.rollout.programs, params, prompts, lens,
                        rng.device_key(key, step, "sample"), examples)
  ep = got.episodes
  batch = run.programs.prepare(params, ref_params, ep.as_rollout(), prompts, lens)
  if cfg.multiturn.turn_credit:
    batch = batch.replace(turn_BxGxT=ep.turn_BxGxT)
    rewards = got.turn_rewards_BxGxK
  else:
    rewards = got.rewards_BxG
  time_sample = time.perf_counter() - t0
  G = cfg.rollout.group_size
  rows = [e for e in examples for _ in range(G)]
  correct = np.array([run.task.is_correct(e, t) for e, t in zip(rows, episode_texts(run.tok, ep))])
  n = B * G
  stats = {"reward_mean": got.rewards_BxG.mean(), "reward_std": got.rewards_BxG.std(),
           "accuracy": correct.mean(), "time_sample": time_sample,
           "turns_mean": float(np.asarray(ep.turns_BxG).mean()),
           **{f"env/{k}": v / n for k, v in got.counts.items()}}
  device_stats = {**sampling.rollout_stats(ep.as_rollout()),
                  "obs_tokens": jnp.sum(ep.obs_mask_BxGxT) / n}
  return RolloutResult(batch, sharding.feed(np.asarray(rewards, np.float32), mesh, B), stats,
                       device_stats)


@dataclasses.dataclass(frozen=True)
class Episodes:
  """Multi-turn episodes with the run's environment: the rollout's and the greedy
  evaluation's episode programs (`multiturn.programs.episode_programs`), built once per run."""
  programs: Any                 # the rollout's EpisodePrograms
  greedy: Any                   # the greedy evaluation's
  make: Callable[[Any], Any]    # EpisodeConfig -> EpisodePrograms (pass@k's n episodes)

  @classmethod
  def build(cls, graphdef, cfg, layout, tok) -> "Episodes":
    make = lambda ecfg: P.episode_programs(graphdef, ecfg, layout=layout)
    rollout, greedy = P.episode_configs(tok, cfg)
    return cls(make(rollout), make(greedy), make)

  def collect(self, run, params, key, step: int, ref_params=None, log=print) -> RolloutResult:
    return episode_rollout_step(run, params, key, step, ref_params, log=log)

  def responder(self, run, n: int | None = None) -> Callable:
    """Whole episodes; `shown_BxGxT` covers the model's turns and the observations (the task
    scores each episode's text)."""
    if n is None:
      programs = self.greedy
    else:
      ecfg = self.programs.cfg
      programs = self.make(dataclasses.replace(
          ecfg, sampler=dataclasses.replace(ecfg.sampler, group_size=n)))

    def respond(params, prompts_BxP, lens_B, key, examples):
      ep = sample_episodes(run, programs, params, prompts_BxP, lens_B, key, examples).episodes
      return ep.tokens_BxGxT, ep.mask_BxGxT + ep.obs_mask_BxGxT
    return respond

  def demonstrations(self, run, examples):
    """Observations in a demonstration condition the model's turns and are not learned."""
    return text.encode_segments(run.tok, [run.task.demonstration_segments(e) for e in examples],
                                run.cfg.rollout.max_new_tokens)
