"""The sampler against the model's own full forward: log-probs, cache decoding, stopping, seeds,
shape buckets and bad input. (Parity with transformers: test_sampling_hf.py; meshes:
test_sampling_sharding.py; the drawn distribution: test_sampling_distribution.py.)"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from ksjax import model, sampling
from ksjax.sampling import batching, sampler

CFG = model.preset("tiny", vocab_size=97, max_position_embeddings=64)
PROMPTS = [[5, 17, 3], [8, 1, 2, 9, 33, 4, 60], [70]]  # mixed lengths, one bucket (16)
TEMPERATURE = 0.7
N_NEW = 12
SAMPLED = dict(num_samples=3, max_new_tokens=N_NEW, temperature=TEMPERATURE)


def scaled_llama(cfg: model.LlamaConfig = CFG) -> model.Llama:
  """A tiny random model with weights scaled up so its distributions are not near-uniform."""
  llama = model.Llama(cfg, rngs=nnx.Rngs(0))
  nnx.update(llama, jax.tree.map(lambda x: 3.0 * x, nnx.state(llama)))
  return llama


@pytest.fixture(scope="module")
def llama():
  return scaled_llama()


@pytest.fixture(scope="module")
def sampled(llama):
  return sampling.generate(llama, PROMPTS, seed=3, **SAMPLED)


def completion_mask(out) -> np.ndarray:
  return np.arange(out.tokens.shape[1])[None] < np.asarray(out.lengths)[:, None]


def test_output_shapes_rows_and_padding(sampled):
  rows = len(PROMPTS) * SAMPLED["num_samples"]
  assert sampled.tokens.shape == sampled.logprobs.shape == (rows, N_NEW)
  assert sampled.tokens.dtype == jnp.int32 and sampled.logprobs.dtype == jnp.float32
  np.testing.assert_array_equal(sampled.lengths, N_NEW)  # no EOS configured
  assert not np.asarray(sampled.finished).any()
  np.testing.assert_array_equal(sampled.prompt_lengths, np.repeat([len(p) for p in PROMPTS], 3))
  for r in range(rows):  # prompt-major rows
    prompt = PROMPTS[r // 3]
    np.testing.assert_array_equal(np.asarray(sampled.prompt_tokens[r, -len(prompt):]), prompt)


def test_logprobs_equal_the_full_forward_at_the_same_temperature(llama, sampled):
  tokens, mask = sampled.sequences()
  logp_full, _ = nnx.jit(model.token_logprobs, static_argnames="temperature")(
      llama, tokens, mask, temperature=TEMPERATURE)
  t = sampled.prompt_tokens.shape[1]
  np.testing.assert_allclose(np.asarray(sampled.logprobs), np.asarray(logp_full)[:, t:],
                             atol=1e-4, rtol=0)
  assert np.asarray(sampled.logprobs).min() < -1.0  # not a degenerate (near-greedy) model


@pytest.mark.parametrize("prefill_once", [True, False])
def test_cache_decoding_equals_recomputing_the_full_prefix(llama, prefill_once):
  """The sampler's prefill and decode steps, fed fixed continuation tokens, give the logits of a
  full forward over prompt + continuation at every step."""
  n, steps = 2, 5
  ids = batching.validate_prompts(PROMPTS, CFG.vocab_size)
  batch = batching.pad_prompts(ids, n, batch_shards=1, pad_id=0)
  rows, t = batch.tokens_pt.shape[0] * n, batch.tokens_pt.shape[1]
  continuation = np.random.RandomState(0).randint(0, CFG.vocab_size, (rows, steps)).astype(np.int32)

  prefill = nnx.jit(sampler.prefill_logits, static_argnames=("num_samples", "new_slots",
                                                             "prefill_once"))
  step = nnx.jit(sampler.step_logits)
  logits, prompt, cache, kv_mask, position = prefill(
      llama, batch.tokens_pt, batch.mask_pt, num_samples=n, new_slots=steps,
      prefill_once=prefill_once)
  # One prompt cache per prompt, shared by its n rows (per row without prefill_once).
  assert prompt.mask_pt.shape[0] == (rows // n if prefill_once else rows)
  cached = [logits]
  for i in range(steps):
    logits, cache, kv_mask = step(llama, continuation[:, i], position + i, prompt, cache, i,
                                  kv_mask)
    cached.append(logits)

  full_tokens = np.concatenate([np.repeat(batch.tokens_pt, n, 0), continuation], 1)
  full_mask = np.concatenate([np.repeat(batch.mask_pt, n, 0), np.ones_like(continuation, bool)], 1)
  full = np.asarray(nnx.jit(lambda m, x, k: m(x, attention_mask=k))(llama, full_tokens, full_mask))
  for i, logits in enumerate(cached):
    np.testing.assert_allclose(np.asarray(logits), full[:, t - 1 + i], atol=1e-4, rtol=0,
                               err_msg=f"step {i}")


def test_a_prompt_cache_per_row_gives_the_samples_of_one_per_prompt(llama, sampled):
  """prefill_once=False prefills every row and decodes with a prompt cache per row (n = 1); the
  shared cache of the default gives the same draws."""
  cfg = sampling.SamplerConfig(max_new_tokens=N_NEW, temperature=TEMPERATURE, prefill_once=False)
  out = sampling.sample(llama, PROMPTS, cfg, num_samples=SAMPLED["num_samples"], seed=3)
  np.testing.assert_array_equal(out.tokens, sampled.tokens)
  np.testing.assert_array_equal(out.lengths, sampled.lengths)
  np.testing.assert_allclose(out.logprobs, sampled.logprobs, atol=1e-5, rtol=0)


def test_same_seed_same_samples_other_seed_other_samples(llama, sampled):
  again = sampling.generate(llama, PROMPTS, seed=3, **SAMPLED)
  np.testing.assert_array_equal(again.tokens, sampled.tokens)
  np.testing.assert_array_equal(again.logprobs, sampled.logprobs)
  other = sampling.generate(llama, PROMPTS, seed=4, **SAMPLED)
  assert (np.asarray(other.tokens) != np.asarray(sampled.tokens)).mean() > 0.5
  # The samples of one prompt differ from each other.
  assert (np.asarray(sampled.tokens[0]) != np.asarray(sampled.tokens[1])).any()


def test_prompts_of_other_lengths_in_the_same_bucket_reuse_the_programs(llama, sampled):
  misses = sampler.programs.cache_info().misses
  prompts = [[1] * 16, [2, 3], [4, 5, 6, 7, 8]]  # same count, longest 16: bucket 16
  out = sampling.generate(llama, prompts, seed=3, **SAMPLED)
  assert sampler.programs.cache_info().misses == misses
  assert out.tokens.shape == (9, N_NEW)
  assert out.prompt_tokens.shape[1] == batching.bucket_length(16) == 16


def test_bucket_sizes():
  assert [batching.bucket_length(n) for n in (1, 16, 17, 200, 256, 257, 700)] == [
      16, 16, 32, 256, 256, 512, 768]
  # rows = prompts x samples must split over the batch shards.
  assert batching.bucket_prompt_batch(3, 1, 1) == 4
  assert batching.bucket_prompt_batch(1, 64, 8) == 1
  assert batching.bucket_prompt_batch(3, 2, 8) == 4
  assert batching.bucket_prompt_batch(5, 1, 8) == 8
  assert batching.bucket_prompt_batch(2, 3, 6) == 2


def test_eos_ids_and_stop_sequences_end_rows_early(llama, sampled):
  """Draws do not depend on the stop settings (per-row, per-step keys), so the run with stops
  must be a prefix of the run without them, cut at the first EOS id or stop sequence."""
  free = np.asarray(sampled.tokens)
  eos = (int(free[0, 4]), int(free[4, 2]))  # any of several EOS ids
  stop = (int(free[7, 5]), int(free[7, 6]))
  out = sampling.generate(llama, PROMPTS, seed=3, eos_id=eos, stop_sequences=[stop], **SAMPLED)

  for r in range(free.shape[0]):
    ends = [j + 1 for j in range(N_NEW) if free[r, j] in eos]
    ends += [j + 1 for j in range(1, N_NEW) if tuple(free[r, j - 1:j + 1]) == stop]
    length = min(ends, default=N_NEW)
    assert int(out.lengths[r]) == length, r
    assert bool(out.finished[r]) == bool(ends), r
    np.testing.assert_array_equal(np.asarray(out.tokens[r, :length]), free[r, :length])
    np.testing.assert_array_equal(np.asarray(out.tokens[r, length:]), 0)  # pad_id
    np.testing.assert_array_equal(np.asarray(out.logprobs[r, length:]), 0.0)
    np.testing.assert_allclose(np.asarray(out.logprobs[r, :length]),
                               np.asarray(sampled.logprobs[r, :length]), atol=1e-6)
  assert int(out.lengths[0]) <= 5 and int(out.lengths[4]) <= 3 and int(out.lengths[7]) <= 7


def test_decode_loop_exits_when_every_row_is_done(llama, sampled):
  """Every row's first token is an EOS id: the loop must stop after one step, not run N."""
  eos = tuple(int(x) for x in np.asarray(sampled.tokens[:, 0]))
  cfg = sampling.SamplerConfig(max_new_tokens=N_NEW, temperature=TEMPERATURE, eos_id=eos)
  n = SAMPLED["num_samples"]
  batch = batching.pad_prompts(batching.validate_prompts(PROMPTS, CFG.vocab_size), n, 1, 0)
  shapes = sampler.Shapes(batch.tokens_pt.shape[0], n, batch.tokens_pt.shape[1])
  graphdef, params = nnx.split(llama)
  prefill, decode = sampler.programs(graphdef, cfg, sampler.model_mesh(llama), shapes)
  rows = len(PROMPTS) * n
  prompt, state = prefill(params, batch.tokens_pt, batch.mask_pt, np.int32(rows), np.uint32(3))
  state = decode(params, prompt, state, np.int32(-1))
  assert int(state.step) == 1
  np.testing.assert_array_equal(state.lengths_b[:rows], 1)
  assert np.asarray(state.done_b).all() and np.asarray(state.finished_b[:rows]).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), r"prompts\[1\]"),
    (dict(prompts=[[1, 2], [3, 97]]), r"prompts\[1\] has token id 97"),
    (dict(prompts=[[1, 2], [-1]]), r"prompts\[1\] has token id -1"),
    (dict(prompts=[list(range(64))]), r"prompts\[0\] has 64 tokens"),
    (dict(prompts=[[1] * 60], max_new_tokens=5), "max_new_tokens=5 is past the context"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(num_samples=0), "num_samples=0"),
    (dict(eos_id=97), "eos_id has token id 97"),
    (dict(eos_id="</s>"), "eos_id="),
    (dict(stop_sequences=[[]]), r"stop_sequences\[0\]"),
    (dict(seed=-1), "seed=-1"),
])
def test_bad_input_raises_one_clear_error(llama, kwargs, match):
  kwargs = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    sampling.generate(llama, kwargs.pop("prompts"), **kwargs)


