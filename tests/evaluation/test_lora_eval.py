"""The eval binary on a LoRA run (config.run.lora): each step's adapters restored onto the run's
frozen base, rebuilt once on the evaluation mesh; the start policy (adapters alone on disk) as
step 0 and as the KL reference; and one line, nothing written, for a checkpoint of another base
or of the other kind (LoRA read as full fine-tuning, and the reverse).

The trained policy is compared with one rebuilt here without the binary's code: the preset base
made on one device from the run's seed, adapted with the run's settings, the adapters of final/
(the trainer's last step) read in. The run trains with rewards whose advantages are not zero
(the mean objective without a baseline, every tiny model's reward being equal) and a large
learning rate after a short supervised warm-up, so that base, start and final are three different
policies and an equality below cannot hold by the adapters standing still.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ksjax import model
from ksjax.evaluation import results, runner
from ksjax.evaluation import settings as settings_lib
from ksjax.model import lora
from ksjax.run import checkpoints, policy, scoring
from ksjax.run.directory import CONFIG_ITEM, LORA_BASE_KEY, locate

from tests.support import eval_run

# A LoRA run trained and evaluated on two meshes: about four CPU-minutes, most of it compiling.
pytestmark = pytest.mark.slow

# What the eval config must repeat of the run: the adapters' shapes and scale.
LORA = {"lora.rank": 4, "lora.alpha": 8.0}
TRAIN = {
    **LORA, "aggregator": "mean", "baseline": "none", "learning_rate": 3e-2,
    "lr_warmup_steps": 0, "sparse_updates": False, "sft_warmup.steps": 2,
    "sft_warmup.batch_size": 4, "sft_warmup.learning_rate": 3e-2, "sft_warmup.lr_warmup_steps": 0,
}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> pathlib.Path:
  workdir = tmp_path_factory.mktemp("lora_eval") / "run"
  eval_run.train(workdir, **TRAIN)
  return workdir


@pytest.fixture(scope="module")
def evaluator(lora_run, tmp_path_factory) -> runner.Evaluator:
  """The binary's Evaluator of the run with its LoRA settings (its base built once, here)."""
  return _evaluator(lora_run, tmp_path_factory.mktemp("lora_eval_out"))


def _config(run: pathlib.Path, lora_fields=None, **overrides):
  """The eval config of the run (`lora_fields` in place of its LoRA settings), on a mesh of
  FSDP and tensor parallelism: the base is built there, the trainer built it on one device."""
  config = eval_run.configured(run, **overrides)
  eval_run.set_fields(config.run, {"mesh": (1, 2, 2),
                                   **(LORA if lora_fields is None else lora_fields)})
  return config


def _evaluator(run: pathlib.Path, out: pathlib.Path, lora_fields=None,
               **overrides) -> runner.Evaluator:
  s = settings_lib.validate(_config(run, lora_fields, **overrides))
  return runner.open_evaluator(s, locate(str(run)), runner.open_task(s), str(out))


def _base(s: settings_lib.Settings, vocab_size: int) -> model.Llama:
  """The run's preset base, made on one device from its seed (no mesh, no `build_model`). Under
  jit, as the trainer makes it: XLA's fused initialisers round differently from eager ones."""
  cfg = runner.policy_config(s.run, vocab_size)
  make = lambda: model.Llama(cfg, rngs=nnx.Rngs(s.run.run.seed))
  return nnx.merge(nnx.graphdef(nnx.eval_shape(make)), jax.jit(lambda: nnx.state(make()))())


def _rebuilt(base: model.Llama, adapters: pathlib.Path) -> model.Llama:
  """`base` adapted with the run's settings, the adapters at `adapters` read in."""
  adapted = lora.apply(base, lora.LoraSpec(rank=LORA["lora.rank"], alpha=LORA["lora.alpha"]),
                       rngs=nnx.Rngs(0))  # A's initial value: overwritten by the restore
  lora.restore(str(adapters), adapted)
  return adapted


@nnx.jit
def _logprobs(llama, tokens, mask):
  return model.token_logprobs(llama, tokens, mask)[0]


def _recorded_config(run: pathlib.Path, step: int) -> pathlib.Path:
  return run / "checkpoints" / str(step) / CONFIG_ITEM / "metadata"


