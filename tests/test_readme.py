"""The documentation's code runs as written, and its links point at files that exist.

Snippets are marked `<!-- snippet: NAME -->` before a ```python block: the README's
"Using the losses in your own code" (own-train-step), docs/losses.md's recomposition of
GSPO from its blocks (recompose) and docs/model_and_sampler.md's sampler example (sampler).
"""

import contextlib
import glob
import io
import os
import re

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MODEL_AND_SAMPLER = os.path.join(ROOT, "docs", "model_and_sampler.md")
LOSSES = os.path.join(ROOT, "docs", "losses.md")


def snippet(name: str, path: str = README) -> str:
  """The ```python block after `<!-- snippet: NAME -->` in the markdown file `path`."""
  text = open(path, encoding="utf-8").read()
  match = re.search(rf"<!-- snippet: {name} -->\s*```python\n(.*?)```", text, re.S)
  assert match, f"{os.path.relpath(path, ROOT)} has no snippet {name!r}"
  return match.group(1)


def run_snippet(name: str, path: str = README) -> dict:
  namespace = {}
  where = f"{os.path.relpath(path, ROOT)}:{name}"
  exec(compile(snippet(name, path), where, "exec"), namespace)
  return namespace


def test_own_train_step_snippet_runs():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    namespace = run_snippet("own-train-step")
  metrics = namespace["metrics"]
  assert "'loss'" in out.getvalue()
  assert all(np.isfinite(float(v)) for v in metrics.values())
  # Two minibatch steps were taken; the second is off-policy (ratios moved off 1).
  assert float(metrics["ratio_max"]) != 1.0
  assert float(metrics["num_seqs"]) == 8 and float(metrics["num_tokens"]) == 38


def test_recompose_snippet_runs():
  with contextlib.redirect_stdout(io.StringIO()):
    namespace = run_snippet("recompose", LOSSES)
  # GSPO rebuilt from the blocks equals gspo_loss; some rows are clipped at eps 3e-4/4e-4.
  np.testing.assert_allclose(namespace["mine"], namespace["pg_loss"], rtol=1e-6)
  assert 0 < float(namespace["metrics"]["clip_frac_seq"]) < 1
  assert float(namespace["kl"]) > 0 and np.isfinite(float(namespace["loss"]))


def test_sampler_snippet_runs():
  namespace = run_snippet("sampler", MODEL_AND_SAMPLER)
  rollout, logp = namespace["rollout"], namespace["logp"]
  assert rollout.tokens_BxGxT.shape == (2, 4, 16)
  np.testing.assert_allclose(np.asarray(logp) * np.asarray(rollout.mask_BxGxT),
                             rollout.logp_BxGxT, rtol=1e-5, atol=1e-5)


def _markdown(path: str) -> str:
  """The file's text with its fenced code blocks removed (no links or headings in code)."""
  return re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)


def _anchors(path: str) -> set[str]:
  """GitHub's anchors for the file's headings."""
  headings = re.findall(r"^#+ (.+)$", _markdown(path), re.M)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve():
  """Every relative link in README.md and docs/*.md names an existing file (and, for a
  link into a markdown file, one of its headings)."""
  files = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
  assert len(files) > 1, "docs/ holds no markdown files"
  bad = []
  for path in files:
    for target in re.findall(r"\]\(([^)\s]+)\)", _markdown(path)):
      if re.match(r"[a-z]+:", target):                          # http(s):, mailto: ...
        continue
      file_part, _, anchor = target.partition("#")
      dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
      where = f"{os.path.relpath(path, ROOT)}: {target}"
      if not os.path.exists(dest):
        bad.append(f"{where} (no such file)")
      elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
        bad.append(f"{where} (no such heading)")
  assert not bad, "broken links:\n" + "\n".join(bad)
