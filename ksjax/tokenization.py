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
    add_bos: whether `encode` prepends BOS when not told (False for models trained without it,
      e.g. a GGUF saying tokenizer.ggml.add_bos_token=false).
  """
  tok: tokenizers.Tokenizer
  bos_id: int | None
  eos_ids: tuple[int, ...]
  pad_id: int
  add_bos: bool = True

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  @property
  def eos_id(self) -> int:
    return self.eos_ids[0]

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text` (special-token text such as "<|im_end|>" becomes its id); BOS first
    when `add_bos` (default: `self.add_bos`) and the vocabulary has one."""
    add_bos = self.add_bos if add_bos is None else add_bos
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

  @classmethod
  def from_gguf(cls, path: str) -> "Tokenizer":
    """The tokenizer stored in a GGUF file's metadata (see `ksjax.model.gguf_io`).

    Special ids and `add_bos` come from the file; padding falls back to the first EOS id. Raises
    `ksjax.model.gguf_io.GGUFError` for a file without a usable tokenizer or EOS id.
    """
    from ksjax.model import gguf_io  # the model package is only needed for this constructor

    g = gguf_io.read_gguf_tokenizer(path)
    if not g.eos_ids:
      raise gguf_io.GGUFError(f"{path}: metadata names no tokenizer.ggml.eos_token_id; expected "
                              "one (a completion must be able to end)")
    return cls(tok=g.tok, bos_id=g.bos_id, eos_ids=g.eos_ids,
               pad_id=g.eos_ids[0] if g.pad_id is None else g.pad_id, add_bos=g.add_bos)
