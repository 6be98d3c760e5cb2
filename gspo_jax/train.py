"""GSPO training: cold start (SFT), then rollout -> rewards -> advantages -> minibatch updates.

Legend: B prompts per iteration, G responses per prompt, P prompt tokens, T response
tokens, M = B*G / num_minibatches responses per minibatch.

Phases and their compile boundaries:
  rollout: `sampling.sample_groups` (one jit: prefill + decode loop)
  scoring: host Python (decode text, user reward functions), then group advantages
  old log-probs: `_score_jit` (teacher-forced pi_old and optional pi_ref), or the sampler's
  update: `_update_jit` (one jit, state donated): a `lax.scan` over the minibatches, one
          optax step each; a non-finite gradient skips that step (counted).

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

from gspo_jax import _checks, checkpoint, configlib, losses, metrics, sampling
from gspo_jax.advantages import group_advantages
from gspo_jax.models.config import ModelConfig, tiny

Array = jax.Array

OLD_LOGP_SOURCES = ("recompute", "sampler")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  prompts_per_iter: int = 16        # B
  group_size: int = 8               # G
  max_new_tokens: int = 6           # T
  max_prompt_len: int = 16          # P: prompts are padded to this (static shapes, one compile)
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if self.prompts_per_iter < 1 or self.group_size < 2:
      raise ValueError("rollout.prompts_per_iter must be >= 1 and rollout.group_size >= 2 "
                       "(group-normalised advantages need 2 responses per prompt)")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 1e-4
  warmup_steps: int = 0
  decay_steps: int = 0              # cosine decay to 10% over this many steps; 0 = constant
  weight_decay: float = 0.0
  grad_clip: float = 1.0            # global-norm clip; 0 = off
  b1: float = 0.9
  b2: float = 0.99

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(f"optim.learning_rate must be > 0; got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Cold start: supervised steps on task demonstrations before RL (the paper starts RL
  from a cold-start fine-tuned model)."""
  steps: int = 300                  # maximum number of steps
  batch_size: int = 64
  learning_rate: float = 3e-3
  # Stop early once greedy accuracy on a probe of *train-split* problems reaches this
  # (0 = run all steps): RL then starts from comparable partial accuracy for every seed,
  # where a fixed step count lands anywhere on a steep learning curve.
  target_accuracy: float = 0.0
  check_every: int = 20
  probe_size: int = 256


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  task: str = "addition"
  task_digits: int = 2
  model: ModelConfig = dataclasses.field(default_factory=lambda: tiny(vocab_size=32))
  rollout: RolloutConfig = RolloutConfig()
  optim: OptimConfig = OptimConfig()
  sft: SFTConfig = SFTConfig()
  loss: str = "gspo"
  eps_low: float = 3e-4             # paper: GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.27
  eps_high: float = 4e-4
  num_minibatches: int = 4
  old_logp: str = "recompute"       # or "sampler": reuse the sampler's log-probs as pi_old
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  iterations: int = 50
  eval_every: int = 10
  eval_size: int = 256
  seed: int = 0

  def __post_init__(self):
    _checks.check_choice("TrainConfig", "loss", self.loss, tuple(losses.LOSSES))
    _checks.check_choice("TrainConfig", "old_logp", self.old_logp, OLD_LOGP_SOURCES)
    _checks.check_choice("TrainConfig", "kl_estimator", self.kl_estimator, losses.KL_ESTIMATORS)
    if (self.rollout.prompts_per_iter * self.rollout.group_size) % self.num_minibatches:
      raise ValueError(f"TrainConfig.num_minibatches ({self.num_minibatches}) must divide "
                       "rollout.prompts_per_iter * rollout.group_size")
    if not (self.eps_low > 0 and self.eps_high > 0):
      raise ValueError("TrainConfig.eps_low and eps_high must be > 0")


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


def _minibatch_loss(params, graphdef, mb: Batch, cfg: TrainConfig):
  logp = score_logprobs(params, graphdef, mb.prompts_RxP, mb.prompt_lens_R, mb.tokens_RxT,
                        cfg.rollout.temperature)
  return losses.LOSSES[cfg.loss](
      logp, mb.old_logp_RxT, mb.adv_R, mb.mask_RxT, eps_low=cfg.eps_low,
      eps_high=cfg.eps_high, ref_logp_BxT=mb.ref_logp_RxT, kl_coef=cfg.kl_coef,
      kl_estimator=cfg.kl_estimator)


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


def update(state: TrainState, batch: Batch, graphdef, tx, cfg: TrainConfig):
  """Shuffle the R rows, split into `num_minibatches`, one step each (scan). Returns the new
  state and the per-minibatch metrics averaged (skipped_updates summed)."""
  R = batch.adv_R.shape[0]
  perm = jax.random.permutation(jax.random.fold_in(state.key, 2 * state.step + 1), R)
  split = lambda x: None if x is None else x[perm].reshape(cfg.num_minibatches, -1, *x.shape[1:])
  minibatches = jax.tree.map(split, batch)
  step = functools.partial(_apply_step, graphdef=graphdef, tx=tx, cfg=cfg)
  (params, opt_state), metrics = jax.lax.scan(step, (state.params, state.opt_state), minibatches)
  summary = {k: jnp.mean(v) for k, v in metrics.items()}
  summary["skipped_updates"] = jnp.sum(metrics["skipped_updates"])
  summary["ratio_max"] = jnp.max(metrics["ratio_max"])
  summary["ratio_min"] = jnp.min(metrics["ratio_min"])
  return state.replace(params=params, opt_state=opt_state, step=state.step + 1), summary


