"""The run directory: read and checked before anything is written to it, and kept in
agreement with its checkpoints.

    runs/<name>/
      config.json              the run's config; written once the run has started (step 0
                               saved) or been restored, never by a refused start
      config.before_step_N.json  the previous config.json when a resume at step N changed
                               settings that are safe to change (SAFE below)
      tokenizer.model          the task tokenizer (pretrained runs use the model's)
      checkpoints/<step>       orbax; <step>.incomplete and <step>.damaged are set aside,
                               never deleted (gspo_jax/train/checkpoint.py)
      reference/               the KL reference policy (loss.kl_coef > 0; not in a LoRA run,
                               whose reference is its frozen base)
      base.json, base/         a LoRA run's frozen base: where it comes from, and the
                               cold start's policy saved once (gspo_jax/lora/run.py)
      metrics.jsonl            one JSON record per step, each step once: cut back to the
                               restored step on resume
      metrics.jsonl.dropped    the records a resume cut (steps after the restored
                               checkpoint, a half-written last line), appended
      tb/                      TensorBoard events (append-only: a resumed run's steps after
                               the restored checkpoint appear twice there; TensorBoard
                               shows the later ones)

`check_resume` compares the saved config with the requested one: a change to a field that
fixes the state's structure or meaning (REFUSED) stops the resume, naming every such field;
the other changes are allowed and listed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

from gspo_jax.models.config import EXECUTION_FIELDS
from gspo_jax.utils import configlib


class RunDirError(ValueError):
  """A start or resume refused before anything in the run directory was written."""


CONFIG = "config.json"
METRICS = "metrics.jsonl"

# Dotted-field prefixes whose change a resume refuses, with what they fix. A field matches
# a prefix equal to it or a parent of it ("model" covers model.hidden).
REFUSED: dict[str, str] = {
    "model": "the model's shape (the checkpoint's arrays)",
    "pretrained": "the model and tokenizer",
    "pretrained_dtype": "the checkpoint's parameter dtypes",
    "task": "the task (prompts, tokenizer, rewards, the held-out set and the data stream)",
    "multiturn.env": "the environment (its problems, observations and rewards)",
    "loss.name": "the objective",
    "lora": "the adapters (the checkpoint's arrays) and which weights are frozen",
    "loss.kl_coef": "the KL reference (saved at step 0 only when loss.kl_coef > 0)",
    "optim": "the optimiser state (its hyperparameters and schedule live in it)",
    "seed": "the data stream and the random keys",
    "rollout.prompts_per_iter": "the data position (step x prompts per iteration)",
    "rollout.oversample": "the data position (step x prompts sampled per iteration)",
    "asynchronous.max_staleness": "the rollouts in flight saved with each checkpoint (one "
                                  "per step of staleness) and which version samples each",
    "asynchronous.pi_old": "what pi_old is (the sampling version's, or the trainer's)",
}
# How the model runs, not its parameters (`models.config.EXECUTION_FIELDS`): allowed under
# the refused "model", so a resume can turn on remat or attention chunks to fit memory.
EXECUTION = tuple(f"model.{name}" for name in EXECUTION_FIELDS)
# Changes that are safe: they change neither the state nor what a step means (the three
# task.data fields only report or score, under the refused "task").
SAFE = ("iterations", "eval_every", "eval_size", "sft", "mesh", "profile_phases", "prepare_chunks",
        "placement", "asynchronous.timeline",
        "task.data.slow_reward_s",
        "task.data.correct_threshold", "task.data.answer_field")


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _under(field: str, prefixes) -> str | None:
  return next((p for p in prefixes if field == p or field.startswith(p + ".")), None)


def config_diff(saved, requested) -> dict[str, tuple[Any, Any]]:
  """{dotted field: (saved value, requested value)} for every field that differs. A
  pretrained run's `model` is filled in from its directory when it starts, so it is
  compared through `pretrained` alone."""
  a, b = _flat(configlib.to_dict(saved)), _flat(configlib.to_dict(requested))
  diff = {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
  if saved.pretrained and saved.pretrained == requested.pretrained:
    diff = {k: v for k, v in diff.items() if not _under(k, ("model",))}
  if not saved.pretrained and not requested.pretrained:  # it applies to a loaded checkpoint
    diff.pop("pretrained_dtype", None)
  return diff


def check_resume(saved, requested, log: Callable[[str], None]) -> dict[str, tuple[Any, Any]]:
  """Refuse (ValueError naming each field, its two values and what it fixes) when a field
  in REFUSED differs (RunDirError); log the allowed changes. Returns the allowed changes."""
  diff = config_diff(saved, requested)
  refused = {k: v for k, v in diff.items()
             if _under(k, REFUSED) and not _under(k, SAFE) and k not in EXECUTION}
  if refused:
    lines = [f"  {k}: saved {a!r}, requested {b!r} ({REFUSED[_under(k, REFUSED)]})"
             for k, (a, b) in refused.items()]
    raise RunDirError("--resume refused: the requested config changes what the saved run's "
                     "state means:\n" + "\n".join(lines) + "\nresume with the saved values, "
                     "or start a new --run-dir; nothing in the run directory was changed")
  for k, (a, b) in diff.items():
    kind = ("" if _under(k, SAFE) else
            " (the same function run another way: results may differ in float rounding)"
            if k in EXECUTION else (" (changes the trajectory: the resumed run is no "
                                    "longer an uninterrupted run of either config)"))
    log(f"resume: {k} changed from {a!r} to {b!r}{kind}")
  return diff


def load_saved_config(run_dir: str, cls):
  """The run's saved config, or None when it has none."""
  path = os.path.join(run_dir, CONFIG)
  if not os.path.exists(path):
    return None
  try:
    return configlib.load_json(cls, path)
  except ValueError as e:
    raise RunDirError(f"{path}: the saved config does not load ({e}); nothing was changed")