def _lines(error: BaseException) -> list[str]:
  return [line for line in str(error).splitlines() if line.strip()]


def test_a_step_is_the_trainers_adapted_policy_on_the_base_built_once(lora_run, evaluator):
  s, task = evaluator.settings, evaluator.task
  vocab_size = task.tokenizer.vocab_size
  # The base built once on the eval mesh, and the one built here, are the trainer's: the
  # checkpoints' record of it matches both.
  recorded = json.loads(_recorded_config(lora_run, 3).read_text())[LORA_BASE_KEY]
  assert evaluator.base.record == recorded
  base = _base(s, vocab_size)
  assert policy.base_record(s.run.model, base) == recorded
  evaluator.check(3)
  restored = evaluator.restore(3)

  final = _rebuilt(base, lora_run / "final")
  want = dict(nnx.to_flat_state(nnx.state(final, nnx.LoRAParam)))
  got = dict(nnx.to_flat_state(nnx.state(restored, nnx.LoRAParam)))
  assert want.keys() == got.keys() and len(want) == 2 * 7 * final.cfg.num_layers
  for path, variable in want.items():  # step 3's adapters are final/'s, bit for bit
    np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(variable[...]))
  # Only the adapters were read: the base's arrays are the ones built once, not copies.
  assert restored.layers[0].mlp.up_proj[...] is evaluator.base.adapted.layers[0].mlp.up_proj[...]
  q_a = restored.layers[0].self_attn.q_proj_lora_a[...]
  assert q_a.sharding.mesh.shape == evaluator.mesh.shape and len(q_a.sharding.device_set) == 4

  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab_size, (4, 12)), jnp.int32)
  mask = jnp.ones_like(tokens, dtype=bool)
  logp = {name: np.asarray(_logprobs(m, tokens, mask)) for name, m in (
      ("restored", restored), ("final", final), ("base", base),
      ("start", _rebuilt(base, lora_run / "start")))}
  np.testing.assert_allclose(logp["restored"], logp["final"], rtol=0, atol=1e-5)
  # The adapters moved, in the warm-up and in RL: the equality above is neither the base's nor
  # the start's.
  assert np.abs(logp["final"] - logp["base"]).max() > 1e-2
  assert np.abs(logp["final"] - logp["start"]).max() > 1e-2
  assert np.abs(logp["start"] - logp["base"]).max() > 1e-2
  # (The binary's samples of step 3 are checked against the rebuilt policy's below, by their KL.)


def test_the_binary_evaluates_a_step_and_the_start_with_kl_to_the_start(lora_run, tmp_path):
  run = eval_run.copy_run(lora_run, tmp_path / "run", with_eval=False)
  config = _config(run, steps="3", include_start=True, kl_reference="start", kl_samples=3)
  runner.run(config)
  (out,) = (run / "eval").iterdir()
  records = {r["step"]: r for r in results.load_records(str(out))}
  assert sorted(records) == [0, 3] and records[0]["checkpoint"] == str(run / "start")
  # Step 0 against the reference: zero, so step 0 is the policy the reference is (the start, as
  # step 3's KL below shows).
  assert abs(records[0]["metrics"]["kl_k1"]) < 1e-4 and records[0]["metrics"]["kl_k3"] < 1e-6

  # Step 3's KL to the start: its samples drawn again on one device from the rebuilt final
  # policy, scored by unsharded forwards of the rebuilt final and start.
  s = settings_lib.validate(config)
  task = runner.open_task(s)
  prompts = runner.select_prompts(task, s)
  assert len(prompts) <= s.batch_prompts  # one sampler call, seeded with config.seed
  base = _base(s, task.tokenizer.vocab_size)
  final, start = _rebuilt(base, run / "final"), _rebuilt(base, run / "start")
  scored = scoring.sample_and_score(final, task, prompts, s.draw(), seed=s.seed)
  tokens_rt, mask_rt = scored.output.sequences()
  t = scored.output.prompt_tokens.shape[1]
  logp = {name: np.asarray(_logprobs(m, tokens_rt, mask_rt))[:, t:]
          for name, m in (("final", final), ("start", start))}
  mask_rn = np.asarray(mask_rt)[:, t:]
  k1_r = np.where(mask_rn, logp["final"] - logp["start"], 0.0).sum(1)
  k1_g = k1_r.reshape(len(prompts), s.num_samples)[:, :3].mean(1)
  np.testing.assert_allclose(records[3]["problems"]["kl_k1"], k1_g, rtol=1e-3, atol=1e-4)
  assert records[3]["metrics"]["kl_k3"] > 1e-3  # final is not the start


