"""Cold start: a short supervised stage on task demonstrations before RL (the paper starts
RL from a cold-start fine-tuned model).

The loss (`sft_loss`) is the negative mean log-likelihood of the demonstration tokens
(+ EOS) given the prompt, by the same teacher forcing as the RL update; the step is the
run's `programs.sft` (params and optimiser state donated). `run` is a `gspo_jax.train.run.Run`
(unannotated: this phase imports nothing of the run setup).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from gspo_jax.lora import adapters as lora
from gspo_jax.parallel import sharding
from gspo_jax.rollout.teacher_forcing import response_logprobs
from gspo_jax.utils import rng


def sft_loss(params, graphdef, prompts_BxP, lens_B, tokens_BxT, mask_BxT):
  """Negative mean log-likelihood of the demonstration tokens (+ EOS) given the prompt, by
  the same teacher forcing as the RL update (temperature 1)."""
  model = lora.model_of(graphdef, params)
  logp_Bx1xT, _ = response_logprobs(model, prompts_BxP, lens_B, tokens_BxT[:, None])
  return -jnp.sum(logp_Bx1xT[:, 0] * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1)


def sft_step(params, opt_state, batch, *, graphdef, tx):
  """One cold-start step on a (prompts_BxP, lens_B, tokens_BxT, mask_BxT) batch."""
  loss, grads = jax.value_and_grad(sft_loss)(params, graphdef, *batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def supervised_batch(run, examples):
  """This process's rows of a global demonstration batch, fed as global arrays:
  (prompts_BxP, lens_B, tokens_BxT, mask_BxT); the solutions as the run's kind of rollout
  writes them (`Run.rollout.demonstrations`)."""
  mesh = run.layout.mesh
  B = len(examples)
  mine = sharding.local_part(examples, mesh)
  prompts, lens = run.encode_prompts([e.prompt for e in mine])
  tokens, mask = run.rollout.demonstrations(run, mine)
  return tuple(sharding.feed(x, mesh, B) for x in (prompts, lens, tokens, mask))


# The line that says the target was reached (experiments read it from the run's log).
REACHED = "cold start reached the target"


def cold_start(run, *, probe_accuracy: Callable | None = None, log=print):
  """Up to `cfg.sft.steps` AdamW steps (warmup-cosine schedule) from `run.state.params`,
  stopping early once `probe_accuracy(params, probe)` (the loop passes greedy accuracy,
  `evaluate.evaluate`) on a probe of train-split problems reaches `cfg.sft.target_accuracy`.
  The held-out set is never looked at. Returns the new params (sharded like the run's);
  `run.state` itself is left as it was."""
  cfg, task = run.cfg, run.task
  if cfg.sft.steps <= 0:
    return run.state.params
  if cfg.sft.target_accuracy and probe_accuracy is None:
    raise ValueError("cold_start: sft.target_accuracy > 0 needs probe_accuracy (the loop "
                     "passes the greedy accuracy of gspo_jax.evaluate)")
  probe = task.sample(rng.host_rng(cfg.seed, "sft_probe"), cfg.sft.probe_size, "train")
  params = jax.tree.map(jnp.copy, run.state.params)  # the step donates its inputs
  opt_state = run.programs.sft_init(params)
  draws = rng.host_rng(cfg.seed, "sft_batches")
  for i in range(cfg.sft.steps):
    batch = supervised_batch(run, task.sample(draws, cfg.sft.batch_size, "train"))
    params, opt_state, loss = run.programs.sft(params, opt_state, batch)
    done = i + 1
    if cfg.sft.target_accuracy and done % cfg.sft.check_every == 0:
      acc = probe_accuracy(params, probe)
      log(f"cold start step {done:4d}/{cfg.sft.steps}: loss {float(loss):.4f}, "
          f"train-probe accuracy {acc:.3f}")
      if acc >= cfg.sft.target_accuracy:
        log(f"{REACHED} accuracy {cfg.sft.target_accuracy} at step {done}")
        break
    elif not cfg.sft.target_accuracy and (i % max(cfg.sft.steps // 5, 1) == 0 or
                                          done == cfg.sft.steps):
      log(f"cold start step {done:4d}/{cfg.sft.steps}: loss {float(loss):.4f}")
  return params