# The update phase's one compiled program; the state is donated (updated in place).
_update_jit = jax.jit(update, static_argnames=("graphdef", "tx", "cfg"), donate_argnums=(0,))


def score_logprobs(params, graphdef, prompts_RxP, lens_R, tokens_RxT, temperature):
  """Teacher-forced log-probs of the rollout rows under `params` (pi_old or pi_ref)."""
  model = nnx.merge(graphdef, params)
  logp, _ = sampling.response_logprobs(model, prompts_RxP, lens_R, tokens_RxT[:, None],
                                       temperature=temperature)
  return logp[:, 0]


_score_jit = jax.jit(score_logprobs, static_argnames=("graphdef", "temperature"))


def flatten_rollout(prompts_BxP, lens_B, rollout: sampling.Rollout):
  """(B, G, ...) rollout -> R = B*G rows with their prompts repeated."""
  B, G, T = rollout.tokens_BxGxT.shape
  rows = lambda x: jnp.repeat(x, G, axis=0)
  return (rows(prompts_BxP), rows(lens_B), rollout.tokens_BxGxT.reshape(B * G, T),
          rollout.mask_BxGxT.reshape(B * G, T), rollout.logp_BxGxT.reshape(B * G, T))


def build_batch(state: TrainState, graphdef, prompts_BxP, lens_B, rollout, rewards_BxG,
                cfg: TrainConfig, ref_params=None) -> Batch:
  """Advantages, pi_old (recomputed or the sampler's) and pi_ref for the update."""
  prompts, lens, tokens, mask, sampler_logp = flatten_rollout(prompts_BxP, lens_B, rollout)
  adv = group_advantages(rewards_BxG).reshape(-1)
  temp = cfg.rollout.temperature
  if cfg.old_logp == "recompute":
    old = _score_jit(state.params, graphdef, prompts, lens, tokens, temp)
  else:
    old = sampler_logp
  ref = None
  if ref_params is not None and cfg.kl_coef:
    ref = _score_jit(ref_params, graphdef, prompts, lens, tokens, temp)
  return Batch(prompts, lens, tokens, mask, old * mask, adv, ref)


def init_state(model, tx, seed: int) -> tuple[Any, TrainState]:
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, TrainState(params=params, opt_state=tx.init(params),
                              step=jnp.zeros((), jnp.int32), key=jax.random.key(seed))


# ------------------------------------------------------------------------------ text <-> ids


def encode_prompts(tok, examples, max_len: int):
  """[bos] + prompt ids, right-padded to max_len: (ids_BxP int32, lens_B int32)."""
  ids = np.full((len(examples), max_len), tok.pad_id, np.int32)
  lens = np.zeros(len(examples), np.int32)
  for i, ex in enumerate(examples):
    row = [tok.bos_id] + tok.encode(ex.prompt)
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
  return task.sample(np.random.default_rng([cfg.seed, 7_777_777]), cfg.eval_size, "heldout")


def make_tokenizer(task, cfg: TrainConfig, run_dir: str):
  """Train the task tokenizer (or load the run's own on resume), saved next to the run."""
  from gspo_jax.tokenizer import SentencePieceTokenizer
  path = os.path.join(run_dir, "tokenizer.model")
  if os.path.exists(path):
    return SentencePieceTokenizer.load(run_dir)
  corpus = task.corpus(np.random.default_rng([cfg.seed, 31_337]), 20_000)
  tok = SentencePieceTokenizer.train(corpus, vocab_size=cfg.model.vocab_size)
  tok.save(run_dir)
  return tok


