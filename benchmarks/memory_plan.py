"""Memory plans of the paper's accelerator configs on 8, 64 and 256 devices, as tables.

  python benchmarks/memory_plan.py --exact [--devices=8,64,256]     # seconds
  python benchmarks/memory_plan.py [--devices=8,64,256] [--out=plans/]  # 9 minutes on 2 cores
  python benchmarks/memory_plan.py --lora [--exact] [--devices=8,64]

--exact: the parts of the plan that follow from shapes and shardings alone (parameters, AdamW,
reference policy, KV cache) on device-free meshes, and from them the largest sampling batch each
device size can hold; no program is compiled. Without it: full plans, each
`python -m ksjax.tools.plan --fake_devices=N` in its own process (a process has one device
count), written as JSON and summarised in a Markdown table with the compiled update and sampler
programs. See `ksjax.trainer.memory_plan` for what the numbers are and what they assume.

--lora: the 8B MATH and 70B CodeContests configs as they are (full fine-tuning), with LoRA rank 16
on every weight matrix, and with QLoRA (the same adapters on an int4 base): per-device state
(the parameters split into frozen base and trained, AdamW, reference) and, without --exact,
the compiled plan's peaks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from ksjax import model
from ksjax.model import sharding
from ksjax.run import spec as spec_lib
from ksjax.sampling import SamplerConfig, sampler
from ksjax.trainer import memory_plan as planning

_DEVICES = flags.DEFINE_list("devices", ["8", "64", "256"], "Device counts to plan for.")
_OUT = flags.DEFINE_string("out", "memory_plans", "Directory for the plans' JSON files.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "Longest prompt, tokens.")
_EXACT = flags.DEFINE_bool("exact", False, "Only the exact parts, on abstract meshes.")
_LORA = flags.DEFINE_bool("lora", False, "Full fine-tuning vs LoRA vs QLoRA (see above).")
_ROWS_PER_DEVICE = flags.DEFINE_integer(
    "rows_per_device", None, "Micro-batch rows per batch shard; default: the config's "
    "micro_batch_size, raised to one row per shard where the mesh has more shards.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name -> (config file, the model preset whose config.json stands in for init_hf)
    "8B MATH": ("configs/math_llama8b.py", "llama3.1-8b"),
    "8B CodeContests": ("configs/code_contests_llama8b.py", "llama3.1-8b"),
    "70B CodeContests": ("configs/code_contests_llama70b.py", "llama3.1-70b"),
}
# The configs --lora compares, and its variants: name -> config.lora fields. Rank 16 as in the
# LoRA configs (configs/*_lora.py); alpha, which changes no byte, is left at its default.
LORA_CONFIGS = ("8B MATH", "70B CodeContests")
LORA_VARIANTS = {
    "full fine-tuning": {},
    "LoRA r16": {"rank": 16, "targets": "all"},
    "QLoRA r16 int4": {"rank": 16, "targets": "all", "quantize_base": "int4"},
}
MEMORY_GB = (16, 32, 80, 95)
GIB = 2**30


def load_config(path: str):
  spec = importlib.util.spec_from_file_location("config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def hf_config_dir(preset: str, directory: str) -> str:
  """A directory holding only the config.json of `preset`: all a plan reads of `init_hf`."""
  path = os.path.join(directory, preset)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    json.dump(model.to_hf_config(model.preset(preset)), f)
  return path


def run_plan(config: str, init_hf: str, devices: int, tensor: int, micro: int,
             out: str, lora: dict | None = None) -> dict:
  cmd = [sys.executable, "-m", "ksjax.tools.plan", f"--config={config}",
         f"--fake_devices={devices}", f"--prompt_len={_PROMPT_LEN.value}", f"--json_out={out}",
         f"--config.init_hf={init_hf}"]
  cmd += [f"--config.lora.{name}={value}" for name, value in (lora or {}).items()]
  shards = devices // tensor
  rows = shards * _ROWS_PER_DEVICE.value if _ROWS_PER_DEVICE.value else max(micro, shards)
  cmd.append(f"--config.micro_batch_size={rows}")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
  with open(out, encoding="utf-8") as f:
    return json.load(f)


PHASES = ("update", "sampling", "eval", "reference")


def phases_cell(p: dict) -> str:
  """The peaks of a plan's phases, GiB, in PHASES' order ('-' for one a plan lacks)."""
  return " / ".join(f"{p['phases'][name] / GIB:.1f}" if name in p["phases"] else "-"
                    for name in PHASES)


def row(name: str, devices: int, p: dict) -> str:
  if "error" in p:
    return f"| {name} | {devices} | {p['error']} |" + " |" * (7 + len(MEMORY_GB))
  gib = lambda b: f"{b / GIB:.1f}"
  mesh = "x".join(str(v) for v in p["mesh"].values())
  fits = ["yes" if p["peak"] <= 0.9 * gb * 1e9 else "no" for gb in MEMORY_GB]
  s = p["shapes"]
  return (f"| {name} | {devices} ({mesh}) | {gib(p['params'])} | {gib(p['optimizer'])} | "
          f"{gib(p['reference'])} | {gib(p['update_activations'])} (m={s['micro_batch']}) | "
          f"{gib(p['kv_cache'])} ({s['sample_prompts'] * s['samples']} rows) | "
          f"{phases_cell(p)} | {gib(p['peak'])} | " + " | ".join(fits) + " |")


def exact_table() -> str:
  """Per-device state and the KV-cache bound on rows sampled at once, for each config."""
  header = ("| config | devices (data x fsdp x tensor) | params + AdamW + reference | KV cache of "
            "one prompt and its n samples, per device (slots) | " + " | ".join(
                f"max rows sampled at once, {gb} GB" for gb in MEMORY_GB) + " |")
  lines = [header, "|" + "---|" * (4 + len(MEMORY_GB))]
  for name, (path, preset) in CONFIGS.items():
    config = load_config(os.path.join(ROOT, path))
    config.init_hf = hf_config_dir(preset, tempfile.mkdtemp())
    for devices in map(int, _DEVICES.value):
      spec = spec_lib.from_config(config)
      cfg, mesh = planning.resolve(spec, devices, vocab_size=model.preset(preset).vocab_size)
      held = planning.state_bytes(spec, cfg, mesh)
      state = held.params + held.optimizer + held.reference
      n = spec.sampling.n
      shards = sharding.batch_shards(mesh)
      # Prompts and rows are split over the batch shards: with one prompt per shard, a device
      # holds one prompt's cache and its n rows' caches of generated tokens (its share of the
      # kv heads under tensor parallelism).
      per_prompt = planning.kv_cache_bytes(cfg, mesh, prompts=shards, samples=n,
                                           prompt_len=_PROMPT_LEN.value,
                                           max_new_tokens=config.max_new_tokens)
      rows = [max(0, int((planning.USABLE_FRACTION * gb * 1e9 - state) // per_prompt)) * shards
              * n for gb in MEMORY_GB]
      mesh_text = "x".join(str(v) for v in mesh.shape.values())
      lines.append(f"| {name} | {devices} ({mesh_text}) | {state / GIB:.2f} GiB | "
                   f"{per_prompt / 2**20:.1f} MiB ({_PROMPT_LEN.value} + "
                   f"{n} x {sampler.new_slots(SamplerConfig(max_new_tokens=config.max_new_tokens))}) | " + " | ".join(
                       f"{r:,}" if r else "state does not fit" for r in rows) + " |")
  return "\n".join(lines)


def lora_table() -> str:
  """Per-device state, and without --exact the compiled peaks, of each config in LORA_CONFIGS
  under each of LORA_VARIANTS."""
  compiled = not _EXACT.value
  header = ("| config | devices (data x fsdp x tensor) | fine-tuning | params: frozen base + "
            "trained | AdamW | reference | state | "
            + ("peak update / sampling / eval / reference | peak | " + " | ".join(
                f"{gb} GB" for gb in MEMORY_GB) + " |" if compiled else "")).rstrip()
  lines = [header, "|" + "---|" * (7 + (2 + len(MEMORY_GB) if compiled else 0))]
  out_dir = os.path.abspath(_OUT.value)
  if compiled:
    os.makedirs(out_dir, exist_ok=True)
  gib = lambda b: f"{b / GIB:.2f}"
  for name in LORA_CONFIGS:
    path, preset = CONFIGS[name]
    init_hf = hf_config_dir(preset, out_dir if compiled else tempfile.mkdtemp())
    for devices in map(int, _DEVICES.value):
      for variant, fields in LORA_VARIANTS.items():
        config = load_config(os.path.join(ROOT, path))
        if compiled:
          out = os.path.join(out_dir, f"{name.replace(' ', '_')}_{devices}_"
                             f"{variant.replace(' ', '_')}.json")
          p = run_plan(path, init_hf, devices, config.mesh[2], config.micro_batch_size, out,
                       fields)
          if "error" in p:
            lines.append(f"| {name} | {devices} | {variant} | {p['error']} |")
            print(lines[-1], flush=True)
            continue
          mesh = "x".join(str(v) for v in p["mesh"].values())
        else:
          config.init_hf = init_hf
          config.lora.update(fields)
          spec = spec_lib.from_config(config)
          cfg, mesh = planning.resolve(spec, devices, vocab_size=model.preset(preset).vocab_size)
          p = dataclasses.asdict(planning.state_bytes(spec, cfg, mesh))
          mesh = "x".join(str(v) for v in mesh.shape.values())
        state = p["params"] + p["optimizer"] + p["reference"]
        row = (f"| {name} | {devices} ({mesh}) | {variant} | {gib(p['params'])}: "
               f"{gib(p['frozen'])} + {gib(p['params'] - p['frozen'])} | {gib(p['optimizer'])} | "
               f"{gib(p['reference'])} | {gib(state)} |")
        if compiled:
          row += (f" {phases_cell(p)} | {gib(p['peak'])} | " + " | ".join(
                      "yes" if p["peak"] <= planning.USABLE_FRACTION * gb * 1e9 else "no"
                      for gb in MEMORY_GB) + " |")
        lines.append(row)
        print(row, flush=True)
  return "\n".join(lines)


def main(argv):
  del argv
  if _LORA.value:
    print("\nGiB per device.\n" + lora_table())
    return
  if _EXACT.value:
    print(exact_table())
    return
  os.makedirs(_OUT.value, exist_ok=True)
  header = ("| config | devices (data x fsdp x tensor) | params | AdamW | reference | update "
            "activations | KV cache | peak update / sampling / eval / reference | peak | "
            + " | ".join(f"{gb} GB" for gb in MEMORY_GB) + " |")
  lines = [header, "|" + "---|" * (9 + len(MEMORY_GB))]
  out_dir = os.path.abspath(_OUT.value)
  for name, (config, preset) in CONFIGS.items():
    init_hf = hf_config_dir(preset, out_dir)
    c = load_config(os.path.join(ROOT, config))
    for devices in map(int, _DEVICES.value):
      out = os.path.join(out_dir, f"{name.replace(' ', '_')}_{devices}.json")
      plan = run_plan(config, init_hf, devices, c.mesh[2], c.micro_batch_size, out)
      lines.append(row(name, devices, plan))
      print(lines[-1], flush=True)
  print("\nGiB per device.\n" + "\n".join(lines))


if __name__ == "__main__":
  app.run(main)
