"""The README's snippets ("Using the losses in your own code", the loss library's
recomposition, the sampler) run as written."""

import contextlib
import io
import os
import re

import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def snippet(name: str) -> str:
  text = open(README).read()
  match = re.search(rf"<!-- snippet: {name} -->\s*```python\n(.*?)```", text, re.S)
  assert match, f"README has no snippet {name!r}"
  return match.group(1)


def test_own_train_step_snippet_runs():
  code = snippet("own-train-step")
  namespace = {}
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, "README.md:own-train-step", "exec"), namespace)
  metrics = namespace["metrics"]
  assert "'loss'" in out.getvalue()
  assert all(np.isfinite(float(v)) for v in metrics.values())
  # Two minibatch steps were taken; the second is off-policy (ratios moved off 1).
  assert float(metrics["ratio_max"]) != 1.0
  assert float(metrics["num_seqs"]) == 8 and float(metrics["num_tokens"]) == 38


def test_recompose_snippet_runs():
  namespace = {}
  with contextlib.redirect_stdout(io.StringIO()):
    exec(compile(snippet("recompose"), "README.md:recompose", "exec"), namespace)
  # GSPO rebuilt from the blocks equals gspo_loss; some rows are clipped at eps 3e-4/4e-4.
  np.testing.assert_allclose(namespace["mine"], namespace["pg_loss"], rtol=1e-6)
  assert 0 < float(namespace["metrics"]["clip_frac_seq"]) < 1
  assert float(namespace["kl"]) > 0 and np.isfinite(float(namespace["loss"]))


def test_sampler_snippet_runs():
  namespace = {}
  exec(compile(snippet("sampler"), "README.md:sampler", "exec"), namespace)
  rollout, logp = namespace["rollout"], namespace["logp"]
  assert rollout.tokens_BxGxT.shape == (2, 4, 16)
  np.testing.assert_allclose(np.asarray(logp) * np.asarray(rollout.mask_BxGxT),
                             rollout.logp_BxGxT, rtol=1e-5, atol=1e-5)
