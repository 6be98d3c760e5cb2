"""Your own task: prompts from a JSONL file, rewards from your own Python functions.

A dataset is one more Task, so it lives beside the built-in ones and scores like them:
`DatasetTask.score_batch` calls `gspo_jax.tasks.rewards.score_batch`, with the functions named
by `reward` specs (loaded by `gspo_jax.tasks.rewards.load_rewards`) instead of a `reward` method.

One JSON object per line; blank lines are skipped. The prompt field (default "prompt") is
required; every other field (e.g. "answer") is passed through to the reward functions:

    {"prompt": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "7"}

Data order is a pure function of (seed, iteration), as for the built-in tasks, so a
resumed run sees exactly the prompts an uninterrupted one would, with no extra state:
    position p = iteration * B + j       (j < B, B = rollout.sampled_prompts: prompts_per_iter
                                          + oversample)
    epoch e = p // N,  record = perm_e[p % N],  perm_e = permutation of N from (seed, e)
Every process computes the same global batch (multi-host keeps its own rows of it).

Held-out set: `task.data.heldout_file`, or the records whose stable hash (sha256 of the record's
canonical JSON) falls below `task.data.heldout_fraction`: disjoint from training by construction
(duplicates land on the same side), never dependent on an rng.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from gspo_jax.tasks import rewards as R
from gspo_jax.tasks.base import Example, Task, check_sample_args

SOURCE = "_source"  # meta key: "file:line" of the record, for error messages


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the prompts come from and how they are shown to the model (task.name="dataset")."""
  train_file: str = ""              # JSONL, one object per line
  heldout_file: str = ""            # JSONL; "" = split train_file by heldout_fraction
  heldout_fraction: float = 0.0     # of train_file's records, by stable hash
  prompt_field: str = "prompt"
  answer_field: str = "answer"      # the demonstration for a cold start (sft.steps > 0)
  chat_template: bool = True        # render prompts with a pretrained tokenizer's template
  system_prompt: str = ""           # a system message for the template ("" = none)
  correct_threshold: float = 1.0    # correct (accuracy, pass@k) = first reward >= this
  slow_reward_s: float = 10.0       # report a reward call slower than this (0 = never)

  def __post_init__(self):
    if not 0.0 <= self.heldout_fraction < 1.0:
      raise ValueError(f"task.data.heldout_fraction must lie in [0, 1); got "
                       f"{self.heldout_fraction}")
    if self.heldout_file and self.heldout_fraction:
      raise ValueError("task.data.heldout_file and task.data.heldout_fraction are "
                       "alternatives; set one")
    if not self.prompt_field:
      raise ValueError("task.data.prompt_field must name the prompt's JSON field")
    if self.slow_reward_s < 0:
      raise ValueError(f"task.data.slow_reward_s must be >= 0; got {self.slow_reward_s}")


# ------------------------------------------------------------------------------ records


def read_jsonl(path: str, prompt_field: str = "prompt") -> list[dict]:
  """The records of a JSONL file, each with its "file:line" under SOURCE.

  Raises ValueError naming the file and line for bytes that are not UTF-8, malformed JSON,
  a line that is not an object, a missing or non-string prompt field, or a key starting
  with "_"; and naming the file for a missing or empty file."""
  if not os.path.isfile(path):
    raise ValueError(f"dataset file {path!r} not found")
  records = []
  with open(path, "rb") as f:  # decoded line by line, so a bad byte is named by its line
    for n, raw in enumerate(f, start=1):
      where = f"{path}:{n}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                         f"{e.start + 1}); JSONL files are read as UTF-8") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): "
                         f"{line.strip()[:120]!r}") from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
      if not isinstance(record.get(prompt_field), str):
        got = "no such field" if prompt_field not in record else type(record[prompt_field]).__name__
        raise ValueError(f"{where}: field {prompt_field!r} must be a string ({got}); "
                         f"fields: {sorted(record)}")
      if any(k.startswith("_") for k in record):
        raise ValueError(f"{where}: field names starting with '_' are reserved")
      records.append({**record, SOURCE: where})
  if not records:
    raise ValueError(f"dataset file {path!r} holds no records")
  return records


