"""In-graph group sampler: G responses per prompt in one compiled program.

Shapes: the package legend (docs/shapes.md).

Layout (shared with `teacher_forcing.response_logprobs`, which the trainer uses): prompts are
right-padded to P with `prompt_lens_B` valid tokens; prompt token p sits at position p,
response token t at position prompt_len + t.

Each prompt is prefilled once and its KV cache is shared by its G responses (attention
reads the prompt keys once per row instead of G copies). Decoding is a
`lax.while_loop` that stops early once every response has emitted EOS, split into phases
whose response cache doubles in length (`decode_windows`): a decode step reads the whole
cache it holds, so its cost follows the filled prefix instead of max_new_tokens.

The returned log-probs are those of the temperature-scaled distribution *before* top-k /
top-p truncation and vocabulary masking: log softmax(logits / temperature)[token], which is
what a trainer recomputes with `response_logprobs(..., temperature=...)`.

With `record_experts` (MoE only) the sampler also returns its own expert choices per MoE
layer in the trainer's replay layout, (B*G, P+T, K): the prefill's for the prompt
positions (each group's rows share them) and, for response slot t, the choice made when
token t was fed to the decoder (decode step t + 1). That is what Rollout Routing Replay
(R3, `routing="rollout_replay"`) replays in training. Slots never fed to the decoder (the
last response token, which predicts nothing, and those after every response of the batch
has ended) hold experts 0..K-1: no counted log-prob depends on them.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gspo_jax.models.transformer import KVCache, Transformer
from gspo_jax.parallel import sharding
from gspo_jax.rollout import compaction, lengths
from gspo_jax.rollout.teacher_forcing import prompt_forward
from gspo_jax.utils import checks

Array = jax.Array


CACHE_DTYPES = ("", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static sampler knobs (hashable: passed to jax.jit as a static argument).

  top_k = 0 and top_p = 1.0 disable those filters. `vocab_limit` masks ids >= it (model
  vocabularies are padded above the tokenizer's size). `decode_window`: response cache
  slots of the first decode phase (see `decode_windows`); >= max_new_tokens = one phase
  over the whole cache (fewer copies of the step to compile, each step reads all T slots).
  `cache_dtype`: storage dtype of the KV cache ("" = the model's compute dtype); "bfloat16"
  halves its memory, attention still computes in float32 (log-probs then differ from
  teacher forcing by the keys' and values' bfloat16 rounding).
  `compact_rows`: L > 0 lets each decode phase continue on the live rows only, in up to L
  halvings of the B*G rows (`gspo_jax.rollout.compaction`): the same noise per row, so the same
  tokens for the same key and log-probs equal to float32 rounding; (L + 1) copies of the
  decode step per phase. 0 = off (2**L <= B*G).
  """
  group_size: int
  max_new_tokens: int
  eos_id: int
  pad_id: int = 0
  max_prompt_len: int = 512
  temperature: float = 1.0
  greedy: bool = False
  top_k: int = 0
  top_p: float = 1.0
  vocab_limit: int | None = None
  record_experts: bool = False      # return the MoE expert choices (Rollout.experts)
  decode_window: int = 128
  cache_dtype: str = ""
  compact_rows: int = 0

  def __post_init__(self):
    if not (isinstance(self.group_size, int) and self.group_size >= 1):
      raise ValueError(f"SamplerConfig.group_size must be an int >= 1; got {self.group_size!r}")
    if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
      raise ValueError(f"SamplerConfig.max_new_tokens must be an int >= 1; got {self.max_new_tokens!r}")
    if self.max_prompt_len < 1:
      raise ValueError(f"SamplerConfig.max_prompt_len must be >= 1; got {self.max_prompt_len}")
    if not self.greedy and not self.temperature > 0:
      raise ValueError(f"SamplerConfig.temperature must be > 0 unless greedy=True; "
                       f"got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplerConfig.top_p must be in (0, 1]; got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"SamplerConfig.top_k must be >= 0 (0 = off); got {self.top_k}")
    if not (isinstance(self.decode_window, int) and self.decode_window >= 1):
      raise ValueError(f"SamplerConfig.decode_window must be an int >= 1; got {self.decode_window!r}")
    if isinstance(self.compact_rows, bool) or not (isinstance(self.compact_rows, int)
                                                   and self.compact_rows >= 0):
      raise ValueError(f"SamplerConfig.compact_rows must be an int >= 0 (0 = off); "
                       f"got {self.compact_rows!r}")
    if self.cache_dtype not in CACHE_DTYPES:
      raise ValueError(f"SamplerConfig.cache_dtype must be one of {CACHE_DTYPES}; "
                       f"got {self.cache_dtype!r}")
    if self.vocab_limit is not None and self.vocab_limit <= max(self.eos_id, self.pad_id):
      raise ValueError(f"SamplerConfig.vocab_limit ({self.vocab_limit}) must exceed eos_id and pad_id")


@flax.struct.dataclass
class Rollout:
  """G responses per prompt. mask counts response tokens up to and including EOS."""
  tokens_BxGxT: Array      # int32, pad_id after the end
  mask_BxGxT: Array        # float32 0/1
  logp_BxGxT: Array        # float32, sampler log-probs (0 where masked)
  entropy_BxGxT: Array     # float32, entropy of the tempered distribution at each step (0 where masked)
  lengths_BxG: Array       # int32, counted tokens
  eos_BxG: Array           # bool: ended with EOS
  truncated_BxG: Array     # bool: hit max_new_tokens without EOS
  steps: Array             # int32 scalar: tokens generated per response before the loop exited
  # With SamplerConfig.record_experts: per MoE layer (B*G, P+T, K) int32 expert choices.
  experts: tuple[Array, ...] | None = None


@flax.struct.dataclass
class _LoopState:
  t: Array                 # next response slot to fill
  last_BxG: Array          # token sampled at t - 1
  done_BxG: Array          # EOS already emitted
  tokens_BxGxT: Array
  logp_BxGxT: Array
  entropy_BxGxT: Array
  cache: KVCache
  experts_BxGxTxK: tuple[Array, ...] = ()   # per MoE layer, with cfg.record_experts


def filter_logits(logits_RxV: Array, cfg: SamplerConfig) -> Array:
  """Vocabulary limit, top-k and top-p (nucleus) filtering on already-tempered logits."""
  neg = jnp.finfo(logits_RxV.dtype).min
  V = logits_RxV.shape[-1]
  if cfg.vocab_limit is not None and cfg.vocab_limit < V:
    logits_RxV = jnp.where(jnp.arange(V) < cfg.vocab_limit, logits_RxV, neg)
  if cfg.top_k and cfg.top_k < V:
    kth = jax.lax.top_k(logits_RxV, cfg.top_k)[0][..., -1:]
    logits_RxV = jnp.where(logits_RxV >= kth, logits_RxV, neg)
  if cfg.top_p < 1:
    sorted_desc = -jnp.sort(-logits_RxV, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: token i stays iff the mass
    # before it is < top_p (so the top token always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < cfg.top_p
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits_RxV = jnp.where(logits_RxV >= cutoff, logits_RxV, neg)
  return logits_RxV


def first_argmax(x: Array) -> Array:
  """jnp.argmax over the last axis (ties: the first index), as two plain reductions.

  XLA:CPU runs argmax's (value, index) pair reduction element by element; max followed by
  the smallest index attaining it vectorises (`benchmark.py sampler` measures the pick).
  A row containing NaN yields index V - 1 (argmax would point at the NaN).
  """
  V = x.shape[-1]
  is_max = x == jnp.max(x, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(is_max, jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1), V),
                  axis=-1)
  return jnp.minimum(first, V - 1)


def pick_token(logits_BxGxV: Array, key: Array, cfg: SamplerConfig) -> tuple[Array, Array, Array]:
  """(token_BxG, logp_BxG, entropy_BxG) of the tempered, unfiltered distribution."""
  # = jax.random.categorical(key, filtered): the same Gumbel noise, the same tokens
  noise = None if cfg.greedy else jax.random.gumbel(key, logits_BxGxV.shape, jnp.float32)
  return pick_with_noise(logits_BxGxV, noise, cfg)


def pick_with_noise(logits_xV: Array, gumbel_xV: Array | None, cfg: SamplerConfig
                    ) -> tuple[Array, Array, Array]:
  """`pick_token` given its Gumbel noise (None when greedy), for logits of any leading shape:
  argmax(filtered tempered logits + noise), its log-prob and the entropy."""
  temp = 1.0 if cfg.greedy else cfg.temperature
  scaled = logits_xV.astype(jnp.float32) / temp
  logp_all = jax.nn.log_softmax(scaled, axis=-1)
  filtered = filter_logits(scaled, cfg)
  token = first_argmax(filtered if gumbel_xV is None else filtered + gumbel_xV)
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return (token.astype(jnp.int32), jnp.take_along_axis(logp_all, token[..., None], -1)[..., 0],
          entropy)


def _record(state: _LoopState, token_BxG, logp_BxG, entropy_BxG, cfg: SamplerConfig
            ) -> _LoopState:
  """Write slot t; responses that already ended get pad, log-prob 0 and entropy 0."""
  token = jnp.where(state.done_BxG, cfg.pad_id, token_BxG)
  write = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(
      buf, x.astype(buf.dtype)[..., None], state.t, 2)
  put = lambda buf, x: write(buf, jnp.where(state.done_BxG, 0, x))
  return state.replace(t=state.t + 1, last_BxG=token, done_BxG=state.done_BxG | (token == cfg.eos_id),
                       tokens_BxGxT=write(state.tokens_BxGxT, token),
                       logp_BxGxT=put(state.logp_BxGxT, logp_BxG),
                       entropy_BxGxT=put(state.entropy_BxGxT, entropy_BxG))


def sample(graphdef, params, prompts_BxP, prompt_lens_B, key, *, cfg: SamplerConfig) -> Rollout:
  """The sampler as a pure function (traceable; `gspo_jax.train.programs` and `sample_groups`
  compile it): prefill each prompt once, then decode G responses per prompt in a
  `lax.while_loop` until every response has ended or T tokens are out."""
  model: Transformer = nnx.merge(graphdef, params)
  B, P = prompts_BxP.shape
  G, T = cfg.group_size, cfg.max_new_tokens
  limit = model.cfg.max_positions
  if limit is not None and P + T > limit:
    raise ValueError(f"sample: P + SamplerConfig.max_new_tokens = {P} + {T} positions, more "
                     f"than the model's ModelConfig.max_positions = {limit}")
  windows = decode_windows(T, cfg.decode_window)
  cache_dtype = _cache_dtype(cfg, model.cfg.dtype)
  out, valid_BxP, last_BxD = prompt_forward(model, prompts_BxP, prompt_lens_B)
  logits_BxGxV = jnp.broadcast_to(model.logits(last_BxD)[:, None], (B, G, model.cfg.vocab_size))
  K = model.cfg.experts_per_token
  experts = tuple(jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, G, T, K))
                  for _ in out.router.indices) if cfg.record_experts else ()
  state = _LoopState(t=jnp.zeros((), jnp.int32), last_BxG=jnp.zeros((B, G), jnp.int32),
                     done_BxG=jnp.zeros((B, G), bool),
                     tokens_BxGxT=jnp.full((B, G, T), cfg.pad_id, jnp.int32),
                     logp_BxGxT=jnp.zeros((B, G, T), jnp.float32),
                     entropy_BxGxT=jnp.zeros((B, G, T), jnp.float32),
                     cache=KVCache.from_prefill(out, valid_BxP, G, windows[0], cache_dtype),
                     experts_BxGxTxK=experts)
  state = _record(state, *pick_token(logits_BxGxV, jax.random.fold_in(key, 0), cfg), cfg)
  # compact_rows: the full-size loop hands over once the live rows fit half of them.
  sizes = compaction.row_sizes(B * G, cfg.compact_rows) if cfg.compact_rows else None

  def cond(s: _LoopState, window: int):  # step t writes cache slot t - 1 < window
    go = (s.t < T) & (s.t <= window) & ~jnp.all(s.done_BxG)
    return go if sizes is None else go & (jnp.sum(~s.done_BxG) > sizes[1])

  def body(s: _LoopState):
    # Token t-1 sits at position prompt_len + t - 1 and is written to cache slot t - 1.
    positions_BxG = jnp.broadcast_to(prompt_lens_B[:, None] + s.t - 1, (B, G))
    if not cfg.record_experts:
      hidden_BxGxD, cache = model.decode(s.last_BxG, positions_BxG, s.cache)
    else:  # the choices for token t - 1 go to its slot (see the module docstring)
      hidden_BxGxD, cache, idx = model.decode(s.last_BxG, positions_BxG, s.cache,
                                              with_experts=True)
      s = s.replace(experts_BxGxTxK=tuple(
          jax.lax.dynamic_update_slice_in_dim(buf, i.reshape(B, G, 1, K), s.t - 1, 2)
          for buf, i in zip(s.experts_BxGxTxK, idx)))
    picked = pick_token(model.logits(hidden_BxGxD), jax.random.fold_in(key, s.t), cfg)
    return _record(s.replace(cache=cache), *picked, cfg)

  for window in windows:
    state = state.replace(cache=state.cache.grow(window))
    state = jax.lax.while_loop(functools.partial(cond, window=window), body, state)
    if sizes is not None:
      state = compaction.stages(model, state, window, sizes, prompt_lens_B=prompt_lens_B,
                                key=key, cfg=cfg, pick=pick_with_noise)
  rollout = _finish(state.tokens_BxGxT, state.logp_BxGxT, state.entropy_BxGxT, state.t, cfg)
  if not cfg.record_experts:
    return rollout
  # Replay layout (B*G, P+T, K): each group's rows share their prompt's prefill choices.
  return rollout.replace(experts=tuple(
      jnp.concatenate([jnp.repeat(p, G, axis=0), r.reshape(B * G, T, K)], axis=1)
      for p, r in zip(out.router.indices, state.experts_BxGxTxK)))


