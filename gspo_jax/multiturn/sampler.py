"""The multi-turn sampler: G episodes per prompt that pause at tool calls, take the
environment's observation onto the same KV cache, and resume, in static shapes.

Shapes: the package legend (docs/shapes.md); G counts episodes, T is
the episode token budget (response slots), O the observation slots of one turn.

Layout: the group sampler's (`gspo_jax.rollout.sampling`), with the whole episode after the prompt
as one response of T slots: model turns and observations in the order they happened,
response slot t at position prompt_len + t. So teacher forcing over the episode is
`teacher_forcing.response_logprobs` on the same tokens, unchanged: observation tokens
condition every later token exactly as in sampling, and `mask_BxGxT` (model tokens only)
keeps them out of the loss, the ratios and every metric.

Two compiled programs share one `EpisodeState`:
  * `start`: prefill each prompt once (its cache shared by its G episodes), pick the
    first token, then decode (`_decode_turn`) until every episode is done or paused.
  * `resume`: paused episodes that the host gave an observation (`resume_BxG`) feed it
    token by token through `Transformer.decode` (the forced tokens of the loop below),
    writing its keys into their own cache slots, and sample on; the other paused ones end.
Between the two the host decodes each paused turn, calls its environment and tokenizes
the observation (`gspo_jax.multiturn.episodes`). Every response slot is written once.

Decode loop (each row at its own slot: `KVCache.index` is (B, G)): a row is *active*
when neither done nor paused. A step feeds each row's newest token `last_BxG` (slot
`cache.index`) and records the next one at slot `cache.index + 1`: the next observation
token when the row has one queued (log-prob 0, `obs_mask` 1), else a sampled token. A
sampled EOS ends the episode; a sampled stop token (`stop_ids`, e.g. a closing tool-call
tag) pauses it; filling slot T - 1 ends it (truncated). Inactive rows still run through
the step (static shapes) but neither record nor advance: the one cache slot such a row
writes is its `cache.index`, rewritten when it resumes. The loop ends when no row is
active: at most T steps per call. The response cache holds all T slots from the start
(the group sampler's doubling phases assume one slot count for every row).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.models.transformer import KVCache, Transformer
from gspo_jax.rollout.sampling import Rollout, SamplerConfig, _cache_dtype, pick_token
from gspo_jax.rollout.teacher_forcing import prompt_forward

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
  """Static knobs of the multi-turn sampler (hashable: a static argument of jax.jit).

  `sampler.max_new_tokens` is the episode budget T (model and observation tokens
  together); `sampler.group_size`, temperature, filters and cache dtype as in the group
  sampler (`decode_window` is not used). `stop_ids`: token ids that end a model turn and
  hand it to the environment. `max_obs_tokens`: O, the most tokens one observation may
  take. `max_turns`: model turns per episode (the host stops asking the environment after
  them)."""
  sampler: SamplerConfig
  stop_ids: tuple[int, ...]
  max_obs_tokens: int = 16
  max_turns: int = 4

  def __post_init__(self):
    if not self.stop_ids or not all(isinstance(i, int) and i >= 0 for i in self.stop_ids):
      raise ValueError(f"EpisodeConfig.stop_ids must be a non-empty tuple of token ids; "
                       f"got {self.stop_ids!r}")
    if self.sampler.eos_id in self.stop_ids:
      raise ValueError(f"EpisodeConfig.stop_ids must not hold the EOS id {self.sampler.eos_id}")
    if not (isinstance(self.max_obs_tokens, int) and self.max_obs_tokens >= 1):
      raise ValueError(f"EpisodeConfig.max_obs_tokens must be an int >= 1; "
                       f"got {self.max_obs_tokens!r}")
    if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
      raise ValueError(f"EpisodeConfig.max_turns must be an int >= 1; got {self.max_turns!r}")


@flax.struct.dataclass
class EpisodeState:
  """Everything the decode loop carries between `start`, the host and `resume`."""
  step: Array              # int32 scalar: decode steps over all calls (the key stream)
  last_BxG: Array          # newest recorded token, at slot cache.index, not yet fed
  done_BxG: Array          # bool: episode over (EOS, budget, or ended by the host)
  paused_BxG: Array        # bool: stopped at a stop token, waiting for the host
  turn_BxG: Array          # int32: index of the row's current model turn
  obs_BxGxO: Array         # int32: the observation being fed (forced tokens)
  obs_len_BxG: Array       # int32: its length
  obs_pos_BxG: Array       # int32: observation tokens already recorded
  tokens_BxGxT: Array      # int32, pad where nothing was recorded
  logp_BxGxT: Array        # float32 sampler log-probs (0 at observations and pad)
  entropy_BxGxT: Array     # float32 (0 at observations and pad)
  obs_mask_BxGxT: Array    # bool: observation token
  turn_BxGxT: Array        # int32: turn of each recorded token (observations: the next one)
  cache: KVCache           # index (B, G): the slot of last_BxG

  @property
  def recorded_BxG(self) -> Array:
    """Slots written per row (tokens of the episode so far)."""
    return self.cache.index + 1


@flax.struct.dataclass
class Episodes:
  """Finished episodes. `mask_BxGxT` counts model tokens only (the loss mask, up to and
  including EOS); `obs_mask_BxGxT` marks observation tokens; both 0 after the end."""
  tokens_BxGxT: Array
  mask_BxGxT: Array        # float32 0/1: model tokens
  obs_mask_BxGxT: Array    # float32 0/1: observation tokens
  logp_BxGxT: Array        # float32 sampler log-probs, 0 where mask is 0
  entropy_BxGxT: Array
  turn_BxGxT: Array        # int32 turn of each model token, -1 where mask is 0
  lengths_BxG: Array       # int32 model tokens
  turns_BxG: Array         # int32 model turns taken
  eos_BxG: Array           # bool: ended with EOS
  truncated_BxG: Array     # bool: filled the budget T without EOS
  steps: Array             # int32 scalar: decode steps taken

  def as_rollout(self) -> Rollout:
    """The group sampler's record of the same episodes (what `step.prepare` takes): the
    whole episode is the response, the mask its model tokens."""
    return Rollout(tokens_BxGxT=self.tokens_BxGxT, mask_BxGxT=self.mask_BxGxT,
                   logp_BxGxT=self.logp_BxGxT, entropy_BxGxT=self.entropy_BxGxT,
                   lengths_BxG=self.lengths_BxG, eos_BxG=self.eos_BxG,
                   truncated_BxG=self.truncated_BxG, steps=self.steps)


def _put(buf_BxGxT: Array, slot_BxG: Array, x_BxG: Array, write_BxG: Array) -> Array:
  """buf with x written at each writing row's own slot (a select, static shapes)."""
  T = buf_BxGxT.shape[-1]
  hit = (jnp.arange(T)[None, None] == slot_BxG[..., None]) & write_BxG[..., None]
  return jnp.where(hit, x_BxG.astype(buf_BxGxT.dtype)[..., None], buf_BxGxT)


