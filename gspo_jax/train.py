"""GSPO training: cold start (SFT), then rollout -> rewards -> advantages -> minibatch updates.

Legend: B prompts per iteration, G responses per prompt, P prompt tokens, T response
tokens, M = B*G / num_minibatches responses per minibatch.

Phases and their compile boundaries (each one `jax.jit` with shardings declared, see
`make_programs`; the mesh is `cfg.mesh`, one CPU by default, any TPU slice or pod):
  rollout: `sampling.sample_groups` (one jit: prefill + decode loop)
  prepare: `Programs.prepare`: teacher-forced pi_old (or the sampler's) and optional
           pi_ref; dispatched before scoring, so the device computes it while the host
           scores (JAX dispatch is asynchronous)
  scoring: host Python on this process's rows (decode text, user reward functions)
  advantages: `Programs.advantages`: group-normalised advantages into the batch
  update:  `Programs.update` (state donated): a `lax.scan` over the minibatches, one optax
           step each; a non-finite gradient skips that step (counted).

    python -m gspo_jax.train --config configs/addition_tiny.py [--set loss=grpo ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gspo_jax import _checks, checkpoint, configlib, losses, metrics, sampling, sharding
from gspo_jax.advantages import group_advantages
from gspo_jax.config import (OptimConfig, RolloutConfig, SFTConfig, TrainConfig,  # noqa: F401
                             check_routing)
from gspo_jax.models.config import ModelConfig

Array = jax.Array

@flax.struct.dataclass
class TrainState:
  params: Any                     # nnx.State of the policy's nnx.Param variables
  opt_state: optax.OptState
  step: Array                     # RL iterations completed
  key: Array


@flax.struct.dataclass
class Batch:
  """Flattened rollout rows (R = B*G), everything the update needs."""
  prompts_RxP: Array
  prompt_lens_R: Array
  tokens_RxT: Array
  mask_RxT: Array
  old_logp_RxT: Array
  adv_R: Array
  ref_logp_RxT: Array | None = None
  # pi_old's expert choices per MoE layer, (R, P+T, K) int32 each (routing track / replay).
  old_experts: tuple[Array, ...] | None = None


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  lr: Any = cfg.learning_rate
  if cfg.decay_steps:
    lr = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1),
                                            cfg.decay_steps, cfg.learning_rate * 0.1)
  elif cfg.warmup_steps:
    lr = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
  parts.append(optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b1=cfg.b1, b2=cfg.b2,
                                                     weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


def current_lr(opt_state) -> Array:
  """The injected learning rate (the schedule's state has the same name; take the array)."""
  return optax.tree_utils.tree_get(opt_state, "learning_rate",
                                   filtering=lambda _, value: isinstance(value, jax.Array))


def shared_group(cfg: TrainConfig) -> int:
  """Rows per shared prompt in teacher forcing: G with `share_prompts`, else 1."""
  return cfg.rollout.group_size if cfg.share_prompts else 1


def _minibatch_loss(params, graphdef, mb: Batch, cfg: TrainConfig):
  replay = mb.old_experts if cfg.routing == "replay" else None
  logp, router = teacher_forced(params, graphdef, mb.prompts_RxP, mb.prompt_lens_R, mb.tokens_RxT,
                                cfg.rollout.temperature, replay=replay,
                                group_size=shared_group(cfg))
  loss, metrics = losses.LOSSES[cfg.loss](logp, mb.old_logp_RxT, mb.adv_R, mb.mask_RxT,
                                          **cfg.loss_kwargs())
  if mb.ref_logp_RxT is not None:
    kl, kl_metrics = losses.kl_loss(logp, mb.ref_logp_RxT, mb.mask_RxT,
                                    estimator=cfg.kl_estimator, aggregation=cfg.kl_aggregation)
    loss = loss + cfg.kl_coef * kl
    metrics = {**metrics, **kl_metrics, "loss": jax.lax.stop_gradient(loss)}
  if cfg.routing == "track":
    metrics = {**metrics, "routing_changed": routing_changed(router.indices, mb.old_experts,
                                                             mb.mask_RxT)}
  return loss, metrics


def routing_changed(new_experts, old_experts, mask_RxT: Array) -> Array:
  """Fraction of (response token, MoE layer) pairs whose top-k expert *set* differs between
  two forwards of the same rows (paper section 5.3: ~10% per update at 48 layers).

  new_experts, old_experts: per MoE layer (R, P+T, K) int expert indices; mask_RxT: which
  response tokens count. Order within the top k does not matter (sets are compared)."""
  T = mask_RxT.shape[1]
  changed = [jnp.any(jnp.sort(n[:, -T:], -1) != jnp.sort(o[:, -T:], -1), -1)
             for n, o in zip(new_experts, old_experts)]
  per_layer = [jnp.sum(c * mask_RxT) / jnp.maximum(jnp.sum(mask_RxT), 1.0) for c in changed]
  return jnp.mean(jnp.stack(per_layer))


def _apply_step(state_parts, mb: Batch, graphdef, tx, cfg: TrainConfig):
  """One optax step on one minibatch; skipped (params unchanged) if loss/grads are non-finite."""
  params, opt_state = state_parts
  (_, metrics), grads = jax.value_and_grad(_minibatch_loss, has_aux=True)(params, graphdef, mb, cfg)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
  updates, new_opt = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  metrics = {**metrics, "grad_norm": grad_norm, "skipped_updates": 1.0 - finite,
             "learning_rate": current_lr(opt_state)}
  return (keep(new_params, params), keep(new_opt, opt_state)), metrics


def minibatch_order(key: Array, rows: int, group: int) -> Array:
  """A random order of the rows that keeps each run of `group` consecutive rows together
  (group = 1: any order), so equal slices of it hold whole groups."""
  perm = jax.random.permutation(key, rows // group)
  return (perm[:, None] * group + jnp.arange(group)[None, :]).reshape(rows)


def update(state: TrainState, batch: Batch, *, graphdef, tx, cfg: TrainConfig, mesh=None):
  """Shuffle the R rows, split into `num_minibatches`, one step each (scan). Returns the new
  state and the per-minibatch metrics averaged (skipped_updates summed). With a mesh, each
  minibatch's rows stay split over the batch mesh axes. With `cfg.share_prompts` whole
  groups are shuffled (their G rows stay together, so a prompt is computed once)."""
  perm = minibatch_order(jax.random.fold_in(state.key, 2 * state.step + 1),
                         batch.adv_R.shape[0], shared_group(cfg))

  def split(x):
    x = x[perm].reshape(cfg.num_minibatches, -1, *x.shape[1:])
    if mesh is None:
      return x
    spec = P(None, sharding.ACTIVATION_RULES["batch"], *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  minibatches = jax.tree.map(split, batch)
  step = functools.partial(_apply_step, graphdef=graphdef, tx=tx, cfg=cfg)
  (params, opt_state), metrics = jax.lax.scan(step, (state.params, state.opt_state), minibatches)
  summary = {k: jnp.mean(v) for k, v in metrics.items()}
  summary["skipped_updates"] = jnp.sum(metrics["skipped_updates"])
  summary["ratio_max"] = jnp.max(metrics["ratio_max"])
  summary["ratio_min"] = jnp.min(metrics["ratio_min"])
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), summary


def teacher_forced(params, graphdef, prompts_RxP, lens_R, tokens_RxT, temperature, *,
                   replay=None, group_size: int = 1):
  """Teacher-forced log-probs of the rollout rows under `params`, and the forward's expert
  choices (RouterInfo; `replay` forces them, Routing Replay).

  group_size > 1: rows come in consecutive groups of that many sharing one prompt (as
  `flatten_rollout` lays them out); each prompt is then computed once for its group."""
  model = nnx.merge(graphdef, params)
  R, T = tokens_RxT.shape
  G = group_size
  prompts = prompts_RxP.reshape(R // G, G, -1)[:, 0]
  lens = lens_R.reshape(R // G, G)[:, 0]
  logp, router = sampling.response_logprobs(model, prompts, lens, tokens_RxT.reshape(R // G, G, T),
                                            temperature=temperature, replay=replay)
  return logp.reshape(R, T), router


def score_logprobs(params, graphdef, prompts_RxP, lens_R, tokens_RxT, temperature, *,
                   group_size: int = 1):
  """Teacher-forced log-probs of the rollout rows under `params` (pi_old or pi_ref)."""
  return teacher_forced(params, graphdef, prompts_RxP, lens_R, tokens_RxT, temperature,
                        group_size=group_size)[0]


def flatten_rollout(prompts_BxP, lens_B, rollout: sampling.Rollout):
  """(B, G, ...) rollout -> R = B*G rows with their prompts repeated."""
  B, G, T = rollout.tokens_BxGxT.shape
  rows = lambda x: jnp.repeat(x, G, axis=0)
  return (rows(prompts_BxP), rows(lens_B), rollout.tokens_BxGxT.reshape(B * G, T),
          rollout.mask_BxGxT.reshape(B * G, T), rollout.logp_BxGxT.reshape(B * G, T))


def prepare(params, ref_params, prompts_BxP, lens_B, rollout: sampling.Rollout, *,
            graphdef, cfg: TrainConfig) -> Batch:
  """pi_old (recomputed or the sampler's), pi_ref (when ref_params is given) and, when
  `cfg.routing` is not "free", pi_old's expert choices (from the teacher-forced pass: what
  the trainer's pi_old routes, also when its log-probs are the sampler's). Advantages are
  zero until `with_advantages` (the host scores rewards meanwhile)."""
  prompts, lens, tokens, mask, sampler_logp = flatten_rollout(prompts_BxP, lens_B, rollout)
  adv = jnp.zeros(tokens.shape[:1], jnp.float32)
  temp = cfg.rollout.temperature
  old, experts = sampler_logp, None
  if cfg.old_logp == "recompute" or cfg.routing != "free":
    recomputed, router = teacher_forced(params, graphdef, prompts, lens, tokens, temp,
                                        group_size=shared_group(cfg))
    old = recomputed if cfg.old_logp == "recompute" else old
    experts = None if cfg.routing == "free" else router.indices
  ref = None if ref_params is None else score_logprobs(ref_params, graphdef, prompts, lens,
                                                       tokens, temp, group_size=shared_group(cfg))
  return Batch(prompts, lens, tokens, mask, old * mask, adv, ref, experts)


def with_advantages(batch: Batch, rewards_BxG) -> Batch:
  """The batch with A_i = group-normalised rewards (rows in (prompt, response) order)."""
  return batch.replace(adv_R=group_advantages(rewards_BxG).reshape(-1))


# ------------------------------------------------------------------------------ programs


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where every array of a run lives: the mesh and the shardings of the state and batches."""
  mesh: Mesh
  state: TrainState       # of NamedShardings
  batch: Batch            # of NamedShardings (rows over the batch mesh axes)
  rollout: sampling.Rollout

  def rows(self, ndim: int) -> NamedSharding:
    return sharding.batch_sharding(self.mesh, ndim)

  @property
  def replicated(self) -> NamedSharding:
    return sharding.replicated(self.mesh)


def make_layout(params, tx, mesh: Mesh, with_ref: bool, moe_layers: int = 0) -> Layout:
  """`moe_layers`: how many expert-choice arrays the batch carries (0 unless routing is
  tracked or replayed)."""
  ps = sharding.param_shardings(params, mesh)
  rep, rows = sharding.replicated(mesh), functools.partial(sharding.batch_sharding, mesh)
  state = TrainState(params=ps, opt_state=sharding.optimizer_shardings(tx, params, ps, mesh),
                     step=rep, key=rep)
  batch = Batch(rows(2), rows(1), rows(2), rows(2), rows(2), rows(1),
                rows(2) if with_ref else None,
                tuple(rows(3) for _ in range(moe_layers)) if moe_layers else None)
  rollout = sampling.Rollout(rows(3), rows(3), rows(3), rows(3), rows(2), rows(2), rows(2), rep)
  return Layout(mesh, state, batch, rollout)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The compiled phases of a run (rollout is `sampling.sample_groups(..., mesh=)`), each one
  `jax.jit` with its shardings and donation declared here."""
  init: Any       # params -> TrainState (fresh optimiser state, step 0)
  prepare: Any    # (params, ref_params | None, prompts, lens, rollout) -> Batch (adv 0)
  advantages: Any  # (batch, rewards_BxG) -> batch with advantages; the batch is donated
  update: Any     # (state, batch) -> (state, metrics); the state is donated


def make_programs(graphdef, tx, cfg: TrainConfig, layout: Layout) -> Programs:
  rep, ps = layout.replicated, layout.state.params
  ref_sh = ps if cfg.kl_coef else None

  def init(params):
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                      key=jax.random.key(cfg.seed))

  return Programs(
      init=jax.jit(init, in_shardings=(ps,), out_shardings=layout.state),
      prepare=jax.jit(
          functools.partial(prepare, graphdef=graphdef, cfg=cfg),
          in_shardings=(ps, ref_sh, layout.rows(2), layout.rows(1), layout.rollout),
          out_shardings=layout.batch),
      advantages=jax.jit(with_advantages, in_shardings=(layout.batch, layout.rows(2)),
                         out_shardings=layout.batch, donate_argnums=(0,)),
      update=jax.jit(
          functools.partial(update, graphdef=graphdef, tx=tx, cfg=cfg, mesh=layout.mesh),
          in_shardings=(layout.state, layout.batch), out_shardings=(layout.state, rep),
          donate_argnums=(0,)))


def batch_moe_layers(cfg: TrainConfig) -> int:
  return 0 if cfg.routing == "free" else cfg.model.num_moe_layers


def check_layout(cfg: TrainConfig, mesh: Mesh) -> None:
  """Every batch dimension must divide over the batch mesh axes (a clear error otherwise)."""
  r = cfg.rollout
  sharding.check_rows("rollout.prompts_per_iter", r.prompts_per_iter, mesh)
  sharding.check_rows("rows per minibatch (rollout.prompts_per_iter * rollout.group_size / "
                      "num_minibatches)", r.prompts_per_iter * r.group_size // cfg.num_minibatches,
                      mesh)
  if cfg.sft.steps > 0:
    sharding.check_rows("sft.batch_size", cfg.sft.batch_size, mesh)


# ------------------------------------------------------------------------------ text <-> ids


def encode_prompts(tok, examples, max_len: int):
  """[bos] + prompt ids (no bos when the tokenizer has none), right-padded to max_len:
  (ids_BxP int32, lens_B int32)."""
  ids = np.full((len(examples), max_len), tok.pad_id, np.int32)
  lens = np.zeros(len(examples), np.int32)
  for i, ex in enumerate(examples):
    row = ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(ex.prompt)
    if len(row) > max_len:
      raise ValueError(f"prompt {ex.prompt!r} needs {len(row)} tokens > rollout.max_prompt_len="
                       f"{max_len}")
    ids[i, :len(row)], lens[i] = row, len(row)
  return ids, lens


def encode_completions(tok, texts, max_len: int):
  """completion ids + [eos], right-padded (truncated to max_len): (ids_BxT, mask_BxT)."""
  ids = np.full((len(texts), max_len), tok.pad_id, np.int32)
  mask = np.zeros((len(texts), max_len), np.float32)
  for i, text in enumerate(texts):
    row = (tok.encode(text) + [tok.eos_id])[:max_len]
    ids[i, :len(row)], mask[i, :len(row)] = row, 1.0
  return ids, mask


def decode_completions(tok, tokens_RxT, mask_RxT) -> list[str]:
  """Text of each response: counted tokens, without the EOS. Other special ids (pad, bos,
  unk) decode to "" in sentencepiece, which would let "1<s>22" pass for "122": they become
  U+FFFD instead, so such a response can never match an answer."""
  special = {tok.pad_id, tok.bos_id, getattr(tok, "unk_id", -1)}
  out = []
  for ids, m in zip(np.asarray(tokens_RxT), np.asarray(mask_RxT)):
    pieces, run = [], []
    for t in (int(t) for t in ids[m > 0] if t != tok.eos_id):
      if t in special:
        pieces += [tok.decode(run), "\ufffd"]
        run = []
      else:
        run.append(t)
    out.append("".join(pieces) + tok.decode(run))
  return out


# ------------------------------------------------------------------------------ the loop


def heldout(task, cfg: TrainConfig):
  """The fixed held-out set (same for every evaluation of a run)."""
  return task.eval_examples(cfg.seed, cfg.eval_size)


def make_tokenizer(task, cfg: TrainConfig, run_dir: str):
  """Train the task tokenizer (or load the run's own on resume), saved next to the run."""
  from gspo_jax.tokenizer import SentencePieceTokenizer
  path = os.path.join(run_dir, "tokenizer.model")
  if not os.path.exists(path) and jax.process_index() == 0:
    corpus = task.corpus(np.random.default_rng([cfg.seed, 31_337]), 20_000)
    SentencePieceTokenizer.train(corpus, vocab_size=cfg.model.vocab_size).save(run_dir)
  sharding.barrier("tokenizer")  # multi-host: the run directory must be shared by all hosts
  if not os.path.exists(path):
    raise ValueError(f"process {jax.process_index()} cannot see {path}: in multi-host runs the "
                     "run directory must be on a filesystem every host shares")
  return SentencePieceTokenizer.load(run_dir)


def local_examples(examples, mesh: Mesh):
  """This process's share of a global batch: every process draws the same examples (a pure
  function of seed and step), and encodes only the rows its devices hold."""
  return examples[sharding.local_rows(sharding.batch_sharding(mesh), len(examples))]


def feed(local, mesh: Mesh, rows: int) -> jax.Array:
  """A global row-sharded array from this process's rows."""
  local = np.asarray(local)
  return sharding.to_global(local, sharding.batch_sharding(mesh, local.ndim),
                            (rows, *local.shape[1:]))


def rollout_step(run: "Run", state: TrainState, ref_params=None):
  """Sample, score and build the update batch for iteration `state.step`.

  Multi-host: each process encodes its rows of the prompt batch, decodes and scores the
  responses on its own devices, and feeds its rows of the rewards back; metrics are
  gathered over processes.

  Overlap: pi_old / pi_ref scoring (`prepare`) is dispatched before the host decodes and
  scores, so the device runs it meanwhile. Nothing more can overlap: the advantages need
  this batch's rewards, and the next rollout needs the policy this batch updates."""
  cfg, tok, mesh = run.cfg, run.tok, run.layout.mesh
  times, it = {}, int(state.step)
  B = cfg.rollout.prompts_per_iter
  # Data position = a pure function of (seed, iteration): resume is exact.
  examples = local_examples(run.task.train_batch(cfg.seed, it, B), mesh)
  prompts_l, lens_l = encode_prompts(tok, examples, cfg.rollout.max_prompt_len)
  prompts, lens = feed(prompts_l, mesh, B), feed(lens_l, mesh, B)
  t0 = time.perf_counter()
  model = sampler_policy(run.graphdef, state.params, cfg.model, cfg.rollout.sampler_dtype)
  rollout = jax.block_until_ready(sampling.sample_groups(
      model, prompts, lens, jax.random.fold_in(state.key, 2 * it), sampler_config(tok, cfg),
      mesh=mesh))
  times["time_sample"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  batch = run.programs.prepare(state.params, ref_params, prompts, lens, rollout)  # async
  tokens, mask = sharding.to_host(rollout.tokens_BxGxT), sharding.to_host(rollout.mask_BxGxT)
  b, G, T = tokens.shape
  texts = decode_completions(tok, tokens.reshape(b * G, T), mask.reshape(b * G, T))
  group_examples = [e for e in examples for _ in range(G)]
  rewards, correct, parts = run.task.score_batch(group_examples, texts, log=_log)
  rewards = rewards.reshape(b, G)
  times["time_score"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  batch = run.programs.advantages(batch, feed(rewards.astype(np.float32), mesh, B))
  jax.block_until_ready(batch.adv_R)
  times["time_old_logp"] = time.perf_counter() - t0  # what scoring did not hide of prepare
  all_rewards, all_correct = sharding.gather_rows(rewards), sharding.gather_rows(correct)
  lengths = sharding.gather_rows(mask.sum(-1))
  truncated = sharding.gather_rows(sharding.to_host(rollout.truncated_BxG))
  entropy = float(jnp.sum(rollout.entropy_BxGxT) / jnp.maximum(jnp.sum(rollout.mask_BxGxT), 1))
  stats = {"reward_mean": all_rewards.mean(), "reward_std": all_rewards.std(),
           "accuracy": all_correct.mean(), "response_length": lengths.mean(),
           "truncated_frac": truncated.mean(), "entropy": entropy,
           "tokens_per_s": lengths.sum() / times["time_sample"], **times}
  stats.update({k: sharding.gather_rows(v).mean() for k, v in parts.items()})
  position = run.task.position(it, B)
  if position is not None:
    stats["data_epoch"], stats["data_index"] = position
  return batch, stats


@functools.lru_cache(maxsize=8)
def _graphdef_with_dtype(model_cfg: ModelConfig, dtype: str):
  from gspo_jax.models.transformer import Transformer
  cfg = dataclasses.replace(model_cfg, dtype=dtype, param_dtype=dtype)
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]


def sampler_policy(graphdef, params, model_cfg: ModelConfig, dtype: str = ""):
  """The policy the sampler runs: `params` as they are, or (dtype given) a copy with
  parameters and activations cast to `dtype` -- an inference engine in bfloat16 next to a
  float32 trainer. The trainer's parameters are not touched."""
  if not dtype or (dtype == model_cfg.dtype and dtype == model_cfg.param_dtype):
    return nnx.merge(graphdef, params)
  cast = jax.tree.map(lambda x: x.astype(dtype), params)
  return nnx.merge(_graphdef_with_dtype(model_cfg, dtype), cast)


def sampler_config(tok, cfg: TrainConfig) -> sampling.SamplerConfig:
  r = cfg.rollout
  return sampling.SamplerConfig(group_size=r.group_size, max_new_tokens=r.max_new_tokens,
                                eos_id=tok.eos_id, pad_id=tok.pad_id,
                                max_prompt_len=r.max_prompt_len, temperature=r.temperature,
                                top_p=r.top_p, top_k=r.top_k, vocab_limit=tok.vocab_size)


@dataclasses.dataclass
class Run:
  cfg: TrainConfig
  task: Any
  tok: Any
  graphdef: Any
  state: TrainState
  tx: Any
  layout: Layout
  programs: Programs

  def reconfigure(self, cfg: TrainConfig) -> "Run":
    """The same run and state with other loss settings (the programs are rebuilt)."""
    check_routing(cfg)
    layout = make_layout(self.state.params, self.tx, self.layout.mesh, bool(cfg.kl_coef),
                         batch_moe_layers(cfg))
    return dataclasses.replace(self, cfg=cfg, layout=layout,
                               programs=make_programs(self.graphdef, self.tx, cfg, layout))


def make_task(cfg: TrainConfig):
  """The built-in task `cfg.task`, or for task="dataset" the JSONL prompts and rewards."""
  if cfg.task == "dataset":
    from gspo_jax.data import DatasetTask
    return DatasetTask(cfg.data, cfg.reward)
  from gspo_jax.tasks import make_task as builtin
  return builtin(cfg.task, digits=cfg.task_digits)


def with_chat_template(task, tok, cfg: TrainConfig):
  """A dataset task's prompts rendered with a pretrained tokenizer's own chat template
  (unless data.chat_template is off or the tokenizer has none); other tasks unchanged."""
  from gspo_jax import chat
  from gspo_jax.data import DatasetTask
  if not (isinstance(task, DatasetTask) and cfg.pretrained and cfg.data.chat_template):
    return task
  render = chat.tokenizer_renderer(tok, system_prompt=cfg.data.system_prompt)
  return task if render is None else task.with_renderer(render)


def setup(cfg: TrainConfig, run_dir: str) -> Run:
  """Mesh, task, tokenizer, the sharded model and optimiser state, the compiled phases."""
  from gspo_jax.models.transformer import Transformer
  mesh = sharding.make_mesh(cfg.mesh)
  check_layout(cfg, mesh)
  checkpoint.check_writable(run_dir)
  task = make_task(cfg)
  if cfg.pretrained:
    from gspo_jax.hf_tokenizer import load_tokenizer
    from gspo_jax.models import hf
    tok = load_tokenizer(cfg.pretrained)
    task = with_chat_template(task, tok, cfg)
    model = hf.load(cfg.pretrained, mesh=mesh, param_dtype=cfg.pretrained_dtype or None)
    cfg = dataclasses.replace(cfg, model=model.cfg)
    check_routing(cfg)
  else:
    tok = make_tokenizer(task, cfg, run_dir)
    model = sharding.init_sharded(Transformer, cfg.model, mesh, cfg.seed)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"tokenizer has {tok.vocab_size} ids > model.vocab_size={cfg.model.vocab_size}")
  tx = make_optimizer(cfg.optim)
  graphdef, params = nnx.split(model, nnx.Param)
  layout = make_layout(params, tx, mesh, bool(cfg.kl_coef), batch_moe_layers(cfg))
  programs = make_programs(graphdef, tx, cfg, layout)
  return Run(cfg, task, tok, graphdef, programs.init(params), tx, layout, programs)


def load_run(run_dir: str, step: int | None = None) -> Run:
  """Config, tokenizer and the newest (or given) checkpoint of a run directory."""
  cfg = configlib.load_json(TrainConfig, os.path.join(run_dir, "config.json"))
  run = setup(cfg, run_dir)
  ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), every=0, keep=1)
  try:
    if ckpt.latest_step() is None:
      raise ValueError(f"no complete checkpoint in {run_dir!r}")
    run.state = ckpt.restore(run.state, step)
  finally:
    ckpt.close()
  return run


SHOW = ("reward_mean", "accuracy", "clip_frac_token", "heldout_accuracy")


def reference_params(run: Run, run_dir: str, *, fresh: bool):
  """The KL reference: the cold-start policy, saved once to <run>/reference and restored
  on resume (the resumed policy must not become its own reference)."""
  ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "reference"), every=0, keep=1)
  try:
    if fresh:
      ckpt.maybe_save(0, run.state.params, force=True)
      return jax.tree.map(jnp.copy, run.state.params)  # the policy's buffers get donated
    if ckpt.latest_step() is None:
      raise ValueError(f"kl_coef > 0 but {run_dir!r} has no saved reference policy "
                       "(the run was started with kl_coef = 0)")
    return ckpt.restore(run.state.params)
  finally:
    ckpt.close()


