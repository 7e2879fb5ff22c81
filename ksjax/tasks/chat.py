"""Chat templates: the Jinja programs that turn messages into an instruct model's prompt text.

An instruct model only answers well when its prompt is laid out exactly as in its fine-tuning,
special tokens and newlines included, and the model ships the layout as a Jinja template (in
`tokenizer_config.json`, or as GGUF metadata `tokenizer.chat_template`). `ChatTemplate` renders
such a template the way transformers' `apply_chat_template` does, so that a prompt built here is
the prompt the model's authors evaluate with, token for token:

* the same Jinja environment: `ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)` with the loopcontrols extension, a no-op `{% generation %}` block, the
  `raise_exception` and `strftime_now` globals, transformers' restricted `dict` and `namespace`,
  and its `tojson` filter (no HTML escaping, with indent/separators/sort_keys arguments);
* the same variables: `messages` (keys whose value is None dropped), `add_generation_prompt`,
  `tools` and `documents` (None), and the special tokens `bos_token` and `eos_token`;
* the rendered text is the prompt: the template writes whatever BOS it wants, nothing is added.

Why not call transformers: it is a test-only dependency of ksjax (the tests compare against it),
and its tokenizer classes are not ksjax's `Tokenizer`; rendering needs only jinja2. Templates are
untrusted code from model hubs, hence the sandbox and the jinja2 >= 3.1.6 floor (older versions
have known sandbox escapes), as in transformers.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where recent transformers versions save the template

_MIN_JINJA = (3, 1, 6)


def _version_tuple(version: str) -> tuple[int, ...]:
  parts = []
  for part in version.split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit()) or "0"
    parts.append(int(digits))
  return tuple(parts)


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it (for its
  assistant-token masks); rendering is the body unchanged. Without the tag such templates would
  not compile."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson escapes HTML characters ('<' as \u003c), which would change the prompt.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(format):  # pylint: disable=redefined-builtin
  return datetime.datetime.now().strftime(format)


class _TemplateDict:
  """`dict(...)` and `dict.fromkeys(...)` without exposing the dict type to the template."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
  """Jinja's `namespace` refusing underscore attributes (a route to CPython internals)."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, args = args[0], args[1:]  # Jinja's signature trick: `namespace(self=...)` still works.
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _TemplateNamespace._check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check_name(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"chat templates cannot set underscore attributes on a namespace; got {name!r}")


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
  """The compiled template (cached: a task renders thousands of prompts from one template)."""
  if _version_tuple(jinja2.__version__) < _MIN_JINJA:
    raise ImportError(f"chat templates need jinja2 >= 3.1.6 (older sandboxes have known escapes); "
                      f"found {jinja2.__version__}")
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  env.globals["namespace"] = _TemplateNamespace
  return env.from_string(source)


def _token_content(value: Any, where: str) -> str | None:
  """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"{where} is {value!r}; expected a string or an AddedToken dict with a "
                   "'content' string")


