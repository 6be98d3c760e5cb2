"""Cold start: a short supervised stage on task demonstrations before RL.

The SFT loss is the negative mean log-likelihood of the demonstration tokens (+ EOS) given
the prompt, computed with the same teacher-forced `response_logprobs` the RL update uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gspo_jax import sharding
from gspo_jax import train as T


def _sft_loss(params, graphdef, prompts_RxP, lens_R, tokens_RxT, mask_RxT):
  logp = T.score_logprobs(params, graphdef, prompts_RxP, lens_R, tokens_RxT, 1.0)
  return -jnp.sum(logp * mask_RxT) / jnp.maximum(jnp.sum(mask_RxT), 1)


def _sft_step(params, opt_state, batch, *, graphdef, tx):
  loss, grads = jax.value_and_grad(_sft_loss)(params, graphdef, *batch)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def sft_program(graphdef, tx, ps, os_, mesh):
  """The cold start's one compiled step: params (shardings `ps`) and optimiser state (`os_`)
  donated, batch rows split over the batch mesh axes."""
  rows = lambda ndim: sharding.batch_sharding(mesh, ndim)
  return jax.jit(functools.partial(_sft_step, graphdef=graphdef, tx=tx),
                 in_shardings=(ps, os_, (rows(2), rows(1), rows(2), rows(2))),
                 out_shardings=(ps, os_, sharding.replicated(mesh)), donate_argnums=(0, 1))


def supervised_batch(task, tok, rng, cfg: "T.TrainConfig", mesh):
  """This process's rows of a global demonstration batch, fed as global arrays."""
  B = cfg.sft.batch_size
  examples = T.local_examples(task.sample(rng, B, "train"), mesh)
  prompts, lens = T.encode_prompts(tok, examples, cfg.rollout.max_prompt_len)
  tokens, mask = T.encode_completions(tok, [task.demonstration(e) for e in examples],
                                      cfg.rollout.max_new_tokens)
  return tuple(T.feed(x, mesh, B) for x in (prompts, lens, tokens, mask))


def _probe_accuracy(params, graphdef, task, tok, probe, cfg, mesh) -> float:
  from gspo_jax import evaluate
  return evaluate.evaluate(params, graphdef, task, tok, probe, cfg, mesh=mesh)["accuracy"]


def cold_start(params, graphdef, task, tok, cfg: "T.TrainConfig", *, mesh, log=print):
  """Up to `cfg.sft.steps` AdamW steps (warmup-cosine schedule), stopping early once the
  greedy accuracy on a probe of train-split problems reaches `cfg.sft.target_accuracy`.
  The held-out set is never looked at. Returns the new params (sharded like `params`)."""
  if cfg.sft.steps <= 0:
    return params
  probe = task.sample(np.random.default_rng([cfg.seed, 4_242_424]), cfg.sft.probe_size, "train")
  warmup = max(cfg.sft.steps // 10, 1)
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.sft.learning_rate, warmup,
                                                max(cfg.sft.steps, warmup + 1))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  ps = sharding.param_shardings(params, mesh)
  os_ = sharding.optimizer_shardings(tx, params, ps, mesh)
  step_fn = sft_program(graphdef, tx, ps, os_, mesh)
  params = jax.tree.map(jnp.copy, params)  # the caller's params stay valid (donation below)
  opt_state = jax.jit(tx.init, in_shardings=(ps,), out_shardings=os_)(params)
  rng = np.random.default_rng([cfg.seed, 10_000_019])
  for step in range(cfg.sft.steps):
    batch = supervised_batch(task, tok, rng, cfg, mesh)
    params, opt_state, loss = step_fn(params, opt_state, batch)
    done = step + 1
    if cfg.sft.target_accuracy and done % cfg.sft.check_every == 0:
      acc = _probe_accuracy(params, graphdef, task, tok, probe, cfg, mesh)
      log(f"cold start step {done:4d}/{cfg.sft.steps}: loss {float(loss):.4f}, "
          f"train-probe accuracy {acc:.3f}")
      if acc >= cfg.sft.target_accuracy:
        log(f"cold start reached the target accuracy {cfg.sft.target_accuracy} at step {done}")
        break
    elif not cfg.sft.target_accuracy and (step % max(cfg.sft.steps // 5, 1) == 0 or
                                          done == cfg.sft.steps):
      log(f"cold start step {done:4d}/{cfg.sft.steps}: loss {float(loss):.4f}")
  return params