def test_a_step_recording_another_base_is_refused_with_one_line(lora_run, evaluator, tmp_path):
  run = eval_run.copy_run(lora_run, tmp_path / "run", with_eval=False)
  path = _recorded_config(run, 2)
  config = json.loads(path.read_text())
  config[LORA_BASE_KEY]["sha256"] = "f" * 64
  path.write_text(json.dumps(config))
  # As a run on another base would have written it: its checksums whole.
  checkpoints.write_manifest(str(run / "checkpoints" / "2"))

  copy = locate(str(run))
  check = lambda step: checkpoints.check_shapes(
      copy, step, evaluator.target, "the adapters", evaluator.base.record)
  check(3)
  with pytest.raises(checkpoints.CheckpointInputError) as raised:
    check(2)
  (line,) = _lines(raised.value)
  assert (f"checkpoint step 2 in {run / 'checkpoints'}" in line and "ffffffffffffffff" in line
          and evaluator.base.record["sha256"][:16] in line and "expected the base" in line)

  # The binary checks every selected step before it writes anything (`ksjax.errors` makes the
  # error its one line on stderr, exit status 2).
  with pytest.raises(checkpoints.CheckpointInputError, match="checkpoint step 2 in "):
    runner.run(_config(run, steps="all"))
  assert not (run / "eval").exists()


def _full_run(run: pathlib.Path, llama: model.Llama) -> pathlib.Path:
  """A run directory whose step 1 holds every parameter of `llama`, as a full fine-tuning run's
  checkpoint does (the state item's params; the rest of its TrainState is not read)."""
  iterator = grain.MapDataset.range(4).to_iter_dataset().__iter__()
  saver = checkpoints.Checkpointer(str(run / "checkpoints"), save_every=1, keep=1,
                                   use_async=False)
  saver.save(1, {"params": nnx.state(llama)}, iterator, {"note": "full fine-tuning"})
  saver.close()
  return run


def test_lora_and_full_fine_tuning_checkpoints_are_not_mistaken(lora_run, evaluator, tmp_path):
  # The LoRA run's checkpoint read as a full fine-tuning run's (config.run.lora left at 0).
  full_fine_tuning = _evaluator(lora_run, tmp_path / "full_out", lora_fields={})
  assert full_fine_tuning.base is None
  with pytest.raises(checkpoints.CheckpointInputError) as raised:
    full_fine_tuning.check(3)
  (line,) = _lines(raised.value)
  assert "checkpoint step 3" in line and "it holds LoRA adapters" in line

  # A full fine-tuning run's checkpoint read with config.run.lora: every parameter but no adapter.
  full = _full_run(tmp_path / "full", _base(evaluator.settings,
                                            evaluator.task.tokenizer.vocab_size))
  with pytest.raises(checkpoints.CheckpointInputError) as raised:
    checkpoints.check_shapes(locate(str(full)), 1, evaluator.target, "the LoRA adapters",
                             evaluator.base.record)
  (line,) = _lines(raised.value)
  assert ("checkpoint step 1" in line and "_lora_a" in line
          and "it holds a whole model" in line and "config.run.lora.rank=0" in line)


def test_an_adapter_start_of_another_base_or_settings_is_refused_with_one_line(lora_run,
                                                                               evaluator):
  """The start's adapters read onto a base of another sha256, or with config.run.lora of
  another alpha than the run's: either computes another policy, so the start is refused."""
  base = evaluator.base
  for other, expected in (
      (dataclasses.replace(base, record={**base.record, "sha256": "e" * 64}), "eeeeeeeeeeeeeeee"),
      (dataclasses.replace(base, spec=dataclasses.replace(base.spec, alpha=2.0)), "alpha=2.0")):
    with pytest.raises(checkpoints.CheckpointInputError) as raised:
      runner.load_policy(str(lora_run / "start"), "the start", evaluator.cfg, evaluator.mesh,
                         other)
    (line,) = _lines(raised.value)
    assert line.startswith("the start") and expected in line
  assert "alpha=8.0" in line  # the run's, which the start records
