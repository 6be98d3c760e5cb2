"""A multi-turn run's compiled programs: the episode samplers' configs (`episode_configs`)
and their start / resume / finish programs (`episode_programs`), built once per run by
`multiturn.rollout.Episodes` with the layout of the run's other programs
(`gspo_jax.train.programs`)."""

from __future__ import annotations

import functools

import jax

from gspo_jax.config import TrainConfig
from gspo_jax.multiturn import sampler as mt
from gspo_jax.multiturn.sampler import EpisodeConfig
from gspo_jax.train.programs import Layout, experts_on_mesh, sampler_configs


def episode_configs(tok, cfg: TrainConfig):
  """(the rollout's, the greedy evaluation's) EpisodeConfig: the samplers of
  `sampler_configs` with the episode budget rollout.max_new_tokens and the stop strings'
  token ids (ValueError naming multiturn.stop_strings unless each is one token)."""
  mt, stop_ids = cfg.multiturn, []
  for s in mt.stop_strings:
    ids = tok.encode(s)
    if len(ids) != 1:
      raise ValueError(f"multiturn.stop_strings: {s!r} is {len(ids)} tokens of the run's "
                       f"tokenizer (task.name={cfg.task.name!r}) ({ids}); a stop string must "
                       "be exactly one token")
    stop_ids.append(ids[0])
  knobs = dict(stop_ids=tuple(stop_ids), max_obs_tokens=mt.max_obs_tokens,
               max_turns=mt.max_turns)
  return tuple(EpisodeConfig(sampler=s, **knobs) for s in sampler_configs(tok, cfg))


def episode_programs(graphdef, ecfg, *, layout: Layout):
  """The multi-turn sampler's programs for `ecfg` (a multiturn.sampler.EpisodeConfig):
  start, resume and finish, with the parameters in their shardings and the prompts split
  by rows; the episode state's shardings follow from them."""
  ps, rows, rep = layout.state.params, layout.rows, layout.replicated
  on_mesh = lambda fn: experts_on_mesh(fn, layout.mesh)
  start = jax.jit(on_mesh(functools.partial(mt.start, graphdef, cfg=ecfg)),
                  in_shardings=(ps, rows(2), rows(1), rep))
  resume = jax.jit(on_mesh(lambda params, state, lens, obs, obs_len, go, key: mt.resume(
      graphdef, params, state, lens, obs, obs_len, go, key, cfg=ecfg)), donate_argnums=(1,))
  return mt.EpisodePrograms(ecfg, start, resume, jax.jit(functools.partial(mt.finish, cfg=ecfg)))