def _record(s: EpisodeState, token_BxG, logp_BxG, entropy_BxG, forced_BxG, active_BxG,
            cfg: EpisodeConfig) -> EpisodeState:
  """Record one token per active row at slot recorded_BxG, and apply the turn ends."""
  scfg, T = cfg.sampler, cfg.sampler.max_new_tokens
  slot = s.recorded_BxG
  put = lambda buf, x: _put(buf, slot, x, active_BxG)
  sampled = active_BxG & ~forced_BxG
  eos = sampled & (token_BxG == scfg.eos_id)
  stop = sampled & jnp.isin(token_BxG, jnp.asarray(cfg.stop_ids, jnp.int32))
  full = active_BxG & (slot + 1 >= T)
  zero = jnp.zeros((), jnp.float32)
  return s.replace(
      last_BxG=jnp.where(active_BxG, token_BxG, s.last_BxG),
      done_BxG=s.done_BxG | eos | full, paused_BxG=s.paused_BxG | (stop & ~eos & ~full),
      obs_pos_BxG=s.obs_pos_BxG + (active_BxG & forced_BxG),
      tokens_BxGxT=put(s.tokens_BxGxT, token_BxG),
      logp_BxGxT=put(s.logp_BxGxT, jnp.where(forced_BxG, zero, logp_BxG)),
      entropy_BxGxT=put(s.entropy_BxGxT, jnp.where(forced_BxG, zero, entropy_BxG)),
      obs_mask_BxGxT=put(s.obs_mask_BxGxT, forced_BxG),
      turn_BxGxT=put(s.turn_BxGxT, s.turn_BxG),
      cache=s.cache.replace(index=jnp.where(active_BxG, slot, s.cache.index)))


