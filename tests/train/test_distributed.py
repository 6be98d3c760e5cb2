"""Two processes joined by `jax.distributed` (gloo collectives on 127.0.0.1), each with 2 CPU
devices, train a tiny config over one global mesh (data=2 across the processes x fsdp=2
within each) through the real command line; the metrics and the final parameters equal a
single-process, single-device run of the same config."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from gspo_jax import config as C
from gspo_jax.parallel import sharding
from gspo_jax.train import checkpoint
from gspo_jax.train import run as R
from gspo_jax.utils import configlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One-digit addition after 20 SFT steps earns some reward (nonzero advantages and gradients).
SETTINGS = ["iterations=3", "eval_every=0", "eval_size=8", "task.digits=1", "sft.steps=20",
            "sft.batch_size=16", "sft.learning_rate=1e-2", "sft.target_accuracy=0",
            "optim.warmup_steps=0", "rollout.prompts_per_iter=4", "rollout.group_size=4",
            "rollout.max_new_tokens=4", "rollout.max_prompt_len=8", "num_minibatches=2",
            "model.hidden=32", "model.mlp_dim=64", "model.head_dim=8", "model.num_heads=2",
            "model.num_kv_heads=2", "optim.learning_rate=1e-3"]


def command(run_dir, mesh, *extra):
  sets = [a for s in SETTINGS + mesh for a in ("--set", s)]
  return [sys.executable, "-m", "gspo_jax.train", "--config",
          os.path.join(ROOT, "configs", "addition_tiny.py"), "--run-dir", run_dir, "--no-progress",
          "--checkpoint-every", "1", *sets, *extra]


def launch(cmds, timeout=420):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # conftest's fast-compile flags, without its 8-device count (--cpu-devices sets that).
  env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)
  procs = [subprocess.Popen(c, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for c in cmds]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return outs


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def final_params(run_dir):
  """The newest checkpoint's parameters, restored onto one device of this process."""
  cfg = configlib.load_json(C.TrainConfig, os.path.join(run_dir, "config.json"))
  run = R.setup(dataclasses.replace(cfg, mesh=sharding.MeshConfig(num_devices=1)), run_dir)
  ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), every=0, keep=1)
  try:
    return ckpt.latest_step(), ckpt.restore(run.state).params
  finally:
    ckpt.close()


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  two, one = str(tmp_path / "two"), str(tmp_path / "one")
  port = free_port()
  mesh = ["mesh.data=2", "mesh.fsdp=2"]
  # The single-process reference runs beside the two processes: on two cores, one XLA
  # compile after another would leave a core idle.
  outs = launch([command(two, mesh, "--cpu-devices", "2", "--coordinator-address",
                         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i))
                 for i in range(2)] + [command(one, ["mesh.data=1"], "--cpu-devices", "1")])
  # Logging is process 0's alone.
  assert "held-out accuracy:" in outs[0] and "held-out accuracy:" not in outs[1]
  read = lambda d: [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
  a, b = read(two), read(one)
  assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
  assert max(r["grad_norm"] for r in b) > 0  # the updates did something to compare
  for ra, rb in zip(a, b):
    for k in ("reward_mean", "accuracy", "loss", "grad_norm", "clip_frac_token", "ratio_max"):
      assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (ra["step"], k)
  (step_a, pa), (step_b, pb) = final_params(two), final_params(one)
  assert step_a == step_b == 3
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=2e-5)
