"""Setting up a run: mesh, task, tokenizer, model, optimiser, the compiled programs, the
reference policy, and loading a run directory back.

`setup` does everything that can fail on a bad setting before any training work; the loop
(`gspo_jax.train.loop`) and evaluation (`gspo_jax.evaluate`) start from the `Run` it returns.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax.config import TrainConfig, check_lora, check_positions, check_routing
from gspo_jax.lora import run as lora_run
from gspo_jax.models.config import EXECUTION_FIELDS
from gspo_jax.parallel import expert_mesh, placement, sharding
from gspo_jax.tasks import text
from gspo_jax.train import checkpoint, rundir
from gspo_jax.train.optim import make_optimizer, sft_optimizer
from gspo_jax.train.programs import Layout, Programs, check_layout, make_layout, make_programs
from gspo_jax.train.step import TrainState
from gspo_jax.utils import configlib, rng


@dataclasses.dataclass
class Run:
  cfg: TrainConfig
  task: Any
  tok: Any
  graphdef: Any
  state: TrainState
  tx: Any
  layout: Layout
  programs: Programs
  # The kind of rollout (`rollout.Groups`, or multi-turn `Episodes`): what the loop, the
  # evaluation and the cold start call, so none of them asks which kind the run makes.
  rollout: Any
  # A LoRA run's frozen base (`lora_run.Frozen`; `state.params` are then the adapters).
  frozen: Any = None
  # The sampler's own devices (`pipeline.SamplerSide`, placement.sampler_devices > 0).
  sampler: Any = None

  def encode_prompts(self, prompts):
    """The run's prompts as ids: (ids_BxP, lens_B) padded to rollout.max_prompt_len. A
    prompt rendered by the tokenizer's chat template already holds its special tokens and
    is encoded without adding any, as transformers' apply_chat_template does."""
    return text.encode_prompts(self.tok, prompts, self.cfg.rollout.max_prompt_len,
                               add_special_tokens=not _rendered(self.task))

  def reconfigure(self, cfg: TrainConfig) -> "Run":
    """The same run and state with other loss settings (the programs are rebuilt; a LoRA
    run keeps its base and adapters)."""
    check_routing(cfg)
    if (cfg.lora.rank > 0) != (self.frozen is not None):
      raise ValueError("reconfigure cannot turn LoRA on or off (lora.rank): the state differs")
    base = self.state.params if self.frozen is None else self.frozen.params
    layout, programs, frozen, _ = _assemble(cfg, self.graphdef, base, self.tx,
                                            self.layout.mesh, self.tok)
    sampler = self.sampler and sampler_side(cfg, self.graphdef, base, self.tx,
                                            self.sampler.layout.mesh, self.tok)
    return dataclasses.replace(self, cfg=cfg, layout=layout, programs=programs, frozen=frozen,
                               rollout=make_rollout(self.graphdef, cfg, layout, self.tok),
                               sampler=sampler)


def _rendered(task) -> bool:
  return getattr(task, "render", None) is not None


def _layout(params, tx, mesh, cfg: TrainConfig) -> Layout:
  sft_tx = sft_optimizer(cfg.sft.steps, cfg.sft.learning_rate) if cfg.sft.steps > 0 else None
  return make_layout(params, tx, mesh, sft_tx)


def _assemble(cfg: TrainConfig, graphdef, params, tx, mesh, tok):
  """(layout, programs, frozen, the trained parameters at init) of a run on the model
  `params`: a full run trains them (frozen None); a LoRA run freezes them as its base and
  trains fresh adapters (`lora_run`)."""
  layout = _layout(params, tx, mesh, cfg)
  programs = make_programs(graphdef, tx, cfg, layout, tok)
  if not cfg.lora.rank:
    return layout, programs, None, params
  frozen = lora_run.Frozen(None, layout, cfg.lora.scale, programs, cfg.lora.base_dtype)
  frozen.params = frozen.store(params)
  layout, adapters = lora_run.adapter_layout(params, tx, mesh, cfg)
  programs = lora_run.make_programs(graphdef, tx, cfg, layout, tok, frozen)
  return layout, programs, frozen, adapters


def sampler_side(cfg: TrainConfig, graphdef, params, tx, mesh, tok):
  """The sampler's layout and programs on its own mesh (`placement.sampler_devices`)."""
  from gspo_jax.train.pipeline import SamplerSide
  layout = _layout(params, tx, mesh, cfg)
  return SamplerSide(layout, make_programs(graphdef, tx, cfg, layout, tok))


def pretrained_load_args(cfg: TrainConfig) -> dict[str, Any]:
  """How `pretrained` is loaded (`hf.load` / `hf.model_config`): the checkpoint fixes the
  architecture; the parameter dtype is `pretrained_dtype`, and how the model runs (remat,
  ...) and whether its layers are scanned (stacked on load) the user's `model`."""
  return {"param_dtype": cfg.pretrained_dtype or None,
          "execution": {name: getattr(cfg.model, name) for name in EXECUTION_FIELDS},
          "scan_layers": cfg.model.scan_layers}


