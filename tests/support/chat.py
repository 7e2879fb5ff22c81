"""Chat templates and a small byte-level BPE tokenizer for tests of chat tasks (no downloads)."""

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ksjax.tokenization import Tokenizer

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
SPECIALS = ("<s>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|im_start|>", "<|im_end|>")


def make_tokenizer(bos: str | None, add_bos: bool = True) -> Tokenizer:
  """A byte-level BPE (encodes any text) trained on a few task sentences."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIALS), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["Tom has 12 apples. He buys 7 more and then gives away 5.",
                           "What is 7 + 8? Give the final answer as a number."] * 4, trainer)
  eos = tok.token_to_id("<|im_end|>")
  return Tokenizer(tok=tok, bos_id=None if bos is None else tok.token_to_id(bos), eos_ids=(eos,),
                   pad_id=eos, add_bos=add_bos)
