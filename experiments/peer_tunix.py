"""Side by side with tunix (google-tunix): the same tiny Qwen3, the same weights, the same work.

    python3.11 -m venv .venv-tunix
    .venv-tunix/bin/pip install -r requirements.txt google-tunix==0.1.7
    .venv-tunix/bin/python -m experiments.peer_tunix      # a few minutes on 2 CPU cores

tunix is not a dependency of gspo_jax: it is imported only inside this script, which stops
with a message (exit code 2) when it is missing. Writes runs/results/peer_tunix.json
(experiments/results/ with --record).

What is compared, and why it is the same work on both sides:

* Model. One Qwen3 configuration built twice: ours (`gspo_jax.models`, q/k RMSNorm on) and
  tunix's `tunix.models.qwen3.model.Qwen3`, float32 both. Our initial weights are copied
  into theirs tensor by tensor (the layouts agree: q (D, N, H), k/v (D, C, H), o (N, H, D),
  MLP (in, out)), and the logits of both on the same tokens are compared: the max
  difference is printed and stored. tunix 0.1.7's Qwen3 ignores `ModelConfig.rope_theta`
  (its `apply_rope` is always called with the default 1e6), so we use theta = 1e6.
* Generated tokens/s. B prompts of P tokens, G responses each, exactly T new tokens,
  temperature 1, no top-k / top-p. No response may stop early: the EOS id is set to V (one
  past the vocabulary), which the sampler can never draw, on both sides. Ours:
  `gspo_jax.rollout.sampling.sample_groups` (one compiled program; each prompt prefilled once and
  its KV cache shared by its G responses), results fetched to the host. Theirs: what
  tunix's GRPO learner runs for a rollout: the prompts repeated G times (each prompt's
  copies adjacent, as `RLLearner` does with `np.repeat`), given as strings to
  `VanillaRollout.generate` (the `Sampler`: a jitted prefill, then a jitted
  `lax.while_loop` of decode steps, then detokenisation on the host), with a KV cache of
  exactly P + T slots (the smallest it accepts; its default is 1024). The tokenizer is a
  trivial whitespace-separated-ids one, so host text work is negligible. Ours is also run
  with the prompts repeated G times (group size 1), to show how much of the difference is
  prefix sharing.
* Update step. One GSPO policy-gradient step on the same B*G rows of P + T tokens (one
  minibatch), the same pi_old log-probs and advantages (ours computes them from the
  rewards inside the update, `group_advantages`; tunix is handed the same values), the same
  optax optimizer (ours: `optim.make_optimizer`, AdamW lr 1e-4 with global-norm clip 1.0,
  handed to both), float32. Ours: `gspo_jax.train.step.update` under `jax.jit` with the state
  donated (as in `benchmark.py train`), loss "gspo"; every timed call starts from the same
  state (a copy of the initial one, made before the clock starts), so every call updates
  the same pi_theta against the same pi_old: repeated updates from the state each call
  leaves would drift pi_theta away from pi_old, clip ever more rows, and let the row skip
  skip more in later calls than the first step's dead share says. Theirs: the jitted step tunix's RL trainer runs: a
  `tunix.rl.trainer.Trainer` (a `PeftTrainer`) with the loss function and model-input
  function set exactly as `GRPOLearner.__init__` sets them (`algo_core.grpo_loss_fn` with
  `GRPOConfig(loss_algo="gspo-token", beta=0)`), and the step from
  `Trainer.jit_train_and_eval_step(cache_nnx_graph=True)` (what `Trainer.train` calls: an
  `nnx.jit` of value_and_grad + `optimizer.update` with the optimizer donated), called on a
  `TrainExample`. GSPO-token with per-sequence advantages has GSPO's value and gradient,
  so both sides compute the same loss: the first step's loss and gradient norm of both,
  and the parameters after it, are compared and stored. tunix's clip bounds are
  epsilon = 3e-4 and an `epsilon_high` attribute of 4e-4 (its loss reads it with
  `hasattr`; `GRPOConfig` has no such field), the paper's GSPO range, as ours.
* Timing. Each figure is the median of `--sampling-repeats` / `--update-repeats` calls
  after a first call (reported separately: it includes compilation). The calls of the two
  sides alternate (ours, theirs, ours, theirs, ...) so that both see the same machine
  load; "paired" ratios are the median of the per-round ratios. The load average is
  recorded before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import _bench, _results
from experiments._bench import bench_peak
from gspo_jax.config import LossConfig, RolloutConfig, TrainConfig
from gspo_jax.models import config as our_config
from gspo_jax.models import transformer
from gspo_jax.objectives.advantages import group_advantages
from gspo_jax.objectives.row_skip import RowSkipConfig
from gspo_jax.rollout import sampling
from gspo_jax.train import optim, programs, step

TARGET_SPEEDUP = 2.0
# Stored in the record: exactly what each side's timed call runs.
WHAT_RUNS = {
    "sampling_ours": "jax.device_get(gspo_jax.rollout.sampling.sample_groups(model, prompts_BxP, lens, "
                     "key, SamplerConfig(group_size=G, eos_id=V, ...)))",
    "sampling_ours_repeated_prompts": "the same with prompts repeated G times and group_size=1",
    "sampling_theirs": "tunix.rl.rollout.vanilla_rollout.VanillaRollout(model, tokenizer, "
                       "CacheConfig(cache_size=P+T)).generate(B*G prompt strings, "
                       "RolloutConfig(max_tokens_to_generate=T, temperature=1.0, top_p=1.0, "
                       "top_k=None, max_prompt_length=P, eos_tokens=[V]))",
    "update_ours": "jax.jit(gspo_jax.train.step.update, donate state)(state, batch, rewards_BxG); "
                   "loss 'gspo', 1 minibatch",
    "update_theirs": "tunix.rl.trainer.Trainer(model, optimizer, TrainingConfig)"
                     ".with_loss_fn(grpo_loss_fn wrapper as in GRPOLearner, has_aux=True)"
                     ".with_gen_model_input_fn(as in GRPOLearner).jit_train_and_eval_step("
                     "cache_nnx_graph=True)[0](TrainExample); GRPOConfig(loss_algo='gspo-token', "
                     "beta=0, epsilon=3e-4) + epsilon_high=4e-4",
    "optimizer_both": "gspo_jax.train.optim.make_optimizer(OptimConfig()): clip_by_global_norm(1.0), "
                      "adamw(lr=1e-4, b1=0.9, b2=0.99, weight_decay=0)",
}


def import_tunix():
  """The tunix modules this script drives, or exit 2 with how to install them."""
  try:
    from tunix.generate import utils as gen_utils
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import algo_core, common
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout, vanilla_rollout
    from tunix.sft import peft_trainer
  except ImportError as e:
    print(f"peer_tunix.py needs tunix ({e}). Make a separate venv:\n"
          f"  python3.11 -m venv .venv-tunix\n"
          f"  .venv-tunix/bin/pip install -r requirements.txt google-tunix==0.1.7\n"
          f"  .venv-tunix/bin/python -m experiments.peer_tunix", file=sys.stderr)
    sys.exit(2)
  return argparse.Namespace(
      qwen3=qwen3, gen_utils=gen_utils, algo_core=algo_core, common=common,
      rl_trainer=rl_trainer, grpo_learner=grpo_learner, base_rollout=base_rollout,
      vanilla_rollout=vanilla_rollout, peft_trainer=peft_trainer)


# ------------------------------------------------------------------------------ the model


def our_model_config(args) -> our_config.ModelConfig:
  return our_config.ModelConfig(
      vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers,
      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
      mlp_dim=args.mlp, rope_theta=1e6, rms_eps=1e-6, qk_norm=True,
      tie_embeddings=args.tie_embeddings, dtype="float32", param_dtype="float32")


def their_model_config(tx, cfg: our_config.ModelConfig):
  """tunix's Qwen3 config with the same fields (their hidden_dim = our mlp_dim)."""
  return tx.qwen3.ModelConfig(
      num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden,
      hidden_dim=cfg.mlp_dim, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
      num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_eps,
      use_tied_embedding=cfg.tie_embeddings, dtype=jnp.float32, param_dtype=jnp.float32)