def _log(*args):
  if jax.process_index() == 0:
    print(*args, flush=True)


def train(cfg: TrainConfig, run_dir: str, *, resume: bool = False, checkpoint_every: int = 10,
          keep: int = 3, progress: bool = True) -> dict[str, Any]:
  """Cold start (unless resuming), then `cfg.iterations` GSPO iterations. Returns a summary.

  Multi-host: every process calls this with the same arguments after
  `jax.distributed.initialize`; `run_dir` must be shared by all hosts."""
  from gspo_jax import coldstart, evaluate
  run = setup(cfg, run_dir)
  mesh = run.layout.mesh
  checkpoint.check_free_space(run_dir, run.state, keep)
  cfg = run.cfg  # with `model` filled in from a pretrained directory
  if jax.process_index() == 0:
    configlib.save_json(cfg, os.path.join(run_dir, "config.json"))
  ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), every=checkpoint_every,
                                 keep=keep)
  writer = None
  try:
    held = heldout(run.task, cfg)
    if not resume and ckpt.latest_step() is not None:
      raise ValueError(f"{run_dir!r} already holds checkpoints (newest: step "
                       f"{ckpt.latest_step()}); pass --resume to continue it, or choose a new "
                       "--run-dir")
    start = ckpt.latest_step() if resume else None
    summary: dict[str, Any] = {}
    if not held:
      _log("no held-out set (data.heldout_file / data.heldout_fraction): held-out accuracy "
           "is reported as nan")
    evaluate_now = lambda: float("nan") if not held else evaluate.evaluate(
        run.state.params, run.graphdef, run.task, run.tok, held, cfg, mesh=mesh)["accuracy"]
    if start is not None:
      run.state = ckpt.restore(run.state)
      _log(f"resumed from checkpoint step {start} in {run_dir}")
    else:
      params = coldstart.cold_start(run.state.params, run.graphdef, run.task, run.tok, cfg,
                                    mesh=mesh, log=_log)
      run.state = run.programs.init(params)
      ckpt.maybe_save(0, run.state, force=True)
    position = run.task.position(int(run.state.step), cfg.rollout.prompts_per_iter)
    if position is not None:
      _log(f"data position at step {int(run.state.step)}: epoch {position[0]}, index "
           f"{position[1]} of {len(run.task.train_records)} training records")
    first = run.task.train_batch(cfg.seed, int(run.state.step), cfg.rollout.prompts_per_iter)[0]
    _log(f"first prompt as the model sees it: {first.prompt!r}")
    summary["heldout_accuracy_start"] = evaluate_now()
    _log(f"held-out accuracy at step {int(run.state.step)}: "
         f"{summary['heldout_accuracy_start']:.3f}")
    writer = metrics.MetricsWriter(run_dir, total=cfg.iterations, initial=int(run.state.step),
                                   progress=progress)
    ref_params = reference_params(run, run_dir, fresh=start is None) if cfg.kl_coef else None
    while int(run.state.step) < cfg.iterations:
      batch, stats = rollout_step(run, run.state, ref_params)
      t0 = time.perf_counter()
      run.state, m = run.programs.update(run.state, batch)
      m = {**jax.device_get(m), **stats, "time_update": time.perf_counter() - t0}
      step = int(run.state.step)
      if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.iterations):
        m["heldout_accuracy"] = evaluate_now()
      writer.write(step, m, show=SHOW)
      ckpt.maybe_save(step, run.state, force=step == cfg.iterations)
      summary["last"] = m
    summary["heldout_accuracy_end"] = evaluate_now()
    writer.print(f"held-out accuracy: {summary['heldout_accuracy_start']:.3f} at the start, "
                 f"{summary['heldout_accuracy_end']:.3f} after {cfg.iterations} {cfg.loss} "
                 f"iterations ({len(held)} problems, seed {cfg.seed})")
    return summary
  finally:
    if writer is not None:
      writer.close()
    ckpt.close()