def make_rollout(graphdef, cfg: TrainConfig, layout: Layout, tok):
  """The run's kind of rollout, chosen here once: multi-turn episodes when `multiturn.env`
  is set (their programs built now), else single-turn groups."""
  if cfg.multiturn.env:
    from gspo_jax.multiturn.rollout import Episodes
    return Episodes.build(graphdef, cfg, layout, tok)
  from gspo_jax.train.collect import Groups
  return Groups()


def make_task(cfg: TrainConfig):
  """The built-in task `task.name`, for "dataset" the JSONL prompts and rewards, for "gym" a
  reasoning-gym dataset (generated here; it needs the optional package)."""
  t = cfg.task
  if t.name == "dataset":
    from gspo_jax.tasks import DatasetTask
    return DatasetTask(t.data, t.reward)
  if t.name == "gym":
    from gspo_jax.tasks.gym import GymTask
    return GymTask(t.gym, t.data, t.reward)
  from gspo_jax.tasks import make_task as builtin
  return builtin(t.name, **t.builtin_kwargs())


def with_chat_template(task, tok, cfg: TrainConfig):
  """A dataset task's prompts rendered with a pretrained tokenizer's own chat template
  (unless data.chat_template is off or the tokenizer has none); other tasks unchanged."""
  from gspo_jax.tasks import DatasetTask, chat
  if not (isinstance(task, DatasetTask) and cfg.pretrained and cfg.task.data.chat_template):
    return task
  render = chat.tokenizer_renderer(tok, system_prompt=cfg.task.data.system_prompt)
  return task if render is None else task.with_renderer(render)


def run_started(run_dir: str) -> bool:
  """Whether a run in `run_dir` has started: gspo_jax/train/loop.py saves its config once the
  cold start is done or a checkpoint restored (checkpoints without a config: an older run)."""
  return (os.path.exists(os.path.join(run_dir, rundir.CONFIG))
          or bool(checkpoint.complete_steps(os.path.join(run_dir, "checkpoints"))))


def make_tokenizer(task, cfg: TrainConfig, run_dir: str):
  """(tokenizer, trained): the run's own `tokenizer.model` once the run has started (resume,
  evaluation), else trained from the task and seed and saved there (trained = True). A
  tokenizer left by a start that never got that far is not reused: it may be of another
  task or vocab_size, and would bring back the error that stopped that start."""
  from gspo_jax.tasks.tokenizer import SentencePieceTokenizer
  path = os.path.join(run_dir, "tokenizer.model")
  trained = not run_started(run_dir)
  if trained and jax.process_index() == 0:
    corpus = task.corpus(rng.host_rng(cfg.seed, "tokenizer_corpus"), 20_000)
    SentencePieceTokenizer.train(corpus, vocab_size=cfg.model.vocab_size).save(run_dir)
  sharding.barrier("tokenizer")  # multi-host: the run directory must be shared by all hosts
  if not os.path.exists(path):
    raise ValueError(f"process {jax.process_index()} cannot see {path}: in multi-host runs the "
                     "run directory must be on a filesystem every host shares")
  return SentencePieceTokenizer.load(run_dir), trained


def check_prompts(task, tok, cfg: TrainConfig) -> None:
  """Every record of a dataset task, train and held-out, as the model will see it (chat
  template included): ValueError naming the record's file:line when its prompt is empty
  (blank), cannot be encoded (e.g. a held-out character the task tokenizer, trained on the
  training text, never saw) or encodes to more than rollout.max_prompt_len tokens.
  Built-in tasks fit by
  construction. Linear in the records (tests/train/test_run_dir.py times 100k; the number is
  in docs/training.md)."""
  from gspo_jax.tasks.dataset import SOURCE, DatasetTask
  if not isinstance(task, DatasetTask):
    return
  rendered = _rendered(task)  # encoded as Run.encode_prompts encodes them
  limit = cfg.rollout.max_prompt_len
  for example in task._train + task._heldout:  # the rendered examples the run draws from
    if not example.meta[cfg.task.data.prompt_field].strip():
      raise ValueError(f"{example.meta[SOURCE]}: the prompt ({cfg.task.data.prompt_field!r}) "
                       "is empty")
    try:
      n = len(tok.encode(example.prompt, add_special_tokens=not rendered))
    except ValueError as e:
      raise ValueError(f"{example.meta[SOURCE]}: the prompt cannot be encoded by the run's "
                       f"tokenizer: {e}") from None
    if n > limit:
      raise ValueError(f"{example.meta[SOURCE]}: the prompt is {n} tokens as the model sees "
                       f"it, longer than rollout.max_prompt_len={limit}: "
                       f"{example.prompt[:80]!r}")


def check_fits(task, tok, cfg: TrainConfig) -> None:
  """A task with long worked solutions checks that they fit the rollout widths (before the
  model is built: a demonstration cut by max_new_tokens would teach a wrong solution)."""
  fits = getattr(task, "check_fits", None)
  if fits is not None:
    fits(tok, cfg.rollout.max_new_tokens, cfg.rollout.max_prompt_len)


