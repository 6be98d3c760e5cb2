"""Every compiled program of a training run, declared in one place and built once per run.

Each phase is one `jax.jit` with its input and output shardings and its donation written
here (the mesh is `cfg.mesh`: one CPU by default, any TPU slice or pod):

  init     params -> TrainState (fresh optimiser state, step 0)
  sample   the rollout: prefill + decode loop + on-device rollout statistics; the sampler's
           bf16 cast (rollout.sampler_dtype) happens inside it
  greedy   the evaluation sampler (one greedy response per prompt)
  episode  multi-turn episodes' start / resume / finish (`multiturn.programs`, built by
           `multiturn.rollout.Episodes` with this layout when the run has an environment)
  sft      one cold-start step (params and optimiser state donated)
  prepare  teacher-forced pi_old (or the sampler's) and optional pi_ref; dispatched before
           the host scores the rewards, so the device computes it meanwhile
  update   advantages from the rewards, then a `lax.scan` of one optax step per minibatch
           (the state donated)

The pure functions they compile live in `gspo_jax.train.step` and `gspo_jax.rollout.sampling`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from gspo_jax.config import TrainConfig
from gspo_jax.models.config import ModelConfig
from gspo_jax.objectives import losses, row_skip
from gspo_jax.parallel import expert_mesh, sharding
from gspo_jax.rollout import sampling
from gspo_jax.rollout.sampling import SamplerConfig
from gspo_jax.train import coldstart, optim, step
from gspo_jax.train.step import TrainState
from gspo_jax.utils import rng


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the arrays of a run live: the mesh, the state's shardings and the parameters'
  abstract shapes. Batches and rollouts are split by rows (`batch`); a program's outputs
  take their shardings from their abstract shapes (`sharding.by_rank`)."""
  mesh: Mesh
  state: TrainState       # of NamedShardings
  sft_opt_state: Any      # the cold start's optimiser state (None: no cold start)
  params: Any             # the parameters as jax.ShapeDtypeStruct, with their shardings

  def rows(self, ndim: int) -> NamedSharding:
    return sharding.batch_sharding(self.mesh, ndim)

  @property
  def batch(self) -> NamedSharding:
    """Rows split over the batch mesh axes: a sharding prefix of any `Batch` (every field
    of one is per row), whichever optional fields it carries."""
    return sharding.rows(self.mesh)

  @property
  def replicated(self) -> NamedSharding:
    return sharding.replicated(self.mesh)


def make_layout(params, tx, mesh: Mesh, sft_tx=None) -> Layout:
  """`sft_tx`: the cold start's optimiser (None: no cold start)."""
  ps = sharding.param_shardings(params, mesh)
  rep = sharding.replicated(mesh)
  state = TrainState(params=ps, opt_state=sharding.optimizer_shardings(tx, params, ps, mesh),
                     step=rep, key=rep)
  sft = None if sft_tx is None else sharding.optimizer_shardings(sft_tx, params, ps, mesh)
  return Layout(mesh, state, sft, sharding.abstract(params, ps))


def step_config(cfg: TrainConfig) -> step.StepConfig:
  """What the train step reads of `cfg`, resolved once: the loss with its hyperparameters
  bound (`LossConfig.kwargs`), the KL term when `loss.kl_coef` > 0, the row skip's
  settings when `row_skip.enabled`."""
  lc = cfg.loss
  kl = step.KLTerm(lc.kl_coef, lc.kl_estimator, lc.kl_aggregation) if lc.kl_coef else None
  return step.StepConfig(
      loss=functools.partial(losses.LOSSES[lc.name], **lc.kwargs()),
      num_minibatches=cfg.num_minibatches, temperature=cfg.rollout.temperature,
      share_prompts=cfg.share_prompts, old_logp=cfg.old_logp, routing=cfg.routing, kl=kl,
      truncation=cfg.truncation, max_new_tokens=cfg.rollout.max_new_tokens,
      overlong_cache=cfg.overlong_cache, correction=cfg.rollout_correction,
      keep_groups=cfg.rollout.prompts_per_iter if cfg.rollout.oversample else 0,
      turn_credit=cfg.multiturn.turn_credit, length_clip_metrics=cfg.length_clip_metrics,
      prepare_chunks=cfg.prepare_chunks,
      row_skip=row_skip.RowSkip(lc.name, tuple(sorted(lc.kwargs().items())),
                                cfg.row_skip.buckets) if cfg.row_skip.enabled else None)


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
                    dtype: str = "", rollout: bool = False, outs=None,
                    frozen=None) -> Callable:
  """(params, prompts_BxP, lens_B, key) -> Rollout; with `rollout`, the run's rollout
  program (params, prompts_BxP, lens_B, key, step) -> (Rollout, `sampling.rollout_stats`),
  which draws the "sample" stream of iteration `step` from the run's key itself.

  With `dtype` the sampler runs a copy of the policy with parameters and activations in
  that dtype (an inference engine in bfloat16 next to a float32 trainer); the cast is part
  of the program. Nothing is donated: the KV cache lives and dies inside the program.
  `outs`: the Rollout's shardings (default: `rollout_shardings`).

  `frozen` (a LoRA run's `lora_run.Frozen`): `params` are the adapters; the compiled
  program also takes the frozen base, which `frozen` passes at each call, and merges the
  adapters into it once per call (`lora.merge`), before the cast and the decode loop."""
  if dtype and not (dtype == model_cfg.dtype and dtype == model_cfg.param_dtype):
    sample_graphdef = _cast_graphdef(model_cfg, dtype)
    cast = lambda params: jax.tree.map(lambda x: x.astype(dtype), params)
  else:
    sample_graphdef, cast = graphdef, lambda params: params

  def run(params, prompts_BxP, lens_B, key):
    params = expert_mesh.place_experts(cast(params))
    return sampling.sample(sample_graphdef, params, prompts_BxP, lens_B, key, cfg=scfg)

  def run_rollout(params, prompts_BxP, lens_B, key, step_):
    out = run(params, prompts_BxP, lens_B, rng.device_key(key, step_, "sample"))
    return out, sampling.rollout_stats(out)

  rep = layout.replicated
  ins = (layout.state.params, layout.rows(2), layout.rows(1), rep)
  fn = run_rollout if rollout else run
  fn = experts_on_mesh(fn, layout.mesh)
  if outs is None:
    outs = rollout_shardings(graphdef, scfg, layout if frozen is None else frozen.layout)
  ins, outs = ((*ins, rep), (outs, rep)) if rollout else (ins, outs)
  if frozen is None:
    return jax.jit(fn, in_shardings=ins, out_shardings=outs)
  return frozen.bind(jax.jit(frozen.merged(fn), in_shardings=(frozen.shardings, *ins),
                             out_shardings=outs))