def shrinking_case(llama, mesh=None, compact_rows=2):
  """4 prompts x 8 samples with EOS ids drawn from a free run, so rows end at many different
  steps; returns (output, batch sizes the decode loop shrank to)."""
  prompts = PROMPTS + [[11, 12, 13, 14]]
  free = sampling.sample(llama, prompts, sampling.SamplerConfig(
      max_new_tokens=N_NEW, temperature=TEMPERATURE, compact_rows=0), num_samples=8, seed=5)
  tokens = np.asarray(free.tokens)
  eos = tuple(sorted({int(tokens[r, r % N_NEW]) for r in range(0, 32, 3)}))
  cfg = sampling.SamplerConfig(max_new_tokens=N_NEW, temperature=TEMPERATURE, eos_id=eos,
                               compact_rows=compact_rows)
  shrunk = []
  original = sampler.compact_program

  def counting(m):
    program = original(m)
    def compact(prompt, ds, keep):
      shrunk.append(len(keep))
      return program(prompt, ds, keep)
    return compact

  sampler.compact_program = counting
  try:
    out = sampling.sample(llama, prompts, cfg, num_samples=8, seed=5, mesh=mesh)
  finally:
    sampler.compact_program = original
  return out, shrunk


@pytest.mark.slow  # the default suite shrinks on a mesh against the unsharded samples
# (tests/sampling/test_sharding.py::test_shrinking_on_a_mesh_gives_the_unsharded_samples)
def test_shrinking_the_decode_batch_changes_no_sample(llama):
  whole, never = shrinking_case(llama, compact_rows=0)
  out, shrunk = shrinking_case(llama)
  assert never == [] and len(shrunk) >= 2 and shrunk == sorted(shrunk, reverse=True), shrunk
  assert min(shrunk) < 32 // 4  # it went down past a quarter of the batch
  lengths = np.asarray(whole.lengths)
  assert len(set(lengths.tolist())) >= 4 and lengths.max() == N_NEW  # rows end at many steps
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_array_equal(out.lengths, whole.lengths)
  np.testing.assert_array_equal(out.finished, whole.finished)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-6, rtol=0)


