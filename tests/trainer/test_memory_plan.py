"""The memory plan: exact bytes against hand counts, the compiled phases, and the start-up check.

Hand counts use the tiny preset's dimensions written out here (vocab 100, width 64, 2 layers,
4 query heads and 2 kv heads of 16, MLP 128, tied embedding), not the code's own parameter count.
"""

import dataclasses
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from ksjax.lora_options import LoraSpec

from ksjax.model import lora
from ksjax.run import policy
from ksjax.run import spec as spec_lib
from ksjax.trainer import memory_plan as planning
from ksjax.config_validation import ConfigError
from ksjax.run import config as defaults
from ksjax.run import tasks as run_tasks
from ksjax.trainer import learner
from ksjax.trainer import update as update_lib
from tests import support

VOCAB = 100
# Tiny preset, by hand: per layer q, k, v, o, gate/up/down, two norm scales; then the tied
# embedding and the final norm.
PER_LAYER = 64 * 4 * 16 + 2 * (64 * 2 * 16) + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64
TINY_PARAMS = 2 * PER_LAYER + VOCAB * 64 + 64
F32 = 4
# Rank-4 adapters of one tiny layer: A [inputs, 4] and B [4, outputs] of q (64 -> 4 x 16), k and
# v (64 -> 2 x 16), o (4 x 16 -> 64), gate and up (64 -> 128) and down (128 -> 64).
RANK = 4
ADAPTERS_PER_LAYER = RANK * ((64 + 64 + 64 + 4 * 16 + 64 + 64 + 128)
                             + (4 * 16 + 2 * 16 + 2 * 16 + 64 + 128 + 128 + 64))
ADAPTERS = 2 * ADAPTERS_PER_LAYER
# The tiny base under QLoRA int4: each weight's values at 4 bits, and a float32 scale per output
# and group of 64 inputs along the last input axis (o's last input axis, 16, is one group per
# head; down's 128 inputs are two groups); the norms and the embedding stay float32.
WEIGHTS_PER_LAYER = 64 * 4 * 16 + 2 * (64 * 2 * 16) + 4 * 16 * 64 + 3 * 64 * 128
SCALES_PER_LAYER = 4 * 16 + 2 * (2 * 16) + 4 * 64 + 2 * 128 + 2 * 64
INT4_BASE = (2 * (WEIGHTS_PER_LAYER // 2 + (SCALES_PER_LAYER + 2 * 64) * F32)
             + (VOCAB * 64 + 64) * F32)
spec_of = spec_lib.from_config  # plans take the typed spec of a trainer config


def small_config(mesh=(8, 1, 1), **fields):
  """The default (tiny, CPU) trainer config at sizes that compile in seconds."""
  c = defaults.base_config()
  c.mesh = mesh
  c.batch_prompts = 4
  c.k = 2
  c.max_new_tokens = 8
  c.eval.batch_prompts = 4  # the training sampler's shapes: compiled once
  c.eval.num_samples = 2
  c.eval.ks = (1, 2)
  for name, value in fields.items():
    c[name] = value
  return c


def test_parameters_and_optimizer_state_are_the_hand_counted_bytes():
  config = small_config()
  cfg, mesh = planning.resolve(spec_of(config), vocab_size=VOCAB)
  held = planning.state_bytes(spec_of(config), cfg, mesh)
  assert held.params == TINY_PARAMS * F32 == 321792
  assert held.reference == held.params
  # AdamW: two float32 moments per parameter, and two int32 step counters (Adam's and the
  # learning-rate schedule's), replicated.
  assert held.optimizer == 2 * TINY_PARAMS * F32 + 2 * 4


def test_under_bfloat16_operands_the_reference_holds_its_matrices_in_bfloat16():
  # The reference is read only by forward products that cast to the operand dtype
  # (`lora.frozen_operands`): its attention and MLP matrices take 2 bytes, not 4.
  config = small_config()
  config.model.matmul_dtype = "bfloat16"
  held = planning.state_bytes(spec_of(config), *planning.resolve(spec_of(config),
                                                                  vocab_size=VOCAB))
  matrices = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128)  # 2 layers
  assert held.params == TINY_PARAMS * F32
  assert held.reference == held.params - matrices * 2


