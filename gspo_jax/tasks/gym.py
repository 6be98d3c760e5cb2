"""reasoning-gym's procedural tasks (chain_sum, basic_arithmetic, countdown, ...) as a task.

    python -m gspo_jax.train --config configs/smollm2_gym.py --set task.gym.name=countdown \\
        --set 'task.gym.kwargs={"min_numbers": 3, "max_numbers": 4}'

Why a config group (`task.name="gym"`, `task.gym.*`) rather than an export to JSONL: a
reasoning-gym problem is a pure function of (dataset, its settings, seed, index), so the
run generates its problems where it starts. No file has to be written, kept in step with
the config or put on a filesystem every host of a pod shares (each host generates the same
problems, as each computes the same batch for the other tasks), and the dataset's own
`score_answer` sees the entry exactly as reasoning-gym built it (verifiers read its
metadata, countdown its numbers and target, and a JSON round trip would turn tuples into
lists). Everything after generation is the dataset path: `GymTask` is a `DatasetTask`
built from generated records instead of a file, so the data order, resume, chat template,
prompt-length check, held-out evaluation and the one scoring path
(`gspo_jax.tasks.rewards.score_batch`) are shared, not copied.

Records: {prompt: the question, answer: reasoning-gym's oracle answer, "metadata": its
metadata} (task.data.prompt_field / task.data.answer_field name the first two). Training problems
are items 0 ... task.gym.size - 1 of the dataset at task.gym.seed, shuffled per epoch by the run's
`seed` as for a dataset. `task.gym.kwargs` is a JSON object of the dataset's own settings
(its difficulty: chain_sum's min_terms / max_terms / min_digits / max_digits, countdown's
min_numbers / max_numbers / min_target / ...); unknown keys are refused with close matches.

Held-out set: task.gym.heldout_size items of the same dataset at task.gym.heldout_seed (default
task.gym.seed + 2**31). reasoning-gym draws item i from Random(seed + i), so two seeds closer
than task.gym.size share items (seed + 1 repeats all but one training problem); 2**31 apart
they share none. Different draws can still write the same question (chain_sum with two
one-digit terms has 200 distinct problems), so held-out problems whose question text is
also a training question are dropped, and the run says how many.

Answers (reasoning-gym's convention): the model writes its final answer between <answer>
and </answer>; the answer is the text of the last such tag (reasoning-gym's own
`extract_answer`; without a tag there is no answer), and the reward is the dataset's
`score_answer(answer, entry)` in [0, 1]. Some verifiers give partial credit: chain_sum
len(oracle) / len(answer) when the oracle is a substring of a wrong answer ("14" for 4:
0.5), countdown 0.05 for a wrong expression and 0.01 for none. A row is correct (accuracy,
pass@k) when the score is >= task.data.correct_threshold (1.0). reasoning-gym's questions do not
ask for the tag, its system prompts do (`reasoning_gym.utils.SYSTEM_PROMPTS`): set one as
task.data.system_prompt (configs/smollm2_gym.py uses its "direct" prompt). `reward` adds terms
after the verifier (e.g. format_reward*0.1); each is logged as reward/<name>, the verifier
as reward/<task.gym.name>.

reasoning-gym is an optional extra (`pip install reasoning-gym`), imported when the task
is built (about 2 s: it imports all its datasets). The name is checked when the config is
built, against the datasets of the version tested here (NAMES) without importing it; a
name missing there is looked up in the installed package when that is another version.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import json
import time
from collections.abc import Callable, Sequence

from gspo_jax.tasks import rewards as R
from gspo_jax.tasks.base import Example
from gspo_jax.tasks.dataset import SOURCE, DataConfig, DatasetTask

TESTED_VERSION = "0.1.25"
# The datasets registered by reasoning-gym 0.1.25 (reasoning_gym.factory.DATASETS);
# tests/tasks/test_gym.py compares them with the installed package.
NAMES = frozenset("""
ab acre advanced_geometry aiw arc_1d arc_agi base_conversion basic_arithmetic bf
binary_alternation binary_matrix bitwise_arithmetic boxnet caesar_cipher calendar_arithmetic
chain_sum circuit_logic codeio coin_flip color_cube_rotation complex_arithmetic composite
count_bits count_primes countdown course_schedule cryptarithm decimal_arithmetic
decimal_chain_sum dice emoji_mystery family_relationships figlet_font fraction_simplification
futoshiki game_of_life game_of_life_halting gcd graph_color group_anagrams gsm_symbolic
intermediate_integration isomorphic_strings jugs kakurasu knight_swap knights_knaves
largest_island lcm leg_counting letter_counting letter_jumble list_functions mahjong_puzzle
manipulate_matrix maze mini_sudoku modulo_grid n_queens needle_haystack number_filtering
number_format number_sequence number_sorting palindrome_generation palindrome_partitioning
path_star polynomial_equations polynomial_multiplication pool_matrix power_function
prime_factorization products propositional_logic puzzle24 quantum_lock ransom_note rearc
rectangle_count rotate_matrix rotten_oranges rubiks_cube rush_hour self_reference
sentence_reordering shortest_path simple_equations simple_geometry simple_integration sokoban
spell_backward spiral_matrix string_insertion string_manipulation string_splitting
string_synthesis sudoku survo syllogism time_intervals tower_of_hanoi tsumego word_ladder
word_sequence_reversal word_sorting zebra_puzzles
""".split())
HELDOUT_OFFSET = 2**31  # default gym.heldout_seed - gym.seed (see the module docstring)
_OWN = ("seed", "size")  # dataset settings that have a gym.* field of their own


@dataclasses.dataclass(frozen=True)
class GymConfig:
  """Which reasoning-gym dataset, how many problems, and its own settings (task.name="gym")."""
  name: str = ""                    # a registered dataset, e.g. chain_sum, countdown
  size: int = 1000                  # training problems: items 0 ... size - 1
  seed: int = 0                     # the dataset's seed (the run's `seed` orders the data)
  heldout_size: int = 256
  heldout_seed: int | None = None   # None = seed + 2**31, far from training (docstring)
  kwargs: str = ""                  # JSON object of the dataset's settings, e.g. '{"max_terms": 3}'

  def __post_init__(self):
    if self.size < 1 or self.heldout_size < 1:
      raise ValueError(f"task.gym.size ({self.size}) and task.gym.heldout_size "
                       f"({self.heldout_size}) must be >= 1")
    self.settings()  # the JSON is checked here; its keys against the dataset at setup
    if self.name:
      check_name(self.name)

  def settings(self) -> dict:
    """task.gym.kwargs as a dict; ValueError when it is not a JSON object or sets seed / size."""
    if not self.kwargs.strip():
      return {}
    try:
      out = json.loads(self.kwargs)
    except json.JSONDecodeError as e:
      raise ValueError(f"task.gym.kwargs must be a JSON object, e.g. '{{\"max_terms\": 3}}'; "
                       f"got {self.kwargs!r} ({e.msg})") from None
    if not isinstance(out, dict):
      raise ValueError(f"task.gym.kwargs must be a JSON object; got {self.kwargs!r} (a "
                       f"{type(out).__name__})")
    own = [k for k in _OWN if k in out]
    if own:
      raise ValueError(f"task.gym.kwargs sets {own}: use task.gym.{own[0]} instead")
    return out

  @property
  def resolved_heldout_seed(self) -> int:
    return self.seed + HELDOUT_OFFSET if self.heldout_seed is None else self.heldout_seed


def check_settings(task: str, gym: GymConfig, data: DataConfig) -> None:
  """The task group's checks of gym: task.name="gym" needs task.gym.name; task.gym.* applies
  to it alone; its held-out set is gym's own, never task.data.heldout_file /
  heldout_fraction."""
  if task != "gym":
    if gym != GymConfig():
      raise ValueError(f"task.gym.* applies to task.name='gym'; task.name is {task!r}")
    return
  if not gym.name:
    raise ValueError("task.name='gym' needs task.gym.name, a reasoning-gym dataset "
                     "(e.g. task.gym.name=chain_sum)")
  if data.train_file or data.heldout_file or data.heldout_fraction:
    raise ValueError("task.name='gym' generates its problems and its held-out set (task.gym.size, "
                     "task.gym.heldout_size, task.gym.heldout_seed); task.data.train_file, "
                     "task.data.heldout_file and task.data.heldout_fraction apply to "
                     "task.name='dataset'")


def _refuse(what: str, value: str, known, where: str) -> ValueError:
  close = difflib.get_close_matches(value, sorted(known), n=3, cutoff=0.6)
  hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
  return ValueError(f"{what} {value!r} is not {where}{hint}")


def check_name(name: str) -> None:
  """ValueError naming task.gym.name, with close matches, for a name no dataset has."""
  if name in NAMES:
    return
  known, where = NAMES, f"a reasoning-gym {TESTED_VERSION} dataset"
  if installed_version() not in (None, TESTED_VERSION):  # another version: ask it (~2 s)
    known, where = set(import_reasoning_gym(name).factory.DATASETS), "a reasoning-gym dataset"
  if name not in known:
    raise _refuse("task.gym.name", name, known, where)


def installed_version() -> str | None:
  """The installed reasoning-gym's version, without importing it; None when absent."""
  try:
    return importlib.metadata.version("reasoning-gym")
  except importlib.metadata.PackageNotFoundError:
    return None


