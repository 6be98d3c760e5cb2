"""Shared pieces of the multi-turn tests: a character tokenizer over a tiny vocabulary, a
scripted environment and a small episode configuration."""

import dataclasses

from gspo_jax.multiturn.envs import EnvStep
from gspo_jax.multiturn.sampler import EpisodeConfig
from gspo_jax.rollout.sampling import SamplerConfig

PAD, EOS, BOS = 0, 1, 2
CHARS = "0123456789;?+*<>/calc[]"   # ids 3.. ; "/" is the stop token of these tests
VOCAB_LIMIT = 3 + len(set(CHARS))


class CharTok:
  """ids 0 pad, 1 eos, 2 bos, then one id per character of CHARS."""
  pad_id, eos_id, bos_id = PAD, EOS, BOS

  def __init__(self):
    self.chars = list(dict.fromkeys(CHARS))
    self.ids = {c: 3 + i for i, c in enumerate(self.chars)}

  def encode(self, s: str, add_special_tokens: bool = False) -> list[int]:
    return [self.ids[c] for c in s]

  @property
  def vocab_size(self) -> int:
    return VOCAB_LIMIT

  def decode(self, ids) -> str:
    return "".join(self.chars[i - 3] if i >= 3 else "" for i in ids)


TOK = CharTok()
STOP = TOK.ids["/"]


def episode_cfg(**overrides) -> EpisodeConfig:
  sampler = SamplerConfig(group_size=overrides.pop("group_size", 2),
                          max_new_tokens=overrides.pop("T", 24), eos_id=EOS, pad_id=PAD,
                          max_prompt_len=8, temperature=overrides.pop("temperature", 1.0),
                          vocab_limit=VOCAB_LIMIT)
  # Several stop ids so that a random tiny model pauses often.
  base = dict(stop_ids=(STOP, TOK.ids[";"], TOK.ids["c"]), max_obs_tokens=4, max_turns=3)
  return EpisodeConfig(sampler=sampler, **{**base, **overrides})


@dataclasses.dataclass
class ScriptedEnv:
  """Observation "<k>?" after turn k (k+1 digits), reward k + 1 on turn k."""
  example: object

  def step(self, turn_text: str, *, final: bool) -> EnvStep:
    self.turn = getattr(self, "turn", -1) + 1
    return EnvStep(None if final else "7" * (self.turn + 1) + "?", float(self.turn + 1),
                   {"seen_chars": len(turn_text)})