def test_compact_rows_is_validated():
  with pytest.raises(ValueError, match="compact_rows=-1 is not accepted"):
    sampling.SamplerConfig(compact_rows=-1)


def test_shrunk_rows_halves_while_the_running_rows_fit():
  assert sampler.shrunk_rows(128, 40, 8, 1) == 64
  assert sampler.shrunk_rows(128, 3, 8, 1) == 8
  assert sampler.shrunk_rows(128, 64, 8, 1) == 64
  assert sampler.shrunk_rows(128, 65, 8, 1) == 128
  assert sampler.shrunk_rows(32, 1, 8, 16) == 16  # a half must split over the batch shards
  assert sampler.shrunk_rows(24, 1, 1, 1) == 3


def test_phase_slots_bound_each_phase_and_end_at_all_slots():
  assert sampler.phase_slots(96, 3) == (96,)  # up to 97 new tokens: one loop
  assert sampler.phase_slots(97, 3) == (64, 97)
  assert sampler.phase_slots(255, 3) == (64, 128, 255)
  assert sampler.phase_slots(1023, 3) == (256, 512, 1023)
  assert sampler.phase_slots(1023, 5) == (64, 128, 256, 512, 1023)
  assert sampler.phase_slots(1023, 1) == (1023,)
  for slots in range(1, 600):
    for phases in (1, 2, 3, 6):
      bounds = sampler.phase_slots(slots, phases)
      assert bounds[-1] == slots and len(bounds) <= phases
      assert all(b % 16 == 0 and b >= 64 and b + 16 <= c for b, c in zip(bounds, bounds[1:]))