def rollout_step(state: TrainState, graphdef, task, tok, cfg: TrainConfig, ref_params=None):
  """Sample, score and build the update batch for iteration `state.step`."""
  from gspo_jax.tasks.base import score
  times, it = {}, int(state.step)
  rng = np.random.default_rng([cfg.seed, it])  # data position = iteration: resume is exact
  examples = task.sample(rng, cfg.rollout.prompts_per_iter, "train")
  prompts, lens = encode_prompts(tok, examples, cfg.rollout.max_prompt_len)
  scfg = sampler_config(tok, cfg)
  t0 = time.perf_counter()
  model = nnx.merge(graphdef, state.params)
  rollout = jax.block_until_ready(sampling.sample_groups(
      model, prompts, lens, jax.random.fold_in(state.key, 2 * it), scfg))
  times["time_sample"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  B, G, T = rollout.tokens_BxGxT.shape
  texts = decode_completions(tok, rollout.tokens_BxGxT.reshape(B * G, T),
                             rollout.mask_BxGxT.reshape(B * G, T))
  group_examples = [e for e in examples for _ in range(G)]
  rewards = score([task.reward], group_examples, texts).reshape(B, G)
  correct = np.array([task.is_correct(e, c) for e, c in zip(group_examples, texts)])
  times["time_score"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  batch = build_batch(state, graphdef, prompts, lens, rollout, rewards, cfg, ref_params)
  jax.block_until_ready(batch.old_logp_RxT)
  times["time_old_logp"] = time.perf_counter() - t0
  lengths = np.asarray(rollout.lengths_BxG)
  entropy = float(jnp.sum(rollout.entropy_BxGxT) / jnp.maximum(jnp.sum(rollout.mask_BxGxT), 1))
  stats = {"reward_mean": rewards.mean(), "reward_std": rewards.std(), "accuracy": correct.mean(),
           "response_length": lengths.mean(), "truncated_frac": np.asarray(rollout.truncated_BxG).mean(),
           "entropy": entropy, "tokens_per_s": lengths.sum() / times["time_sample"], **times}
  return batch, stats


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


def setup(cfg: TrainConfig, run_dir: str) -> Run:
  from gspo_jax.models import transformer
  from gspo_jax.tasks import make_task
  checkpoint.check_writable(run_dir)
  task = make_task(cfg.task, digits=cfg.task_digits)
  tok = make_tokenizer(task, cfg, run_dir)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"tokenizer has {tok.vocab_size} ids > model.vocab_size={cfg.model.vocab_size}")
  tx = make_optimizer(cfg.optim)
  graphdef, state = init_state(transformer.create(cfg.model, seed=cfg.seed), tx, cfg.seed)
  return Run(cfg, task, tok, graphdef, state, tx)


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


def train(cfg: TrainConfig, run_dir: str, *, resume: bool = False, checkpoint_every: int = 10,
          keep: int = 3, progress: bool = True) -> dict[str, Any]:
  """Cold start (unless resuming), then `cfg.iterations` GSPO iterations. Returns a summary."""
  from gspo_jax import coldstart, evaluate
  run = setup(cfg, run_dir)
  checkpoint.check_free_space(run_dir, run.state, keep)
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
    log = print
    summary: dict[str, Any] = {}
    if start is not None:
      run.state = ckpt.restore(run.state)
      log(f"resumed from checkpoint step {start} in {run_dir}")
    else:
      params = coldstart.cold_start(run.state.params, run.graphdef, run.task, run.tok, cfg, log=log)
      run.state = run.state.replace(params=params, opt_state=run.tx.init(params))
      ckpt.maybe_save(0, run.state, force=True)
    before = evaluate.evaluate(run.state.params, run.graphdef, run.task, run.tok, held, cfg)
    summary["heldout_accuracy_start"] = before["accuracy"]
    log(f"held-out accuracy at step {int(run.state.step)}: {before['accuracy']:.3f}")
    writer = metrics.MetricsWriter(run_dir, total=cfg.iterations, initial=int(run.state.step),
                                   progress=progress)
    ref_params = reference_params(run, run_dir, fresh=start is None) if cfg.kl_coef else None
    while int(run.state.step) < cfg.iterations:
      batch, stats = rollout_step(run.state, run.graphdef, run.task, run.tok, cfg, ref_params)
      t0 = time.perf_counter()
      run.state, m = _update_jit(run.state, batch, run.graphdef, run.tx, cfg)
      m = {**jax.device_get(m), **stats, "time_update": time.perf_counter() - t0}
      step = int(run.state.step)
      if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.iterations):
        m["heldout_accuracy"] = evaluate.evaluate(run.state.params, run.graphdef, run.task,
                                                  run.tok, held, cfg)["accuracy"]
      writer.write(step, m, show=SHOW)
      ckpt.maybe_save(step, run.state, force=step == cfg.iterations)
      summary["last"] = m
    after = evaluate.evaluate(run.state.params, run.graphdef, run.task, run.tok, held, cfg)
    summary["heldout_accuracy_end"] = after["accuracy"]
    writer.print(f"held-out accuracy: {summary['heldout_accuracy_start']:.3f} at the start, "
                 f"{after['accuracy']:.3f} after {cfg.iterations} {cfg.loss} iterations "
                 f"({len(held)} problems, seed {cfg.seed})")
    return summary
  finally:
    if writer is not None:
      writer.close()
    ckpt.close()


def main(argv=None):
  parser = argparse.ArgumentParser(description="GSPO training (cold start, then RL)")
  configlib.add_cli_args(parser)
  parser.add_argument("--run-dir", default=None, help="default: runs/<config file name>")
  parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
  parser.add_argument("--checkpoint-every", type=int, default=10, help="iterations between saves")
  parser.add_argument("--keep-checkpoints", type=int, default=3, help="newest checkpoints kept")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  try:
    cfg = configlib.config_from_args(args, TrainConfig)
  except ValueError as e:
    raise SystemExit(f"config error: {e}") from None
  name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
  run_dir = args.run_dir or os.path.join("runs", name)
  train(cfg, run_dir, resume=args.resume, checkpoint_every=args.checkpoint_every,
        keep=args.keep_checkpoints, progress=not args.no_progress)


if __name__ == "__main__":
  main()
