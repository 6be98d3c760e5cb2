"""Every compiled program of a training run, declared in one place and built once per run.

Each phase is one `jax.jit` with its input and output shardings and its donation written
here (the mesh is `cfg.mesh`: one CPU by default, any TPU slice or pod):

  init     params -> TrainState (fresh optimiser state, step 0)
  sample   the rollout: prefill + decode loop + on-device rollout statistics; the sampler's
           bf16 cast (rollout.sampler_dtype) happens inside it
  greedy   the evaluation sampler (one greedy response per prompt)
  sft      one cold-start step (params and optimiser state donated)
  prepare  teacher-forced pi_old (or the sampler's) and optional pi_ref; dispatched before
           the host scores the rewards, so the device computes it meanwhile
  update   advantages from the rewards, then a `lax.scan` of one optax step per minibatch
           (the state donated)

The pure functions they compile live in `gspo_jax.step` and `gspo_jax.sampling`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from gspo_jax import rng, sampling, sharding, step
from gspo_jax.config import TrainConfig
from gspo_jax.models.config import ModelConfig
from gspo_jax.sampling import Rollout, SamplerConfig
from gspo_jax.step import Batch, TrainState


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where every array of a run lives: the mesh and the shardings of the state and batches."""
  mesh: Mesh
  state: TrainState       # of NamedShardings
  batch: Batch            # of NamedShardings (rows over the batch mesh axes)
  rollout: Rollout
  sft_opt_state: Any      # the cold start's optimiser state

  def rows(self, ndim: int) -> NamedSharding:
    return sharding.batch_sharding(self.mesh, ndim)

  @property
  def replicated(self) -> NamedSharding:
    return sharding.replicated(self.mesh)


def make_layout(params, tx, mesh: Mesh, with_ref: bool, moe_layers: int = 0,
                sft_tx=None, with_sampler_logp: bool = False,
                rollout_experts: bool = False, with_turns: bool = False) -> Layout:
  """`moe_layers`: how many expert-choice arrays the batch carries (0 unless routing is
  tracked or replayed); `sft_tx`: the cold start's optimiser (None: no cold start);
  `with_sampler_logp`: the batch keeps the sampler's log-probs (rollout correction);
  `rollout_experts`: the rollout carries the sampler's `moe_layers` expert choices (R3);
  `with_turns`: the batch carries the turn of each token (multi-turn, turn credit)."""
  ps = sharding.param_shardings(params, mesh)
  rep, rows = sharding.replicated(mesh), functools.partial(sharding.batch_sharding, mesh)
  state = TrainState(params=ps, opt_state=sharding.optimizer_shardings(tx, params, ps, mesh),
                     step=rep, key=rep)
  batch = Batch(rows(2), rows(1), rows(3), rows(3), rows(3), rows(3) if with_ref else None,
                tuple(rows(3) for _ in range(moe_layers)) if moe_layers else None,
                rows(3) if with_sampler_logp else None, rows(3) if with_turns else None)
  rollout = Rollout(rows(3), rows(3), rows(3), rows(3), rows(2), rows(2), rows(2), rep,
                    tuple(rows(3) for _ in range(moe_layers)) if rollout_experts else None)
  sft = None if sft_tx is None else sharding.optimizer_shardings(sft_tx, params, ps, mesh)
  return Layout(mesh, state, batch, rollout, sft)


def batch_moe_layers(cfg: TrainConfig) -> int:
  return 0 if cfg.routing == "free" else cfg.model.num_moe_layers


def check_layout(cfg: TrainConfig, mesh: Mesh) -> None:
  """Every batch dimension must divide over the batch mesh axes (a clear error otherwise)."""
  r = cfg.rollout
  sharding.check_rows("rollout.prompts_per_iter", r.prompts_per_iter, mesh)
  if r.oversample:
    sharding.check_rows("rollout.prompts_per_iter + rollout.oversample (prompts sampled)",
                        r.sampled_prompts, mesh)
  sharding.check_rows("rows per minibatch (rollout.prompts_per_iter * rollout.group_size / "
                      "num_minibatches)", r.prompts_per_iter * r.group_size // cfg.num_minibatches,
                      mesh)
  if cfg.sft.steps > 0:
    sharding.check_rows("sft.batch_size", cfg.sft.batch_size, mesh)


