"""Chat templates: a prompt rendered the way an instruct model was trained to see it.

Hugging Face tokenizers ship a jinja2 `chat_template` (tokenizer_config.json); rendering it
with jinja2 itself, in a sandbox, is the only way to reproduce it exactly (the templates
use jinja2's syntax, filters and whitespace rules). E.g. SmolLM2 / Qwen3 (ChatML):

    <|im_start|>user\\nWhat is 2+3?<|im_end|>\\n<|im_start|>assistant\\n

The rendered text is transformers' `apply_chat_template(..., tokenize=False)`: a template
that starts with `{{ bos_token }}` (Llama 2 / 3, Mistral, Gemma) writes the BOS as text.
Encode it as `apply_chat_template` does, without adding special tokens:
`text.encode_prompts(tok, rendered, max_len, add_special_tokens=False)`.
"""

from __future__ import annotations

from collections.abc import Callable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str):
  raise jinja2.exceptions.TemplateError(message)


def compile_template(template: str) -> jinja2.Template:
  """The template compiled as transformers does: sandboxed, trim_blocks, lstrip_blocks."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = _raise
  return env.from_string(template)


def prompt_renderer(template: str, *, system_prompt: str = "", bos_token: str = "",
                    eos_token: str = "") -> Callable[[str], str]:
  """A function user text -> the rendered prompt, ending with the assistant's turn header
  (`add_generation_prompt=True`). messages = [system (if given), user]. `bos_token` and
  `eos_token` are the texts the template may write (transformers passes the tokenizer's)."""
  compiled = compile_template(template)

  def render(prompt: str) -> str:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": prompt})
    return compiled.render(messages=messages, add_generation_prompt=True,
                           bos_token=bos_token, eos_token=eos_token)

  return render


def tokenizer_renderer(tok, *, system_prompt: str = "") -> Callable[[str], str] | None:
  """The renderer of a tokenizer's own chat template, or None when it has none. The
  template sees the tokenizer config's `bos_token` text (whether or not encoding adds it,
  as in transformers) and the EOS token's text."""
  template = getattr(tok, "chat_template", None)
  if not template:
    return None
  return prompt_renderer(template, system_prompt=system_prompt, bos_token=tok.bos_token or "",
                         eos_token=tok.decode([tok.eos_id]))