def save_config(run_dir: str, cfg, *, previous_step: int | None = None) -> None:
  """Write config.json whole (a temporary file renamed over it). With previous_step, an
  existing config.json that differs is first kept as config.before_step_<N>.json."""
  path = os.path.join(run_dir, CONFIG)
  tmp = path + ".tmp"
  configlib.save_json(cfg, tmp)
  if os.path.exists(path):
    with open(path, "rb") as f, open(tmp, "rb") as g:
      if f.read() == g.read():
        os.remove(tmp)
        return
    if previous_step is not None:
      shutil.copyfile(path, os.path.join(run_dir, f"config.before_step_{previous_step}.json"))
  os.replace(tmp, path)


def cut_metrics(run_dir: str, step: int) -> str | None:
  """Keep the records of metrics.jsonl with "step" <= `step`, in order; move the others
  (later steps, a line that does not parse such as a half-written last one) to
  metrics.jsonl.dropped. The file is rewritten whole (temporary file, rename) and only
  when something is cut. Returns what was done, or None."""
  path = os.path.join(run_dir, METRICS)
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    data = f.read()
  keep, dropped, broken = [], [], 0
  for line in data.splitlines(keepends=True):
    try:
      record = json.loads(line) if line.endswith(b"\n") else None
      ok = isinstance(record, dict) and int(record["step"]) <= step
    except (ValueError, KeyError, TypeError):
      record, ok = None, False
    if record is None:
      broken += 1
    (keep if ok else dropped).append(line if line.endswith(b"\n") else line + b"\n")
  if not dropped:
    return None
  with open(path + ".dropped", "ab") as f:
    f.write(b"".join(dropped))
  with open(path + ".tmp", "wb") as f:
    f.write(b"".join(keep))
  os.replace(path + ".tmp", path)
  repaired = f" ({broken} unreadable line(s), e.g. a half-written last one)" if broken else ""
  return (f"{METRICS} cut back to step {step}: {len(dropped)} record(s) after the restored "
          f"checkpoint moved to {METRICS}.dropped{repaired}")