def experts_on_mesh(fn, mesh: Mesh):
  """A sampler's function traced on the mesh when the mesh splits experts, so that its MoE
  layers dispatch expert-parallel with whole experts per chip (tokens to the experts'
  chips, `models.moe`; `expert_mesh.expert_group`) instead of leaving XLA to move the
  experts' weights at every step; unchanged otherwise (see `Transformer.decode`)."""
  return sharding.on_mesh(fn, mesh, whole_experts=True) if expert_mesh.expert_parallel(mesh) else fn


def rollout_shardings(graphdef, scfg: SamplerConfig, layout: Layout,
                      prompts: int | None = None):
  """The shardings of a sampler's Rollout, derived from its abstract shapes
  (`sharding.by_rank`: rows split, scalars replicated). Traced for `prompts` prompts
  (default: the fewest the mesh and `scfg.compact_rows` take), so a setting the sampler
  refuses for that batch (e.g. too many halvings) fails here, before any work."""
  B = prompts or sharding.batch_ways(layout.mesh) * 2 ** scfg.compact_rows
  shapes = jax.eval_shape(
      lambda params, prompts_BxP, lens_B, key: sampling.sample(graphdef, params, prompts_BxP,
                                                               lens_B, key, cfg=scfg),
      layout.params, jax.ShapeDtypeStruct((B, scfg.max_prompt_len), jnp.int32),
      jax.ShapeDtypeStruct((B,), jnp.int32), jax.eval_shape(lambda: jax.random.key(0)))
  return sharding.by_rank(shapes, layout.mesh)


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
  step_cfg: step.StepConfig                 # what prepare and update were built with
  make_sampler: Callable[[SamplerConfig], Any]   # another sampler program (pass@k's n samples)


def make_programs(graphdef, tx, cfg: TrainConfig, layout: Layout, tok) -> Programs:
  rep, ps, rows = layout.replicated, layout.state.params, layout.rows
  ref_sh = ps if cfg.loss.kl_coef else None
  scfg = step_config(cfg)
  rollout_cfg, greedy_cfg = sampler_configs(tok, cfg)
  sampler = functools.partial(sampler_program, graphdef, layout=layout, model_cfg=cfg.model)
  rollout_sh = rollout_shardings(graphdef, rollout_cfg, layout, cfg.rollout.sampled_prompts)

  def init(params):
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                      key=jax.random.key(cfg.seed))

  sft_tx = optim.sft_optimizer(cfg.sft.steps, cfg.sft.learning_rate)
  sft_os = layout.sft_opt_state or rep
  sft_batch = (rows(2), rows(1), rows(2), rows(2))
  on_mesh = lambda fn: sharding.on_mesh(fn, layout.mesh)
  return Programs(
      init=jax.jit(init, in_shardings=(ps,), out_shardings=layout.state),
      sample=sampler(rollout_cfg, dtype=cfg.rollout.sampler_dtype, rollout=True,
                     outs=rollout_sh),
      greedy=sampler(greedy_cfg, outs=rollout_sh.replace(experts=None)),
      # Training and teacher forcing are traced on the mesh (`sharding.on_mesh`): the
      # model keeps their activations split by rows there.
      sft=jax.jit(on_mesh(functools.partial(coldstart.sft_step, graphdef=graphdef,
                                            tx=sft_tx)),
                  in_shardings=(ps, sft_os, sft_batch), out_shardings=(ps, sft_os, rep),
                  donate_argnums=(0, 1)),
      sft_init=jax.jit(sft_tx.init, in_shardings=(ps,), out_shardings=sft_os),
      prepare=jax.jit(
          on_mesh(functools.partial(step.prepare, graphdef=graphdef, cfg=scfg)),
          in_shardings=(ps, ref_sh, rollout_sh, rows(2), rows(1)),
          out_shardings=layout.batch),
      update=jax.jit(
          on_mesh(functools.partial(step.update, graphdef=graphdef, tx=tx, cfg=scfg,
                                    mesh=layout.mesh)),
          # rewards_BxG, or per-turn rewards_BxGxK with multiturn.credit="turn"
          in_shardings=(layout.state, layout.batch, layout.batch),
          out_shardings=(layout.state, rep), donate_argnums=(0,)),
      step_cfg=scfg, make_sampler=sampler)