def sampler_configs(tok, cfg: TrainConfig) -> tuple[SamplerConfig, SamplerConfig]:
  """(the rollout's sampler, the greedy evaluation sampler) for this tokenizer and config."""
  r = cfg.rollout
  rollout = SamplerConfig(group_size=r.group_size, max_new_tokens=r.max_new_tokens,
                          eos_id=tok.eos_id, pad_id=tok.pad_id, max_prompt_len=r.max_prompt_len,
                          temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          vocab_limit=tok.vocab_size, cache_dtype=r.kv_cache_dtype,
                          compact_rows=r.compact_rows)
  greedy = dataclasses.replace(rollout, group_size=1, greedy=True, temperature=1.0, top_p=1.0,
                               top_k=0, compact_rows=0)
  if cfg.routing == "rollout_replay":  # R3: the rollout records its experts (not the greedy)
    rollout = dataclasses.replace(rollout, record_experts=True)
  return rollout, greedy


def _cast_graphdef(model_cfg: ModelConfig, dtype: str):
  from gspo_jax.models.transformer import Transformer
  cfg = dataclasses.replace(model_cfg, dtype=dtype, param_dtype=dtype)
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]


def sampler_program(graphdef, scfg: SamplerConfig, layout: Layout, *, model_cfg: ModelConfig,
                    dtype: str = "", rollout: bool = False) -> Callable:
  """(params, prompts_BxP, lens_B, key) -> Rollout; with `rollout`, the run's rollout
  program (params, prompts_BxP, lens_B, key, step) -> (Rollout, `sampling.rollout_stats`),
  which draws the "sample" stream of iteration `step` from the run's key itself.

  With `dtype` the sampler runs a copy of the policy with parameters and activations in
  that dtype (an inference engine in bfloat16 next to a float32 trainer); the cast is part
  of the program. Nothing is donated: the KV cache lives and dies inside the program."""
  if dtype and not (dtype == model_cfg.dtype and dtype == model_cfg.param_dtype):
    sample_graphdef = _cast_graphdef(model_cfg, dtype)
    cast = lambda params: jax.tree.map(lambda x: x.astype(dtype), params)
  else:
    sample_graphdef, cast = graphdef, lambda params: params

  def run(params, prompts_BxP, lens_B, key):
    return sampling.sample(sample_graphdef, cast(params), prompts_BxP, lens_B, key, cfg=scfg)

  def run_rollout(params, prompts_BxP, lens_B, key, step_):
    out = run(params, prompts_BxP, lens_B, rng.device_key(key, step_, "sample"))
    return out, sampling.rollout_stats(out)

  rep = layout.replicated
  ins = (layout.state.params, layout.rows(2), layout.rows(1), rep)
  outs = layout.rollout if scfg.record_experts else layout.rollout.replace(experts=None)
  if rollout:
    return jax.jit(run_rollout, in_shardings=(*ins, rep), out_shardings=(outs, rep))
  return jax.jit(run, in_shardings=ins, out_shardings=outs)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The compiled phases of a run (see the module docstring)."""
  init: Any       # params -> TrainState
  sample: Any     # (params, prompts_BxP, lens_B, key, step) -> (Rollout, stats)
  greedy: Any     # (params, prompts_BxP, lens_B, key) -> Rollout (G = 1, argmax)
  sft: Any        # (params, opt_state, (prompts, lens, tokens, mask)) -> (params, opt_state, loss)
  sft_init: Any   # params -> the cold start's optimiser state
  prepare: Any    # (params, ref_params | None, rollout, prompts_BxP, lens_B) -> Batch
  update: Any     # (state, batch, rewards_BxG) -> (state, metrics); the state is donated
  sampler: Callable[[SamplerConfig], Any]   # another sampler program (e.g. pass@k's n samples)
  # Multi-turn episodes (multiturn.env set; else None): the rollout's and the greedy
  # evaluation's EpisodePrograms, and EpisodeConfig -> EpisodePrograms (pass@k's n).
  episode: Any = None
  episode_greedy: Any = None
  episodes: Callable[[Any], Any] | None = None


def make_programs(graphdef, tx, cfg: TrainConfig, layout: Layout, tok) -> Programs:
  rep, ps, rows = layout.replicated, layout.state.params, layout.rows
  ref_sh = ps if cfg.kl_coef else None
  rollout_cfg, greedy_cfg = sampler_configs(tok, cfg)
  sampler = functools.partial(sampler_program, graphdef, layout=layout, model_cfg=cfg.model)

  def init(params):
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                      key=jax.random.key(cfg.seed))

  sft_tx, sft_os = step.sft_optimizer(cfg.sft), layout.sft_opt_state or rep
  sft_batch = (rows(2), rows(1), rows(2), rows(2))
  return Programs(
      init=jax.jit(init, in_shardings=(ps,), out_shardings=layout.state),
      sample=sampler(rollout_cfg, dtype=cfg.rollout.sampler_dtype, rollout=True),
      greedy=sampler(greedy_cfg),
      sft=jax.jit(functools.partial(step.sft_step, graphdef=graphdef, tx=sft_tx),
                  in_shardings=(ps, sft_os, sft_batch), out_shardings=(ps, sft_os, rep),
                  donate_argnums=(0, 1)),
      sft_init=jax.jit(sft_tx.init, in_shardings=(ps,), out_shardings=sft_os),
      prepare=jax.jit(
          functools.partial(step.prepare, graphdef=graphdef, cfg=cfg),
          in_shardings=(ps, ref_sh, layout.rollout, rows(2), rows(1)),
          out_shardings=layout.batch),
      update=jax.jit(
          functools.partial(step.update, graphdef=graphdef, tx=tx, cfg=cfg, mesh=layout.mesh),
          # rewards_BxG, or per-turn rewards_BxGxK with multiturn.credit="turn"
          in_shardings=(layout.state, layout.batch, rows(3 if cfg.multiturn.turn_credit else 2)),
          out_shardings=(layout.state, rep), donate_argnums=(0,)),
      sampler=sampler, **_episode_fields(graphdef, cfg, layout, tok))


def episode_configs(tok, cfg: TrainConfig):
  """(the rollout's, the greedy evaluation's) EpisodeConfig: the samplers of
  `sampler_configs` with the episode budget rollout.max_new_tokens and the stop strings'
  token ids (ValueError naming multiturn.stop_strings unless each is one token)."""
  from gspo_jax.multiturn.sampler import EpisodeConfig
  mt, stop_ids = cfg.multiturn, []
  for s in mt.stop_strings:
    ids = tok.encode(s)
    if len(ids) != 1:
      raise ValueError(f"multiturn.stop_strings: {s!r} is {len(ids)} tokens of this tokenizer "
                       f"({ids}); a stop string must be exactly one token")
    stop_ids.append(ids[0])
  knobs = dict(stop_ids=tuple(stop_ids), max_obs_tokens=mt.max_obs_tokens,
               max_turns=mt.max_turns)
  return tuple(EpisodeConfig(sampler=s, **knobs) for s in sampler_configs(tok, cfg))


def _episode_fields(graphdef, cfg: TrainConfig, layout: Layout, tok) -> dict[str, Any]:
  if not cfg.multiturn.env:
    return {}
  build = functools.partial(episode_programs, graphdef, layout=layout)
  rollout, greedy = episode_configs(tok, cfg)
  return {"episode": build(rollout), "episode_greedy": build(greedy), "episodes": build}


def episode_programs(graphdef, ecfg, *, layout: Layout):
  """The multi-turn sampler's programs for `ecfg` (a multiturn.sampler.EpisodeConfig):
  start, resume and finish, with the parameters in their shardings and the prompts split
  by rows; the episode state's shardings follow from them."""
  from gspo_jax.multiturn import sampler as mt
  ps, rows, rep = layout.state.params, layout.rows, layout.replicated
  start = jax.jit(functools.partial(mt.start, graphdef, cfg=ecfg),
                  in_shardings=(ps, rows(2), rows(1), rep))
  resume = jax.jit(lambda params, state, lens, obs, obs_len, go, key: mt.resume(
      graphdef, params, state, lens, obs, obs_len, go, key, cfg=ecfg), donate_argnums=(1,))
  return mt.EpisodePrograms(ecfg, start, resume, jax.jit(functools.partial(mt.finish, cfg=ecfg)))