def weight_pairs(ours, theirs) -> list[tuple[str, nnx.Variable, nnx.Variable]]:
  """(name, our parameter, their parameter) for every tensor; the layouts are the same."""
  pairs = [("embed", ours.embed, theirs.embedder.input_embedding),
           ("final_norm", ours.final_norm.weight, theirs.final_norm.w)]
  if ours.lm_head is not None:
    pairs.append(("lm_head", ours.lm_head, theirs.lm_head.w))
  for i, (a, b) in enumerate(zip(ours.layers, theirs.layers)):
    pairs += [(f"layers.{i}.{name}", x, y) for name, x, y in (
        ("attn_norm", a.attn_norm.weight, b.input_layernorm.w),
        ("mlp_norm", a.mlp_norm.weight, b.post_attention_layernorm.w),
        ("attn.q", a.attn.q, b.attn.q_proj.w), ("attn.k", a.attn.k, b.attn.k_proj.w),
        ("attn.v", a.attn.v, b.attn.v_proj.w), ("attn.o", a.attn.o, b.attn.o_proj.w),
        ("attn.q_norm", a.attn.q_norm.weight, b.attn.q_norm.w),
        ("attn.k_norm", a.attn.k_norm.weight, b.attn.k_norm.w),
        ("mlp.gate", a.mlp.gate, b.mlp.gate_proj.kernel),
        ("mlp.up", a.mlp.up, b.mlp.up_proj.kernel),
        ("mlp.down", a.mlp.down, b.mlp.down_proj.kernel))]
  return pairs