@pytest.fixture(scope="module")
def long_llama():
  """The tiny random model with room for 120 new tokens."""
  return scaled_llama(model.preset("tiny", vocab_size=97, max_position_embeddings=144))


# Phases with compaction (compact_rows=2) is slow, so that CI keeps under its 20 minutes; the
# default suite decodes in phases here (0) and compacts on a mesh (tests/sampling/test_sharding.py).
@pytest.mark.parametrize("compact_rows", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_decoding_in_phases_changes_no_sample(long_llama, compact_rows, monkeypatch):
  """120 new tokens (119 slots: phases of 64 and 119 slots) with an EOS id drawn from a free run,
  so rows end inside both phases and, with compact_rows=2, the batch shrinks while decoding in
  phases: the same tokens as one loop over all slots, and the log-probs of the model's full
  forward."""
  n_new = 120
  llama = long_llama
  prompts = PROMPTS + [[11, 12, 13, 14]]
  one_loop = dict(max_new_tokens=n_new, temperature=TEMPERATURE, compact_rows=0, cache_phases=1)
  free = sampling.sample(llama, prompts, sampling.SamplerConfig(**one_loop), num_samples=8,
                         seed=5)
  tokens = np.asarray(free.tokens)
  eos = (int(tokens[0, 90]),)  # one id of 97: rows end at many steps, some never
  whole = sampling.sample(llama, prompts, sampling.SamplerConfig(**one_loop, eos_id=eos),
                          num_samples=8, seed=5)
  phased_cfg = sampling.SamplerConfig(**{**one_loop, "compact_rows": compact_rows,
                                         "cache_phases": 3}, eos_id=eos)
  assert sampler.phase_slots(sampler.new_slots(phased_cfg), 3) == (64, 119)
  shrinks = []  # the batch sizes the decode loop shrank to
  original = sampler.compact_program
  monkeypatch.setattr(sampler, "compact_program", lambda mesh: (
      lambda prompt, ds, keep: shrinks.append(len(keep)) or original(mesh)(prompt, ds, keep)))
  out = sampling.sample(llama, prompts, phased_cfg, num_samples=8, seed=5)
  assert bool(shrinks) == bool(compact_rows), shrinks
  lengths = np.asarray(whole.lengths)
  assert (lengths < 64).any() and ((lengths > 65) & (lengths < n_new)).any(), lengths
  assert (lengths == n_new).any(), lengths
  np.testing.assert_array_equal(out.tokens, whole.tokens)
  np.testing.assert_array_equal(out.lengths, whole.lengths)
  np.testing.assert_array_equal(out.finished, whole.finished)
  np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-5, rtol=0)
  seq, mask = out.sequences()
  logp_full, _ = nnx.jit(model.token_logprobs, static_argnames="temperature")(
      llama, seq, mask, temperature=TEMPERATURE)
  t = out.prompt_tokens.shape[1]
  done = completion_mask(out)
  np.testing.assert_allclose(np.asarray(out.logprobs)[done], np.asarray(logp_full)[:, t:][done],
                             atol=1e-4, rtol=0)


def test_cache_phases_is_validated():
  with pytest.raises(ValueError, match="cache_phases=0 is not accepted"):
    sampling.SamplerConfig(cache_phases=0)