def _active(s: EpisodeState) -> Array:
  return ~s.done_BxG & ~s.paused_BxG


def _decode_turn(model: Transformer, s: EpisodeState, prompt_lens_B, key,
                 cfg: EpisodeConfig) -> EpisodeState:
  """Decode until no row is active (see the module docstring)."""
  O = cfg.max_obs_tokens

  def body(s: EpisodeState) -> EpisodeState:
    active = _active(s)
    positions_BxG = prompt_lens_B[:, None] + s.cache.index   # where last_BxG sits
    hidden_BxGxD, cache = model.decode(s.last_BxG, positions_BxG, s.cache)
    s = s.replace(step=s.step + 1, cache=cache.replace(index=s.cache.index))
    token, logp, entropy = pick_token(model.logits(hidden_BxGxD), jax.random.fold_in(key, s.step),
                                      cfg.sampler)
    forced = s.obs_pos_BxG < s.obs_len_BxG
    queued = jnp.take_along_axis(s.obs_BxGxO, jnp.minimum(s.obs_pos_BxG, O - 1)[..., None],
                                 -1)[..., 0]
    return _record(s, jnp.where(forced, queued, token), logp, entropy, forced, active, cfg)

  return jax.lax.while_loop(lambda s: jnp.any(_active(s)), body, s)


def start(graphdef, params, prompts_BxP, prompt_lens_B, key, *, cfg: EpisodeConfig
          ) -> EpisodeState:
  """Prefill, the first token of every episode, and decoding up to the first pauses."""
  model: Transformer = nnx.merge(graphdef, params)
  scfg = cfg.sampler
  B, _ = prompts_BxP.shape
  G, T, O = scfg.group_size, scfg.max_new_tokens, cfg.max_obs_tokens
  out, valid_BxP, last_BxD = prompt_forward(model, prompts_BxP, prompt_lens_B)
  cache = KVCache.from_prefill(out, valid_BxP, G, T, _cache_dtype(scfg, model.cfg.dtype))
  zeros = lambda shape, dtype: jnp.zeros(shape, dtype)
  s = EpisodeState(
      step=zeros((), jnp.int32), last_BxG=zeros((B, G), jnp.int32),
      done_BxG=zeros((B, G), bool), paused_BxG=zeros((B, G), bool),
      turn_BxG=zeros((B, G), jnp.int32), obs_BxGxO=zeros((B, G, O), jnp.int32),
      obs_len_BxG=zeros((B, G), jnp.int32), obs_pos_BxG=zeros((B, G), jnp.int32),
      tokens_BxGxT=jnp.full((B, G, T), scfg.pad_id, jnp.int32),
      logp_BxGxT=zeros((B, G, T), jnp.float32), entropy_BxGxT=zeros((B, G, T), jnp.float32),
      obs_mask_BxGxT=zeros((B, G, T), bool), turn_BxGxT=zeros((B, G, T), jnp.int32),
      # index -1: the first token is recorded at slot 0 and nothing is in the cache yet.
      cache=cache.replace(index=jnp.full((B, G), -1, jnp.int32)))
  logits_BxGxV = jnp.broadcast_to(model.logits(last_BxD)[:, None], (B, G, model.cfg.vocab_size))
  token, logp, entropy = pick_token(logits_BxGxV, jax.random.fold_in(key, 0), scfg)
  no = zeros((B, G), bool)
  s = _record(s, token, logp, entropy, no, ~no, cfg)
  return _decode_turn(model, s, prompt_lens_B, key, cfg)