def test_fsdp_divides_the_state_by_its_size():
  replicated = small_config(mesh=(8, 1, 1))
  sharded = small_config(mesh=(1, 8, 1))
  a = planning.state_bytes(spec_of(replicated), *planning.resolve(spec_of(replicated), vocab_size=VOCAB))
  b = planning.state_bytes(spec_of(sharded), *planning.resolve(spec_of(sharded), vocab_size=VOCAB))
  # Every tiny parameter has a width-64 axis, which fsdp splits; the counters stay whole.
  assert b.params * 8 == a.params
  assert (b.optimizer - 8) * 8 == a.optimizer - 8


def test_kv_cache_is_the_hand_counted_bytes_per_device():
  config = small_config(mesh=(2, 2, 2))
  cfg, mesh = planning.resolve(spec_of(config), vocab_size=VOCAB)
  # keys and values x 2 layers x 2 kv heads x 16, float32, over (prompt slots of 4 prompts +
  # generated slots of their 4 x 2 rows); prompts and rows over data x fsdp = 4 devices, kv
  # heads over tensor = 2.
  per_slot = 2 * 2 * 2 * 16 * F32
  expected = per_slot * (4 * 16 + 8 * (8 - 1)) // (4 * 2)
  assert planning.kv_cache_bytes(cfg, mesh, prompts=4, samples=2, prompt_len=16,
                                 max_new_tokens=8) == expected
  # 2 prompts do not split over 4 batch shards: their cache is whole on every batch shard.
  expected = per_slot * (2 * 16 * 4 + 4 * (8 - 1)) // (4 * 2)
  assert planning.kv_cache_bytes(cfg, mesh, prompts=2, samples=2, prompt_len=16,
                                 max_new_tokens=8) == expected


@pytest.fixture(scope="module")
def tiny_plan():
  return planning.plan(spec_of(small_config()), prompt_len=10, vocab_size=VOCAB)


