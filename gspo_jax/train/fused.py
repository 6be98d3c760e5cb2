"""A fused GSPO iteration: sample -> reward on token ids -> advantages -> minibatch updates
as one XLA program, with no host round trip (the purejaxrl pattern).

Shapes: the package legend (docs/shapes.md).

This needs a reward written in JAX. For the arithmetic tasks (with `format_reward = 0`) the
reward is exact match, and exact match can be checked on token ids: a response scores 1.0
iff its tokens are the canonical encoding of the answer followed by EOS. That is stricter
than the text reward in one corner: a different tokenization of the same text (never the
tokenizer's own output) scores 0 here; `experiments/benchmark.py iteration` reports how
often the two agree. Python rewards keep the phased loop of `gspo_jax.train.loop`.

It lives beside `gspo_jax.train.programs` rather than in it: it is an opt-in program with a
reward of its own (token ids, not text), used by the benchmarks, not by `train`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gspo_jax.rollout import sampling
from gspo_jax.rollout.sampling import SamplerConfig
from gspo_jax.train import programs, step
from gspo_jax.train.step import TrainState
from gspo_jax.utils import rng

Array = jax.Array


def exact_match_reward(tokens_BxGxT: Array, answer_BxA: Array, answer_lens_B: Array,
                       eos_id: int) -> Array:
  """rewards_BxG: 1.0 where response = answer_B[:answer_len] followed by `eos_id`, else 0.0.

  `answer_BxA` holds each prompt's canonical answer ids, right-padded (any pad value)."""
  B, G, T = tokens_BxGxT.shape
  A = answer_BxA.shape[1]
  pad = max(T - A, 0)
  want_BxT = jnp.pad(answer_BxA, ((0, 0), (0, pad)))[:, :T]
  t_T = jnp.arange(T)
  want_BxT = jnp.where(t_T[None] < answer_lens_B[:, None], want_BxT, eos_id)
  # Only the first answer_len + 1 positions matter; the rest is padding after EOS.
  checked_BxT = t_T[None] <= answer_lens_B[:, None]
  fits_B = answer_lens_B < T  # the EOS must fit
  ok = jnp.all((tokens_BxGxT == want_BxT[:, None]) | ~checked_BxT[:, None], axis=-1)
  return (ok & fits_B[:, None]).astype(jnp.float32)


def _iteration(state: TrainState, prompts_BxP, lens_B, answer_BxA, answer_lens_B, *,
               graphdef, tx, cfg: step.StepConfig, scfg: SamplerConfig):
  """The body of `make_fused_iteration` (pure: state in, state and metrics out). The same
  functions as the phased loop: the run's "sample" stream, `step.prepare`, `step.update`."""
  key = rng.device_key(state.key, state.step, "sample")
  rollout = sampling.sample(graphdef, state.params, prompts_BxP, lens_B, key, cfg=scfg)
  rewards_BxG = exact_match_reward(rollout.tokens_BxGxT, answer_BxA, answer_lens_B, scfg.eos_id)
  batch = step.prepare(state.params, None, rollout, prompts_BxP, lens_B, graphdef=graphdef,
                       cfg=cfg)
  state, metrics = step.update(state, batch, rewards_BxG, graphdef=graphdef, tx=tx, cfg=cfg)
  return state, {**metrics, "reward_mean": jnp.mean(rewards_BxG),
                 **sampling.rollout_stats(rollout)}


def make_fused_iteration(run):
  """One jitted (state, prompts_BxP, lens_B, answer_BxA, answer_lens_B) -> (state, metrics)
  for a `gspo_jax.train.run.Run`; the state is donated. Single-process, no KL reference,
  exact-match tasks only (answers encoded with `text.encode_answers`)."""
  if run.cfg.loss.kl_coef:
    raise ValueError("fused iteration: loss.kl_coef must be 0 (no reference policy)")
  if run.cfg.lora.rank:
    raise ValueError("fused iteration: lora.rank must be 0 (its programs take full parameters)")
  if getattr(run.task, "format_reward", 0.0):
    raise ValueError("fused iteration: the task's format_reward must be 0 (exact match only)")
  fn = functools.partial(_iteration, graphdef=run.graphdef, tx=run.tx,
                         cfg=run.programs.step_cfg,
                         scfg=programs.sampler_configs(run.tok, run.cfg)[0])
  return jax.jit(fn, donate_argnums=(0,))
