"""Thin wrapper over a `tokenizers.Tokenizer` giving the ids the sampler and trainer need."""

from __future__ import annotations

import dataclasses
import os

import tokenizers


@dataclasses.dataclass
class Tokenizer:
  """A Hugging Face `tokenizers` tokenizer plus the special ids ksjax uses.

  Attributes:
    tok: the underlying `tokenizers.Tokenizer`.
    bos_id: prepended by `encode(..., add_bos=True)`; None if the vocabulary has none.
    eos_ids: ids that end a completion (Llama 3 Instruct has several: <|eot_id|>, <|end_of_text|>).
    pad_id: the id used for padding (never attended to).
  """
  tok: tokenizers.Tokenizer
  bos_id: int | None
  eos_ids: tuple[int, ...]
  pad_id: int

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  @property
  def eos_id(self) -> int:
    return self.eos_ids[0]

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    ids = self.tok.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

  def decode(self, ids) -> str:
    """Decodes ids, stopping at the first EOS and skipping padding and special tokens."""
    out = []
    for i in ids:
      i = int(i)
      if i in self.eos_ids:
        break
      if i != self.pad_id:
        out.append(i)
    return self.tok.decode(out, skip_special_tokens=True)

  def save(self, directory: str) -> None:
    """Writes tokenizer.json (the standard Hugging Face file) into `directory`."""
    os.makedirs(directory, exist_ok=True)
    self.tok.save(os.path.join(directory, "tokenizer.json"))

  @classmethod
  def from_file(cls, path: str, *, bos: str | None = None, eos: tuple[str, ...] = (),
                pad: str | None = None) -> "Tokenizer":
    """Loads tokenizer.json (a file, or a directory holding one) and resolves special tokens."""
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path} (expected a Hugging Face tokenizer.json)")
    tok = tokenizers.Tokenizer.from_file(path)

    def tid(name):
      i = tok.token_to_id(name)
      if i is None:
        raise ValueError(f"token {name!r} is not in the vocabulary of {path}")
      return i

    eos_ids = tuple(tid(e) for e in eos)
    if not eos_ids:
      raise ValueError(f"no end-of-sequence token given for {path}")
    return cls(tok=tok, bos_id=tid(bos) if bos else None, eos_ids=eos_ids,
               pad_id=tid(pad) if pad else eos_ids[0])