def _select_template(value: Any, where: str) -> str:
  """The default template among the forms of `chat_template`: a string, a {name: template} dict,
  or a [{"name": ..., "template": ...}] list (how transformers saves several named templates).
  Like transformers without tools, the one named "default", or the only one."""
  if isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
    value = {t.get("name"): t.get("template") for t in value}
  if isinstance(value, Mapping):
    if "default" in value:
      chosen = value["default"]
    elif len(value) == 1:
      [chosen] = value.values()
    else:
      raise ValueError(f"{where} holds templates {sorted(map(str, value))} and none is named "
                       "'default'; pass the one to use with ChatTemplate.from_string")
    if isinstance(chosen, str):
      return chosen
  raise ValueError(f"{where} is {str(value)[:80]!r}; expected a template string, a dict of named "
                   "templates or a list of {'name', 'template'} dicts")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat template with the special tokens it refers to.

  Attributes:
    source: the Jinja template text.
    bos_token, eos_token: the tokenizer's special token strings, visible to the template as
      `bos_token` and `eos_token` (None: undefined there, which renders as "").
    system_prompt: a system message put first in every rendered conversation that does not begin
      with one (None: whatever the template does without one, e.g. SmolLM2's default system
      message).
    origin: where the template came from, for error messages.

  Raises ValueError, naming `origin`, if the template does not compile.
  """
  source: str
  bos_token: str | None = None
  eos_token: str | None = None
  system_prompt: str | None = None
  origin: str = "a template string"

  def __post_init__(self):
    if not isinstance(self.source, str) or not self.source.strip():
      raise ValueError(f"the chat template from {self.origin} is {self.source!r}; expected a "
                       "non-empty Jinja template string")
    try:
      _compile(self.source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template from {self.origin} does not compile: {e.message} "
                       f"(template line {e.lineno})") from e

  @classmethod
  def from_string(cls, source: str, *, bos_token: str | None = None,
                  eos_token: str | None = None, system_prompt: str | None = None,
                  origin: str = "a template string") -> ChatTemplate:
    """From template text, e.g. a GGUF file's `tokenizer.chat_template` (pass its BOS and EOS
    token strings too: templates such as Llama 3's write `bos_token`)."""
    return cls(source=source, bos_token=bos_token, eos_token=eos_token,
               system_prompt=system_prompt, origin=origin)

  @classmethod
  def from_tokenizer_config(cls, path: str | os.PathLike, *,
                            system_prompt: str | None = None) -> ChatTemplate:
    """From a Hugging Face `tokenizer_config.json` (the file, or the model directory holding it).

    The template is the config's `chat_template` (a string, or named templates: "default" is
    used), or else a `chat_template.jinja` beside the config, where transformers >= 4.50 saves it.
    """
    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(config_path):
      raise FileNotFoundError(f"tokenizer config not found: {config_path} (expected a Hugging "
                              f"Face {CONFIG_FILE} or a directory holding one)")
    with open(config_path, encoding="utf-8") as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(config, Mapping):
      raise ValueError(f"{config_path} holds a {type(config).__name__}; expected a JSON object")
    template_file = os.path.join(directory, TEMPLATE_FILE)
    if config.get("chat_template") is not None:
      source = _select_template(config["chat_template"], f"'chat_template' in {config_path}")
      origin = config_path
    elif os.path.isfile(template_file):
      with open(template_file, encoding="utf-8") as f:
        source = f.read()
      origin = template_file
    else:
      raise ValueError(f"{config_path} has no 'chat_template' and there is no {template_file}: "
                       "the model has no chat template (is it a base model?)")
    return cls(source=source, origin=origin, system_prompt=system_prompt,
               bos_token=_token_content(config.get("bos_token"), f"'bos_token' in {config_path}"),
               eos_token=_token_content(config.get("eos_token"), f"'eos_token' in {config_path}"))

  def with_system_prompt(self, system_prompt: str | None) -> ChatTemplate:
    return dataclasses.replace(self, system_prompt=system_prompt)

  def render(self, messages: Sequence[Mapping[str, Any]], *,
             add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` ({"role": ..., "content": ...} dicts), as transformers'
    `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` renders it, with
    `system_prompt` first where the conversation has no system message."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
      raise ValueError(f"messages is {str(messages)[:80]!r}; expected a non-empty list of "
                       "{'role': ..., 'content': ...} dicts")
    chat = []
    for i, message in enumerate(messages):
      if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"message {i} is {str(message)[:80]!r}; expected a dict with a 'role' "
                         "string")
      chat.append({k: v for k, v in message.items() if v is not None})  # as transformers does
    if self.system_prompt is not None and chat[0]["role"] != "system":
      chat.insert(0, {"role": "system", "content": self.system_prompt})
    variables = {"bos_token": self.bos_token, "eos_token": self.eos_token}
    try:
      return _compile(self.source).render(
          messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
          **{k: v for k, v in variables.items() if v is not None})
    except jinja2.TemplateError as e:
      raise ValueError(f"the chat template from {self.origin} failed to render {len(chat)} "
                       f"messages: {e}") from e

  def render_user(self, content: str) -> str:
    """One user message with the generation prompt: a single-turn task's prompt."""
    return self.render([{"role": "user", "content": content}])

  @functools.cached_property
  def end_of_turn_tokens(self) -> tuple[str, ...]:
    """The token strings a sampled row should stop on, most specific first.

    The template's own end of an assistant turn (what it writes after an assistant message's
    content: `<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3, `<end_of_turn>` for Gemma,
    `</s>` for Mistral), found by rendering a user/assistant exchange with a marker content, and
    then `eos_token` if it differs (a model may also end with its end-of-text token, e.g. Llama 3's
    `<|end_of_text|>`). Surrounding whitespace is not part of it; a template writing only
    whitespace there (no marker) contributes nothing. Turning these strings into ids is the
    tokenizer's business (`Tokenizer.from_file(..., eos=template.end_of_turn_tokens)`).
    """
    marker = "\x00KSJAX_ASSISTANT_TURN\x00"
    tokens: list[str] = []
    try:
      text = self.render([{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": marker}], add_generation_prompt=False)
    except ValueError:
      text = ""  # a template that refuses the probe conversation: fall back to eos_token
    if text.count(marker) == 1:
      after = text.split(marker)[1].split()
      if after:
        tokens.append(after[0])
    if self.eos_token and self.eos_token not in tokens:
      tokens.append(self.eos_token)
    return tuple(tokens)