def _cache_dtype(cfg: SamplerConfig, model_dtype: str):
  if cfg.cache_dtype == "bfloat16" and jnp.dtype(model_dtype) == jnp.float64:
    # A float64 run is a precision reference; a rounded cache would defeat it silently.
    raise ValueError("SamplerConfig.cache_dtype='bfloat16' (rollout.kv_cache_dtype) needs a "
                     "float32 or bfloat16 model; this one computes in float64 "
                     "(ModelConfig.dtype): leave cache_dtype empty")
  return jnp.dtype(cfg.cache_dtype or model_dtype)


def decode_windows(max_new_tokens: int, first: int) -> tuple[int, ...]:
  """Response cache lengths of the decode phases: first, 2 first, 4 first, ..., T.

  Phase w holds a cache of w slots (`KVCache.grow` pads it between phases, once) and
  runs the steps that write slots < w, so a step reads at most twice the filled prefix
  (after the first phase). Each phase is one more copy of the decode step in the
  compiled program: ceil(log2(T / first)) + 1 of them.
  """
  windows = [min(first, max_new_tokens)]
  while windows[-1] < max_new_tokens:
    windows.append(min(2 * windows[-1], max_new_tokens))
  return tuple(windows)


def _finish(tokens_BxGxT, logp_BxGxT, entropy_BxGxT, steps, cfg: SamplerConfig) -> Rollout:
  is_eos = tokens_BxGxT == cfg.eos_id
  eos_before = jnp.cumsum(is_eos, axis=-1) - is_eos
  mask = (eos_before == 0).astype(jnp.float32)
  ended = jnp.any(is_eos, axis=-1)
  return Rollout(tokens_BxGxT=tokens_BxGxT, mask_BxGxT=mask, logp_BxGxT=logp_BxGxT * mask,
                 entropy_BxGxT=entropy_BxGxT * mask,
                 lengths_BxG=jnp.sum(mask, -1).astype(jnp.int32), eos_BxG=ended,
                 truncated_BxG=~ended, steps=steps)