def import_reasoning_gym(name: str):
  """The reasoning_gym module; ImportError saying how to install it and which setting
  asked for it."""
  try:
    import reasoning_gym
  except ImportError as e:
    raise ImportError(f"task.name='gym' (task.gym.name={name!r}) needs the optional package "
                      f"reasoning-gym: pip install reasoning-gym=={TESTED_VERSION} (the "
                      "version tested here)") from e
  return reasoning_gym


def make_dataset(cfg: GymConfig, seed: int, size: int):
  """reasoning-gym's dataset cfg.name with task.gym.kwargs, at `seed` with `size` items.
  ValueError naming task.gym.kwargs for a setting the dataset lacks or refuses."""
  rg = import_reasoning_gym(cfg.name)
  if cfg.name not in rg.factory.DATASETS:
    raise _refuse("task.gym.name", cfg.name, rg.factory.DATASETS, "a reasoning-gym dataset")
  config_cls = rg.factory.DATASETS[cfg.name][1]
  fields = {f.name for f in dataclasses.fields(config_cls)} - set(_OWN)
  settings = cfg.settings()
  for key in settings:
    if key not in fields:
      raise _refuse("task.gym.kwargs:", key, fields, f"a setting of {cfg.name} "
                    f"({config_cls.__name__}: {', '.join(sorted(fields))})")
  try:
    return rg.create_dataset(cfg.name, seed=seed, size=size, **settings)
  except (AssertionError, TypeError, ValueError) as e:  # its config's validate() asserts
    raise ValueError(f"task.gym.kwargs={cfg.kwargs!r} refused by reasoning-gym's {cfg.name}: "
                     f"{e}") from e