def their_model_from(tx, ours):
  """A tunix Qwen3 holding copies of our model's weights (every one of its parameters)."""
  theirs = tx.qwen3.Qwen3(their_model_config(tx, ours.cfg), rngs=nnx.Rngs(1))
  pairs = weight_pairs(ours, theirs)
  for name, a, b in pairs:
    if a[...].shape != b[...].shape:
      raise ValueError(f"{name}: our shape {a[...].shape} != their shape {b[...].shape}")
    b.value = jnp.array(a[...], copy=True)
  n_theirs = len(jax.tree.leaves(nnx.state(theirs, nnx.Param)))
  if n_theirs != len(pairs):
    raise ValueError(f"copied {len(pairs)} tensors but tunix's model has {n_theirs}")
  return theirs


def logits_check(tx, ours, theirs, tokens_BxS) -> dict:
  """Max |logit difference| of the two models on the same tokens (full causal forward)."""
  B, S = tokens_BxS.shape
  positions = jnp.broadcast_to(jnp.arange(S), (B, S))
  ours_logits = ours.logits(ours(tokens_BxS, positions).hidden_BxSxD)
  mask = tx.gen_utils.make_causal_attn_mask(jnp.ones((B, S), bool), S)
  their_logits, _ = theirs(tokens_BxS, positions, None, mask)
  diff = jnp.abs(ours_logits - their_logits)
  return {"tokens": [B, S], "max_abs_diff": float(diff.max()),
          "mean_abs_diff": float(diff.mean()), "max_abs_logit": float(jnp.abs(ours_logits).max())}


def param_count(model) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ------------------------------------------------------------------------------ timing


def first_call(fn) -> tuple[float, object]:
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
  """Wall seconds of each callable, called in turn (A, B, A, B, ...) `repeats` times each.

  Each callable returns only when its work is done (on the host or blocked on). A callable
  with a `reset` method has it called before its clock starts."""
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      getattr(fn, "reset", lambda: None)()
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return times


def paired_speedup(times: dict[str, list[float]], slow: str, fast: str) -> float:
  """Median over rounds of slow / fast seconds: each ratio compares calls made back to back."""
  return statistics.median(a / b for a, b in zip(times[slow], times[fast]))


# ------------------------------------------------------------------------------ sampling


class IdTokenizer:
  """Text = token ids separated by spaces: the cheapest tokenizer tunix's sampler accepts."""

  def __init__(self, eos: int):
    self.eos = eos

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(map(str, ids))

  def bos_id(self):
    return None  # no BOS prepended

  def eos_id(self) -> int:
    return self.eos

  def pad_id(self) -> int:
    return 0


def our_sampler(model, prompts_BxP, args):
  """Ours: one `sample_groups` call (prefix shared by the G responses), fetched to host."""
  B, P = prompts_BxP.shape
  cfg = sampling.SamplerConfig(group_size=args.group, max_new_tokens=args.new_tokens,
                               eos_id=args.vocab, pad_id=0, max_prompt_len=P, temperature=1.0)
  lens = jnp.full((B,), P, jnp.int32)
  key = jax.random.key(0)
  return lambda: jax.device_get(sampling.sample_groups(model, prompts_BxP, lens, key, cfg))


def our_sampler_repeated(model, prompts_BxP, args):
  """Ours without prefix sharing: each prompt repeated G times, one response per row."""
  rows = jnp.repeat(prompts_BxP, args.group, axis=0)
  return our_sampler(model, rows, argparse.Namespace(**{**vars(args), "group": 1}))