def _validate_prompts(fn: str, prompts_BxP, prompt_lens_B, cfg: SamplerConfig) -> None:
  checks.check_rank(fn, "prompts_BxP", prompts_BxP, 2, "B, P")
  checks.check_shape(fn, "prompt_lens_B", prompt_lens_B, np.shape(prompts_BxP)[:1],
                      "prompts_BxP.shape[:1]")
  P = np.shape(prompts_BxP)[1]
  if P > cfg.max_prompt_len:
    raise ValueError(f"{fn}: prompts_BxP has {P} positions, more than "
                     f"SamplerConfig.max_prompt_len={cfg.max_prompt_len}")
  if checks.is_concrete(prompt_lens_B):
    lens = np.asarray(prompt_lens_B)
    if lens.size and lens.min() < 1:
      raise ValueError(f"{fn}: prompt_lens_B has an empty prompt (length {lens.min()} at row "
                       f"{int(lens.argmin())}); every prompt needs at least one token")
    if lens.size and lens.max() > P:
      raise ValueError(f"{fn}: prompt_lens_B has a length {lens.max()} > P = {P}")


def sample_groups(model: Transformer, prompts_BxP: Array, prompt_lens_B: Array, key: Array,
                  cfg: SamplerConfig, *, mesh: Mesh | None = None) -> Rollout:
  """Sample `cfg.group_size` responses for each prompt (one jitted call, deterministic per key).

  For use outside a training run (generation, evaluation of a loaded model, tests): compiled
  through jax.jit's own cache (one program per model structure, cfg, mesh and input shapes).
  A training run builds its sampler program once instead (`gspo_jax.train.programs`).

  Args:
    model: the policy (its current parameters are used; the model is not modified).
    prompts_BxP: right-padded prompt ids. prompt_lens_B: valid prompt tokens per row (>= 1).
    key: a jax.random key. cfg: SamplerConfig.
    mesh: run sharded over this mesh (B must divide over its batch axes); the outputs are
      then global arrays split by rows. In multi-host runs pass global arrays
      (`sharding.to_global`).
  Returns:
    Rollout with (B, G, T) tokens, mask, sampler log-probs, lengths, eos and truncation flags.
  """
  _validate_prompts("sample_groups", prompts_BxP, prompt_lens_B, cfg)
  if mesh is not None:
    sharding.check_rows("the number of prompts B", np.shape(prompts_BxP)[0], mesh)
  graphdef, params = nnx.split(model)
  return _sample_jit(params, jnp.asarray(prompts_BxP, jnp.int32),
                     jnp.asarray(prompt_lens_B, jnp.int32), key, graphdef=graphdef, cfg=cfg,
                     mesh=mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "mesh"))
