"""A LoRA run (`lora.rank` > 0): the frozen base, the adapters' layout and programs, and the
base kept beside the checkpoints. `run.setup` builds either kind of run; this module says
what a LoRA run does differently:

  TrainState.params  the adapters only (`lora.adapter_shapes`): the optimiser state, the
                     update's donation and every checkpoint hold adapters and nothing else
  the programs       sample, greedy, prepare and update take the frozen base as a first
                     argument, which `Frozen` passes at each call (`Bound`), so they are
                     called as a full run's are; the base is never donated
  pi_ref (KL term)   the cold-start policy, as in a full run: the base with the adapters
                     off, teacher-forced inside `prepare` (no copy of the model, nothing
                     saved); with an adapter cold start, the base with the cold start's
                     adapters (saved once in <run>/reference: adapter bytes only)
  the cold start     `lora.cold_start = "full"`: trains the whole model (`Frozen.programs`,
                     the full run's programs); its policy becomes the frozen base and the
                     adapters start at B = 0, so RL starts from the cold-start policy, as a
                     full run does. "adapters": trains the adapters on the frozen initial
                     base (the only cold start an int8 base allows without a float copy),
                     and RL goes on from them
  <run>/base.json    where the base comes from (the pointer the checkpoints need): the
                     cold start, saved once in <run>/base/; or, with no cold start, the
                     initial model (`pretrained`, or `model` and `seed`), rebuilt by setup
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from gspo_jax.lora import adapters as lora
from gspo_jax.lora import quant
from gspo_jax.parallel import sharding
from gspo_jax.train import checkpoint, coldstart, optim, programs, step
from gspo_jax.train.programs import Layout, Programs
from gspo_jax.train.step import TrainState
from gspo_jax.utils import rng

POINTER = "base.json"
BASE_DIR = "base"


@dataclasses.dataclass
class Frozen:
  """A LoRA run's frozen base: its parameters (as stored: with `lora.base_dtype = "int8"`
  the dense weights quantised, `quant`; set through `store`), the full model's layout
  (the float base's shardings and abstract shapes), the adapters' scale alpha / r, and the
  full model's programs (the cold start's, which train every parameter)."""
  params: Any
  layout: Layout
  scale: float
  programs: Programs
  base_dtype: str = ""
  abstract: Any = dataclasses.field(init=False)    # the stored base, abstract and sharded
  shardings: Any = dataclasses.field(init=False)

  def __post_init__(self):
    full = self.layout.params
    if not self.base_dtype:
      self.abstract, self.shardings = full, self.layout.state.params
      return
    self._inputs = lora.dense_weights(full)
    abstract = quant.abstract(full, self._inputs)
    self.shardings = sharding.param_shardings(abstract, self.layout.mesh)
    self.abstract = sharding.abstract(abstract, self.shardings)

  def store(self, params):
    """`params` (the full model's, in its layout) as this base stores them."""
    if not self.base_dtype:
      return params
    quantize = jax.jit(lambda p: quant.quantize(p, self._inputs),
                       out_shardings=self.shardings)
    return quantize(params)

  def weights(self):
    """The base as the full model takes it (an int8 base dequantised), in its layout."""
    if not self.base_dtype:
      return self.params
    return jax.jit(quant.dequantize, out_shardings=self.layout.state.params)(self.params)

  def merged(self, fn):
    """fn(params, *rest) as f(base, adapters, *rest), the adapters merged into the base."""
    return lambda base, adapters, *rest: fn(lora.merge(base, adapters, self.scale), *rest)

  def bind(self, jitted) -> "Bound":
    return Bound(jitted, self)


class Bound:
  """A compiled program whose first argument is the frozen base: called with the rest of
  its arguments, it passes `frozen.params` as they are at the call."""

  def __init__(self, jitted, frozen: Frozen):
    self.jitted, self.frozen = jitted, frozen

  def __call__(self, *args):
    return self.jitted(self.frozen.params, *args)

  def lower(self, *args):
    return self.jitted.lower(self.frozen.abstract, *args)


def adapter_layout(base_params, tx, mesh, cfg) -> tuple[Layout, Any]:
  """(the adapters' layout, the adapters at init): each adapter sharded by its logical axes,
  which are its base weight's (`lora.adapter_shapes`), and initialised directly in that
  sharding from the run's seed (A random, B = 0)."""
  abstract = lora.adapter_shapes(base_params, cfg.lora)
  layout = adapters_layout(abstract, tx, mesh, cfg)
  init = jax.jit(lambda key: lora.init_adapters(abstract, key),
                 out_shardings=layout.state.params)
  return layout, init(rng.init_key(cfg.seed, "lora_adapters"))


def adapters_cold_start(cfg) -> bool:
  """Whether the cold start trains the adapters (`lora.cold_start`), and there is one."""
  return cfg.lora.rank > 0 and cfg.lora.cold_start == "adapters" and cfg.sft.steps > 0


def adapters_layout(abstract, tx, mesh, cfg) -> Layout:
  """The adapters' layout (with the cold start's optimiser state when it trains them)."""
  sft_tx = (optim.sft_optimizer(cfg.sft.steps, cfg.sft.learning_rate)
            if adapters_cold_start(cfg) else None)
  return programs.make_layout(abstract, tx, mesh, sft_tx)


def make_programs(graphdef, tx, cfg, layout: Layout, tok, frozen: Frozen) -> Programs:
  """A LoRA run's programs (`programs.Programs`): `params` are the adapters; the cold
  start's `sft` / `sft_init` are the full model's, or with `lora.cold_start = "adapters"`
  the adapters' on the frozen base (the base's argument first, the adapters and their
  optimiser state donated)."""
  rep, ps, rows, fs = layout.replicated, layout.state.params, layout.rows, frozen.shardings
  scfg = programs.step_config(cfg)
  rollout_cfg, greedy_cfg = programs.sampler_configs(tok, cfg)
  sampler = functools.partial(programs.sampler_program, graphdef, layout=layout,
                              model_cfg=cfg.model, frozen=frozen)
  rollout_sh = programs.rollout_shardings(graphdef, rollout_cfg, frozen.layout,
                                          cfg.rollout.sampled_prompts)
  adapted = lambda base: lora.Adapted(graphdef, base, frozen.scale)

  def init(adapters):
    return TrainState(params=adapters, opt_state=tx.init(adapters),
                      step=jnp.zeros((), jnp.int32), key=jax.random.key(cfg.seed))

  def prepare(base, adapters, ref_adapters, rollout, prompts_BxP, lens_B):
    """pi_ref: the base with `ref_adapters` (an adapter cold start's), or with none."""
    if ref_adapters is not None:
      return step.prepare(adapters, ref_adapters, rollout, prompts_BxP, lens_B,
                          graphdef=adapted(base), cfg=scfg)
    batch = step.prepare(adapters, None, rollout, prompts_BxP, lens_B, graphdef=adapted(base),
                         cfg=scfg)
    if scfg.kl is None:
      return batch
    # The adapters off: the frozen weights through the plain structure (exactly the base).
    ref = step.policy_logprobs(quant.dequantize(base), graphdef, batch, scfg)[0]
    return batch.replace(ref_logp_BxGxT=ref)

  def update(base, state, batch, rewards_BxG):
    return step.update(state, batch, rewards_BxG, graphdef=adapted(base), tx=tx, cfg=scfg,
                       mesh=layout.mesh)

  sft, sft_init = frozen.programs.sft, frozen.programs.sft_init
  if adapters_cold_start(cfg):
    sft_tx = optim.sft_optimizer(cfg.sft.steps, cfg.sft.learning_rate)
    sft_os = layout.sft_opt_state
    sft_step = lambda base, adapters, opt_state, batch: coldstart.sft_step(
        adapters, opt_state, batch, graphdef=adapted(base), tx=sft_tx)
    sft = frozen.bind(jax.jit(sharding.on_mesh(sft_step, layout.mesh),
                              in_shardings=(fs, ps, sft_os, (rows(2), rows(1), rows(2), rows(2))),
                              out_shardings=(ps, sft_os, rep), donate_argnums=(1, 2)))
    sft_init = jax.jit(sft_tx.init, in_shardings=(ps,), out_shardings=sft_os)
  ref_sh = ps if trains_reference(cfg) else None  # an adapter cold start's adapters
  return Programs(
      init=jax.jit(init, in_shardings=(ps,), out_shardings=layout.state),
      sample=sampler(rollout_cfg, dtype=cfg.rollout.sampler_dtype, rollout=True,
                     outs=rollout_sh),
      greedy=sampler(greedy_cfg, outs=rollout_sh.replace(experts=None)),
      sft=sft, sft_init=sft_init,
      # Traced on the mesh, as the full model's (`programs.make_programs`).
      prepare=frozen.bind(jax.jit(sharding.on_mesh(prepare, layout.mesh),
                                  in_shardings=(fs, ps, ref_sh, rollout_sh, rows(2), rows(1)),
                                  out_shardings=layout.batch)),
      update=frozen.bind(jax.jit(sharding.on_mesh(update, layout.mesh),
                                 in_shardings=(fs, layout.state, layout.batch, layout.batch),
                                 out_shardings=(layout.state, rep), donate_argnums=(1,))),
      step_cfg=scfg, make_sampler=sampler)


def freeze(frozen: Frozen, params, run_dir: str, cfg, *, trained: bool,
           stored: bool = False) -> None:
  """Make `params` (the cold start's policy) the frozen base (quantised when
  `lora.base_dtype` says). A trained base is saved once, as stored, in <run>/base/; either
  way <run>/base.json says where the base comes from. `stored`: `params` are already as
  the base stores them."""
  frozen.params = params = params if stored else frozen.store(params)
  if trained:
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, BASE_DIR), every=0, keep=1)
    try:
      ckpt.maybe_save(0, params, force=True)
    finally:
      ckpt.close()
  if jax.process_index() == 0:
    source = ({"base": "cold start", "directory": BASE_DIR} if trained else
              {"base": "initial model", "pretrained": cfg.pretrained, "seed": cfg.seed})
    with open(os.path.join(run_dir, POINTER), "w") as f:
      json.dump({**source, "lora_rank": cfg.lora.rank,
                 **({"base_dtype": cfg.lora.base_dtype} if cfg.lora.base_dtype else {})},
                f, indent=2)
  sharding.barrier("lora-base")