def records(dataset, name: str, data: DataConfig, split: str) -> list[dict]:
  """Every item of `dataset` as a record of the dataset path (see the module docstring)."""
  out = []
  for i in range(len(dataset)):
    entry = dataset[i]
    out.append({data.prompt_field: entry["question"], data.answer_field: entry["answer"],
                "metadata": entry["metadata"],
                SOURCE: f"reasoning-gym {name} {split} item {i}"})
  return out


def drop_seen(heldout: list[dict], train: list[dict], field: str) -> tuple[list[dict], int]:
  """(held-out records whose `field` no training record has, how many were dropped)."""
  seen = {r[field] for r in train}
  kept = [r for r in heldout if r[field] not in seen]
  return kept, len(heldout) - len(kept)


def verifier(dataset, name: str, data: DataConfig) -> R.Reward:
  """The dataset's score_answer as a batch reward: score_answer(the last <answer> tag's
  text or None, {question, answer, metadata}) per row."""
  from reasoning_gym.utils import extract_answer
  prompt_field, answer_field = data.prompt_field, data.answer_field

  def score(prompts, completions, **fields):
    return [dataset.score_answer(extract_answer(c), {"question": p, "answer": a,
                                                     "metadata": m})
            for p, c, a, m in zip(prompts, completions, fields[answer_field],
                                  fields["metadata"])]

  needs = (answer_field, "metadata")
  return R.Reward(spec=f"gym:{name}", name=name, weight=1.0, fn=score, needs=needs,
                  takes=needs, takes_all=False)


class GymTask(DatasetTask):
  """A reasoning-gym dataset's problems and verifier as a DatasetTask (module docstring).

  Rewards: the verifier first (it decides correctness), then those named by `extra`."""

  name = "gym"

  def __init__(self, cfg: GymConfig, data: DataConfig, extra: Sequence[str] = (),
               render: Callable[[str], str] | None = None, log: Callable[[str], None] = print):
    import_reasoning_gym(cfg.name)  # its own import (about 2 s) is not generation time
    t0 = time.perf_counter()
    train_set = make_dataset(cfg, cfg.seed, cfg.size)
    held_seed = cfg.resolved_heldout_seed
    train = records(train_set, cfg.name, data, "train")
    held = records(make_dataset(cfg, held_seed, cfg.heldout_size), cfg.name, data, "held-out")
    heldout, dropped = drop_seen(held, train, data.prompt_field)
    log(f"gym: reasoning-gym {cfg.name}: {len(train)} training and {cfg.heldout_size} "
        f"held-out problems generated in {time.perf_counter() - t0:.1f} s")
    if dropped:
      log(f"gym: dropped {dropped} of {cfg.heldout_size} held-out problems (seed "
          f"{held_seed}) whose question is also a training one (seed {cfg.seed}, size "
          f"{cfg.size}); {len(heldout)} held-out problems left")
    if not heldout:
      raise ValueError(f"gym: every held-out problem of {cfg.name} is also a training one "
                       "(the settings allow few distinct problems): lower task.gym.size or widen "
                       "task.gym.kwargs")
    rewards = [verifier(train_set, cfg.name, data)]
    for r in R.load_rewards(extra) if extra else []:
      rewards.append(r if r.name != cfg.name else dataclasses.replace(r, name=f"{r.name}_2"))
    self.gym = cfg
    self._load(data, rewards, train, heldout, render)

  def __repr__(self) -> str:
    return (f"GymTask({self.gym.name!r}: {len(self._train)} train, {len(self._heldout)} "
            f"held-out, rewards {[r.spec for r in self.rewards]})")

  def demonstration(self, example: Example) -> str:
    """The oracle answer in the tag the verifier reads (a cold start teaches the format)."""
    return f"<answer>{example.answer}</answer>"
