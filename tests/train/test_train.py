"""The GSPO training loop on a tiny config: one iteration of each loss, the on-policy
equivalence of the three losses, resume = uninterrupted, config round trip, bad input."""

import contextlib
import dataclasses
import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax.tasks import text
from gspo_jax.train import loop as T
from gspo_jax.train import run as R
from gspo_jax.utils import configlib
from tests import adam_bounds
from tests.helpers import interrupted_copy, leaves, random_rewards, read_metrics, rollout, tiny_cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return R.setup(tiny_cfg(), str(tmp_path_factory.mktemp("run")))


@pytest.fixture(scope="module")
def rolled(run):
  """One rollout batch of the module's run: rollouts and pi_old do not depend on the loss
  settings, so the update tests below share it."""
  return rollout(run)


@pytest.mark.parametrize("loss,eps", [("gspo", (3e-4, 4e-4)), ("gspo_token", (3e-4, 4e-4)),
                                      ("grpo", (0.2, 0.27))])
def test_one_iteration_of_each_loss(configured, rolled, loss, eps):
  cfg = tiny_cfg(loss=C.LossConfig(name=loss))
  assert (cfg.loss.kwargs()["eps_low"], cfg.loss.kwargs()["eps_high"]) == eps
  run = configured(cfg)
  before = leaves(run.state.params)
  r = rolled
  state = jax.tree.map(jnp.copy, run.state)  # the update donates its input
  new, m = run.programs.update(state, r.batch, random_rewards(r, 0))
  assert int(new.step) == 1
  assert all(np.isfinite(float(v)) for v in m.values())
  assert all(np.isfinite(float(v)) for v in {**r.stats, **r.device_stats}.values())
  assert any(np.any(a != b) for a, b in zip(before, leaves(new.params)))
  assert float(m["skipped_updates"]) == 0


def test_recomputed_old_logprobs_equal_the_samplers(run, rolled):
  # Old log-probs recomputed by the trainer equal the sampler's (same policy, same tokens).
  sampler_run = run.reconfigure(dataclasses.replace(run.cfg, old_logp="sampler"))
  r2 = rollout(sampler_run)
  np.testing.assert_array_equal(r2.batch.tokens_BxGxT, rolled.batch.tokens_BxGxT)
  np.testing.assert_allclose(r2.batch.old_logp_BxGxT, rolled.batch.old_logp_BxGxT, rtol=1e-5,
                             atol=1e-5)


