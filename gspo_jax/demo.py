"""A small GSPO run on CPU that visibly learns, built only from the loss library.

It lives in the package, not in experiments/, because it is the smallest complete example
of composing the public loss API into a training loop of your own, and it runs from an
installed package (`python -m gspo_jax.demo`) in about ten seconds. The policy is tabular: for each prompt p and position t it holds logits over 10 digits
and an end-of-sequence token, so pi(y | p) = prod_t softmax(theta[p, t])[y_t] up to the
first EOS. The task is verifiable: prompt p must be answered with its own hidden digit
string followed by EOS. Reward = fraction of the L + 1 target positions (digits and the
EOS) reproduced; positions after an early EOS count as wrong.

Each iteration follows the paper's recipe: sample G responses per prompt with the
rollout policy, score them, group-normalise the rewards (Eq. 6), record the rollout
log-probs as pi_old, then split the B*G responses into minibatches (4 by default) and
take one optax step per minibatch, so all but the first are off-policy.

Shapes: the package legend (docs/shapes.md); n the prompts in the task
(lowercase: this module's own), R = B*G responses, A the answer's digits and EOS.

    python -m gspo_jax.demo --config configs/demo.py [--set loss=grpo --set iterations=80]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gspo_jax.models.logprobs import token_logprobs
from gspo_jax.objectives import losses
from gspo_jax.objectives.advantages import group_advantages
from gspo_jax.utils import configlib

NUM_DIGITS = 10
EOS = NUM_DIGITS  # token id of end-of-sequence
VOCAB = NUM_DIGITS + 1


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Static knobs of the demo. eps_* default to the GSPO entry of `losses.LOSS_DEFAULTS`
  (the paper's 3e-4, 4e-4)."""
  loss: str = "gspo"
  eps_low: float = losses.LOSS_DEFAULTS["gspo"]["eps_low"]
  eps_high: float = losses.LOSS_DEFAULTS["gspo"]["eps_high"]
  num_prompts: int = 64            # P
  answer_len: int = 5              # L digits, then EOS
  max_len: int = 7                 # T
  prompts_per_iter: int = 16       # B
  group_size: int = 8              # G
  num_minibatches: int = 4
  learning_rate: float = 0.05
  iterations: int = 200
  seed: int = 0
  log_every: int = 20

  def __post_init__(self):
    # The demo passes eps_low / eps_high: the losses that take a clip range.
    losses_ = tuple(k for k, d in losses.LOSS_DEFAULTS.items() if "eps_low" in d)
    if self.loss not in losses_:
      raise ValueError(f"DemoConfig.loss must be one of {losses_}; got {self.loss!r}")
    if self.max_len < self.answer_len + 1:
      raise ValueError(f"DemoConfig.max_len ({self.max_len}) must leave room for answer_len "
                       f"({self.answer_len}) digits and EOS")
    if (self.prompts_per_iter * self.group_size) % self.num_minibatches:
      raise ValueError("DemoConfig: prompts_per_iter * group_size must divide into "
                       f"num_minibatches ({self.num_minibatches})")
    for name in ("eps_low", "eps_high", "learning_rate"):
      if not getattr(self, name) > 0:
        raise ValueError(f"DemoConfig.{name} must be > 0; got {getattr(self, name)}")


@flax.struct.dataclass
class TrainState:
  logits_nxTxV: jax.Array
  opt_state: optax.OptState
  step: jax.Array
  key: jax.Array


@flax.struct.dataclass
class Rollout:
  prompt_ids_R: jax.Array
  tokens_RxT: jax.Array
  mask_RxT: jax.Array
  old_logp_RxT: jax.Array
  adv_R: jax.Array
  reward_BxG: jax.Array


def response_mask(tokens_RxT: jax.Array) -> jax.Array:
  """1 up to and including the first EOS; the whole row if there is none (truncated)."""
  is_eos = tokens_RxT == EOS
  eos_before = jnp.cumsum(is_eos, axis=-1) - is_eos  # EOS strictly before t
  return (eos_before == 0).astype(jnp.float32)


def reward(tokens_RxT, mask_RxT, target_RxA) -> jax.Array:
  """Fraction of the answer_len + 1 target tokens (digits, then EOS) reproduced."""
  A = target_RxA.shape[-1]
  hit = (tokens_RxT[:, :A] == target_RxA) & (mask_RxT[:, :A] > 0)
  return jnp.mean(hit.astype(jnp.float32), axis=-1)


def policy_logprobs(logits_nxTxV, prompt_ids_R, tokens_RxT) -> jax.Array:
  return token_logprobs(logits_nxTxV[prompt_ids_R], tokens_RxT)


def make_task(cfg: DemoConfig) -> np.ndarray:
  """Hidden answers, target_nxA: L random digits then EOS (fixed by the seed)."""
  rng = np.random.default_rng(cfg.seed)
  digits = rng.integers(0, NUM_DIGITS, (cfg.num_prompts, cfg.answer_len))
  return np.concatenate([digits, np.full((cfg.num_prompts, 1), EOS)], axis=1)


def rollout(state: TrainState, target_nxA: jax.Array, cfg: DemoConfig) -> Rollout:
  """Sample B prompts x G responses, score them, and record pi_old log-probs."""
  B, G, T = cfg.prompts_per_iter, cfg.group_size, cfg.max_len
  key = jax.random.fold_in(state.key, state.step)
  k_prompts, k_tokens = jax.random.split(key)
  prompts_B = jax.random.choice(k_prompts, cfg.num_prompts, (B,), replace=False)
  prompt_ids_R = jnp.repeat(prompts_B, G)
  logits_RxTxV = state.logits_nxTxV[prompt_ids_R]
  tokens_RxT = jax.random.categorical(k_tokens, logits_RxTxV)
  mask_RxT = response_mask(tokens_RxT)
  reward_R = reward(tokens_RxT, mask_RxT, target_nxA[prompt_ids_R])
  reward_BxG = reward_R.reshape(B, G)
  adv_R = group_advantages(reward_BxG).reshape(B * G)
  old_logp_RxT = token_logprobs(logits_RxTxV, tokens_RxT)
  del T
  return Rollout(prompt_ids_R, tokens_RxT, mask_RxT, old_logp_RxT, adv_R, reward_BxG)