def _sample_jit(params, prompts_BxP, prompt_lens_B, key, *, graphdef, cfg, mesh):
  rollout = sample(graphdef, params, prompts_BxP, prompt_lens_B, key, cfg=cfg)
  if mesh is None:
    return rollout
  rows = lambda x: jax.lax.with_sharding_constraint(x, sharding.batch_sharding(mesh, x.ndim))
  return rollout.replace(**{f: rows(getattr(rollout, f)) for f in ROW_FIELDS})


ROW_FIELDS = ("tokens_BxGxT", "mask_BxGxT", "logp_BxGxT", "entropy_BxGxT", "lengths_BxG",
              "eos_BxG", "truncated_BxG")  # Rollout's (B, ...) arrays; `steps` is a scalar


def rollout_stats(rollout: Rollout) -> dict[str, Array]:
  """Scalars that describe a rollout, computed where the rollout lives (on device): the
  length statistics of `lengths.length_stats` (mean, p90 and max response length in
  counted tokens, the fraction truncated at max_new_tokens, the fraction in each quartile
  of max_new_tokens), the mean entropy per counted token, the counted tokens and the
  decode steps taken."""
  tokens = jnp.sum(rollout.mask_BxGxT)
  T = rollout.tokens_BxGxT.shape[-1]
  return {**lengths.length_stats(rollout.lengths_BxG, rollout.truncated_BxG, T),
          "entropy": jnp.sum(rollout.entropy_BxGxT) / jnp.maximum(tokens, 1),
          "response_tokens": tokens, "decode_steps": rollout.steps}