def resume(graphdef, params, state: EpisodeState, prompt_lens_B, obs_BxGxO, obs_len_BxG,
           resume_BxG, key, *, cfg: EpisodeConfig) -> EpisodeState:
  """Continue the paused episodes with `resume_BxG` after their observation
  (obs_BxGxO, obs_len_BxG tokens; empty allowed) in a new turn; end the other paused ones.
  The host guarantees that each observation leaves room for a model token
  (`recorded + obs_len < T`)."""
  model: Transformer = nnx.merge(graphdef, params)
  go = state.paused_BxG & resume_BxG
  s = state.replace(
      done_BxG=state.done_BxG | (state.paused_BxG & ~resume_BxG),
      paused_BxG=jnp.zeros_like(state.paused_BxG), turn_BxG=state.turn_BxG + go,
      obs_BxGxO=obs_BxGxO.astype(jnp.int32),
      obs_len_BxG=jnp.where(go, obs_len_BxG, 0).astype(jnp.int32),
      obs_pos_BxG=jnp.zeros_like(state.obs_pos_BxG))
  return _decode_turn(model, s, prompt_lens_B, key, cfg)


def finish(s: EpisodeState, cfg: EpisodeConfig) -> Episodes:
  """The episodes' masks and lengths from the final state (every row done)."""
  T = cfg.sampler.max_new_tokens
  n_BxG = s.recorded_BxG
  recorded = jnp.arange(T)[None, None] < n_BxG[..., None]
  model = recorded & ~s.obs_mask_BxGxT
  mask = model.astype(jnp.float32)
  eos = jnp.any(model & (s.tokens_BxGxT == cfg.sampler.eos_id), axis=-1)
  return Episodes(tokens_BxGxT=s.tokens_BxGxT, mask_BxGxT=mask,
                  obs_mask_BxGxT=(recorded & s.obs_mask_BxGxT).astype(jnp.float32),
                  logp_BxGxT=s.logp_BxGxT * mask, entropy_BxGxT=s.entropy_BxGxT * mask,
                  turn_BxGxT=jnp.where(model, s.turn_BxGxT, -1),
                  lengths_BxG=jnp.sum(model, -1).astype(jnp.int32), turns_BxG=s.turn_BxG + 1,
                  eos_BxG=eos, truncated_BxG=~eos & (n_BxG >= T), steps=s.step)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def start_jit(params, prompts_BxP, prompt_lens_B, key, *, graphdef, cfg: EpisodeConfig):
  return start(graphdef, params, prompts_BxP, prompt_lens_B, key, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("state",))
def resume_jit(params, state, prompt_lens_B, obs_BxGxO, obs_len_BxG, resume_BxG, key, *,
               graphdef, cfg: EpisodeConfig):
  return resume(graphdef, params, state, prompt_lens_B, obs_BxGxO, obs_len_BxG, resume_BxG,
                key, cfg=cfg)


finish_jit = jax.jit(finish, static_argnames=("cfg",))


@dataclasses.dataclass(frozen=True)
class EpisodePrograms:
  """A run's compiled multi-turn programs (`multiturn.programs.episode_programs`), parameters first:
  start(params, prompts_BxP, lens_B, key), resume(params, state, lens_B, obs_BxGxO,
  obs_len_BxG, resume_BxG, key) (the state donated), finish(state) -> Episodes."""
  cfg: EpisodeConfig
  start: Callable
  resume: Callable
  finish: Callable

  def bound(self, params):
    """(start, resume, finish) with `params` bound, as `episodes.run_episodes` takes them."""
    return (functools.partial(self.start, params), functools.partial(self.resume, params),
            self.finish)