def their_sampler(tx, theirs, prompts_BxP, args):
  """Theirs: `VanillaRollout.generate` on the prompts repeated G times, as GRPOLearner."""
  B, P = prompts_BxP.shape
  T = args.new_tokens
  cfg = theirs.config
  rollout = tx.vanilla_rollout.VanillaRollout(
      theirs, IdTokenizer(eos=args.vocab),
      tx.base_rollout.CacheConfig(cache_size=P + T, num_layers=cfg.num_layers,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
  rollout_cfg = tx.base_rollout.RolloutConfig(
      max_tokens_to_generate=T, temperature=1.0, top_p=1.0, top_k=None, max_prompt_length=P,
      kv_cache_size=P + T, eos_tokens=[args.vocab], seed=None)  # None: PRNGKey(0) per call
  texts = [" ".join(map(str, row)) for row in np.repeat(np.asarray(prompts_BxP), args.group, 0)]
  return lambda: rollout.generate(texts, rollout_cfg)


def bench_sampling(tx, ours, theirs, args) -> dict:
  B, P, G, T = args.prompts, args.prompt_len, args.group, args.new_tokens
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, args.vocab, (B, P)), jnp.int32)  # 0 is padding
  fns = {"ours": our_sampler(ours, prompts, args),
         "theirs": their_sampler(tx, theirs, prompts, args),
         "ours_repeated_prompts": our_sampler_repeated(ours, prompts, args)}
  if args.fast_variants:  # the same weights with bfloat16 matmul inputs (float32 accumulation)
    fns["ours_bf16_matmul"] = our_sampler(with_matmul_dtype(ours, "bfloat16"), prompts, args)
  first, outputs = {}, {}
  for name, fn in fns.items():
    first[name], outputs[name] = first_call(fn)
  # Every response must be exactly T tokens long on both sides (no EOS can be drawn).
  ours_len = int(outputs["ours"].lengths_BxG.min()), int(outputs["ours"].lengths_BxG.max())
  their_len = (min(map(len, outputs["theirs"].tokens)), max(map(len, outputs["theirs"].tokens)))
  if ours_len != (T, T) or their_len != (T, T) or len(outputs["theirs"].tokens) != B * G:
    raise RuntimeError(f"responses not all {T} tokens: ours {ours_len}, theirs {their_len}")
  times = interleaved(fns, args.sampling_repeats)
  tokens = B * G * T
  out = {"B": B, "P": P, "G": G, "T": T, "generated_tokens": tokens,
         "response_lengths_ours": ours_len, "response_lengths_theirs": their_len}
  for name in fns:
    sec = statistics.median(times[name])
    out[name] = {"seconds": sec, "all_seconds": times[name], "tokens_per_s": tokens / sec,
                 "first_call_seconds": first[name]}
  out["speedup_ours_over_theirs"] = out["theirs"]["seconds"] / out["ours"]["seconds"]
  out["speedup_ours_repeated_over_theirs"] = (out["theirs"]["seconds"] /
                                              out["ours_repeated_prompts"]["seconds"])
  out["speedup_paired"] = paired_speedup(times, "theirs", "ours")
  out["speedup_repeated_paired"] = paired_speedup(times, "theirs", "ours_repeated_prompts")
  if "ours_bf16_matmul" in fns:
    out["speedup_bf16_matmul_over_theirs"] = out["theirs"]["seconds"] / out["ours_bf16_matmul"]["seconds"]
    out["speedup_bf16_matmul_paired"] = paired_speedup(times, "theirs", "ours_bf16_matmul")
  return out


def with_matmul_dtype(model, matmul_dtype: str):
  """`model`'s parameters under its config with `model.matmul_dtype` set."""
  return with_model_config(model, matmul_dtype=matmul_dtype)


