"""Prints the per-device memory plan of a trainer config, without allocating the model.

  python -m ksjax.tools.plan --config=configs/pass_at_k.py \
      --config.model.preset=llama3.1-70b --config.model.dtype=bfloat16 \
      --config.mesh='(1,-1,1)' --fake_devices=256 --prompt_len=512 --memory_gb=80,95

`--fake_devices=N` plans on N CPU devices (hardware you do not have); without it the plan uses the
devices of this machine, so on a TPU VM or GPU host it reports that backend's compiled programs,
and on a CPU it also counts the host process (the interpreter and libraries, measured), whose
memory is the devices'.
`--exact_only` prints only what follows from shapes and shardings (parameters, optimizer state,
reference, KV caches) on a device-free mesh of --fake_devices (or this machine's) devices: no
program is compiled, so any device count takes seconds. `--memory_gb` lists device sizes to judge
the plan against; `--json_out` writes the numbers. A bad config file or value prints one line
naming it and exits with status 2 (`ksjax.errors`). See `ksjax.trainer.memory_plan`.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from ksjax import config_validation, errors, files
from ksjax.run import spec as spec_lib
from ksjax.trainer import memory_plan as planning
from ksjax.config_validation import ConfigError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a trainer config file (configs/*.py).", lock_config=True)
_FAKE_DEVICES = flags.DEFINE_integer(
    "fake_devices", None, "Plan on this many fake CPU devices instead of this machine's.",
    lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", None, "Longest prompt in tokens; default: the task's (synthetic) or "
    f"{planning.DEFAULT_PROMPT_LEN}.", lower_bound=1)
_MEMORY_GB = flags.DEFINE_list(
    "memory_gb", ["16", "32", "80", "95"], "Device memory sizes (GB, 1e9 bytes) to judge against.")
_EXACT_ONLY = flags.DEFINE_bool(
    "exact_only", False, "Only the parts exact from shapes and shardings; compile nothing.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the plan as JSON to this file.")


def plan_json(memory_plan: planning.MemoryPlan) -> dict:
  out = dataclasses.asdict(memory_plan)
  out["model"] = dataclasses.asdict(memory_plan.model) | {
      "num_params": memory_plan.model.num_params}
  out.update(phases=memory_plan.phases, peak=memory_plan.peak,
             update_activations=memory_plan.update_activations)
  return out


def exact_text(spec: spec_lib.TrainSpec, devices: int, prompt_len: int | None) -> str:
  """Parameters, optimizer state, reference and KV caches per device on a device-free mesh."""
  cfg, mesh = planning.resolve(spec, devices)
  shapes = planning.plan_shapes(spec, mesh, prompt_len or planning.prompt_len_of(spec))
  held = planning.state_bytes(spec, cfg, mesh)
  train_cache, eval_cache = planning.sampler_caches(cfg, mesh, shapes)
  mesh_text = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
  gib = lambda b: f"{b / planning.GIB:10.2f} GiB"
  return "\n".join([
      f"model: {cfg.num_params / 1e9:.2f}B parameters, {cfg.num_layers} layers, {cfg.param_dtype}",
      *planning.lora_lines(spec.lora, cfg),
      f"mesh: {mesh_text} ({devices} devices; exact parts only, nothing compiled)",
      "per device:",
      *planning.state_lines(held, spec.lora),
      f"  sampler KV cache          {gib(train_cache)} ({shapes.sample_prompts} prompts x "
      f"{shapes.samples}, {shapes.prompt_len} + {shapes.max_new_tokens} tokens)",
      f"  eval KV cache             {gib(eval_cache)} ({shapes.eval_prompts} prompts x "
      f"{shapes.eval_samples}, {shapes.prompt_len} + {shapes.eval_max_new_tokens} tokens)"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _CONFIG.value is None:
    print("plan: --config is required (e.g. --config=configs/pass_at_k.py)", file=sys.stderr)
    sys.exit(2)
  try:
    memory = [float(x) * 1e9 for x in _MEMORY_GB.value]
  except ValueError:
    raise ConfigError(f"--memory_gb={','.join(_MEMORY_GB.value)} is not accepted; expected "
                      "numbers") from None
  if _FAKE_DEVICES.value and not _EXACT_ONLY.value:
    # Before anything asks jax for its devices (reading the spec runs the estimator once).
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", _FAKE_DEVICES.value)
  spec = spec_lib.from_config(_CONFIG.value)
  if _EXACT_ONLY.value:
    print(exact_text(spec, _FAKE_DEVICES.value or jax.device_count(), _PROMPT_LEN.value))
    return
  # This machine's CPU devices hold their buffers in this process: count the process itself.
  memory_plan = planning.plan(spec, prompt_len=_PROMPT_LEN.value,
                              host=_FAKE_DEVICES.value is None)
  print(memory_plan.table(memory))
  if _JSON_OUT.value:
    files.write_json(_JSON_OUT.value, plan_json(memory_plan))


if __name__ == "__main__":
  app.run(errors.boundary("plan", main), flags_parser=config_validation.parse_flags_or_exit)