def test_plan_reports_the_exact_parts_and_compiled_phases(tiny_plan):
  p = tiny_plan
  assert (p.params, p.reference) == (TINY_PARAMS * F32, TINY_PARAMS * F32)
  # The sampler's buckets: 4 prompts x 2 samples = 8 rows, prompt length 10 -> 16 slots.
  assert (p.shapes.sample_prompts, p.shapes.samples, p.shapes.prompt_len) == (4, 2, 16)
  # KV caches (keys and values x 2 layers x 2 kv heads x 16, float32 per slot): the 4 prompts'
  # 16 slots, whole on each of the 8 data shards (4 prompts do not split 8 ways), and the 8
  # rows' 8 - 1 generated slots, one row per device.
  assert p.kv_cache == 2 * 2 * 2 * 16 * F32 * (4 * 16 + 8 * (8 - 1) // 8)
  # The compiled update receives the TrainState (parameters, optimizer, step, skipped-step
  # count, key) and the batch: 8 rows of 24 tokens, int32 tokens, bool mask, three float32
  # per-token arrays and a float32 advantage per row, split over 8 devices.
  scalars = 4 + 4 + 8
  batch = (8 * 24 * (4 + 1 + 4 + 4) + 8 * 4) // 8
  assert p.update.arguments == p.params + p.optimizer + scalars + batch
  assert p.update.aliased == p.params + p.optimizer + scalars  # the state is donated
  assert p.update.temps > 0 and p.decode.temps > 0
  assert p.phases["update"] == p.reference + p.update.peak
  assert p.peak == max(p.phases.values())
  assert "peak" in p.table([16e9]) and "fits" in p.table([16e9])


def test_a_plan_of_this_machines_cpu_counts_the_host_process_in_every_phase(tiny_plan,
                                                                            monkeypatch):
  # What a fresh interpreter holds after the trainer's imports: more than the bare interpreter
  # (tens of MiB), less than this machine's memory.
  measured = planning.host_process_bytes()
  assert 64 * 2**20 < measured < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert tiny_plan.host == 0 and "host process" not in tiny_plan.table()  # not asked for
  monkeypatch.setattr(planning, "host_process_bytes", lambda: 12345)
  monkeypatch.setattr(planning.allocator, "allocated_bytes", lambda: None)  # programs: below
  counted = planning.plan(spec_of(small_config()), prompt_len=10, vocab_size=VOCAB, host=True)
  assert counted.host == 12345 and counted.programs == 0
  assert counted.phases == {k: v + 12345 for k, v in tiny_plan.phases.items()}
  assert counted.peak == tiny_plan.peak + 12345 and "host process" in counted.table()
  assert "compiled programs" not in counted.table()  # not measured: not guessed either
  # Where the child cannot run, nothing is counted rather than a guess.
  monkeypatch.undo()
  monkeypatch.setattr(planning.subprocess, "run", _refuse)
  assert planning.host_process_bytes() == 0


def _refuse(*args, **kwargs):
  raise OSError("no interpreter")


@pytest.mark.slow  # up to three measured plans, 12-18 compiles; held_since is tested below
def test_a_plan_of_this_machines_cpu_counts_what_its_compiled_programs_hold(tiny_plan,
                                                                            monkeypatch):
  monkeypatch.setattr(planning, "host_process_bytes", lambda: 0)
  # A plan measures what compiling adds (`held_since`), and a program compiled before is found in
  # a cache and adds nothing: in jit's caches and the sampler's (cleared here), or in the
  # session's persistent compilation cache, which every test process uses (tests/conftest.py).
  # So these programs are ones no other test compiles: a vocabulary of its own. (With
  # tiny_plan's, CI's order of tests gave prefill 0 bytes, and decode 3.6 KiB here and 0 on CI's
  # machine while the sampler's decode cache was kept, where a fresh compile holds about 6 MiB.)
  # What other threads free meanwhile comes off a measurement: a test before this one on the
  # worker may leave background work (an asynchronous checkpoint's buffers, a task's pool), so
  # the allocator is let settle first, and a plan with a program under 1 MiB is made once more
  # (with yet another vocabulary): a program that holds nothing because a cache served it fails
  # both times.
  for vocab in (VOCAB + 3, VOCAB + 4):
    _settle_allocator()
    planning.sampler_lib.forget_programs()
    counted = planning.plan(spec_of(small_config()), prompt_len=10, vocab_size=vocab, host=True)
    programs = (counted.update, counted.prefill, counted.decode, counted.eval_prefill,
                counted.eval_decode, counted.reference_forward)
    if all(p.held > 2**20 for p in programs):
      break
  analysed = planning.plan(spec_of(small_config()), prompt_len=10, vocab_size=vocab)
  if planning.allocator.allocated_bytes() is None:  # not glibc's malloc: nothing measured
    assert counted.programs == 0 and counted.phases == analysed.phases
    return
  # Each compiled program holds something (its executable, jit's forms of it), and the same
  # program serving training and evaluation is counted once.
  # Each of the tiny programs' fresh compiles held 5.8-13.6 MiB on an AVX2 EPYC; a program found
  # in a cache holds kilobytes, and other threads' frees took at most 2.5 MiB off a measurement.
  assert all(p.held > 2**20 for p in programs), [p.held for p in programs]
  unique = {id(p): p.held for p in programs}
  assert counted.programs == sum(unique.values())
  assert counted.phases == {k: v + counted.programs for k, v in analysed.phases.items()}
  assert "compiled programs" in counted.table()
  # Only what the buffers need is compiled-analysed; the held bytes change nothing else.
  for planned, plain in zip(programs, (analysed.update, analysed.prefill, analysed.decode,
                                       analysed.eval_prefill, analysed.eval_decode,
                                       analysed.reference_forward)):
    assert dataclasses.replace(planned, held=0) == plain


def _settle_allocator(seconds: float = 5.0) -> None:
  """Waits (up to `seconds`) until glibc's in-use bytes stop moving between two readings 0.2 s
  apart: other threads' frees and allocations, left by earlier tests, done before a measurement."""
  deadline = time.monotonic() + seconds
  last = planning.allocated_now()
  while last is not None and time.monotonic() < deadline:
    time.sleep(0.2)
    now = planning.allocated_now()
    if abs(now - last) < 2**16:
      return
    last = now


def test_the_reference_forward_is_planned_on_the_trainers_layout_and_is_a_phase(tiny_plan):
  spec = spec_of(small_config())
  cfg, mesh = planning.resolve(spec, vocab_size=VOCAB)
  # Its arguments: the reference as the trainer keeps it, and a rollout's rows laid out as
  # `learner.reference_rows` lays them: 4 prompts x 2 samples over 8 data shards, one row each.
  selection, group = learner.reference_layout(8, 2, 8, spec.loss.micro_batch_size)
  rows = len(selection.rows)
  seq = tiny_plan.shapes.prompt_len + tiny_plan.shapes.max_new_tokens
  per_device = rows // 8 * seq * (4 + 1)  # int32 tokens and a bool mask, rows over 8 shards
  forward = tiny_plan.reference_forward
  assert forward.arguments == tiny_plan.reference + per_device + 4  # and the int32 count
  assert forward.outputs == rows // 8 * seq * 4  # the log-probs, float32
  assert tiny_plan.reference_rows == forward.peak - tiny_plan.reference > per_device
  assert tiny_plan.phases["reference"] == (tiny_plan.params + tiny_plan.optimizer
                                           + forward.peak)
  assert "reference forward" in tiny_plan.table()
  # Longer completions hold more in the reference's phase: their KV cache and log-probs.
  longer = dataclasses.replace(tiny_plan.shapes, max_new_tokens=64)
  assert planning.compile_reference(spec, cfg, mesh, longer).peak > forward.peak


@pytest.mark.slow  # three measured update compiles; the measurement is held_since's, below
def test_a_plan_of_this_machines_cpu_counts_each_update_sparse_updates_may_compile(monkeypatch):
  monkeypatch.setattr(planning, "host_process_bytes", lambda: 0)
  # pass@2 leave-one-out with sparse updates from 1 row, in micro-batches of 2 of the 8 rows on
  # one device: updates of 1 and 2 rows a micro-batch, the dense one running each group's prompt
  # once (`sparse.shared`), and a 2-row update a prompt per row for steps that keep one row of a
  # group. (Without measuring, an accelerator's plan, these are not compiled: they need less than
  # the dense update.)
  config = small_config(mesh=(1, 1, 1), aggregator="pass_at_k", sparse_min_rows=1,
                        micro_batch_size=2)
  spec = spec_of(config)
  assert spec.loss.use_sparse and planning.sparse.micro_sizes(8, 1, 1, 2) == (1, 2)
  # The updates are what this is about: the sampler's and the reference's programs are not
  # compiled (their measuring is the test above's).
  nothing = planning.ProgramMemory(0, 0, 0, 0)
  monkeypatch.setattr(planning, "compile_sampler", lambda *a, **k: (nothing, nothing))
  monkeypatch.setattr(planning, "compile_reference", lambda *a, **k: nothing)
  counted = planning.plan(spec, devices=jax.devices()[:1], prompt_len=10, vocab_size=VOCAB,
                          host=True)
  # On one CPU device the sampler's transposed weight copies (`sampler.weights_first`) are
  # counted, in training and evaluation: the tiny model's matrices, hand-counted (its head is
  # tied: no copy of it).
  assert counted.weights_t == counted.eval_weights_t == 2 * WEIGHTS_PER_LAYER * F32
  if planning.allocator.allocated_bytes() is None:  # not glibc's malloc: nothing compiled
    assert counted.sparse_updates == ()
    return
  assert planning.dense_share(spec, planning.model.make_mesh((1, 1, 1)), counted.shapes) == 2
  smaller, alone = counted.sparse_updates
  assert smaller.held > 0 and smaller.temps < counted.update.temps
  assert alone.held > 0 and alone.temps > counted.update.temps  # each row's prompt: more
  assert counted.programs >= smaller.held + alone.held + counted.update.held


def test_held_since_counts_what_a_live_object_holds_and_nothing_freed():
  before = planning.allocated_now()
  if before is None:
    assert planning.held_since(None) == 0
    return
  kept = bytearray(64 * 2**20)  # malloc'd by Python: what a compiled program's memory is too
  # Less what the process's other threads freed meanwhile: 2.5 MiB was seen on CI's machine.
  assert 56 * 2**20 <= planning.held_since(before) < 80 * 2**20
  del kept
  assert planning.held_since(before) < 16 * 2**20


def test_check_fits_refuses_a_config_too_large_and_says_what_to_change(tiny_plan, monkeypatch):
  monkeypatch.setattr(planning, "plan", lambda config, **kw: tiny_plan)  # compiled already
  with pytest.raises(ConfigError) as e:
    planning.check_fits(spec_of(small_config()), device_memory=10**6, prompt_len=10, vocab_size=VOCAB)
  message = str(e.value)
  assert message.startswith(f"config does not fit: it needs {tiny_plan.peak / 2**30:.1f} GiB "
                            "per device")
  assert "config.mesh=(1, 8, 1)" in message  # more fsdp
  assert "config.model.dtype='bfloat16'" in message
  assert "micro_batch_size" in message or "batch_prompts" in message
  assert "max_new_tokens" in message  # shorter context
  assert "config.lora.rank=16" in message  # adapters on a frozen base
  assert planning.check(tiny_plan, device_memory=64 * 2**30) is tiny_plan


def test_a_lora_plan_that_does_not_fit_is_advised_a_4_bit_base_and_not_lora_again(tiny_plan):
  lora_plan = dataclasses.replace(tiny_plan, lora=LoraSpec(rank=8), frozen=tiny_plan.params)
  advice = " ".join(planning.advice(lora_plan, device_memory=10**6))
  assert "config.lora.quantize_base='int4'" in advice and "config.lora.rank" not in advice
  qlora = dataclasses.replace(lora_plan, lora=LoraSpec(rank=8, quantize_base="int4"))
  assert "config.lora" not in " ".join(planning.advice(qlora, device_memory=10**6))


def test_a_plan_whose_peak_is_the_reference_forward_is_advised_for_it(tiny_plan):
  """Without remat the reference forward's unrolled layers may gather every layer's weights at
  once (docs/scaling.md): where it is the peak, the advice names remat and its micro-batch."""
  big = 64 * 2**30
  forward = dataclasses.replace(tiny_plan.reference_forward, temps=big)
  plan = dataclasses.replace(tiny_plan, reference_forward=forward,
                             model=dataclasses.replace(tiny_plan.model, remat=False))
  assert max(plan.phases, key=plan.phases.get) == "reference"
  advice = " ".join(planning.advice(plan, device_memory=10**6))
  assert "config.model.remat=True" in advice and "reference forward" in advice
  remat = dataclasses.replace(plan, model=dataclasses.replace(plan.model, remat=True))
  assert "config.model.remat" not in " ".join(planning.advice(remat, device_memory=10**6))


def test_bfloat16_is_advised_for_float32_and_halves_the_parameters():
  f32 = small_config()
  bf16 = small_config()
  bf16.model.dtype = "bfloat16"
  a = planning.state_bytes(spec_of(f32), *planning.resolve(spec_of(f32), vocab_size=VOCAB))
  b = planning.state_bytes(spec_of(bf16), *planning.resolve(spec_of(bf16), vocab_size=VOCAB))
  assert 2 * b.params == a.params


def test_deep_models_are_compiled_at_two_depths_and_continued_on_their_line():
  compiled = []

  def fake_compile(cfg, measure=False):  # bytes affine in depth, as a stack of blocks is;
    compiled.append((cfg.num_layers, measure))  # the held bytes not (docs/benchmarks.md)
    d = cfg.num_layers
    return planning.ProgramMemory(arguments=100 * d + 7, outputs=50 * d, aliased=40 * d,
                                  temps=1000 * d + 3, held=d * d if measure else 0)

  by_depth = planning._by_depth  # pylint: disable=protected-access
  cfg = planning.model.preset("tiny", num_layers=32)
  assert by_depth(fake_compile, cfg) == fake_compile(cfg)
  assert compiled[:2] == [(d, False) for d in planning.PROBE_DEPTHS]
  # Measured: on one more compile, at the model's own depth, not continued on the probes' line.
  compiled.clear()
  assert by_depth(fake_compile, cfg, measure=True) == fake_compile(cfg, True)
  assert compiled[:3] == [(2, False), (4, False), (32, True)]
  shallow = planning.model.preset("tiny", num_layers=planning.EXACT_DEPTH)
  for measure in (False, True):
    compiled.clear()
    whole = by_depth(fake_compile, shallow, measure=measure)
    # Compiled whole, and once: a second compile of the same program would find jit's cache.
    assert compiled == [(planning.EXACT_DEPTH, measure)]
    assert whole == fake_compile(shallow, measure)
  compiled.clear()
  by_depth(lambda c, m: (fake_compile(c, m), fake_compile(c, m)), cfg, measure=True)  # sampler
  assert compiled == [(2, False)] * 2 + [(4, False)] * 2 + [(32, True)] * 2
  compiled.clear()
  by_depth(fake_compile, cfg, scanned=True)
  assert compiled == [(32, False)]  # a scan over layers compiles one block at any depth: whole


@pytest.mark.slow  # three compiles of the update; the arithmetic is covered above
def test_deep_models_are_extrapolated_in_depth_to_what_a_full_compile_gives():
  config = small_config()
  config.model.num_layers = 6
  cfg, mesh = planning.resolve(spec_of(config), vocab_size=VOCAB)
  shapes = planning.plan_shapes(spec_of(config), mesh, prompt_len=10)
  compile_update = lambda c, m=False: planning.compile_update(spec_of(config), c, mesh, shapes)
  extrapolated = planning._by_depth(compile_update, cfg)  # pylint: disable=protected-access
  exact = compile_update(cfg)
  assert planning.PROBE_DEPTHS == (2, 4)  # what was compiled above, besides the 6 layers
  assert extrapolated.arguments == exact.arguments
  assert abs(extrapolated.temps - exact.temps) <= 0.01 * exact.temps


def test_a_mesh_that_cannot_divide_the_batch_or_model_is_a_config_error():
  with pytest.raises(ConfigError, match="tensor"):
    planning.resolve(spec_of(small_config(mesh=(1, 1, 8))), vocab_size=VOCAB)  # 2 kv heads
  with pytest.raises(ConfigError, match="prompt_len"):
    planning.plan(spec_of(small_config()), prompt_len=0, vocab_size=VOCAB)


@pytest.mark.parametrize("modulus,levels", [
    (10, (1, 2, 3, 4, 5)), (100, (1, 2, 3, 4, 5)),  # the default, and " mod 100" prompts
    (10, (1, 2, 3)), (50, (2, 4))])                 # without level 5, the prompts are shorter
def test_the_planned_prompt_length_is_the_synthetic_tasks_longest_prompt(modulus, levels):
  config = small_config()
  config.synthetic.modulus = modulus
  config.synthetic.levels = levels
  spec = spec_of(config)
  task = run_tasks.make_task(spec.task, spec.model, spec.eval.split)
  prompts = [p for split in ("train", "test") for p in task.prompts(split)]
  assert {p.text.endswith(f" mod {modulus}\n") for p in prompts} == {True}
  longest = max(len(p.text) for p in prompts)
  assert planning.prompt_len_of(spec) == longest + 1  # one token per character, and BOS
  assert max(len(p.tokens) for p in prompts) == longest + 1


def test_the_command_line_tool_on_fake_devices(tmp_path):
  root = str(support.REPO)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device by default
  tool = [sys.executable, "-m", "ksjax.tools.plan",
          f"--config={os.path.join(root, 'configs', 'pass_at_k.py')}", "--fake_devices=4",
          "--config.batch_prompts=4", "--config.k=2", "--config.max_new_tokens=8",
          "--config.eval.batch_prompts=4", "--config.eval.num_samples=2",
          "--config.eval.ks=(1,2)", "--prompt_len=10"]
  run = lambda *flags: subprocess.run([*tool, *flags], capture_output=True, text=True, cwd=root,
                                      env=env, timeout=120, check=False)
  exact = run("--exact_only", "--config.mesh=(1,4,1)")
  assert exact.returncode == 0, exact.stderr
  assert "data=1 x fsdp=4 x tensor=1 (4 devices; exact parts only" in exact.stdout
  params = TINY_PARAMS * F32 // 4  # the synthetic task's tokenizer has 100 symbols
  assert f"parameters                {params / 2**30:10.2f} GiB" in exact.stdout
  # The compiling path really gets 4 devices: a tensor axis of 4 is refused for 2 kv heads
  # (with one device the mesh itself would be refused), in one line and with status 2.
  bad = run("--config.mesh=(1,1,4)")
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1] == (
      "plan: bad config: mesh axis 'tensor' of size 4 does not divide "
      "LlamaConfig.num_kv_heads=2; choose a mesh whose tensor size divides it")