def init_distributed(args) -> None:
  """Join the processes of a multi-host run (JAX's own runtime; before any JAX computation).

  On Cloud TPU, `--distributed` alone is enough: JAX finds the coordinator and the process
  ids from the TPU metadata. Elsewhere (CPU or GPU hosts) give the coordinator address, the
  number of processes and this one's id."""
  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.coordinator_address or args.num_processes:
    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes, process_id=args.process_id)
  elif args.distributed:
    jax.distributed.initialize()


def main(argv=None):
  parser = argparse.ArgumentParser(description="GSPO training (cold start, then RL)")
  configlib.add_cli_args(parser)
  parser.add_argument("--run-dir", default=None, help="default: runs/<config file name>")
  parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
  parser.add_argument("--checkpoint-every", type=int, default=10, help="iterations between saves")
  parser.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints kept")
  parser.add_argument("--no-progress", action="store_true")
  dist = parser.add_argument_group("multi-host (see README: Running on Cloud TPU)")
  dist.add_argument("--distributed", action="store_true",
                    help="jax.distributed.initialize() with auto-detection (Cloud TPU pods)")
  dist.add_argument("--coordinator-address", default=None, help="host:port of process 0")
  dist.add_argument("--num-processes", type=int, default=None)
  dist.add_argument("--process-id", type=int, default=None)
  dist.add_argument("--cpu-devices", type=int, default=0,
                    help="simulate this many devices per process on CPU")
  args = parser.parse_args(argv)
  try:
    cfg = configlib.config_from_args(args, TrainConfig)
  except ValueError as e:
    raise SystemExit(f"config error: {e}") from None
  init_distributed(args)
  name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
  run_dir = args.run_dir or os.path.join("runs", name)
  try:
    train(cfg, run_dir, resume=args.resume, checkpoint_every=args.checkpoint_every,
          keep=args.keep_checkpoints, progress=not args.no_progress)
  finally:
    if jax.process_count() > 1:
      jax.distributed.shutdown()


if __name__ == "__main__":
  main()