def is_heldout(record: dict, fraction: float) -> bool:
  """True when sha256(canonical JSON of the record, without SOURCE) / 2**64 < fraction."""
  body = {k: v for k, v in record.items() if k != SOURCE}
  digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def split_records(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
  """(train, heldout) records for `cfg`; heldout may be empty (no held-out set configured)."""
  if not cfg.train_file:
    raise ValueError("task.name='dataset' needs task.data.train_file (a JSONL file of prompts)")
  train = read_jsonl(cfg.train_file, cfg.prompt_field)
  if cfg.heldout_file:
    return train, read_jsonl(cfg.heldout_file, cfg.prompt_field)
  if not cfg.heldout_fraction:
    return train, []
  held = [r for r in train if is_heldout(r, cfg.heldout_fraction)]
  train = [r for r in train if not is_heldout(r, cfg.heldout_fraction)]
  if not train or not held:
    raise ValueError(f"task.data.heldout_fraction={cfg.heldout_fraction} leaves the "
                     f"{'train' if not train else 'held-out'} split of {cfg.train_file!r} empty")
  return train, held


def check_fields(rewards: Sequence[R.Reward], records: Sequence[dict]) -> None:
  """Every field a reward requires is in every record; else ValueError naming the reward,
  the field and the record's file:line."""
  for r in rewards:
    for field in r.needs:
      for rec in records:
        if field not in rec:
          raise ValueError(f"reward {r.name} ({r.spec}) needs the field {field!r}, which the "
                           f"record at {rec[SOURCE]} lacks (it has: "
                           f"{sorted(k for k in rec if k != SOURCE)})")


# ------------------------------------------------------------------------------ the task


class DatasetTask(Task):
  """Prompts from records, rewards from user functions (see the module docstring).

  Example.prompt is the text the model sees (rendered by the chat template when one is
  set); Example.meta holds the record, whose prompt field keeps the user's text: that is
  what reward functions receive as `prompts`."""

  name = "dataset"

  def __init__(self, cfg: DataConfig, reward_specs: Sequence[str],
               render: Callable[[str], str] | None = None):
    self._load(cfg, R.load_rewards(reward_specs), *split_records(cfg), render)

  def _load(self, cfg: DataConfig, rewards: Sequence[R.Reward], train: list[dict],
            heldout: list[dict], render: Callable[[str], str] | None) -> None:
    """Takes records from anywhere (a file here, a generator in tasks/gym.py): each a dict
    with the prompt field and SOURCE, checked against the rewards' fields."""
    self.cfg = cfg
    self.rewards = list(rewards)
    self.train_records, self.heldout_records = train, heldout
    check_fields(self.rewards, self.train_records + self.heldout_records)
    self.render = render
    self._train = [self.example(r) for r in self.train_records]
    self._heldout = [self.example(r) for r in self.heldout_records]
    # Fields the rewards may be given: the union over records (absent ones are None).
    self.fields = sorted({k for r in self.train_records + self.heldout_records for k in r}
                         - {SOURCE, cfg.prompt_field})

  def with_renderer(self, render: Callable[[str], str] | None) -> DatasetTask:
    """The same task with prompts shown to the model through `render` (a chat template)."""
    new = copy.copy(self)
    new.render = render
    new._train = [new.example(r) for r in self.train_records]
    new._heldout = [new.example(r) for r in self.heldout_records]
    return new

  def example(self, record: dict) -> Example:
    """The Example for `record` (a dict from `read_jsonl`), rendered by this task's
    chat template when one is set."""
    text = record[self.cfg.prompt_field]
    shown = text if self.render is None else self.render(text)
    answer = record.get(self.cfg.answer_field)
    return Example(prompt=shown, answer="" if answer is None else str(answer), meta=record)

  def __repr__(self) -> str:
    return (f"DatasetTask({self.cfg.train_file!r}: {len(self._train)} train, "
            f"{len(self._heldout)} held-out, rewards {[r.spec for r in self.rewards]})")

  # -- data order

  @functools.lru_cache(maxsize=8)
  def _order(self, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, 2_718_281, epoch]).permutation(len(self._train))

  def position(self, step: int, batch: int) -> tuple[int, int]:
    """(epoch, index in that epoch) of the first prompt of iteration `step`."""
    return divmod(step * batch, len(self._train))

  def train_batch(self, seed: int, step: int, n: int) -> list[Example]:
    """Prompts p = step*n ... step*n + n - 1 of the epoch-wise shuffled stream."""
    N = len(self._train)
    return [self._train[int(self._order(seed, p // N)[p % N])]
            for p in range(step * n, step * n + n)]

  def eval_examples(self, seed: int, n: int) -> list[Example]:
    """The first `n` held-out records, in file order (all of them if fewer; none when no
    held-out set is configured)."""
    return self._heldout[:n]

  def sample(self, rng: np.random.Generator, n: int, split: str) -> list[Example]:
    """`n` examples of `split` drawn uniformly with replacement."""
    check_sample_args("DatasetTask.sample", rng, n, split)
    pool = self._train if split == "train" else self._heldout
    if not pool:
      raise ValueError(f"{self!r}: the {split!r} split is empty")
    return [pool[int(i)] for i in rng.integers(0, len(pool), size=n)]

  def corpus(self, rng: np.random.Generator, n: int) -> list[str]:
    """Prompt + answer of every training record (for a task tokenizer), cycled up to n."""
    texts = [e.prompt + e.answer for e in self._train]
    return [texts[i % len(texts)] for i in range(max(n, len(texts)))]

  # -- scoring

  def demonstration(self, example: Example) -> str:
    return example.answer

  def score_batch(self, examples: Sequence[Example], completions: Sequence[str], *,
                  log: Callable[[str], None] = print
                  ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(rewards_R float32, correct_R bool, {"reward/<name>": values_R float64}) for the
    rows: the weighted sum of the rewards, the first one >= task.data.correct_threshold, and
    each reward unweighted."""
    prompts = [e.meta[self.cfg.prompt_field] for e in examples]
    fields = {k: [e.meta.get(k) for e in examples] for k in self.fields}
    total, parts = R.score_batch(self.rewards, prompts, completions, fields,
                                 slow_s=self.cfg.slow_reward_s, log=log)
    correct = parts[self.rewards[0].name] >= self.cfg.correct_threshold
    return total, correct, {f"reward/{k}": v for k, v in parts.items()}

  def is_correct(self, example: Example, completion: str) -> bool:
    return bool(self.score_batch([example], [completion])[1][0])

  def reward(self, example: Example, completion: str) -> float:
    return float(self.score_batch([example], [completion])[0][0])


def examples_from_file(task: DatasetTask, path: str) -> list[Example]:
  """The records of another JSONL file (e.g. a held-out set for evaluation) as examples of
  `task` (same fields, rewards and chat template); reward fields checked."""
  records = read_jsonl(path, task.cfg.prompt_field)
  check_fields(task.rewards, records)
  return [task.example(r) for r in records]

