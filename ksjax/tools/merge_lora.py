"""Merges a LoRA adapter checkpoint into its base and writes a Hugging Face Llama directory.

  python -m ksjax.tools.merge_lora --checkpoint=<adapters> --out=<new directory> \
      [--base=<the base, if it moved>] [--dtype=bfloat16]

The adapters (`ksjax.model.lora.save`) record their base: its path, name and sha256. The base is
read from that path (or --base), refused if its sha256 is not the recorded one, adapted as the
adapters' settings say (QLoRA: quantized again, as in training), and every adapted weight
becomes W + (alpha / r) A B (`lora.merge`; a quantized base dequantized). The result is written
as config.json and safetensors (`hf_io.save_hf`), with the base's tokenizer files where the base
has them (a Hugging Face directory's tokenizer*.json, special_tokens_map.json,
generation_config.json and chat_template.jinja; a GGUF file's tokenizer), so transformers and
`load_hf` read it as any Llama. --dtype is the written tensors' dtype (default: the base's, as
the adapters were trained on it).

Everything is written under a temporary name next to --out and renamed into place when
complete, so --out is either whole or absent. Bad input (a missing or damaged adapter checkpoint,
a missing base, a base of another sha256, an existing --out) prints one line and exits with
status 2 (`ksjax.errors`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
from absl import app, flags
from flax import nnx

from ksjax import errors, files
from ksjax.model import config, hf_io, lora

# A Hugging Face directory's files that are the tokenizer's and the generation settings, not
# weights: copied beside the merged weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "tokenizer.model")


def _define_flags() -> None:
  """The command line, defined only when this module is the program: `merge` is a library
  function too, and absl refuses a flag name (--out) that other tools define in one process."""
  flags.DEFINE_string("checkpoint", None, "Adapter checkpoint (ksjax.model.lora.save).",
                      required=True)
  flags.DEFINE_string("out", None, "Directory to create with the merged Hugging Face model.",
                      required=True)
  flags.DEFINE_string("base", None, "The base model, where it is not at the path the adapter "
                      "checkpoint records (its sha256 must still match).")
  flags.DEFINE_enum("dtype", None, list(config.DTYPES),
                    "dtype of the written tensors (default: the base's).")


def _copy_tokenizer(base: str, directory: str) -> None:
  """The base's tokenizer files into `directory` (none for an Orbax checkpoint, which has none)."""
  if os.path.isfile(base):  # a GGUF file: its tokenizer, as convert_gguf --format=hf writes it
    from ksjax.model import gguf_io  # pylint: disable=import-outside-toplevel
    from ksjax.tools import convert_gguf  # pylint: disable=import-outside-toplevel
    convert_gguf.write_tokenizer(gguf_io.read_gguf_tokenizer(base), directory,
                                 template_file=False)
    return
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(base, name)):
      shutil.copyfile(os.path.join(base, name), os.path.join(directory, name))


def merge(checkpoint: str, out: str, base: str | None = None, dtype: str | None = None) -> None:
  """Reads `checkpoint` and its base, merges, and writes the Hugging Face directory `out`
  atomically. Raises CheckpointError / FileExistsError before anything is written."""
  if os.path.exists(out):
    raise FileExistsError(f"--out={out!r} exists; choose a new directory")
  _, record = lora.read_metadata(checkpoint)
  adapted, _ = lora.load(checkpoint, base=base)
  merged = lora.merge(adapted)
  cfg = merged.cfg
  if dtype is not None and dtype != cfg.param_dtype:
    cfg = dataclasses.replace(cfg, param_dtype=dtype, dtype=dtype)
    merged = nnx.merge(nnx.graphdef(merged),
                       jax.tree.map(lambda x: x.astype(dtype), nnx.state(merged)))
  with files.new_directory(out) as result:
    hf_io.save_hf(merged, cfg, result)
    _copy_tokenizer(base or record["path"], result)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  merge(f.checkpoint, f.out, f.base, f.dtype)
  print(f"merge_lora: wrote {f.out}")


if __name__ == "__main__":
  _define_flags()
  # An existing --out is bad input too (merge refuses to overwrite).
  app.run(errors.boundary("merge_lora", main, extra=(FileExistsError,)))