def with_model_config(model, **fields):
  """`model`'s parameters under its config with execution `fields` replaced."""
  mcfg = dataclasses.replace(model.cfg, **fields)
  abstract = nnx.eval_shape(lambda: transformer.Transformer(mcfg, rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.graphdef(abstract), nnx.state(model))


# ------------------------------------------------------------------------------ update


def update_batch(ours, args) -> tuple[step.Batch, jax.Array]:
  """(batch, rewards_BxG): B prompts x G responses of P + T random tokens (no 0: tunix
  treats id 0 as padding), every response token counted, rewards N(0, 1) (the update turns
  them into group-normalised advantages; the first `--degenerate` share of the groups
  all 0: zero advantage) and pi_old = the current policy's log-probs plus N(0, 0.01)
  noise (so that some sequences are clipped, as in a later minibatch)."""
  B, G, P, T = args.prompts, args.group, args.prompt_len, args.new_tokens
  rng = np.random.default_rng(1)
  prompts = jnp.asarray(rng.integers(1, args.vocab, (B, P)), jnp.int32)
  tokens = jnp.asarray(rng.integers(1, args.vocab, (B, G, T)), jnp.int32)
  mask = jnp.ones((B, G, T), jnp.float32)
  rows = step.Batch(prompts, jnp.full((B,), P, jnp.int32), tokens, mask, mask)
  graphdef, params = nnx.split(ours, nnx.Param)
  cfg = our_train_config(ours.cfg, args)
  scfg = programs.step_config(cfg)
  logp = jax.jit(lambda p, r: step.policy_logprobs(p, graphdef, r, scfg)[0])(params, rows)
  noise = jnp.asarray(rng.normal(0.0, 0.01, (B, G, T)), jnp.float32)
  rewards = rng.normal(0.0, 1.0, (B, G))
  rewards[:round(args.degenerate * B)] = 0.0
  return rows.replace(old_logp_BxGxT=logp + noise), jnp.asarray(rewards, jnp.float32)


# Our update's variants beside the plain one: (share_prompts, model.matmul_dtype, row skip,
# model.attention_block = --attention-block).
VARIANTS = {"ours": (False, "", False, False), "ours_shared_prompts": (True, "", False, False),
            "ours_shared_blocks": (True, "", False, True),
            "ours_bf16": (True, "bfloat16", False, False),
            "ours_bf16_skip": (True, "bfloat16", True, False),
            "ours_bf16_blocks": (True, "bfloat16", False, True),
            "ours_bf16_blocks_skip": (True, "bfloat16", True, True)}


def our_train_config(model_cfg, args, share_prompts: bool = False,
                     row_skip: bool = False) -> TrainConfig:
  """GSPO at the clip range handed to tunix as well (the paper's), one minibatch, no KL."""
  return TrainConfig(
      model=model_cfg, loss=LossConfig(name="gspo", eps_low=3e-4, eps_high=4e-4, kl_coef=0.0),
      num_minibatches=1,
      share_prompts=share_prompts, row_skip=RowSkipConfig(enabled=row_skip),
      rollout=RolloutConfig(prompts_per_iter=args.prompts, group_size=args.group,
                            max_new_tokens=args.new_tokens, max_prompt_len=args.prompt_len,
                            temperature=1.0))


class OurUpdate:
  """Ours: `step.update` jitted with the TrainState donated, one minibatch; with
  `share_prompts` each prompt is computed once for its G responses; `matmul_dtype` the
  model's (`models.matmul`); `row_skip` the backward over live rows only; `blocks` the
  responses' causal attention in query blocks of `--attention-block` (`attend_causal`)."""

  def __init__(self, ours, batch: step.Batch, rewards_BxG, args, share_prompts: bool = False,
               matmul_dtype: str = "", row_skip: bool = False, blocks: bool = False,
               start=None):
    if matmul_dtype or blocks:
      ours = with_model_config(ours, matmul_dtype=matmul_dtype,
                               attention_block=args.attention_block if blocks else 0)
    cfg = our_train_config(ours.cfg, args, share_prompts, row_skip)
    graphdef, params = nnx.split(ours, nnx.Param)
    self.tx = optim.make_optimizer(cfg.optim)
    self.graphdef, self.inputs = graphdef, (batch, rewards_BxG)
    # Never donated: every call starts from a copy of it (`reset`). Variants may share one.
    self.start = start or step.TrainState(params=params, opt_state=self.tx.init(params),
                                          step=jnp.zeros((), jnp.int32), key=jax.random.key(0))
    self.reset()
    self.saved_frac: list[float] = []  # row_skip_saved_frac of each call
    scfg = programs.step_config(cfg)
    self.step = jax.jit(lambda s, b, r: step.update(s, b, r, graphdef=graphdef, tx=self.tx,
                                                    cfg=scfg),
                        donate_argnums=(0,))

  def reset(self):
    self.state = jax.block_until_ready(jax.tree.map(jnp.copy, self.start))

  def __call__(self) -> dict:
    self.state, metrics = self.step(self.state, *self.inputs)
    metrics = jax.device_get(metrics)
    if "row_skip_saved_frac" in metrics:
      self.saved_frac.append(float(metrics["row_skip_saved_frac"]))
    return metrics

  def model(self):
    return nnx.merge(self.graphdef, self.state.params)


class TheirUpdate:
  """Theirs: the train step of tunix's RL `Trainer`, set up as `GRPOLearner` sets it up."""

  def __init__(self, tx, theirs, batch: step.Batch, rewards_BxG, optimizer, args):
    algo = tx.grpo_learner.GRPOConfig(num_generations=args.group, num_iterations=1, beta=0.0,
                                      epsilon=3e-4, loss_algo="gspo-token")
    algo.epsilon_high = 4e-4   # read by grpo_loss_fn with hasattr()
    algo.temperature = 1.0     # GRPOLearner copies the rollout temperature here
    pad_id, eos_id = 0, args.vocab
    loss_fn = lambda model, train_example, algo_config: tx.algo_core.grpo_loss_fn(
        model, train_example, algo_config=algo, pad_id=pad_id, eos_id=eos_id)
    self.trainer = tx.rl_trainer.Trainer(
        theirs, optimizer, tx.peft_trainer.TrainingConfig(eval_every_n_steps=10**9),
        custom_checkpoint_metadata_fn=lambda: {})
    self.trainer.with_loss_fn(loss_fn, has_aux=True)
    self.trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    self.step, _ = self.trainer.jit_train_and_eval_step(skip_jit=False, cache_nnx_graph=True)
    self.example = their_example(tx, batch, rewards_BxG)

  def __call__(self) -> dict:
    loss, aux, grad_norm = self.step(self.example)
    return jax.device_get({"loss": loss, "grad_norm": grad_norm, **aux})


def their_example(tx, b: step.Batch, rewards_BxG):
  """The same B*G rows as tunix's `TrainExample`: each prompt repeated for its G responses
  (unpadded, so left = right padding), and the advantages our update computes from the
  rewards."""
  B, G, T = b.tokens_BxGxT.shape
  prompts = jnp.repeat(b.prompts_BxP, G, axis=0)
  flat = lambda x: x.reshape(B * G, T)
  return tx.common.TrainExample(
      prompt_ids=prompts, prompt_mask=jnp.ones(prompts.shape, bool),
      completion_ids=flat(b.tokens_BxGxT), completion_mask=flat(b.mask_BxGxT).astype(bool),
      advantages=group_advantages(rewards_BxG).reshape(B * G), ref_per_token_logps=None,
      old_per_token_logps=flat(b.old_logp_BxGxT))


def max_abs_diff(ours, theirs) -> float:
  """Largest |our parameter - their parameter| over all tensors."""
  return max(float(jnp.abs(a[...] - b[...]).max()) for _, a, b in weight_pairs(ours, theirs))


def max_abs_diff_ours(model_a, model_b) -> float:
  """Largest |parameter difference| between two of our models."""
  a, b = nnx.state(model_a, nnx.Param), nnx.state(model_b, nnx.Param)
  return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def bench_update(tx, ours, args) -> dict:
  batch, rewards = update_batch(ours, args)
  theirs = their_model_from(tx, ours)
  names = [n for n in VARIANTS if (n in ("ours", "ours_shared_prompts") or args.fast_variants)
           and n not in args.skip_variants]
  steps = {}
  for name in names:  # one start state for all (the same parameters and optimizer)
    start = next(iter(steps.values())).start if steps else None
    steps[name] = OurUpdate(ours, batch, rewards, args, *VARIANTS[name], start=start)
  ref = steps.get("ours") or next(iter(steps.values()))
  their_step = TheirUpdate(tx, theirs, batch, rewards, ref.tx, args)
  firsts = {name: first_call(fn) for name, fn in steps.items()}
  first_theirs, m_theirs = first_call(their_step)
  m_ref = firsts["ours" if "ours" in steps else names[0]][1]
  check = {"loss_ours": float(m_ref["loss"]), "loss_theirs": float(m_theirs["loss"]),
           "grad_norm_ours": float(m_ref["grad_norm"]),
           "grad_norm_theirs": float(m_theirs["grad_norm"]),
           "clip_frac_seq_ours": float(m_ref["clip_frac_seq"]),
           "clip_frac_token_theirs": float(m_theirs["pg_clipfrac"]),
           # Adam's first step moves each parameter by about lr * sign(gradient): the
           # scale against which the difference between the two updated models is small.
           "max_abs_param_change_ours": max_abs_diff_ours(ref.model(), ours),
           "max_abs_param_diff_after_step": max_abs_diff(ref.model(), theirs)}
  if "ours_shared_prompts" in steps:
    m_shared = firsts["ours_shared_prompts"][1]
    check.update(loss_ours_shared=float(m_shared["loss"]),
                 grad_norm_ours_shared=float(m_shared["grad_norm"]),
                 max_abs_param_diff_shared_after_step=max_abs_diff(
                     steps["ours_shared_prompts"].model(), theirs))
  for name in set(steps) - {"ours", "ours_shared_prompts"}:
    m = firsts[name][1]
    check[f"loss_{name}"], check[f"grad_norm_{name}"] = float(m["loss"]), float(m["grad_norm"])
    check[f"max_abs_param_diff_{name}_after_step"] = max_abs_diff(steps[name].model(), theirs)
    if "row_skip_dead_frac" in m:
      check[f"row_skip_dead_frac_{name}"] = float(m["row_skip_dead_frac"])
      check[f"row_skip_saved_frac_{name}"] = float(m["row_skip_saved_frac"])
  times = interleaved({**steps, "theirs": their_step}, args.update_repeats)
  R, S = args.prompts * args.group, args.prompt_len + args.new_tokens
  flops = _bench.update_flops(ours.cfg, R, args.prompt_len, args.new_tokens)
  out = {"rows": R, "P": args.prompt_len, "T": args.new_tokens, "tokens_per_step": R * S,
         "model_flops": flops["step"], "first_step_check": check}
  for name, first in [(n, firsts[n][0]) for n in steps] + [("theirs", first_theirs)]:
    med = statistics.median(times[name])
    out[name] = {"seconds": med, "all_seconds": times[name], "first_call_seconds": first,
                 "model_gflops_per_s": flops["step"] / med / 1e9}
    if getattr(steps.get(name), "saved_frac", None):  # the timed calls' (after the first)
      out[name]["row_skip_saved_frac"] = steps[name].saved_frac[1:]
  for name in set(steps) - {"ours", "ours_shared_prompts"}:
    out[f"speedup_{name}_over_theirs"] = out["theirs"]["seconds"] / out[name]["seconds"]
    out[f"speedup_{name}_paired"] = paired_speedup(times, "theirs", name)
  for name, short in (("ours", ""), ("ours_shared_prompts", "_shared")):
    if name in steps:
      out[f"speedup_ours{short}_over_theirs"] = out["theirs"]["seconds"] / out[name]["seconds"]
      out[f"speedup{short}_paired"] = paired_speedup(times, "theirs", name)
  return out


# ------------------------------------------------------------------------------ report


def print_report(r: dict) -> None:
  lc = r["logits_check"]
  print(f"model: {r['params'] / 1e6:.2f}M params; logits max |ours - theirs| = "
        f"{lc['max_abs_diff']:.2e} (max |logit| {lc['max_abs_logit']:.2f})")
  for s in r["sampling"]:
    print_sampling(r, s)
  for u in r.get("updates", []):
    print_update({**r, "update": u})
  for row in r["peak"]["rows"]:
    print(f"matmul peak here, {row['n']}^2: float32 {row['gflops']:.1f} GFLOP/s, bfloat16 -> "
          f"float32 {row['bf16_f32acc_gflops']:.1f}")
  met = lambda k: "met" if r["target_met"][k] else "NOT met"
  print(f"\ntarget >= {TARGET_SPEEDUP}x: sampling "
        + (met('sampling') if r["sampling"] else "not measured")
        + "".join(f", {k} {met(k)}" for k in r["target_met"] if k.startswith("update"))
        + f"; load average {r['load_average_before'][0]:.2f} -> {r['load_average_after'][0]:.2f}")


def print_sampling(r: dict, s: dict) -> None:
  print(f"\nsampling: B={s['B']} prompts x G={s['G']}, P={s['P']}, T={s['T']} new tokens "
        f"({s['generated_tokens']} tokens), median of {r['args']['sampling_repeats']}, interleaved")
  print(f"{'side':38} {'seconds':>8} {'tokens/s':>10} {'first call s':>13}")
  names = {"ours": "ours (sample_groups, shared prefix)",
           "ours_repeated_prompts": "ours, prompts repeated G times",
           "theirs": "tunix (VanillaRollout / Sampler)",
           "ours_bf16_matmul": "ours, model.matmul_dtype=bfloat16"}
  for k, label in [(k, v) for k, v in names.items() if k in s]:
    x = s[k]
    print(f"{label:38} {x['seconds']:8.3f} {x['tokens_per_s']:10.0f} {x['first_call_seconds']:13.2f}")
  print(f"ours / tunix tokens/s: {s['speedup_ours_over_theirs']:.2f}x, paired "
        f"{s['speedup_paired']:.2f}x (without prefix sharing: "
        f"{s['speedup_ours_repeated_over_theirs']:.2f}x, paired {s['speedup_repeated_paired']:.2f}x)"
        + (f"; bfloat16 matmul inputs {s['speedup_bf16_matmul_over_theirs']:.2f}x, paired "
           f"{s['speedup_bf16_matmul_paired']:.2f}x" if "ours_bf16_matmul" in s else ""))


def print_update(r: dict) -> None:
  u = r["update"]
  c = u["first_step_check"]
  print(f"\nupdate step: {u['rows']} rows x ({u['P']} + {u['T']}) tokens, GSPO, AdamW; first "
        f"step loss {c['loss_ours']:.6f} vs {c['loss_theirs']:.6f}, grad norm "
        f"{c['grad_norm_ours']:.6f} vs {c['grad_norm_theirs']:.6f}, params after it differ "
        f"by <= {c['max_abs_param_diff_after_step']:.1e} (ours moved them by <= "
        f"{c['max_abs_param_change_ours']:.1e})")
  print(f"{'side':38} {'seconds':>8} {'first call s':>13}")
  for name, label in (("ours", "ours (step.update)"), ("ours_shared_prompts", "ours, share_prompts=True"),
                      ("theirs", "tunix (rl Trainer train step)")):
    if name in u:
      print(f"{label:38} {u[name]['seconds']:8.3f} {u[name]['first_call_seconds']:13.2f}")
  if "ours" in u and "ours_shared_prompts" in u:
    print(f"ours / tunix update speed: {u['speedup_ours_over_theirs']:.2f}x, paired "
          f"{u['speedup_paired']:.2f}x; with share_prompts {u['speedup_ours_shared_over_theirs']:.2f}x, "
          f"paired {u['speedup_shared_paired']:.2f}x (median of {r['args']['update_repeats']}, "
          f"interleaved; shared first step: loss {c['loss_ours_shared']:.6f}, params within "
          f"{c['max_abs_param_diff_shared_after_step']:.1e} of tunix's)")
  elif "ours_shared_prompts" in u:
    print(f"ours with share_prompts / tunix: {u['speedup_ours_shared_over_theirs']:.2f}x, paired "
          f"{u['speedup_shared_paired']:.2f}x")
  for name in [n for n in VARIANTS if n in u and n not in ("ours", "ours_shared_prompts")]:
    dead = c.get(f"row_skip_dead_frac_{name}")
    print(f"{name:38} {u[name]['seconds']:8.3f} {u[name]['first_call_seconds']:13.2f}  "
          f"{u[f'speedup_{name}_over_theirs']:.2f}x tunix, paired "
          f"{u[f'speedup_{name}_paired']:.2f}x; first step loss {c[f'loss_{name}']:.6f}"
          + (f", rows dead {dead:.0%}, left out of the backward "
             f"{max(u[name].get('row_skip_saved_frac', [0])):.0%}" if dead is not None else ""))
  print("model GFLOP/s: " + ", ".join(f"{n} {u[n]['model_gflops_per_s']:.1f}"
                                      for n in list(VARIANTS) + ["theirs"] if n in u))


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--vocab", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=32)
  p.add_argument("--mlp", type=int, default=768)
  p.add_argument("--tie-embeddings", action="store_true")
  p.add_argument("--prompts", type=int, default=4, help="B")
  p.add_argument("--prompt-len", type=int, default=64, help="P (a power of 2: tunix pads to one)")
  p.add_argument("--group", type=int, default=8, help="G responses per prompt")
  p.add_argument("--new-tokens", type=int, nargs="+", default=[64],
                 help="T, one sampling comparison per value (each alternated ours/theirs)")
  p.add_argument("--sampling-only", action="store_true", help="skip the update comparison")
  p.add_argument("--update-only", action="store_true", help="skip the sampling comparison")
  p.add_argument("--degenerate", type=float, default=0.0,
                 help="share of the update's groups whose rewards are all equal (zero "
                      "advantage: their rows have no gradient), as in a real run's batches")
  p.add_argument("--update-tokens", type=int, nargs="+", default=None,
                 help="T of each update comparison (default: the first --new-tokens)")
  p.add_argument("--skip-variants", nargs="+", default=[], choices=list(VARIANTS),
                 help="leave these of our update's variants out (memory: each holds a copy "
                      "of the state and its compiled programs)")
  p.add_argument("--fast-variants", action="store_true",
                 help="also time our update with model.matmul_dtype=bfloat16 (share_prompts "
                      "on), with and without row_skip, and with model.attention_block")
  p.add_argument("--attention-block", type=int, default=128,
                 help="model.attention_block of the *_blocks variants (query block size)")
  p.add_argument("--sampling-repeats", type=int, default=15)
  p.add_argument("--update-repeats", type=int, default=5)
  p.add_argument("--out", default=None, help="JSON record path (default: peer_tunix.json "
                 "under runs/results/, or experiments/results/ with --record)")
  _results.add_record_arg(p)
  return p


def versions() -> dict:
  get = importlib.metadata.version
  return {name: get(name) for name in ("jax", "jaxlib", "flax", "optax", "google-tunix")}


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = build_parser()
  args = parser.parse_args(argv)
  if not 0.0 <= args.degenerate <= 1.0:
    parser.error(f"--degenerate must be a share in [0, 1]; got {args.degenerate}")
  tx = import_tunix()
  load_before = os.getloadavg()
  t0 = time.perf_counter()
  ours = transformer.create(our_model_config(args))
  theirs = their_model_from(tx, ours)
  tokens = jnp.asarray(np.random.default_rng(2).integers(1, args.vocab, (2, 64)), jnp.int32)
  record = {"command": "python -m experiments.peer_tunix " + " ".join(argv), "args": vars(args),
            "machine": _bench.machine(), "versions": versions(), "what_runs": WHAT_RUNS,
            "model": dataclasses.asdict(ours.cfg), "params": param_count(ours),
            "logits_check": logits_check(tx, ours, theirs, tokens)}
  # The matmul ceilings in this process, float32 and bfloat16 -> float32 (benchmark.py peak).
  record["peak"] = bench_peak(argparse.Namespace(sizes=[1024, 2048], repeats=3))
  record["sampling"] = [] if args.update_only else [bench_sampling(tx, ours, theirs, argparse.Namespace(
      **{**vars(args), "new_tokens": T})) for T in args.new_tokens]
  record["target_met"] = {"sampling": all(s["speedup_ours_over_theirs"] >= TARGET_SPEEDUP
                                          for s in record["sampling"])}
  if record["sampling"] and not args.sampling_only:  # kept should the update fail
    _results.write_record(args, "peer_tunix.json", record)
  if not args.sampling_only:
    record["updates"] = [bench_update(tx, ours, argparse.Namespace(**{**vars(args), "new_tokens": T}))
                         for T in (args.update_tokens or args.new_tokens[:1])]
    record["update"] = record["updates"][0]
    for target, name in (("update", "ours"), ("update_share_prompts", "ours_shared"),
                         ("update_ours_bf16", "ours_bf16"),
                         ("update_ours_bf16_skip", "ours_bf16_skip"),
                         ("update_ours_bf16_blocks", "ours_bf16_blocks"),
                         ("update_ours_bf16_blocks_skip", "ours_bf16_blocks_skip")):
      if all(f"speedup_{name}_over_theirs" in u for u in record["updates"]):
        record["target_met"][target] = all(
            u[f"speedup_{name}_over_theirs"] >= TARGET_SPEEDUP for u in record["updates"])
  record["seconds"] = time.perf_counter() - t0
  record["load_average_before"], record["load_average_after"] = load_before, os.getloadavg()
  print_report(record)
  _results.write_record(args, "peer_tunix.json", record)


if __name__ == "__main__":
  main()