def test_grpo_alone_takes_grpo_clip_range_and_aggregation():
  cfg = configlib.apply_overrides(tiny_cfg(), ["loss=grpo"])
  assert cfg.loss.kwargs() == {"eps_low": 0.2, "eps_high": 0.27,
                               "aggregation": "seq-mean-token-mean"}
  cfg = configlib.apply_overrides(cfg, ["loss.aggregation=token-mean", "loss.eps_high=0.28"])
  assert cfg.loss.kwargs() == {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token-mean"}
  assert tiny_cfg().loss.kwargs() == {"eps_low": 3e-4, "eps_high": 4e-4}
  with pytest.raises(configlib.ConfigError,
                     match="loss.aggregation applies to loss.name='grpo'"):
    configlib.apply_overrides(tiny_cfg(), ["loss.aggregation=token-mean"])


def test_grpo_alone_trains_with_grpo_clip_range(run, rolled, monkeypatch):
  # What the train step hands the loss when only loss=grpo is set.
  from gspo_jax.objectives import losses
  seen = {}
  real = losses.LOSSES["grpo"]

  def spy(*args, **kwargs):
    seen.update(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setitem(losses.LOSSES, "grpo", spy)
  # A fresh program, traced (what the loss is handed is fixed at trace time; no compile).
  grpo = run.reconfigure(configlib.apply_overrides(tiny_cfg(), ["loss=grpo"]))
  grpo.programs.update.trace(grpo.state, rolled.batch, random_rewards(rolled, 0))
  assert seen == {"eps_low": 0.2, "eps_high": 0.27, "aggregation": "seq-mean-token-mean"}


def test_on_policy_single_minibatch_losses_give_the_same_update(configured, rolled):
  # One minibatch, old = current policy: GSPO, GSPO-token and GRPO share loss and gradient.
  results = []
  for loss in ("gspo", "gspo_token", "grpo"):
    r = configured(tiny_cfg(loss=C.LossConfig(name=loss), num_minibatches=1))
    new, m = r.programs.update(jax.tree.map(jnp.copy, r.state), rolled.batch,
                               random_rewards(rolled, 1))
    results.append((jax.device_get(new), float(m["loss"])))
  for new, loss in results[1:]:
    assert abs(loss - results[0][1]) < 1e-6
    # Gradients (Adam's first moment) to float32 rounding; parameters within what that
    # rounding can make of one Adam step (up to 2 * lr where a gradient is ~0).
    adam_bounds.assert_first_step_states_close(new, results[0][0], r.cfg.optim.learning_rate)


def test_non_finite_loss_skips_the_update(run, rolled):
  r = rolled
  # The first response token always counts: a NaN pi_old there makes its minibatch's loss NaN.
  bad = r.batch.replace(old_logp_BxGxT=r.batch.old_logp_BxGxT.at[0, 0, 0].set(jnp.nan))
  new, m = run.programs.update(jax.tree.map(jnp.copy, run.state), bad, random_rewards(r, 2))
  # The minibatch holding that row is skipped (params of that step unchanged); others apply.
  assert float(m["skipped_updates"]) >= 1
  assert all(np.all(np.isfinite(x)) for x in leaves(new.params))


def train_logged(*args, **kw):
  """T.train(...) and what it printed."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    T.train(*args, **kw)
  return out.getvalue()


# The resume tests share one uninterrupted run with a KL term, and one resume of it: a copy
# of its directory cut back to an earlier checkpoint (two training runs for what were four
# tests of three runs each).
RESUMED_CFG = tiny_cfg(iterations=4, loss=C.LossConfig(kl_coef=0.1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """An uninterrupted 4-iteration run (checkpoints 0, 2, 4) and its summary."""
  run_dir = tmp_path_factory.mktemp("trained") / "run"
  return run_dir, T.train(RESUMED_CFG, str(run_dir), checkpoint_every=2, progress=False)


@pytest.fixture(scope="module")
def resumed(trained, tmp_path_factory):
  """`trained` interrupted after step 2, with a crashed save beside it (step 7: a directory
  without orbax's metadata; 9: orbax's own unfinished save), resumed to 4; and its log."""
  part = interrupted_copy(trained[0], tmp_path_factory.mktemp("part") / "run", 2)
  (part / "checkpoints" / "7" / "state").mkdir(parents=True)
  (part / "checkpoints" / "9.orbax-checkpoint-tmp-42").mkdir()
  out = train_logged(RESUMED_CFG, str(part), resume=True, checkpoint_every=2, progress=False)
  return part, out


def test_resume_equals_uninterrupted(trained, resumed, capsys):
  full, summary = trained
  a, b = read_metrics(full), read_metrics(resumed[0])
  assert [r["step"] for r in b] == [1, 2, 3, 4]
  for ra, rb in zip(a, b):
    for k in ("reward_mean", "loss", "grad_norm", "clip_frac_token", "ratio_max"):
      assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
  assert summary["heldout_accuracy_end"] >= 0.0
  # The evaluation command reads the run back (config, tokenizer, newest checkpoint).
  from gspo_jax import evaluate
  evaluate.main(["--run", str(full), "--size", "8"])
  assert "step 4: held-out accuracy" in capsys.readouterr().out


def test_kl_reference_is_the_cold_start_policy_across_resume(trained, resumed):
  # After the resume at step 2, the KL of steps 3 and 4 is against the cold-start policy
  # (restored from the run directory), as in the uninterrupted run.
  a, b = read_metrics(trained[0]), read_metrics(resumed[0])
  for ra, rb in zip(a[2:], b[2:]):
    assert ra["kl"] > 0
    assert ra["kl"] == pytest.approx(rb["kl"], rel=1e-5, abs=1e-7), ra["step"]
    assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-7), ra["step"]


def test_half_written_checkpoint_is_ignored(resumed):
  part, out = resumed
  assert "resumed from checkpoint step 2" in out  # the newest complete checkpoint
  assert [r["step"] for r in read_metrics(part)] == [1, 2, 3, 4]
  assert (part / "checkpoints" / "7.incomplete").is_dir()  # set aside, not deleted


def test_existing_run_without_resume_is_refused(trained, tmp_path):
  run_dir = tmp_path / "run"
  shutil.copytree(trained[0], run_dir)
  with pytest.raises(ValueError, match="--resume"):
    T.train(RESUMED_CFG, str(run_dir), progress=False)


def test_config_round_trip_and_overrides():
  cfg = tiny_cfg(loss=C.LossConfig(name="grpo", eps_low=0.2, eps_high=None))
  back = configlib.from_dict(C.TrainConfig, json.loads(json.dumps(configlib.to_dict(cfg))))
  assert back == cfg
  changed = configlib.apply_overrides(cfg, ["rollout.group_size=8", "model.qk_norm=false",
                                            "optim.learning_rate=3e-4"])
  assert changed.rollout.group_size == 8 and not changed.model.qk_norm
  with pytest.raises(configlib.ConfigError, match="rollout.groupsize"):
    configlib.apply_overrides(cfg, ["rollout.groupsize=8"])
  with pytest.raises(configlib.ConfigError, match="loss"):
    configlib.apply_overrides(cfg, ["loss=ppo"])
  with pytest.raises(configlib.ConfigError, match="num_minibatches"):
    configlib.apply_overrides(cfg, ["num_minibatches=3"])


def test_decode_marks_special_tokens(run):
  tok = run.tok
  ids = np.asarray([tok.encode("1") + [tok.bos_id] + tok.encode("22") + [tok.eos_id]])
  out = text.decode_completions(tok, ids, np.ones_like(ids, np.float32))[0]
  assert out == "1\ufffd22" and not run.task.is_correct(run.task.example(10, 12), out)


def test_unwritable_run_dir_fails_before_training(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError, match="not writable"):
    T.train(tiny_cfg(), str(blocker / "run"), progress=False)


def test_shipped_configs_load_and_validate():
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cfg = configlib.load_config(os.path.join(root, "configs", "addition_tiny.py"))
  assert isinstance(cfg, C.TrainConfig) and cfg.loss.name == "gspo" and cfg.num_minibatches == 4
  assert cfg.loss.kwargs() == {"eps_low": 3e-4, "eps_high": 4e-4}
  assert configlib.from_dict(C.TrainConfig, configlib.to_dict(cfg)) == cfg


def test_cold_start_stops_at_the_target_accuracy(run, monkeypatch):
  from gspo_jax.train import coldstart
  lines = []
  cfg = tiny_cfg(sft=C.SFTConfig(steps=10, batch_size=8, target_accuracy=0.4, check_every=2))
  probe = lambda params, examples: 0.3 if len(lines) < 2 else 0.5
  params = coldstart.cold_start(run.reconfigure(cfg), probe_accuracy=probe, log=lines.append)
  # Checks at steps 2 (0.3), 4 (0.3), 6 (0.5 >= 0.4: stop); never 8 or 10.
  assert [l.split(":")[0] for l in lines[:3]] == ["cold start step    2/10",
                                                  "cold start step    4/10",
                                                  "cold start step    6/10"]
  assert "reached the target accuracy 0.4 at step 6" in lines[-1] and len(lines) == 4
  assert any(np.any(a != b) for a, b in zip(leaves(run.state.params), leaves(params)))


def test_full_disk_fails_before_training(tmp_path, monkeypatch):
  import collections
  import shutil
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
  with pytest.raises(ValueError, match="not enough free disk space"):
    T.train(tiny_cfg(), str(tmp_path), progress=False)
  assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_cli_runs_and_rejects_unknown_fields(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit, match="unknown config field 'rollout.groupsize'"):
    T.main(["--set", "rollout.groupsize=8"])
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  T.main(["--config", os.path.join(root, "configs", "addition_tiny.py"), "--run-dir", "r",
          "--no-progress", "--keep-checkpoints", "1", "--checkpoint-every", "1",
          "--set", "iterations=2", "--set", "sft.steps=2", "--set", "eval_size=8",
          "--set", "rollout.prompts_per_iter=4", "--set", "model.hidden=32",
          "--set", "model.mlp_dim=64", "--set", "model.head_dim=8", "--set", "mesh.num_devices=1"])
  assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == ["2"]


def test_default_run_directory_names_the_variant():
  assert T.run_name("configs/addition_tiny.py") == "addition_tiny"
  assert T.run_name("configs/addition_tiny.py:smoke") == "addition_tiny_smoke"
  assert T.run_name(None) == "default"
