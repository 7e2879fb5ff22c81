"""Converts a Hugging Face Llama directory into a ksjax Orbax checkpoint the trainer starts from.

  python -m ksjax.tools.convert_hf --hf_dir=<config.json + *.safetensors> --out=<new directory> \
      [--dtype=bfloat16] [--mesh=1,-1,1]

The checkpoint is written under a temporary name next to `--out` and renamed into place only when
complete, so `--out` is either a whole checkpoint or absent. Bad input (not a Llama, missing, extra
or misshapen tensors, an unreadable config.json or safetensors file, an existing `--out`) prints
one line and exits with status 2 (`ksjax.errors`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from absl import app, flags

from ksjax import errors
from ksjax.config_validation import ConfigError
from ksjax.model import checkpoint, config, hf_io, sharding

_HF_DIR = flags.DEFINE_string("hf_dir", None, "Hugging Face Llama directory.", required=True)
_OUT = flags.DEFINE_string("out", None, "Directory to create with the Orbax checkpoint.",
                           required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(config.DTYPES), "Parameter dtype to store.")
_MESH = flags.DEFINE_list("mesh", ["1", "-1", "1"],
                          "(data, fsdp, tensor) mesh to load onto; -1 = remaining devices.")


def convert(hf_dir: str, out: str, dtype: str = "float32", mesh_shape=(1, -1, 1)) -> None:
  """Loads `hf_dir` onto a mesh and writes the checkpoint `out` atomically."""
  if os.path.exists(out):
    raise FileExistsError(f"--out={out!r} exists; choose a new directory")
  try:
    mesh = sharding.make_mesh(tuple(int(x) for x in mesh_shape))
  except ValueError as e:
    raise ConfigError(f"--mesh={mesh_shape!r} is not accepted: {e}") from None
  llama, _ = hf_io.load_hf(hf_dir, mesh=mesh, dtype=dtype)
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp_convert_hf_", dir=parent)
  try:
    checkpoint.save(os.path.join(tmp, "checkpoint"), llama)
    os.rename(os.path.join(tmp, "checkpoint"), out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  convert(_HF_DIR.value, _OUT.value, _DTYPE.value, _MESH.value)
  print(f"convert_hf: wrote {_OUT.value}")


if __name__ == "__main__":
  # An existing --out is bad input too (convert refuses to overwrite).
  app.run(errors.boundary("convert_hf", main, extra=(FileExistsError,)))
