"""A fused GSPO iteration: sample -> reward on token ids -> advantages -> minibatch updates
as one XLA program, with no host round trip (the purejaxrl pattern).

Legend: B prompts, G responses per prompt, P prompt tokens, T response tokens, A answer tokens.

This needs a reward written in JAX. For the arithmetic tasks (with `format_reward = 0`) the
reward is exact match, and exact match can be checked on token ids: a response scores 1.0
iff its tokens are the canonical encoding of the answer followed by EOS. That is stricter
than the text reward in one corner: a different tokenization of the same text (never the
tokenizer's own output) scores 0 here; `experiments/benchmark.py iteration` reports how
often the two agree. Python rewards keep the phased loop of `gspo_jax.train`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import sampling, train

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


def encode_answers(tok, examples, max_len: int):
  """Canonical answer ids (right-padded with pad_id) and their lengths: (ids_BxA, lens_B)."""
  ids = np.full((len(examples), max_len), tok.pad_id, np.int32)
  lens = np.zeros(len(examples), np.int32)
  for i, ex in enumerate(examples):
    row = tok.encode(ex.answer)[:max_len]
    ids[i, :len(row)], lens[i] = row, len(row)
  return ids, lens


def _iteration(state: train.TrainState, prompts_BxP, lens_B, answer_BxA, answer_lens_B, *,
               graphdef, tx, cfg: train.TrainConfig, scfg: sampling.SamplerConfig):
  """The body of `make_fused_iteration` (pure: state in, state and metrics out)."""
  model = nnx.merge(graphdef, state.params)
  key = jax.random.fold_in(state.key, 2 * state.step)  # the phased loop's sampling key
  rollout = sampling.sample_groups(model, prompts_BxP, lens_B, key, scfg)
  rewards_BxG = exact_match_reward(rollout.tokens_BxGxT, answer_BxA, answer_lens_B, scfg.eos_id)
  batch = train.with_advantages(train.prepare(state.params, None, prompts_BxP, lens_B, rollout,
                                              graphdef=graphdef, cfg=cfg), rewards_BxG)
  state, metrics = train.update(state, batch, graphdef=graphdef, tx=tx, cfg=cfg)
  return state, {**metrics, "reward_mean": jnp.mean(rewards_BxG),
                 "response_length": jnp.mean(rollout.lengths_BxG.astype(jnp.float32))}


def make_fused_iteration(run: train.Run):
  """One jitted (state, prompts_BxP, lens_B, answer_BxA, answer_lens_B) -> (state, metrics);
  the state is donated. Single-process, no KL reference, exact-match tasks only."""
  if run.cfg.kl_coef:
    raise ValueError("fused iteration: TrainConfig.kl_coef must be 0 (no reference policy)")
  if getattr(run.task, "format_reward", 0.0):
    raise ValueError("fused iteration: the task's format_reward must be 0 (exact match only)")
  fn = functools.partial(_iteration, graphdef=run.graphdef, tx=run.tx, cfg=run.cfg,
                         scfg=train.sampler_config(run.tok, run.cfg))
  return jax.jit(fn, donate_argnums=(0,))