def start_rl(run, params, run_dir: str):
  """The state RL starts from after the cold start returned `params`: a full run's policy;
  for a LoRA run, the adapters of an adapter cold start (fresh optimiser state), or a
  whole-model cold start's policy frozen as the base (adapters at B = 0). Without a cold
  start, or after an adapter one, the base stays the initial model as stored (an int8 base
  is not quantised twice)."""
  cfg = run.cfg
  if run.frozen is None:
    return run.programs.init(params)
  if cfg.sft.steps <= 0 or adapters_cold_start(cfg):
    freeze(run.frozen, run.frozen.params, run_dir, cfg, trained=False, stored=True)
    return run.programs.init(params) if adapters_cold_start(cfg) else run.state
  freeze(run.frozen, params, run_dir, cfg, trained=True)
  return run.state


def trains_reference(cfg) -> bool:
  """Whether pi_ref is passed to `prepare` (saved in <run>/reference): a full run's whole
  policy, or an adapter cold start's adapters; otherwise a LoRA run's pi_ref is its base."""
  return bool(cfg.loss.kl_coef) and (not cfg.lora.rank or adapters_cold_start(cfg))


def restore_base(frozen: Frozen, run_dir: str) -> None:
  """The base a resumed (or evaluated) LoRA run was trained on, as <run>/base.json names it:
  the saved cold-start policy, or the initial model setup already built."""
  path = os.path.join(run_dir, POINTER)
  if not os.path.exists(path):
    raise ValueError(f"{run_dir!r} has LoRA checkpoints but no {POINTER} saying which base "
                     "they adapt (lora.rank > 0); nothing was changed")
  with open(path) as f:
    pointer = json.load(f)
  if pointer.get("directory"):
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, pointer["directory"]), every=0, keep=1)
    try:
      frozen.params = ckpt.restore(frozen.params, ckpt.latest_step())
    finally:
      ckpt.close()


def cold_start_view(run):
  """The run the cold start trains: `run` itself (a full run, a LoRA run whose cold start
  trains the adapters, or one without a cold start), or for a LoRA run the whole base model
  (its full layout and programs, the base as `state.params`, dequantised)."""
  if run.frozen is None or adapters_cold_start(run.cfg) or run.cfg.sft.steps <= 0:
    return run
  f = run.frozen
  return dataclasses.replace(run, state=run.state.replace(params=f.weights(), opt_state=None),
                             layout=f.layout, programs=f.programs, frozen=None)


def describe_state(run) -> str:
  """What the update trains and holds, in bytes: parameters + optimiser state, and for a
  LoRA run the frozen base beside them (read, never differentiated or donated)."""
  kib = lambda tree: f"{lora.num_bytes(tree) / 2**10:,.1f} KiB"
  line = (f"update state: {kib(run.state.params)} parameters + {kib(run.state.opt_state)} "
          "optimiser state")
  if run.frozen is None:
    return line
  return f"{line} (LoRA adapters); frozen base: {kib(run.frozen.params)}"