def test_on_cpu_the_start_up_check_plans_nothing(monkeypatch):
  assert jax.devices()[0].platform == "cpu"  # conftest's fake devices
  assert planning.device_memory_bytes() is None  # the CPU runtime reports no memory limit

  def no_plan(*args, **kwargs):
    raise AssertionError("planned without a device memory to check against")

  monkeypatch.setattr(planning, "plan", no_plan)
  assert planning.check_fits(spec_of(small_config()), vocab_size=VOCAB) is None


@pytest.mark.slow  # two plans on 8 devices; the FSDP layout of the state is tested above
def test_fsdp_splits_the_update_activations_over_its_devices():
  """The compiled update's temporaries per device under fsdp=8 are at most 1/4 of one device's
  under fsdp=1, at the same 16-row micro-batch of 128 tokens.

  With the rows split, each device holds 1/8 of the activations, plus what rows cannot split:
  one block's gathered weights, their full-size gradients before the reduce-scatter, and the
  lm head's vocabulary chunks. At this width (256, MLP 1024) those are under 1/8 of the fsdp=1
  temporaries, hence the bound 1/8 + 1/8 (measured: 0.14). Without the activation constraints
  XLA kept every row on every device and gathered nothing: 0.55, which fails here.
  """
  def temps(mesh):
    config = small_config(mesh=mesh, batch_prompts=8, max_new_tokens=112, micro_batch_size=16)
    config.model.remat = True
    cfg, device_mesh = planning.resolve(spec_of(config), vocab_size=VOCAB)
    cfg = dataclasses.replace(cfg, hidden_size=256, intermediate_size=1024, num_heads=8,
                              num_kv_heads=2, head_dim=32)
    shapes = planning.plan_shapes(spec_of(config), device_mesh, prompt_len=16)
    assert (shapes.micro_batch, shapes.update_rows) == (16, 16)
    return planning.compile_update(spec_of(config), cfg, device_mesh, shapes).temps

  assert temps((1, 8, 1)) <= temps((1, 1, 1)) / 4


