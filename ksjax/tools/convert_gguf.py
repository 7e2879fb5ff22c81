"""Converts a llama GGUF file (llama.cpp's format) into a ksjax Orbax checkpoint or an HF directory.

  python -m ksjax.tools.convert_gguf --gguf=<model.gguf> --out=<new directory> \
      [--format=orbax|hf] [--dtype=bfloat16] [--mesh=1,-1,1]

--format=orbax (default) writes
  <out>/checkpoint/   the Orbax checkpoint (`config.init_checkpoint`)
  <out>/tokenizer/    tokenizer.json, tokenizer_config.json (special tokens, add_bos_token,
                      chat_template) and chat_template.jinja (`config.tokenizer.path`)
--format=hf writes one Hugging Face directory: config.json, *.safetensors, tokenizer.json and
tokenizer_config.json (with chat_template), loadable by `load_hf` and by transformers.

Quantized tensors are dequantized: the result is the quantized model in float32 (or --dtype), not
the model it was quantized from. Everything is written under a temporary name next to --out and
renamed into place only when complete, so --out is either whole or absent. Bad input (not a GGUF,
truncated, not a llama, an unsupported tensor type, missing or misshapen tensors, an existing
--out) prints one line on stderr and exits with status 2 (`ksjax.errors`).
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from ksjax import errors, files
from ksjax.config_validation import ConfigError
from ksjax.model import checkpoint, config, gguf_io, hf_io, sharding

FORMATS = ("orbax", "hf")



def _define_flags() -> None:
  """The command line, defined only when this module is the program: `convert` is a library
  function too, and absl refuses a flag name (--out, --mesh) that `convert_hf` also defines in
  the same process."""
  flags.DEFINE_string("gguf", None, "GGUF file of a llama-architecture model.", required=True)
  flags.DEFINE_string("out", None, "Directory to create.", required=True)
  flags.DEFINE_enum("format", "orbax", list(FORMATS),
                    "orbax: ksjax checkpoint + tokenizer/; hf: a Hugging Face directory.")
  flags.DEFINE_enum("dtype", "float32", list(config.DTYPES), "Parameter dtype to store.")
  flags.DEFINE_list("mesh", ["1", "-1", "1"],
                    "(data, fsdp, tensor) mesh to load onto; -1 = remaining devices.")


def write_tokenizer(tok: gguf_io.GGUFTokenizer, directory: str, template_file: bool) -> None:
  """The GGUF file's tokenizer as Hugging Face files in `directory` (also `merge_lora`'s, for a
  GGUF base): tokenizer.json, tokenizer_config.json, and chat_template.jinja if `template_file`."""
  os.makedirs(directory, exist_ok=True)
  tok.tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as fp:
    json.dump(tok.tokenizer_config(), fp, indent=2, ensure_ascii=False)
  if template_file and tok.chat_template is not None:
    with open(os.path.join(directory, "chat_template.jinja"), "w") as fp:
      fp.write(tok.chat_template)


def convert(gguf_path: str, out: str, fmt: str = "orbax", dtype: str = "float32",
            mesh_shape=(1, -1, 1)) -> None:
  """Reads `gguf_path` (tokenizer first, then the weights onto a mesh) and writes `out` atomically.

  Raises GGUFError / ConfigError / FileExistsError before anything is written.
  """
  if fmt not in FORMATS:
    raise ConfigError(f"--format={fmt!r} is not accepted; expected one of {', '.join(FORMATS)}")
  if os.path.exists(out):
    raise FileExistsError(f"--out={out!r} exists; choose a new directory")
  reader = gguf_io.open_gguf(gguf_path)  # the header is parsed once for every read below
  tok = gguf_io.read_gguf_tokenizer(reader)
  gguf_io.check_gguf(reader, dtype)  # a bad file fails before JAX starts (and logs)
  try:
    mesh = sharding.make_mesh(tuple(int(x) for x in mesh_shape))
  except ValueError as e:
    raise ConfigError(f"--mesh={mesh_shape!r} is not accepted: {e}") from None
  llama, cfg = gguf_io.load_gguf(reader, mesh=mesh, dtype=dtype)
  with files.new_directory(out) as result:
    if fmt == "orbax":
      os.makedirs(result)
      checkpoint.save(os.path.join(result, "checkpoint"), llama)
      write_tokenizer(tok, os.path.join(result, "tokenizer"), template_file=True)
    else:
      hf_io.save_hf(llama, cfg, result)
      write_tokenizer(tok, result, template_file=False)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  convert(f.gguf, f.out, f.format, f.dtype, f.mesh)
  print(f"convert_gguf: wrote {f.out}")


if __name__ == "__main__":
  _define_flags()
  # An existing --out is bad input too (convert refuses to overwrite).
  app.run(errors.boundary("convert_gguf", main, extra=(FileExistsError,)))