def update(state: TrainState, batch: Rollout, cfg: DemoConfig, tx: optax.GradientTransformation):
  """One pass over the rollout in `num_minibatches` shuffled minibatches, one step each."""
  loss_fn = losses.LOSSES[cfg.loss]
  num = batch.adv_R.shape[0]
  perm = jax.random.permutation(jax.random.fold_in(state.key, -state.step - 1), num)
  shuffled = jax.tree.map(lambda x: x[perm].reshape(cfg.num_minibatches, -1, *x.shape[1:]),
                          (batch.prompt_ids_R, batch.tokens_RxT, batch.mask_RxT,
                           batch.old_logp_RxT, batch.adv_R))

  def objective(logits, mb):
    prompt_ids, tokens, mask, old_logp, adv = mb
    logp = policy_logprobs(logits, prompt_ids, tokens)
    return loss_fn(logp, old_logp, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high)

  def step(carry, mb):
    logits, opt_state = carry
    (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(logits, mb)
    updates, opt_state = tx.update(grads, opt_state, logits)
    return (optax.apply_updates(logits, updates), opt_state), metrics

  (logits, opt_state), metrics = jax.lax.scan(step, (state.logits_nxTxV, state.opt_state),
                                              shuffled)
  new_state = state.replace(logits_nxTxV=logits, opt_state=opt_state, step=state.step + 1)
  return new_state, jax.tree.map(jnp.mean, metrics)


def init_state(cfg: DemoConfig, tx: optax.GradientTransformation) -> TrainState:
  logits = jnp.zeros((cfg.num_prompts, cfg.max_len, VOCAB), jnp.float32)
  return TrainState(logits, tx.init(logits), jnp.zeros((), jnp.int32),
                    jax.random.key(cfg.seed))


def greedy_accuracy(state: TrainState, target_nxA: jax.Array) -> float:
  """Exact-match rate of the argmax answer over all prompts."""
  tokens = jnp.argmax(state.logits_nxTxV, axis=-1)
  r = reward(tokens, response_mask(tokens), target_nxA)
  return float(jnp.mean(r == 1.0))


def train(cfg: DemoConfig, *, out=None) -> dict[str, list[float]]:
  """Run the demo; returns per-iteration history (reward, accuracy, metrics)."""
  out = out or sys.stdout
  tx = optax.adam(cfg.learning_rate)
  target = jnp.asarray(make_task(cfg))
  state = init_state(cfg, tx)
  rollout_fn = jax.jit(lambda s: rollout(s, target, cfg))
  update_fn = jax.jit(lambda s, b: update(s, b, cfg, tx), donate_argnums=(0,))
  history: dict[str, list[float]] = {"reward": [], "exact": [], "greedy_acc": [],
                                     "clip_frac_token": [], "ratio_max": []}
  print(f"# demo: tabular policy, {cfg.num_prompts} prompts, answers of {cfg.answer_len} digits + "
        f"EOS; loss={cfg.loss} eps=({cfg.eps_low:g}, {cfg.eps_high:g}), B={cfg.prompts_per_iter} "
        f"G={cfg.group_size}, {cfg.num_minibatches} minibatches per rollout", file=out)
  print(f"{'iter':>5} {'reward':>7} {'exact':>6} {'greedy':>7} {'clip_tok':>9} {'ratio_max':>10} "
        f"{'sec':>6}", file=out)
  start = time.perf_counter()
  for it in range(cfg.iterations):
    batch = rollout_fn(state)
    state, metrics = update_fn(state, batch)
    r = np.asarray(batch.reward_BxG)
    history["reward"].append(float(r.mean()))
    history["exact"].append(float((r == 1.0).mean()))
    history["clip_frac_token"].append(float(metrics["clip_frac_token"]))
    history["ratio_max"].append(float(metrics["ratio_max"]))
    if it % cfg.log_every == 0 or it == cfg.iterations - 1:
      history["greedy_acc"].append(greedy_accuracy(state, target))
      print(f"{it:5d} {history['reward'][-1]:7.3f} {history['exact'][-1]:6.3f} "
            f"{history['greedy_acc'][-1]:7.3f} {history['clip_frac_token'][-1]:9.4f} "
            f"{history['ratio_max'][-1]:10.5f} {time.perf_counter() - start:6.1f}", file=out)
  k = max(1, min(5, cfg.iterations // 4))
  first, last = np.mean(history["reward"][:k]), np.mean(history["reward"][-k:])
  print(f"# mean reward, first {k} iterations: {first:.3f}; last {k}: {last:.3f}; greedy exact "
        f"match on all prompts: {history['greedy_acc'][-1]:.3f}", file=out)
  return history


def load_config(path: str | None, overrides: list[str]) -> DemoConfig:
  """`get_config()` from a Python config file (or the defaults), then `key=value` overrides."""
  cfg = configlib.load_config(path) if path else DemoConfig()
  try:
    return configlib.apply_overrides(cfg, overrides)
  except ValueError as e:
    raise SystemExit(f"config error: {e}") from None


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  configlib.add_cli_args(parser)
  args = parser.parse_args(argv)
  train(load_config(args.config, args.set))


if __name__ == "__main__":
  main()