def lora_config(quantize_base="none", mesh=(8, 1, 1), **fields):
  config = small_config(mesh=mesh, **fields)
  config.lora.rank = RANK
  config.lora.quantize_base = quantize_base
  return config


def bytes_on_first_device(tree):
  """What the first device holds of real arrays: its shard of each, int4 at 4 bits (packed, as
  XLA's compiled programs count it; the CPU runtime itself pads each to a byte)."""
  device = jax.devices()[0]
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard, = [s.data for s in leaf.addressable_shards if s.device == device]
    bits = 4 if leaf.dtype == jnp.int4 else 8 * leaf.dtype.itemsize
    total += shard.size * bits // 8
  return total


@pytest.mark.parametrize("quantize_base", ["none", "int4"])
def test_the_lora_state_is_what_the_adapted_model_and_its_train_state_hold(quantize_base):
  spec = spec_of(lora_config(quantize_base, mesh=(2, 2, 2)))
  cfg, mesh = planning.resolve(spec, vocab_size=VOCAB)
  held = planning.state_bytes(spec, cfg, mesh)
  # What the trainer builds (`loop._train`): the policy on the mesh, adapted, split into the
  # adapters and the frozen base, and a TrainState of the adapters.
  llama = policy.adapt(policy.build_model(spec.model, VOCAB, mesh, value_head=False,
                                          seed=spec.run.seed), spec.lora, spec.run.seed)
  graphdef, trainable, frozen = lora.split(llama)
  state = update_lib.build_updater(spec, graphdef, mesh, frozen).init_state(
      trainable, jax.random.key(0))
  assert held.params == bytes_on_first_device(trainable) + bytes_on_first_device(frozen)
  assert held.frozen == bytes_on_first_device(frozen)
  assert held.reference == bytes_on_first_device(state.params)
  assert held.optimizer == bytes_on_first_device(state.opt_state)
  if quantize_base == "int4":  # the base is qwix's int4 values and their scales
    assert {leaf.dtype for leaf in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.int4),
                                                                jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("quantize_base, base", [("none", TINY_PARAMS * F32),
                                                 ("int4", INT4_BASE)])