def check_env(cfg: TrainConfig) -> None:
  """A multi-turn environment that does not load is found before any work (the episode
  sampler would load it only after the cold start)."""
  if cfg.multiturn.env:
    from gspo_jax.multiturn import envs
    try:
      envs.load_env(cfg.multiturn.env)
    except ValueError as e:
      raise ValueError(f"multiturn.env={cfg.multiturn.env!r}: {e}") from e


def setup(cfg: TrainConfig, run_dir: str) -> Run:
  """Mesh, task, tokenizer, the sharded model and optimiser state, the compiled programs."""
  from gspo_jax.models.transformer import Transformer
  mesh, sampler_mesh = placement.make_meshes(cfg)
  check_layout(cfg, mesh)
  if sampler_mesh is not None and not cfg.pretrained:  # the rules on the sampler's mesh
    _sampler_error(lambda: sharding.init_program(Transformer, cfg.model, sampler_mesh),
                   sampler_mesh)
  checkpoint.check_writable(run_dir)
  check_env(cfg)
  task = make_task(cfg)
  if cfg.pretrained:
    from gspo_jax.models import hf
    from gspo_jax.tasks.hf_tokenizer import load_tokenizer
    tok = load_tokenizer(cfg.pretrained)
    task = with_chat_template(task, tok, cfg)
    check_prompts(task, tok, cfg)  # before loading the weights
    check_fits(task, tok, cfg)
    hf_model = hf.config_from_hf(hf.read_config(cfg.pretrained))
    check_positions(hf_model, cfg.rollout)
    expert_mesh.check_experts(cfg.mesh, hf_model.num_experts)
    model = hf.load(cfg.pretrained, mesh=mesh, **pretrained_load_args(cfg))
    cfg = dataclasses.replace(cfg, model=model.cfg)
    check_routing(cfg)
    check_lora(cfg.lora, cfg.model)
  else:
    tok, trained = make_tokenizer(task, cfg, run_dir)
    try:
      check_prompts(task, tok, cfg)
      check_fits(task, tok, cfg)
    except ValueError:
      # A refused start leaves the run directory as it was (process 0 wrote the file).
      if trained and jax.process_index() == 0:
        os.remove(os.path.join(run_dir, "tokenizer.model"))
      raise
    model = sharding.init_sharded(Transformer, cfg.model, mesh, cfg.seed)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"tokenizer has {tok.vocab_size} ids > model.vocab_size={cfg.model.vocab_size}")
  tx = make_optimizer(cfg.optim)
  graphdef, params = nnx.split(model, nnx.Param)
  layout, programs, frozen, trained = _assemble(cfg, graphdef, params, tx, mesh, tok)
  sampler = sampler_mesh and _sampler_error(
      lambda: sampler_side(cfg, graphdef, params, tx, sampler_mesh, tok), sampler_mesh)
  return Run(cfg, task, tok, graphdef, programs.init(trained), tx, layout, programs,
             make_rollout(graphdef, cfg, layout, tok), frozen, sampler)


def _sampler_error(build, mesh):
  """build(), its ValueError (the rules table on the sampler's mesh) naming the group."""
  try:
    return build()
  except ValueError as e:
    raise ValueError(f"placement.sampler_mesh (the sampler's mesh {dict(mesh.shape)}): "
                     f"{e}") from None


def load_run(run_dir: str, step: int | None = None) -> Run:
  """Config, tokenizer and the newest (or given) checkpoint of a run directory."""
  cfg = configlib.load_json(TrainConfig, os.path.join(run_dir, "config.json"))
  run = setup(cfg, run_dir)
  ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), every=0, keep=1)
  try:
    if step is not None:
      run.state = ckpt.restore(run.state, step)
    else:  # a read-only command: a damaged newest checkpoint is named, not moved
      run.state = ckpt.restore_newest(run.state, set_aside=False)[1]
  finally:
    ckpt.close()
  if run.frozen is not None:
    lora_run.restore_base(run.frozen, run_dir)
  return run


def heldout(task, cfg: TrainConfig):
  """The fixed held-out set (same for every evaluation of a run)."""
  return task.eval_examples(cfg.seed, cfg.eval_size)


def reference_params(run: Run, run_dir: str, *, fresh: bool):
  """The KL reference: the cold-start policy, saved once to <run>/reference and restored
  on resume (the resumed policy must not become its own reference)."""
  ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "reference"), every=0, keep=1)
  try:
    if fresh:
      ckpt.maybe_save(0, run.state.params, force=True)
      return jax.tree.map(jnp.copy, run.state.params)  # the policy's buffers get donated
    if ckpt.latest_step() is None:
      raise ValueError(f"loss.kl_coef > 0 but {run_dir!r} has no saved reference policy "
                       "(the run was started with loss.kl_coef = 0)")
    return ckpt.restore(run.state.params, ckpt.latest_step())
  finally:
    ckpt.close()
