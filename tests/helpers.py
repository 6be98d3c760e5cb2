"""Helpers that more than one test file uses: small configs and runs, rollouts and rewards
made by hand, loss batches, the sampler's compiled HLO, Hugging Face fixture logits and a
character tokenizer with a chat template. No test file imports another test file: what
two of them share lives here (the multi-turn pieces in tests/multiturn_helpers.py, Adam's
tolerances in tests/adam_bounds.py)."""

import functools
import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import config as C
from gspo_jax.models import config as model_config
from gspo_jax.parallel import sharding
from gspo_jax.rollout import sampling
from gspo_jax.train.collect import rollout_step

# -- configs --------------------------------------------------------------------------------

# The model of the small single-device runs (24-token vocabulary, width 32).
TINY_MODEL = model_config.tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2,
                               num_kv_heads=1, head_dim=16)


def tiny_cfg(**kw) -> C.TrainConfig:
  """A whole single-device run on the tiny model: 4 prompts x 4, two iterations, a short
  cold start."""
  base = dict(
      model=TINY_MODEL,
      rollout=C.RolloutConfig(prompts_per_iter=4, group_size=4, max_new_tokens=4, max_prompt_len=8),
      sft=C.SFTConfig(steps=30, batch_size=32, learning_rate=3e-3),
      optim=C.OptimConfig(learning_rate=1e-3),
      iterations=2, eval_every=0, eval_size=16, num_minibatches=2,
      mesh=sharding.MeshConfig(num_devices=1))
  return C.TrainConfig(**{**base, **kw})


def correction_cfg(**kw) -> C.TrainConfig:
  """tiny_cfg's run without a cold start, one iteration, token-level rollout correction."""
  base = dict(
      model=TINY_MODEL,
      rollout=C.RolloutConfig(prompts_per_iter=4, group_size=4, max_new_tokens=4, max_prompt_len=8),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-2),
      iterations=1, eval_every=0, eval_size=8, num_minibatches=2,
      rollout_correction=C.RolloutCorrectionConfig(level="token"),
      mesh=sharding.MeshConfig(num_devices=1))
  return C.TrainConfig(**{**base, **kw})


def small_cfg(mesh: sharding.MeshConfig) -> C.TrainConfig:
  """A run that shards on `mesh`, with a KL term."""
  # Every sharded dimension divides by 8 (fsdp) or 2 (tensor); 8 prompts x 4 = 32 rows,
  # 2 minibatches of 16 rows.
  return C.TrainConfig(
      model=model_config.tiny(vocab_size=24, hidden=32, mlp_dim=64, num_heads=2, num_kv_heads=2,
                              head_dim=16),
      rollout=C.RolloutConfig(prompts_per_iter=8, group_size=4, max_new_tokens=4,
                              max_prompt_len=8),
      sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-3), num_minibatches=2,
      loss=C.LossConfig(kl_coef=0.05), mesh=mesh)


def dataset_cfg(path, max_prompt_len=8, **kw):
  """A run on the JSONL dataset at `path`, rewarded by exact match."""
  from gspo_jax.tasks import DataConfig
  return C.TrainConfig(task=C.TaskConfig(name="dataset", data=DataConfig(train_file=str(path)),
                                        reward=("exact_match",)),
                       rollout=C.RolloutConfig(max_prompt_len=max_prompt_len), **kw)


# -- rollouts and rewards -------------------------------------------------------------------

def rollout(run, step=0):
  return rollout_step(run, run.state.params, run.state.key, step)


def random_rewards(r, seed):
  """An untrained model earns reward 0 everywhere (advantages 0, no gradient): give the
  rows random rewards so the update has something to do."""
  return jnp.asarray(np.random.default_rng(seed).normal(size=r.rewards_BxG.shape), jnp.float32)


def random_rewards_BxG(rows: int, group: int):
  """The untrained policy earns reward 0 everywhere: random rewards give the update a
  gradient (advantages are normalised from them inside the update)."""
  return np.random.default_rng(0).normal(size=(rows, group)).astype(np.float32)


# Hand rollouts: B groups of 4 responses of up to HAND_T tokens after 3-token prompts.
HAND_T, HAND_EOS = 4, 1


def hand_cfg(**kw) -> C.TrainConfig:
  """The config of hand_rollout's batches: 2 prompts x 4, T = HAND_T, one minibatch."""
  base = dict(model=TINY_MODEL, rollout=C.RolloutConfig(prompts_per_iter=2, group_size=4,
                                                       max_new_tokens=HAND_T, max_prompt_len=3),
              sft=C.SFTConfig(steps=0), optim=C.OptimConfig(learning_rate=1e-2),
              num_minibatches=1)
  return C.TrainConfig(**{**base, **kw})


def hand_rollout(lengths_BxG, truncated_BxG, seed=0, T=HAND_T) -> sampling.Rollout:
  """Tokens in 2..V-1, EOS (1) as the last counted token of every row that is not
  truncated, pad (0) after; entropy 0.5 per counted token; T decode steps."""
  B, G = lengths_BxG.shape
  tokens = np.random.default_rng(seed).integers(2, TINY_MODEL.vocab_size, (B, G, T))
  t = np.arange(T)
  tokens[t >= lengths_BxG[..., None]] = 0
  ends = ~truncated_BxG
  tokens[ends, lengths_BxG[ends] - 1] = HAND_EOS
  mask = (t < lengths_BxG[..., None]).astype(np.float32)
  return sampling.Rollout(jnp.asarray(tokens, jnp.int32), jnp.asarray(mask),
                          jnp.zeros((B, G, T)), jnp.asarray(mask * 0.5),
                          jnp.asarray(lengths_BxG, jnp.int32), jnp.asarray(ends),
                          jnp.asarray(truncated_BxG), jnp.asarray(T, jnp.int32))