def test_under_lora_gradients_and_adamw_are_the_adapters_alone(quantize_base, base):
  spec = spec_of(lora_config(quantize_base))
  cfg, mesh = planning.resolve(spec, vocab_size=VOCAB)  # data=8: every device holds all of it
  held = planning.state_bytes(spec, cfg, mesh)
  assert held.frozen == base
  assert held.params == base + ADAPTERS * F32
  assert held.reference == ADAPTERS * F32  # the start's adapters, on the same base
  # AdamW: two float32 moments per adapter parameter and the two int32 step counters.
  assert held.optimizer == 2 * ADAPTERS * F32 + 2 * 4
  policy_ = planning.abstract_policy(spec, cfg, mesh)
  opt_state = policy_.updater(spec, mesh).abstract_state(policy_.trainable).opt_state
  moments = [path for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state) if leaf.ndim]
  assert moments and all(str(path[-1].key).endswith(("_lora_a", "_lora_b")) for path in moments)


def test_under_lora_with_ppo_the_value_head_trains_with_the_adapters():
  spec = spec_of(lora_config(algorithm="ppo"))
  cfg, mesh = planning.resolve(spec, vocab_size=VOCAB)
  held = planning.state_bytes(spec, cfg, mesh)
  value_head = (64 + 1) * F32  # a width-64 vector and a bias, new, so not frozen
  assert held.frozen == TINY_PARAMS * F32
  assert held.reference == ADAPTERS * F32 + value_head
  assert held.optimizer == 2 * (ADAPTERS * F32 + value_head) + 2 * 4


