"""The host side of multi-turn episodes: between the sampler's compiled turns, decode each
finished turn, ask its environment, tokenize the observations, and resume.

Shapes: the package legend (docs/shapes.md); G counts episodes, T is the
episode token budget, U = max_turns (`turn_rewards_BxGxK` keeps K for turns).

Outcomes, all counted (`EpisodeResult.counts`), none silent:
  * the model ends a turn at EOS, or the budget T cuts it, or it is the U-th turn: the
    environment sees it with `final=True` and the episode ends;
  * the environment returns `observation=None`: the episode ends (`ended_by_env`);
  * an observation longer than O tokens, or one that leaves no slot for a model token
    after it (`recorded + len >= T`): the episode ends and all its turn rewards are set to
    0 (`obs_overflow`); the observation is not appended, so no mask is ever cut short;
  * anything the environment raises or answers wrongly, or an observation the tokenizer
    cannot encode: an EnvError naming the environment, the example and the turn
    (`gspo_jax.multiturn.envs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from gspo_jax.multiturn.envs import EnvError, LoadedEnv
from gspo_jax.multiturn.sampler import EpisodeConfig, Episodes, EpisodeState
from gspo_jax.tasks import text

COUNTS = ("turns", "ended_by_env", "obs_overflow", "turn_limit")


@dataclasses.dataclass
class EpisodeResult:
  episodes: Episodes                   # on device
  turn_rewards_BxGxK: np.ndarray       # float32 r_k per model turn (0 after the last turn)
  rewards_BxG: np.ndarray              # float32 episode reward: sum_k r_k
  counts: dict[str, float]             # summed over episodes: COUNTS and the envs' info keys


def _turn_texts(tok, state: EpisodeState, rows: np.ndarray) -> list[str]:
  """Decoded current turn (model tokens of the row's current turn) of each row in `rows`."""
  T = state.tokens_BxGxT.shape[-1]
  flat = lambda x: np.asarray(x).reshape(-1, *np.shape(x)[2:])
  tokens, obs, turn_of = flat(state.tokens_BxGxT), flat(state.obs_mask_BxGxT), flat(state.turn_BxGxT)
  recorded = np.arange(T)[None] < flat(state.recorded_BxG)[:, None]
  turn = flat(state.turn_BxG)
  sel = recorded & ~obs & (turn_of == turn[:, None])
  return text.decode_completions(tok, tokens[rows], sel[rows])


def _encode_observation(tok, env: LoadedEnv, example, turn: int, observation: str) -> list[int]:
  try:
    return tok.encode(observation)
  except ValueError as e:
    raise EnvError(f"environment {env.spec!r}: its observation {observation[:80]!r} on example "
                   f"{example.prompt[:80]!r}, turn {turn}, cannot be tokenized: {e}",
                   env=env.spec, example=repr(example.prompt), turn=turn) from e


def run_episodes(start: Callable, resume: Callable, finish: Callable, prompts_BxP, lens_B,
                 key, examples: Sequence[Any], env: LoadedEnv, tok, cfg: EpisodeConfig
                 ) -> EpisodeResult:
  """Sample G episodes per prompt with `env` answering each turn.

  start(prompts_BxP, lens_B, key) -> EpisodeState, resume(state, lens_B, obs_BxGxO,
  obs_len_BxG, resume_BxG, key) -> EpisodeState and finish(state) -> Episodes are the
  compiled programs of `gspo_jax.multiturn.sampler` with the parameters bound.
  `examples` holds one Example per episode, row-major (B*G: each prompt's repeated G
  times). Single-process: the host reads every row."""
  state = start(prompts_BxP, lens_B, key)
  B, G, T = state.tokens_BxGxT.shape
  R, U, O = B * G, cfg.max_turns, cfg.max_obs_tokens
  if len(examples) != R:
    raise ValueError(f"run_episodes: {len(examples)} examples for {B} prompts x {G} episodes")
  envs = [env.make(e) for e in examples]
  finished = np.zeros(R, bool)
  rewards_RxU = np.zeros((R, U), np.float32)
  overflow = np.zeros(R, bool)
  counts = dict.fromkeys(COUNTS, 0.0)
  for k in range(U):
    paused, done, recorded = (np.asarray(x).reshape(R) for x in
                              jax.device_get((state.paused_BxG, state.done_BxG,
                                              state.recorded_BxG)))
    rows = np.flatnonzero(~finished & (paused | done))
    obs_RxO, obs_len_R, go_R = np.zeros((R, O), np.int32), np.zeros(R, np.int32), np.zeros(R, bool)
    for r, turn_text in zip(rows, _turn_texts(tok, state, rows)):
      final = bool(done[r]) or k == U - 1
      out = env.step(envs[r], examples[r], k, turn_text, final=final)
      rewards_RxU[r, k] = out.reward
      counts["turns"] += 1
      for name, value in out.info.items():
        counts[name] = counts.get(name, 0.0) + float(value)
      if final or out.observation is None:
        finished[r] = True
        if not final:
          counts["ended_by_env"] += 1
        elif not done[r]:  # paused at a tool call in its last allowed turn
          counts["turn_limit"] += 1
        continue
      ids = _encode_observation(tok, env, examples[r], k, out.observation)
      if len(ids) > O or recorded[r] + len(ids) >= T:
        finished[r], overflow[r] = True, True
        counts["obs_overflow"] += 1
        continue
      obs_RxO[r, :len(ids)], obs_len_R[r], go_R[r] = ids, len(ids), True
    if not go_R.any():
      break
    shape = lambda x: x.reshape(B, G, *x.shape[1:])
    state = resume(state, lens_B, shape(obs_RxO), shape(obs_len_R), shape(go_R), key)
  rewards_RxU[overflow] = 0.0
  return EpisodeResult(finish(state), rewards_RxU.reshape(B, G, U),
                       rewards_RxU.sum(-1).reshape(B, G), counts)
