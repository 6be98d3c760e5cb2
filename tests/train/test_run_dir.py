"""The run directory under faults: kill -9 in the middle of a checkpoint save and SIGTERM in
the middle of a run, each followed by --resume (real processes, real signals); refused
starts and resumes leave the directory byte for byte unchanged; metrics.jsonl holds every
step once and parses; a damaged newest checkpoint falls back; every setting is checked
before any work."""

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from gspo_jax import config as C
from gspo_jax.models.config import tiny
from gspo_jax.parallel.sharding import MeshConfig
from gspo_jax.train import checkpoint, rundir
from gspo_jax.train import loop as T
from tests.helpers import dataset_cfg

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)

CONFIG = f"""
import sys
sys.path.insert(0, {ROOT!r})
from tests.helpers import tiny_cfg
from gspo_jax import config as C

def get_config(arg=None):
  return tiny_cfg(iterations=6, sft=C.SFTConfig(steps=2, batch_size=8), eval_size=4)
"""

# Runs the training CLI; GSPO_TEST_FAULT injects a fault at a given step:
#   sigterm:N     the process sends itself a real SIGTERM once step N's metrics are written
#   kill_save:N   SIGKILL in the middle of step N's save: its data written, not yet renamed
#                 into place (orbax's finalize)
DRIVER = """
import os, signal, sys
fault = os.environ.get("GSPO_TEST_FAULT", "")
kind, _, step = fault.partition(":")
if kind == "sigterm":
  from gspo_jax.train import metrics
  write = metrics.MetricsWriter.write
  def spy(self, s, m, **kw):
    write(self, s, m, **kw)
    if s == int(step):
      os.kill(os.getpid(), signal.SIGTERM)
  metrics.MetricsWriter.write = spy
elif kind == "kill_save":
  from orbax.checkpoint._src.handlers import standard_checkpoint_handler as sch
  finalize = sch.StandardCheckpointHandler.finalize
  def dying(self, directory):
    if os.path.basename(os.path.dirname(str(directory))).startswith(step + "."):
      os.kill(os.getpid(), signal.SIGKILL)
    finalize(self, directory)
  sch.StandardCheckpointHandler.finalize = dying
from gspo_jax.train import loop as train
train.main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("files")
  (d / "cfg.py").write_text(CONFIG)
  (d / "driver.py").write_text(DRIVER)
  return d


def cli(files, run_dir, *args, fault="", check=True):
  env = {**os.environ, "GSPO_TEST_FAULT": fault, "PYTHONPATH": ROOT,
         "JAX_COMPILATION_CACHE_DIR": os.path.join(ROOT, ".jax_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  p = subprocess.run([sys.executable, str(files / "driver.py"), "--config", str(files / "cfg.py"),
                      "--run-dir", str(run_dir), "--no-progress", "--keep-checkpoints", "10",
                      *args], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
  if check and p.returncode != 0:
    raise AssertionError(f"exit {p.returncode}\n{p.stdout}\n{p.stderr}")
  return p


def records(run_dir):
  """metrics.jsonl: every line parses; the timings (which differ run to run) removed."""
  lines = pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
  return [{k: v for k, v in json.loads(l).items()
           if not k.startswith("time_") and not k.endswith("tokens_per_s")} for l in lines]


def checksums(run_dir):
  out = {}
  for folder, _, names in os.walk(run_dir):
    for n in names:
      p = os.path.join(folder, n)
      out[os.path.relpath(p, run_dir)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
  return out


@pytest.fixture(scope="module")
def full(files, tmp_path_factory):
  """An uninterrupted 6-iteration run, checkpoints every 2."""
  run_dir = tmp_path_factory.mktemp("full")
  cli(files, run_dir, "--checkpoint-every", "2")
  return run_dir


@pytest.fixture(scope="module")
def faulted(files, tmp_path_factory):
  """Both faults in one run directory, each followed by --resume in a new process (three
  processes, not four): SIGTERM mid-run, then --resume killed -9 in the middle of step 6's
  save, then --resume to the end. What each test checks is kept per stage."""
  run_dir = tmp_path_factory.mktemp("faulted")
  ckpts = run_dir / "checkpoints"
  stages = {}
  # --checkpoint-every 0: only step 0 and the save the signal asks for.
  p = cli(files, run_dir, "--checkpoint-every", "0", fault="sigterm:2", check=False)
  stages["sigterm"] = (p, checkpoint.complete_steps(str(ckpts)), records(run_dir))
  # Resumed from 3 with --checkpoint-every 2: saves at 4, then (killed) at 6.
  p = cli(files, run_dir, "--checkpoint-every", "2", "--resume", fault="kill_save:6",
          check=False)
  stages["killed"] = (p, os.listdir(ckpts), checkpoint.complete_steps(str(ckpts)),
                      records(run_dir))
  with open(run_dir / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "loss": 0.')  # and a half-written last line (a full disk)
  before = json.loads((run_dir / "config.json").read_text())
  # A safe change (the held-out size) is allowed and logged; the old config is kept.
  p = cli(files, run_dir, "--checkpoint-every", "2", "--resume", "--set", "eval_size=3")
  stages["resumed"] = (p, before)
  return run_dir, stages


def test_sigterm_mid_run_then_resume(full, faulted):
  run_dir, stages = faulted
  p, complete, got = stages["sigterm"]
  assert p.returncode == 128 + signal.SIGTERM, p.stdout + p.stderr
  assert "Traceback" not in p.stderr
  # The signal arrived in iteration 3 (metrics are written one iteration late): saved at 3.
  assert "stopped by SIGTERM at step 3" in p.stdout and "--resume" in p.stdout
  assert complete == [0, 3]
  assert [r["step"] for r in got] == [1, 2, 3]
  # Step 4 is the SIGTERM resume's (killed later, at step 6); 5 and 6 follow from its
  # checkpoint at 4.
  assert records(run_dir) == records(full)  # steps 1..6 once each, bit for bit


def test_kill_9_mid_save_then_resume(full, faulted):
  run_dir, stages = faulted
  p, names, complete, got = stages["killed"]
  assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
  assert any(n.startswith("6.orbax-checkpoint-tmp") for n in names)  # mid-save
  assert complete == [0, 3, 4]
  assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
  p, before = stages["resumed"]
  assert "resumed from checkpoint step 4" in p.stdout
  assert "resume: eval_size changed from 4 to 3" in p.stdout
  assert "metrics.jsonl cut back to step 4: 2 record(s)" in p.stdout
  assert json.loads((run_dir / "config.before_step_4.json").read_text()) == before
  assert json.loads((run_dir / "config.json").read_text())["eval_size"] == 3
  assert records(run_dir) == records(full)
  dropped = (run_dir / "metrics.jsonl.dropped").read_text().splitlines()
  assert [json.loads(l)["step"] for l in dropped[:1]] == [5] and len(dropped) == 2


def test_refused_start_and_resume_change_nothing(files, full, tmp_path, capsys):
  run_dir = tmp_path / "copy"
  shutil.copytree(full, run_dir)
  before = checksums(run_dir)
  cfg = T.configlib.load_config(str(files / "cfg.py"))
  with pytest.raises(rundir.RunDirError, match="already holds checkpoints"):
    T.train(cfg, str(run_dir), progress=False)
  wider = T.configlib.apply_overrides(cfg, ["model.hidden=64", "loss=grpo"])
  with pytest.raises(rundir.RunDirError) as e:
    T.train(wider, str(run_dir), resume=True, progress=False)
  assert "model.hidden: saved 32, requested 64" in str(e.value)
  assert "loss.name: saved 'gspo', requested 'grpo'" in str(e.value)
  for bad in (["--keep-checkpoints", "0"], ["--checkpoint-every", "-1"],
              ["--set", "rollout.temperature=0"], ["--set", "rollout.top_p=1.5"],
              ["--set", "model.hidden=64"], []):  # the last: a fresh start, refused
    with pytest.raises(SystemExit):
      T.main(["--config", str(files / "cfg.py"), "--run-dir", str(run_dir),
              *(["--resume"] if bad else []), *bad])
  assert checksums(run_dir) == before
  p = cli(files, run_dir, "--resume", "--set", "model.num_layers=3", check=False)
  assert p.returncode == 1 and "model.num_layers: saved 2, requested 3" in p.stderr
  assert "Traceback" not in p.stderr
  assert checksums(run_dir) == before


# orbax's failed read of the damaged step leaves a tensorstore callback that fires after
# its event loop closed ("Event loop is closed", ignored by Python): noise, not a failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_newest_checkpoint_falls_back_and_is_kept(full, tmp_path, capsys):
  from gspo_jax import evaluate
  run_dir = tmp_path / "copy"
  shutil.copytree(full, run_dir)
  newest = run_dir / "checkpoints" / "6"
  for f in (newest / "default").rglob("*"):  # the data files, behind intact metadata
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(b"\0" * 16)
  assert (newest / "_CHECKPOINT_METADATA").exists()
  # A read-only command names it and uses step 4, moving nothing.
  evaluate.main(["--run", str(run_dir), "--size", "2"])
  out = capsys.readouterr().out
  assert "checkpoint step 6" in out and "does not restore" in out and newest.is_dir()
  cfg = T.configlib.load_json(C.TrainConfig, str(run_dir / "config.json"))
  T.train(cfg, str(run_dir), resume=True, checkpoint_every=2, keep=10, progress=False)
  out = capsys.readouterr().out
  assert "checkpoint step 6" in out and "set aside as 6.damaged" in out
  assert "resumed from checkpoint step 4" in out
  assert (run_dir / "checkpoints" / "6.damaged").is_dir()  # kept, not deleted
  assert checkpoint.complete_steps(str(run_dir / "checkpoints")) == [0, 2, 4, 6]
  got = records(run_dir)
  assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
  # Steps 5, 6 recomputed in this process; the same values as the uninterrupted run's.
  for a, b in zip(got[4:], records(full)[4:]):
    for k in ("reward_mean", "loss", "grad_norm", "clip_frac_token"):
      assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)


def test_no_checkpoint_restores_moves_nothing(full, tmp_path):
  # The same error on every step is a wrong template (config), not damage: nothing moved.
  import numpy as np
  ckpts = tmp_path / "checkpoints"
  shutil.copytree(full / "checkpoints", ckpts)
  ckpt = checkpoint.Checkpointer(str(ckpts), every=0, keep=10)
  try:
    with pytest.raises(ValueError, match="no checkpoint restores \\(nothing was moved\\)"):
      ckpt.restore_newest({"x": np.zeros(3)}, log=print)
  finally:
    ckpt.close()
  assert checkpoint.complete_steps(str(ckpts)) == [0, 2, 4, 6]


# ------------------------------------------------------------------------- without training


def test_cut_metrics_repairs_a_half_written_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  good = [json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3)]
  path.write_text("".join(good) + '{"step": 4, "lo')
  message = rundir.cut_metrics(str(tmp_path), 3)
  assert "1 unreadable line" in message
  assert path.read_text() == "".join(good)
  assert (tmp_path / "metrics.jsonl.dropped").read_text() == '{"step": 4, "lo\n'
  assert rundir.cut_metrics(str(tmp_path), 3) is None  # nothing to cut: not rewritten
  rundir.cut_metrics(str(tmp_path), 1)
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1]


def test_a_failed_metrics_write_leaves_no_partial_line(tmp_path, monkeypatch):
  from gspo_jax.train import metrics
  w = metrics.MetricsWriter(str(tmp_path), progress=False)
  w.write(1, {"loss": 0.5})

  class Full:  # a disk that fills after 10 bytes of the next record
    def __init__(self, f):
      self.f = f

    def write(self, b):
      self.f.write(bytes(b[:10]))
      raise OSError(28, "No space left on device")

    def __getattr__(self, name):
      return getattr(self.f, name)

  w.jsonl = Full(w.jsonl)
  with pytest.raises(OSError, match="No space"):
    w.write(2, {"loss": 0.25})
  w.jsonl = w.jsonl.f
  w.close()
  assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'


def test_resume_diff_classifies_fields():
  from tests.helpers import tiny_cfg
  saved = tiny_cfg()
  logs = []
  safe = T.configlib.apply_overrides(saved, ["iterations=9", "eval_every=3",
                                             "rollout.temperature=0.7"])
  assert set(rundir.check_resume(saved, safe, logs.append)) == {
      "iterations", "eval_every", "rollout.temperature"}
  assert "changes the trajectory" in [l for l in logs if "temperature" in l][0]
  assert "trajectory" not in [l for l in logs if "iterations" in l][0]
  # How the model runs may change (e.g. remat to fit memory); its shape may not.
  execution = T.configlib.apply_overrides(saved, ["model.remat=full", "model.attention_chunk=8"])
  logs = []
  assert set(rundir.check_resume(saved, execution, logs.append)) == {
      "model.remat", "model.attention_chunk"}
  assert all("float rounding" in l for l in logs)
  for change, what in [("optim.learning_rate=0.5", "optimiser state"),
                       ("seed=3", "data stream"), ("task=multiplication", "task"),
                       ("rollout.prompts_per_iter=8", "data position"),
                       ("model.scan_layers=true", "model's shape"),
                       ("model.hidden=64", "model's shape")]:
    with pytest.raises(rundir.RunDirError, match=what):
      rundir.check_resume(saved, T.configlib.apply_overrides(saved, [change]), print)
  # What defines the task and its rewards: the chain's length, a multi-turn environment.
  chain = dataclasses.replace(saved, task=C.TaskConfig(name="chain", digits=1, steps=3),
                              rollout=C.RolloutConfig(max_new_tokens=64))
  with pytest.raises(rundir.RunDirError, match=r"task.steps: saved 3, requested 5 \(the task"):
    rundir.check_resume(chain, dataclasses.replace(
        chain, task=dataclasses.replace(chain.task, steps=5)), print)
  env = dataclasses.replace(saved, loss=C.LossConfig("gspo_token"),
                            multiturn=C.MultiTurnConfig(env="calculator"))
  other = dataclasses.replace(
      env, multiturn=C.MultiTurnConfig(env="tests.multiturn_helpers:ScriptedEnv"))
  with pytest.raises(rundir.RunDirError, match=r"multiturn.env: saved 'calculator'.*environment"):
    rundir.check_resume(env, other, print)
  # A pretrained run's model comes from its directory: compared through `pretrained`.
  a = C.TrainConfig(pretrained="some/dir", model=tiny(vocab_size=99))
  assert rundir.config_diff(a, C.TrainConfig(pretrained="some/dir")) == {}
  assert "pretrained" in rundir.config_diff(a, C.TrainConfig(pretrained="other/dir"))


@pytest.mark.parametrize("bad,field", [
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--set", "rollout.temperature=0"], "rollout.temperature must be > 0"),
    (["--set", "rollout.top_p=0"], "rollout.top_p must be in"),
    (["--set", "rollout.top_p=1.5"], "rollout.top_p must be in"),
    (["--set", "rollout.top_k=-1"], "rollout.top_k must be >= 0"),
])
def test_bad_settings_stop_before_any_work(tmp_path, monkeypatch, bad, field):
  monkeypatch.setattr(T, "setup", lambda *a: pytest.fail("setup ran"))
  with pytest.raises(SystemExit, match=field):
    T.main(["--run-dir", str(tmp_path / "r"), *bad])
  assert not (tmp_path / "r").exists()
  with pytest.raises(rundir.RunDirError, match="keep-checkpoints"):
    T.train(C.TrainConfig(), str(tmp_path / "r"), keep=0)
  assert not (tmp_path / "r").exists()


def test_generate_temperature_0_is_greedy(monkeypatch):
  from gspo_jax import generate
  from gspo_jax.rollout import sampling
  seen = []

  class Tok:
    eos_id, pad_id, vocab_size = 1, 0, 8

    def encode(self, text, *, add_special_tokens=False):
      return [2 + ord(c) % 5 for c in text]

  def fake(model, ids, lens, key, cfg):
    seen.append(cfg)
    raise StopIteration

  monkeypatch.setattr(sampling, "sample_groups", fake)
  for t in (0, 0.0, None, 0.7):
    with pytest.raises(StopIteration):
      generate.generate(None, Tok(), ["ab"], temperature=t)
  assert [c.greedy for c in seen] == [True, True, True, False]
  with pytest.raises(ValueError, match="--temperature must be >= 0"):
    generate.generate(None, Tok(), ["ab"], temperature=-1)
  with pytest.raises(SystemExit):
    generate.main(["--model", "x", "--prompt", "a", "--temperature", "-0.5"])


def test_a_too_long_dataset_prompt_stops_the_run_before_any_work(tmp_path):
  path = tmp_path / "d.jsonl"
  records = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(40)]
  records.append({"prompt": "1+2+3+4+5+6+7+8+9=", "answer": "45"})
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  run_dir = tmp_path / "run"
  cfg = dataset_cfg(path, sft=C.SFTConfig(steps=1), iterations=1,
                    mesh=MeshConfig(num_devices=1))
  with pytest.raises(ValueError, match=rf"{path}:41: the prompt is \d+ tokens"):
    T.train(cfg, str(run_dir), progress=False)
  assert not (run_dir / "checkpoints").exists() and not (run_dir / "config.json").exists()


def test_ctrl_c_saves_at_the_next_boundary_and_says_how_to_resume(files, tmp_path, monkeypatch,
                                                                   capsys):
  from gspo_jax.train import metrics
  write = metrics.MetricsWriter.write
  # What SIGINT did before (default_int_handler, or SIG_IGN when started in the background).
  before = signal.getsignal(signal.SIGINT)

  def spy(self, step, m, **kw):
    write(self, step, m, **kw)
    if step == 1:
      os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, in iteration 2

  monkeypatch.setattr(metrics.MetricsWriter, "write", spy)
  args = ["--config", str(files / "cfg.py"), "--run-dir", str(tmp_path), "--no-progress",
          "--checkpoint-every", "0"]
  with pytest.raises(SystemExit) as e:
    T.main(args)
  assert e.value.code == 128 + signal.SIGINT
  out = capsys.readouterr().out
  assert "stopped by SIGINT at step 2" in out
  assert f"python -m gspo_jax.train {' '.join(args)} --resume" in out
  assert checkpoint.complete_steps(str(tmp_path / "checkpoints")) == [0, 2]
  assert [r["step"] for r in records(tmp_path)] == [1, 2]
  assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_a_second_ctrl_c_stops_at_once_and_hosts_agree(monkeypatch):
  before = signal.getsignal(signal.SIGINT)
  signals = T._Signals()
  signals.install(signal.SIGINT, signal.SIGTERM)
  try:
    assert signals.requested() is None
    os.kill(os.getpid(), signal.SIGINT)
    assert signals.requested() == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  finally:
    signals.restore()
  assert signal.getsignal(signal.SIGINT) is before
  # Multi-host: a signal on any host stops every host (the largest signal number wins).
  import numpy as np
  from jax.experimental import multihost_utils
  monkeypatch.setattr(T.jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: np.asarray([int(x), signal.SIGTERM]))
  assert T._Signals().requested() == signal.SIGTERM


def test_a_fresh_start_retrains_a_tokenizer_left_by_a_start_that_never_began(tmp_path):
  # A start refused at setup (or killed before its cold start ended) saved no config and
  # no checkpoint: its tokenizer.model, maybe of another task or vocab, is not the run's.
  from gspo_jax.tasks.tokenizer import SentencePieceTokenizer
  from gspo_jax.train import run as R
  from tests.helpers import tiny_cfg
  cfg = tiny_cfg()
  task = R.make_task(cfg)
  stale = SentencePieceTokenizer.train([f"{a} apples and {a} pears" for a in range(500)],
                                       vocab_size=40)
  fresh_dir, run_dir = tmp_path / "fresh", tmp_path / "run"
  want, trained = R.make_tokenizer(task, cfg, str(fresh_dir))
  assert trained
  stale.save(run_dir)
  got, trained = R.make_tokenizer(task, cfg, str(run_dir))
  assert trained and got.vocab_size == want.vocab_size != stale.vocab_size
  assert (run_dir / "tokenizer.model").read_bytes() == (fresh_dir / "tokenizer.model").read_bytes()
  # Once the run has started (its config saved), resume and evaluation load its own.
  stale.save(run_dir)
  rundir.save_config(str(run_dir), cfg, previous_step=0)
  got, trained = R.make_tokenizer(task, cfg, str(run_dir))
  assert not trained and got.vocab_size == stale.vocab_size


# -------------------------------------------------------- configs saved before the groups


def test_a_config_saved_before_the_groups_loads_as_the_same_config():
  """tests/data/config_before_groups.json is the config.json that commit 5f1a89d wrote for
  configs/addition_tiny.py (task, loss, eps and KL fields flat at the top): it loads, moved
  into the task and loss groups, as the same config the file builds today."""
  saved = T.configlib.load_json(C.TrainConfig, os.path.join(HERE, "data",
                                                            "config_before_groups.json"))
  assert saved == T.configlib.load_config(os.path.join(ROOT, "configs", "addition_tiny.py"))
  assert rundir.config_diff(saved, saved) == {}


def test_a_run_saved_before_the_groups_resumes_and_is_rewritten_once(files, full, tmp_path):
  """A run directory whose config.json has the flat fields (as earlier versions wrote it)
  resumes: the saved config loads through `TrainConfig.migrate`, compares equal to the
  requested one, and the resume writes config.json in the grouped form once (the flat
  file kept beside it as config.before_step_N.json)."""
  run_dir = tmp_path / "old"
  shutil.copytree(full, run_dir)
  grouped = json.loads((run_dir / "config.json").read_text())
  flat = {k: v for k, v in grouped.items() if k not in ("task", "loss")}
  task, loss = grouped["task"], grouped["loss"]
  flat.update(task=task["name"], task_digits=task["digits"], task_steps=task["steps"],
              data=task["data"], reward=task["reward"], gym=task["gym"], loss=loss["name"],
              eps_low=loss["eps_low"], eps_high=loss["eps_high"],
              aggregation=loss["aggregation"], tau_pos=loss["tau_pos"],
              tau_neg=loss["tau_neg"], kl_coef=loss["kl_coef"],
              kl_estimator=loss["kl_estimator"])
  (run_dir / "config.json").write_text(json.dumps(flat))
  cfg = T.configlib.load_config(str(files / "cfg.py"))
  T.train(dataclasses.replace(cfg, iterations=7), str(run_dir), resume=True, progress=False,
          checkpoint_every=0)
  assert json.loads((run_dir / "config.json").read_text())["task"] == grouped["task"]
  assert json.loads((run_dir / "config.before_step_6.json").read_text()) == flat
  assert [r["step"] for r in records(run_dir)] == list(range(1, 8))


def test_a_prompt_the_tokenizer_cannot_encode_names_its_line(tmp_path):
  """A held-out character the task tokenizer never saw (it is trained on the training text)
  makes `encode` refuse; setup's check names the record's file:line."""
  from gspo_jax.tasks import DatasetTask
  from gspo_jax.train.run import check_prompts

  class Refusing:  # as SentencePieceTokenizer.encode refuses what it cannot round-trip
    def encode(self, text, *, add_special_tokens=False):
      if "é" in text:
        raise ValueError("encode: 'é' is not in the vocabulary")
      return list(text)

  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "café", "answer": "2"}\n')
  task = DatasetTask(dataset_cfg(path).task.data, ["exact_match"])
  with pytest.raises(ValueError, match=r"d.jsonl:2: the prompt cannot be encoded by the run's "
                                       r"tokenizer: encode: 'é' is not"):
    check_prompts(task, Refusing(), dataset_cfg(path))


def test_a_resume_without_config_json_into_another_shape_is_one_clear_error(files, full,
                                                                            tmp_path):
  """With config.json gone the requested config cannot be compared before restoring; the
  checkpoint's stored shapes are (from its metadata, before any data is read): the error
  names the arrays that differ and what to do, and no tensorstore read is left to print
  'Event loop is closed' at exit. Nothing in the directory is changed."""
  run_dir = tmp_path / "copy"
  shutil.copytree(full, run_dir)
  (run_dir / "config.json").unlink()
  before = checksums(run_dir)
  p = cli(files, run_dir, "--resume", "--set", "model.hidden=64", check=False)
  assert p.returncode == 1, p.stdout + p.stderr
  assert "does not fit the requested config" in p.stderr
  assert "params/embed/value: stored (24, 32), requested (24, 64)" in p.stderr
  assert "has no config.json to compare" in p.stderr
  assert "Traceback" not in p.stderr and "Event loop is closed" not in p.stderr
  assert checksums(run_dir) == before


def test_pretrained_dtype_is_compared_only_for_a_pretrained_run():
  """pretrained_dtype (float32 masters by default now, "" = as stored before) only acts on
  a loaded checkpoint: a run without `pretrained` resumes whatever it saved; a pretrained
  run's change of parameter dtype is refused."""
  assert rundir.config_diff(C.TrainConfig(pretrained_dtype=""), C.TrainConfig()) == {}
  stored = C.TrainConfig(pretrained="some/dir", pretrained_dtype="")
  with pytest.raises(rundir.RunDirError, match="pretrained_dtype: saved '', requested "
                                               "'float32'"):
    rundir.check_resume(stored, dataclasses.replace(stored, pretrained_dtype="float32"), print)