def test_under_lora_the_samplers_copy_is_of_the_adapters_or_of_all_on_its_own_devices():
  def spec(**fields):
    return spec_of(lora_config(**{"mesh": (1, 8, 1), **fields}))

  cfg, mesh = planning.resolve(spec(), vocab_size=VOCAB)
  held = planning.state_bytes(spec(), cfg, mesh)
  # On the learner's devices it shares the learner's base and copies the adapters.
  assert planning.sampler_copy_bytes(spec(max_lag=2), cfg, mesh) == held.params - held.frozen
  # On its own two devices it holds the base too, placed there once, split two ways.
  own = spec(max_lag=1, sampler_devices=2, sampler_mesh=(1, 2, 1), mesh=(1, 6, 1))
  on_two = planning.state_bytes(own, cfg, planning.abstract_mesh((1, 2, 1), 2))
  assert planning.sampler_copy_bytes(own, cfg, mesh) == on_two.params > 3 * held.params


@pytest.fixture(scope="module")
def qlora_plan():
  return planning.plan(spec_of(lora_config("int4")), prompt_len=10, vocab_size=VOCAB)


@pytest.mark.slow  # compiles the QLoRA update and sampler programs: about 40 s
def test_the_qlora_plan_compiles_the_adapted_programs(tiny_plan, qlora_plan):
  p = qlora_plan
  trained = p.params - p.frozen
  assert (p.frozen, trained) == (INT4_BASE, ADAPTERS * F32)
  # The update receives the base as an argument beside the TrainState and the batch (as in
  # `test_plan_reports_the_exact_parts_and_compiled_phases`), and XLA counts the int4 values
  # as the plan does; only the adapters' TrainState is donated, never the base.
  scalars = 4 + 4 + 8
  batch = (8 * 24 * (4 + 1 + 4 + 4) + 8 * 4) // 8
  assert p.update.arguments == p.params + p.optimizer + scalars + batch
  assert p.update.aliased == trained + p.optimizer + scalars
  # The sampler's programs take the adapted model, base and adapters: their other arguments
  # (prompts, mask, row count, seed) are those of the same run without LoRA.
  for program in ("prefill", "decode", "eval_prefill", "eval_decode"):
    lora_args = getattr(p, program).arguments - p.params
    assert lora_args == getattr(tiny_plan, program).arguments - tiny_plan.params, program
  assert p.kv_cache == tiny_plan.kv_cache
  assert p.phases["update"] == p.reference + p.update.peak
  table = p.table()
  assert "LoRA: rank 4, alpha 16, on all weights" in table and "quantized to int4" in table
  assert f"    frozen base             {INT4_BASE / 2**30:10.2f} GiB" in table
  assert "frozen base" not in tiny_plan.table()


def test_the_samplers_transposed_weight_copies_are_in_its_phases_alone(tiny_plan):
  """The sampler's transposed weight copies (`sampler.weights_first`) are held while it samples:
  in the sampling and eval phases and no other; on 8 devices it makes none."""
  assert tiny_plan.weights_t == tiny_plan.eval_weights_t == 0
  p = dataclasses.replace(tiny_plan, weights_t=3 * 2**20, eval_weights_t=5 * 2**20)
  assert {k: v - tiny_plan.phases[k] for k, v in p.phases.items()} == {
      k: {"sampling": 3 * 2**20, "eval": 5 * 2**20}.get(k, 0) for k in p.phases}
  assert "sampler weight copies" in p.table() and "sampler weight copies" not in tiny_plan.table()