def prompts_of(B):
  """B prompts of 3 tokens for hand rollouts: (prompts_BxP, lengths_B)."""
  prompts = (np.arange(B * 3).reshape(B, 3) % (TINY_MODEL.vocab_size - 2) + 2).astype(np.int32)
  return jnp.asarray(prompts), jnp.full((B,), 3, jnp.int32)


# -- arrays and trees -----------------------------------------------------------------------

def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def host(x):
  return np.asarray(jax.device_get(x))


# -- run directories ------------------------------------------------------------------------

def read_metrics(run_dir):
  return [json.loads(l) for l in pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def interrupted_copy(src, dst, step):
  """A copy of run directory `src` as the run left it had it stopped after its checkpoint
  at `step`: later checkpoints and metrics.jsonl records removed."""
  shutil.copytree(src, dst)
  for name in os.listdir(dst / "checkpoints"):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(dst / "checkpoints" / name)
  kept = [r for r in read_metrics(dst) if r["step"] <= step]
  (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
  return dst


# -- loss batches ---------------------------------------------------------------------------

def arr(x, dtype):
  return jnp.asarray(np.asarray(x, dtype))


def random_batch(seed, dtype, B=6, T=7, scale=0.05, prefix=True, empty_rows=()):
  """logp, old_logp, adv_B, mask; log-ratios ~ N(0, scale)."""
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, (B, T))
  old = logp - rng.normal(0.0, scale, (B, T))
  adv = rng.normal(0.0, 1.0, B)
  if prefix:
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  else:
    mask = (rng.uniform(size=(B, T)) < 0.6).astype(np.float32)
    mask[:, 0] = 1
  for i in empty_rows:
    mask[i] = 0
  return arr(logp, dtype), arr(old, dtype), arr(adv, dtype), jnp.asarray(mask)


# Shared hand batch, eps_low = eps_high = 0.2, clip range [0.8, 1.2]. Token log-ratios
# l = logp - old_logp ("*" = masked junk):
#   row 0: l = [0.1, -0.2, 0.4], A = +1,   n = 3
#   row 1: l = [0.3, *, *],      A = -1,   n = 1
#   row 2: l = [-0.3, -0.3, *],  A = -2,   n = 2
#   row 3: l = [0.5, 0.5, 0.5],  A = +0.5, n = 3
#   row 4: empty,                A = +3,   n = 0   (excluded: N = 4)
HAND_L = [[0.1, -0.2, 0.4], [0.3, 7.0, -9.0], [-0.3, -0.3, 5.0], [0.5, 0.5, 0.5], [1.0, 2.0, 3.0]]
HAND_M = [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]
HAND_A = [1.0, -1.0, -2.0, 0.5, 3.0]


def hand_batch(dtype):
  logp = np.full((5, 3), -1.5) + np.array(HAND_L)
  old = np.full((5, 3), -1.5)
  return arr(logp, dtype), arr(old, dtype), arr(HAND_A, dtype), jnp.asarray(HAND_M, jnp.float32)


# Values written into the padding of a batch: none may leak into a loss or its gradient.
JUNK = [np.nan, np.inf, -np.inf, 1e30, -7.0]


# -- the sampler's compiled program ---------------------------------------------------------

def loop_copies(hlo: str, B: int, G: int, C: int, H: int, slots) -> list[str]:
  """The copies, inside any loop (every computation but the entry), of arrays shaped like a
  response KV cache, (..., B, G, C, w, H) or (..., B, G, C, H, w) for w in `slots`: a
  cache copied per step."""
  copies, in_entry = [], False
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      in_entry = line.startswith("ENTRY")
    m = re.search(r"= \w+\[([\d,]+)\]\S* copy\(", line)
    if m and not in_entry:
      dims = [int(d) for d in m.group(1).split(",")]
      if dims[-5:-2] == [B, G, C] and any(dims[-2:] == pair for w in slots
                                          for pair in ([w, H], [H, w])):
        copies.append(line.strip())
  return copies


def compiled_sampler(model, prompts, key, cfg):
  """(the sampler's rollout, its compiled HLO text)."""
  graphdef, params = nnx.split(model)
  compiled = jax.jit(functools.partial(sampling.sample, graphdef, cfg=cfg)).lower(
      params, *prompts, key).compile()
  return compiled(params, *prompts, key), compiled.as_text()


# -- Hugging Face fixtures ------------------------------------------------------------------

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "hf_fixtures")


@jax.jit
def _forward(graphdef, state, ids):
  model = nnx.merge(graphdef, state)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return model.logits(model(ids, pos).hidden_BxSxD)


def logits(model, ids):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(_forward.__wrapped__, static_argnums=0)(graphdef, state,
                                                                   jnp.asarray(ids, jnp.int32)))


# -- chat templates -------------------------------------------------------------------------

LLAMA_LIKE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


class FakeTok:
  """Just what the renderer and encode_prompts read: ids are characters, "<s>" is BOS."""
  bos_id, eos_id, pad_id = 1, 2, 0
  bos_token = "<s>"
  chat_template = LLAMA_LIKE

  def decode(self, ids):
    return {1: "<s>", 2: "</s>"}[ids[0]]

  def encode(self, text, *, add_special_tokens=False):
    ids = [self.bos_id] if add_special_tokens else []
    while text:
      n = 3 if text.startswith("<s>") else 1  # the BOS text is one token, as in tokenizers
      ids.append(self.bos_id if n == 3 else 3 + ord(text[0]) % 50)
      text = text[n:]
    return ids
