"""Batched generation with a preallocated KV cache: one jitted prefill, one jitted decode loop.

Layout of a run (P' prompts after bucketing, n samples each, R = P * n real rows of B = P' * n,
T the bucketed prompt length, N = max_new_tokens, S = max(N - 1, 1) generated slots):

  rows        row p * n + s is sample s of prompt p (prompt-major); rows >= R are padding, finished
              before the first step.
  caches      two: the prompts' (`PromptCache`, keys [P', K, H, T], one copy per prompt, shared
              by its n rows and only read while decoding) and the rows' own (`DecodeState.cache`,
              keys [B, K, H, S]) of the tokens they generate. A decode step attends both in one
              softmax (`layers.attend_shared_prompt`): a prompt's keys and values are read once
              per group of n rows, not once per row, which at long prompts is most of a step's
              memory traffic, and the cache is n times smaller in its prompt part.
  slots       generated token i - 1 is fed back, and written to the row's slot i - 1, by the step
              that samples token i; the last token is never fed back, hence N - 1 slots.
  positions   prompt token j of a row has RoPE position cumsum(mask)[j] - 1, so a prompt of length
              L sits at 0..L-1 whatever its padding, and generated token i at L + i.
  masks       the prompt's mask [P', T] (its real tokens), and kv_mask [B, S] on a row's slots
              written so far: the step that writes slot i - 1 switches it on.

Shrinking: when at most half of the rows are still running, the loop exits, the running rows are
gathered into a batch half as large (or smaller; `SamplerConfig.compact_rows` is the floor) and
the loop resumes on it (`decode_compacting`), so finished rows stop costing decode steps. The
moved rows take a copy of their prompt's cache each (n = 1 from then on: groups no longer line
up), so a shrink trades the prompt's sharing for fewer rows. On one process only: elsewhere the
whole batch runs until every row is done.

Phases: step i writes slot i - 1, so early steps have written few of the S slots. The decode
program runs up to `SamplerConfig.cache_phases` loops one after another (`phase_slots`: about
S/4, S/2 and S slots for 3), each carrying a copy of only the slots it can write and attending
those, then writing them back; a loop over all S slots would read every unwritten slot at every
step. Each phase is its own compiled loop body; generations of at most 97 tokens take one.

The prefill runs the model over the [P', T] prompt batch in one call, keeps the logits of the last
position only (`Llama.prefill`, so [P', T, V] never exists), gives each prompt's cache and
logits to its n rows, and samples token 0. `prefill_once=True` prefills each prompt once, and its
cache serves its n rows; False repeats the prompts and prefills every row (n times the prefill
compute, and a prompt cache per row: n = 1). Both give the same samples; benchmarks/sampling.py
times them. The decode program is one `lax.while_loop` that samples tokens 1..N-1 and exits as
soon as every row is done (EOS, a stop sequence, or N tokens). Its state, the rows' cache
included, is donated, so that cache exists once; the prompt cache is an argument it only reads.

Randomness: row r has key fold_in(key(seed), r) and draws step i with fold_in(that key, i). A row's
samples depend on (seed, r, its prompt) only, not on the batch padding, the bucket or the mesh.
`sample(..., keys_from=)` gives each prompt's rows the keys of another call's rows instead
(`row_keys`), so one call can draw what several would have.

Sharding: rows over ("data", "fsdp"), kv heads over "tensor" (`sharding.cache_sharding`), fixed by
the programs' out_shardings (the prompt cache's prompts too where the batch shards divide P',
else replicated over them) and held inside the loop by sharding constraints; parameters keep the
partition specs of `sharding.state_shardings`. The mesh has Auto axes (see model/sharding.py), so
the partitioner inserts the collectives. The prefill is traced under the mesh, so the model's
activation constraints hold its rows over ("data", "fsdp") and XLA gathers each fsdp-split weight;
traced without it, XLA kept the weights split and all-reduced each MLP product's activations
whole on every device (docs/scaling.md). The decode step is not: a token per row, its
all-reduced activations are smaller than the weights a gather would move at every step.

Compiled programs are cached per (model structure, SamplerConfig, mesh, Shapes); the buckets of
batching.py bound the number of Shapes a run meets.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ksjax.model import Cache, Llama, LlamaConfig, default_positions, init_cache, sharding
from ksjax.model.llama import MATMUL_WEIGHTS, cast_matmul_weights
from ksjax.sampling import batching
from ksjax.sampling.config import SamplerConfig
from ksjax.sampling.distribution import choose


@flax.struct.dataclass
class PromptCache:
  """The prompts' keys and values, one copy per prompt, shared by its rows (read-only)."""
  cache: Cache               # {"k": L x [P', K, H, T], "v": L x [P', K, T, H]}
  mask_pt: jax.Array         # bool [P', T], the prompt's real tokens


@flax.struct.dataclass
class DecodeState:
  """Everything the decode loop carries (donated between prefill and decode)."""
  cache: Cache               # the rows' own: {"k": L x [B, K, H, S], "v": L x [B, K, S, H]}
  kv_mask_bs: jax.Array      # bool [B, S], generated slots written so far
  position_b: jax.Array      # int32 [B], RoPE position of the next token fed back
  tokens_bn: jax.Array       # int32 [B, N], pad_id where not generated
  logprobs_bn: jax.Array     # float32 [B, N], 0 where not generated
  lengths_b: jax.Array       # int32 [B], tokens generated (incl. EOS / stop sequence)
  finished_b: jax.Array      # bool [B], stopped by EOS or a stop sequence
  done_b: jax.Array          # bool [B], finished, N tokens generated, or a padding row
  keys_b: jax.Array          # PRNG key [B], the row's base key
  step: jax.Array            # int32 [], tokens sampled so far


@flax.struct.dataclass
class SampleOutput:
  """What `generate` returns; R = P * num_samples rows, prompt-major (row p * n + s).

  Past a row's `lengths`, `tokens` hold `pad_id` and `logprobs` 0. `logprobs[r, j]` is the log-prob
  of `tokens[r, j]` under the distribution it was drawn from (see distribution.py: after temperature,
  top-k and top-p; for greedy the model's log-prob at temperature 1).
  """
  tokens: jax.Array          # int32 [R, N]
  lengths: jax.Array         # int32 [R]
  logprobs: jax.Array        # float32 [R, N]
  finished: jax.Array        # bool [R], hit an EOS id or a stop sequence
  prompt_tokens: jax.Array   # int32 [R, T], the row's prompt, left-padded with pad_id
  prompt_lengths: jax.Array  # int32 [R]

  def sequences(self) -> tuple[jax.Array, jax.Array]:
    """Prompt and completion as one left-padded batch (what the trainer scores).

    Returns tokens int32 [R, T + N] and mask bool [R, T + N]. Completion token j is column T + j,
    so `model.token_logprobs(llama, tokens, mask, temperature)[:, T + j]` recomputes
    `logprobs[:, j]` (exactly so without top-k/top-p truncation).
    """
    t = self.prompt_tokens.shape[1]
    n = self.tokens.shape[1]
    prompt_mask_rt = jnp.arange(t)[None, :] >= t - self.prompt_lengths[:, None]
    completion_mask_rn = jnp.arange(n)[None, :] < self.lengths[:, None]
    return (jnp.concatenate([self.prompt_tokens, self.tokens], axis=1),
            jnp.concatenate([prompt_mask_rt, completion_mask_rn], axis=1))


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The array shapes of one compiled prefill/decode pair."""
  prompt_rows: int  # P', bucketed number of prompts
  num_samples: int  # n
  prompt_len: int   # T, bucketed prompt length

  @property
  def rows(self) -> int:
    return self.prompt_rows * self.num_samples


# ---------------------------------------------------------------------------------------------
# The model calls (pure; the test of cache decoding drives them directly)
# ---------------------------------------------------------------------------------------------

def prefill_logits(llama: Llama, tokens_pt: jax.Array, mask_pt: jax.Array, *, num_samples: int,
                   new_slots: int, prefill_once: bool = True):
  """Runs the prompts [P', T] through the model; their cache serves each prompt's n rows.

  Returns next-token logits float32 [B, V], the `PromptCache` (P' prompts; B of them, one per
  row, with prefill_once=False), the rows' empty cache (`model.Cache` with S = new_slots) and its
  mask bool [B, S] (all False), and the position of the next token int32 [B];
  B = P' * num_samples.
  """
  repeat = functools.partial(jnp.repeat, repeats=num_samples, axis=0)
  positions_pt = default_positions(mask_pt)
  if not prefill_once:
    tokens_pt, mask_pt, positions_pt = repeat(tokens_pt), repeat(mask_pt), repeat(positions_pt)
  hidden_ptd, cache = llama.prefill(tokens_pt, positions_pt, mask_pt)
  logits_pv = llama.logits(hidden_ptd[:, -1:])[:, 0]
  prompt = PromptCache(cache=cache, mask_pt=mask_pt)
  if prefill_once:
    logits_pv, positions_pt = repeat(logits_pv), repeat(positions_pt)
  b = logits_pv.shape[0]
  return (logits_pv, prompt, init_cache(llama.cfg, b, new_slots), jnp.zeros((b, new_slots), bool),
          positions_pt[:, -1] + 1)


def step_logits(llama: Llama, token_b: jax.Array, position_b: jax.Array, prompt: PromptCache,
                cache: Cache, slot: jax.Array, kv_mask_bs: jax.Array, rope_table=None,
                weights_t=None):
  """Feeds one token per row, written to the row's cache `slot`; returns next-token logits
  float32 [B, V], the rows' cache and their kv mask with `slot` switched on. `rope_table`,
  `weights_t`: see `Llama.forward_shared`."""
  b = token_b.shape[0]
  kv_mask_bs = jax.lax.dynamic_update_slice(kv_mask_bs, jnp.ones((b, 1), bool), (0, slot))
  logits_bv, cache = llama.forward_shared(token_b, position_b, prompt.cache, prompt.mask_pt,
                                          cache, slot, kv_mask_bs, rope_table, weights_t)
  return logits_bv, cache, kv_mask_bs


MIN_PHASE_SLOTS = 64  # the shortest phase of the decode loop (`phase_slots`)


def phase_slots(slots: int, phases: int) -> tuple[int, ...]:
  """The slots each phase of the decode loop attends (`SamplerConfig.cache_phases`): about
  slots / 2**j for j = phases - 1, ..., 0, rounded up to a multiple of 16, distinct, increasing,
  the last one `slots`; a phase shorter than 64 slots, or within 16 slots of the next, is
  dropped: each phase compiles its own loop body, and below that the saving did not pay for it
  (at the evaluation's 2 x 64 rows x 80 tokens, phases of 32, 48 and 79 slots were no faster and
  compiled longer). So generations of at most 97 tokens take one loop.

  Why: step i of a row writes slot i - 1 and attends the slots written so far, but a loop over
  all S slots reads all of them at every step: with many new tokens (SmolLM2's 64 rows x 256)
  the rows' own attention over slots mostly unwritten early on is a sizeable share of a decode
  step (benchmarks/real_model.py --parts=phases times phases against one loop, the first call's
  compilation included). Masked slots add exact zeros,
  so a phase changes a step's values only by the summation order over fewer slots."""
  bounds = sorted({min(slots, -(-slots // (2 ** j * 16)) * 16) for j in range(phases)})
  kept = [slots]
  for bound in reversed(bounds):
    if MIN_PHASE_SLOTS <= bound <= kept[0] - 16:
      kept.insert(0, bound)
  return tuple(kept)


def slot_view(cache: Cache, live: int) -> Cache:
  """The first `live` slots of the rows' cache (keys [B, K, H, live], values [B, K, live, H])."""
  return {"k": [k[..., :live] for k in cache["k"]], "v": [v[:, :, :live] for v in cache["v"]]}


def slot_write_back(cache: Cache, view: Cache) -> Cache:
  """`cache` with its first slots replaced by `view` (`slot_view`'s layout)."""
  return {"k": [jax.lax.dynamic_update_slice(k, kv, (0, 0, 0, 0))
                for k, kv in zip(cache["k"], view["k"])],
          "v": [jax.lax.dynamic_update_slice(v, vv, (0, 0, 0, 0))
                for v, vv in zip(cache["v"], view["v"])]}


def new_slots(cfg: SamplerConfig) -> int:
  """S, the slots of a row's own cache: one per generated token that is fed back (N - 1), at
  least one (the decode program is traced even when N = 1 leaves it nothing to do)."""
  return max(cfg.max_new_tokens - 1, 1)


# ---------------------------------------------------------------------------------------------
# Bookkeeping of the loop
# ---------------------------------------------------------------------------------------------

def stop_hit(tokens_bn: jax.Array, token_b: jax.Array, i: jax.Array,
             cfg: SamplerConfig) -> jax.Array:
  """bool [B]: token i (just written to `tokens_bn`) is an EOS id or ends a stop sequence."""
  hit_b = jnp.isin(token_b, jnp.asarray(cfg.eos_id, jnp.int32))
  n_new = tokens_bn.shape[1]
  for seq in cfg.stop_sequences:
    m = len(seq)
    if m > n_new:  # cannot fit in the completion
      continue
    window_bm = jax.lax.dynamic_slice_in_dim(tokens_bn, jnp.maximum(i - m + 1, 0), m, axis=1)
    hit_b |= jnp.all(window_bm == jnp.asarray(seq, jnp.int32), axis=1) & (i + 1 >= m)
  return hit_b


def sample_and_record(ds: DecodeState, logits_bv: jax.Array, cfg: SamplerConfig) -> DecodeState:
  """Draws token `ds.step` of every row that is not done and records it."""
  i = ds.step
  keys_b = jax.vmap(jax.random.fold_in, (0, None))(ds.keys_b, i)
  token_b, logp_b = choose(logits_bv, keys_b, cfg)
  active_b = ~ds.done_b
  token_b = jnp.where(active_b, token_b, cfg.pad_id)
  logp_b = jnp.where(active_b, logp_b, 0.0)
  tokens_bn = jax.lax.dynamic_update_index_in_dim(ds.tokens_bn, token_b, i, axis=1)
  logprobs_bn = jax.lax.dynamic_update_index_in_dim(ds.logprobs_bn, logp_b, i, axis=1)
  hit_b = active_b & stop_hit(tokens_bn, token_b, i, cfg)
  return ds.replace(
      tokens_bn=tokens_bn,
      logprobs_bn=logprobs_bn,
      lengths_b=jnp.where(active_b, i + 1, ds.lengths_b),
      finished_b=ds.finished_b | hit_b,
      done_b=ds.done_b | hit_b | (i + 1 >= tokens_bn.shape[1]),
      step=i + 1,
  )


def state_shardings(mesh: Mesh) -> DecodeState:
  """NamedShardings of every DecodeState field: rows over the batch axes, kv heads over tensor."""
  rows = sharding.batch_sharding(mesh, 1)
  matrix = sharding.batch_sharding(mesh, 2)
  return DecodeState(cache=sharding.cache_sharding(mesh), kv_mask_bs=matrix, position_b=rows,
                     tokens_bn=matrix, logprobs_bn=matrix, lengths_b=rows, finished_b=rows,
                     done_b=rows, keys_b=rows, step=NamedSharding(mesh, P()))


def prompt_shardings(mesh: Mesh, prompts: int) -> PromptCache:
  """NamedShardings of a PromptCache of `prompts` prompts: prompts over the batch axes where they
  divide evenly (else replicated over them), kv heads over tensor."""
  if prompts % sharding.batch_shards(mesh) == 0:
    return PromptCache(cache=sharding.cache_sharding(mesh), mask_pt=sharding.batch_sharding(mesh))
  spec = NamedSharding(mesh, P(None, "tensor", None, None))
  return PromptCache(cache={"k": spec, "v": spec}, mask_pt=NamedSharding(mesh, P()))


# ---------------------------------------------------------------------------------------------
# Compiled programs
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def programs(graphdef: nnx.GraphDef, cfg: SamplerConfig, mesh: Mesh, shapes: Shapes):
  """The jitted (prefill, decode) pair for one model structure, config, mesh and shape bucket.

  prefill(params, tokens_pt, mask_pt, num_rows, seed, index_b=None) -> (PromptCache, DecodeState
  after token 0), row b drawing with the key fold_in(key(seed), b), or with per-row arrays seed
  uint32 [B] and index_b int32 [B] fold_in(key(seed[b]), index_b[b]) (`row_keys`);
  decode(params, prompt, state, stop_at) -> DecodeState when every row is done, or as soon as at
  most `stop_at` rows are still running (int32; -1: only when every row is done). State donated.
  """
  n_new = cfg.max_new_tokens
  prompts = shapes.prompt_rows if cfg.prefill_once else shapes.rows
  out_shardings = (prompt_shardings(mesh, prompts), state_shardings(mesh))

  def prefill(params, tokens_pt, mask_pt, num_rows, seed, index_b=None):
    llama = nnx.merge(graphdef, params)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # activation shardings
      logits_bv, prompt, cache, kv_mask_bs, position_b = prefill_logits(
          llama, tokens_pt, mask_pt, num_samples=shapes.num_samples, new_slots=new_slots(cfg),
          prefill_once=cfg.prefill_once)
    b = shapes.rows
    row_b = jnp.arange(b)
    ds = DecodeState(
        cache=cache, kv_mask_bs=kv_mask_bs, position_b=position_b,
        tokens_bn=jnp.full((b, n_new), cfg.pad_id, jnp.int32),
        logprobs_bn=jnp.zeros((b, n_new), jnp.float32),
        lengths_b=jnp.zeros((b,), jnp.int32), finished_b=jnp.zeros((b,), bool),
        done_b=row_b >= num_rows,
        keys_b=(jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), row_b)
                if index_b is None else
                jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed, index_b)),
        step=jnp.int32(0))
    return prompt, sample_and_record(ds, logits_bv, cfg)

  return (jax.jit(prefill, out_shardings=out_shardings), decode_program(graphdef, cfg, mesh))


@functools.lru_cache(maxsize=64)
def decode_program(graphdef: nnx.GraphDef, cfg: SamplerConfig, mesh: Mesh):
  """The jitted decode loop (see `programs`); it compiles once per shape (rows, prompts and
  prompt length) and prompt-cache sharding it is given. Its optional last argument, the
  transposed weights of `weights_first` (None: none), serves a batch of at most
  `cfg.weights_first_rows` rows."""
  n_new = cfg.max_new_tokens
  out_shardings = state_shardings(mesh)

  def decode(params, prompt: PromptCache, ds: DecodeState, stop_at,
             weights_t=None) -> DecodeState:
    llama = nnx.merge(graphdef, params)
    if ds.done_b.shape[0] > cfg.weights_first_rows:
      weights_t = None  # too many rows: the plain products are as fast or faster
    # A row's positions run from its prompt's length (at most the padded length T) to T + N - 1.
    rope_table = llama.rope_table(prompt.mask_pt.shape[1] + n_new)

    def cond(live):
      def go_on(ds):
        running = jnp.sum(~ds.done_b)
        # the step writes slot step - 1, so a phase of `live` slots runs steps up to `live`
        return (ds.step < n_new) & (ds.step <= live) & (running > 0) & (running > stop_at)
      return go_on

    def body(ds):
      token_b = jax.lax.dynamic_index_in_dim(ds.tokens_bn, ds.step - 1, axis=1, keepdims=False)
      logits_bv, cache, kv_mask_bs = step_logits(llama, token_b, ds.position_b, prompt, ds.cache,
                                                 ds.step - 1, ds.kv_mask_bs, rope_table,
                                                 weights_t)
      ds = ds.replace(cache=cache, kv_mask_bs=kv_mask_bs, position_b=ds.position_b + 1)
      return jax.lax.with_sharding_constraint(sample_and_record(ds, logits_bv, cfg),
                                              out_shardings)

    slots = new_slots(cfg)
    for live in phase_slots(slots, cfg.cache_phases):
      if live == slots:
        ds = jax.lax.while_loop(cond(live), body, ds)
        continue
      # The phase's rows attend their first `live` slots only: a copy of those slots (the rest
      # are unwritten, masked off) carried through the phase's loop, then written back.
      phase = jax.lax.while_loop(cond(live), body, ds.replace(
          cache=slot_view(ds.cache, live), kv_mask_bs=ds.kv_mask_bs[:, :live]))
      ds = phase.replace(cache=slot_write_back(ds.cache, phase.cache),
                         kv_mask_bs=ds.kv_mask_bs.at[:, :live].set(phase.kv_mask_bs))
    return ds

  return jax.jit(decode, out_shardings=out_shardings, donate_argnums=2)


def forget_programs() -> None:
  """Drops the jitted programs `programs` and `decode_program` keep, so that the next call
  traces and compiles anew (the memory plan's test measures what a fresh compile holds)."""
  programs.cache_clear()
  decode_program.cache_clear()


@functools.lru_cache(maxsize=64)
def compact_program(mesh: Mesh):
  """compact(prompt, state, keep) -> the prompt cache and state of rows `keep` (int32 [B'], in
  that order), each row with its own copy of its prompt's cache (n = 1: rows of one prompt no
  longer sit together). B' must split over the batch shards (`shrunk_rows` sees to it)."""
  def compact(prompt: PromptCache, ds: DecodeState, keep_b):
    take = lambda x, index: jnp.take(x, index, axis=0)
    prompt_b = keep_b // (ds.done_b.shape[0] // prompt.mask_pt.shape[0])
    prompt = jax.tree.map(lambda x: take(x, prompt_b), prompt)
    ds = jax.tree.map(lambda x: take(x, keep_b), ds.replace(step=None)).replace(step=ds.step)
    return prompt, ds  # every row field

  rows_split = prompt_shardings(mesh, sharding.batch_shards(mesh))  # B' splits over the shards
  return jax.jit(compact, out_shardings=(rows_split, state_shardings(mesh)))


def shrunk_rows(rows: int, running: int, floor: int, batch_shards: int) -> int:
  """The batch the running rows move to: `rows` halved while the half still holds every running
  row, stays >= floor and splits over the batch shards; `rows` itself when it cannot halve."""
  while rows // 2 >= max(running, floor, 1) and (rows // 2) % batch_shards == 0 and rows % 2 == 0:
    rows //= 2
  return rows


def decode_compacting(decode, compact, params, prompt: PromptCache, ds: DecodeState, *,
                      floor: int, batch_shards: int) -> dict[str, np.ndarray]:
  """Runs `decode` to the end, moving the running rows into a smaller batch whenever at most
  half of the batch is running (`shrunk_rows`). Returns the outputs of every original row, on
  the host: {"tokens", "logprobs", "lengths", "finished"} ([B, N], [B, N], [B], [B]).

  Why the result is the same as one loop over the whole batch: a row's draws depend on its own
  key and the step only (both move with the row), a finished row is never changed again, and the
  decode step treats rows independently, so moving rows changes nothing but the batch size the
  matmuls see (which can change their last bits). Each shrink costs one host read of the done
  flags and one gather of the running rows' state and prompt caches; the compiled decode loop is
  reused per batch size.
  """
  rows = ds.done_b.shape[0]
  out = {"tokens": np.asarray(ds.tokens_bn).copy(), "logprobs": np.asarray(ds.logprobs_bn).copy(),
         "lengths": np.asarray(ds.lengths_b).copy(), "finished": np.asarray(ds.finished_b).copy()}
  origin = np.arange(rows)  # the original row of each row of the current batch; -1: filler

  def record(ds, which):
    src = {"tokens": ds.tokens_bn, "logprobs": ds.logprobs_bn, "lengths": ds.lengths_b,
           "finished": ds.finished_b}
    for name, value in src.items():
      out[name][origin[which]] = np.asarray(value)[which]

  while True:
    b = origin.size
    half = shrunk_rows(b, b // 2, floor, batch_shards)
    ds = decode(params, prompt, ds, np.int32(half if half < b else -1))
    done = np.asarray(ds.done_b)
    if done.all() or int(ds.step) >= out["tokens"].shape[1]:
      record(ds, origin >= 0)
      return out
    running = np.flatnonzero(~done)
    new_rows = shrunk_rows(b, running.size, floor, batch_shards)
    record(ds, done & (origin >= 0))
    fillers = np.flatnonzero(done)[:new_rows - running.size]
    keep = np.concatenate([running, fillers]).astype(np.int32)
    prompt, ds = compact(prompt, ds, keep)
    origin = np.concatenate([origin[running], np.full(fillers.size, -1)])


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def model_mesh(llama: Llama) -> Mesh:
  """The ("data", "fsdp", "tensor") mesh the parameters live on; a 1x1x1 mesh of their device
  when they are not sharded."""
  leaf = jax.tree.leaves(nnx.state(llama))[0]
  if isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh.axis_names == sharding.AXES:
    return leaf.sharding.mesh
  devices = list(leaf.sharding.device_set)
  if len(devices) != 1:
    raise ValueError("mesh=None needs a model placed by model.shard or on one device; pass "
                     f"mesh= (a model.make_mesh mesh) for a model on {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(1, 1, 1), sharding.AXES,
              axis_types=(AxisType.Auto,) * 3)


@functools.lru_cache(maxsize=8)
def _cast_program(cfg: LlamaConfig):
  # Elementwise casts: jit keeps each leaf's sharding.
  return jax.jit(functools.partial(cast_matmul_weights, cfg=cfg))


def operand_params(params: nnx.State, cfg: LlamaConfig) -> nnx.State:
  """The parameters the sampler's programs take: the weight matrices already in the dtype their
  products use (`model.llama.cast_matmul_weights`), cast once per `sample` call instead of once
  by the prefill and once by every decode call (the casts were the largest non-matmul item of a
  decode step in benchmarks/real_model.py --parts=profile). The same samples and log-probs
  bit for bit. Returns `params` itself when no weight needs a cast."""
  dtype = jnp.dtype(cfg.operand_dtype)
  needs_cast = nnx.map_state(lambda path, leaf: path[-1] in MATMUL_WEIGHTS and leaf.dtype != dtype,
                             params)
  if not any(jax.tree.leaves(needs_cast)):
    return params
  return _cast_program(cfg)(params)


# The matrices `weights_first` transposes: (module, weight, its leading input axes).
_TRANSPOSED = (("self_attn", "q_proj", 1), ("self_attn", "k_proj", 1), ("self_attn", "v_proj", 1),
               ("self_attn", "o_proj", 2), ("mlp", "gate_proj", 1), ("mlp", "up_proj", 1),
               ("mlp", "down_proj", 1))


def weights_first_applies(cfg: SamplerConfig, mesh: Mesh, rows: int) -> bool:
  """Whether a call whose decode batch starts at `rows` rows takes `weights_first` copies: some
  batch of it (the first, or one it shrinks to) has at most `cfg.weights_first_rows` rows, on
  one CPU device.

  Where not: on accelerators (their dot libraries do not lose at few rows; not measured here)
  and on a mesh of several devices (the copies would need shardings of their own). With float32
  and with bfloat16 operands alike, on CPUs with bfloat16 dot instructions (the matrix units'
  kernels) and without: benchmarks/real_model.py --parts=weights_first measures each, and
  docs/benchmarks.md has the figures."""
  smallest = min(rows, cfg.compact_rows or rows)  # compact_rows 0: the batch never shrinks
  return bool(cfg.weights_first_rows and smallest <= cfg.weights_first_rows
              and jax.default_backend() == "cpu" and mesh.size == 1)


@functools.lru_cache(maxsize=8)
def _transpose_program(cfg: LlamaConfig):
  def transpose(params):
    flat = dict(nnx.to_flat_state(params))

    def copy(path, leading):
      w = jnp.asarray(flat[path][...])
      return w.reshape(int(np.prod(w.shape[:leading])), -1).T.astype(cfg.operand_dtype)

    layers_t = [{} for _ in range(cfg.num_layers)]
    for i, tree in enumerate(layers_t):
      for module, name, leading in _TRANSPOSED:
        if ("layers", i, module, name) in flat:  # a quantized weight's leaves lie below it
          tree.setdefault(module, {})[name] = copy(("layers", i, module, name), leading)
    head = None if cfg.tie_embeddings else copy(("lm_head",), 1)
    return {"layers": layers_t, "lm_head": head}
  return jax.jit(transpose)


def weights_first(params: nnx.State, cfg: LlamaConfig) -> dict:
  """Transposed copies [N, K] of the decoder's weight matrices (their input axes flattened into
  K, their output axes into N) and of an untied head, in the operand dtype, for the decode
  step's products with the weights on the left (`layers.project_weights_first`,
  `Llama.forward_shared`). Made once per `sample` call, outside the decode program: inside it
  XLA neither hoists a transpose of a weight out of the loop nor keeps it apart from the dot
  (a throwaway probe of 30 layers' products in a loop ran at 0.74-0.78x of the plain products'
  speed). A quantized weight keeps its plain product (it is dequantized where it is used)."""
  return _transpose_program(cfg)(params)


def row_keys(num_prompts: int, num_samples: int, rows: int, seed: int,
             keys_from: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
  """(seed_b uint32 [rows], index_b int32 [rows]) of the prefill's per-row keys: sample s of
  prompt p takes fold_in(key(keys_from[p][0]), keys_from[p][1] + s), so that one call draws
  exactly what several calls would have drawn (the evaluation merges its chunks, each with its
  own seed, into one call: `ksjax.evaluation.batched`); padding rows b take (seed, b).
  (seed, p * num_samples) for every p is what a call without `keys_from` draws."""
  if len(keys_from) != num_prompts:
    raise ValueError(f"keys_from has {len(keys_from)} entries for {num_prompts} prompts; "
                     "expected one (seed, first row) pair per prompt")
  seed_b = np.full(rows, seed, np.uint32)
  index_b = np.arange(rows, dtype=np.int32)
  for p, (s, first) in enumerate(keys_from):
    if not (_is_seed(s) and isinstance(first, (int, np.integer)) and not isinstance(first, bool)
            and 0 <= first <= 2**31 - 1 - num_samples):
      raise ValueError(f"keys_from[{p}]={(s, first)!r} is not accepted; expected (seed in "
                       "[0, 2**32), first row in [0, 2**31 - num_samples))")
    seed_b[p * num_samples:(p + 1) * num_samples] = s
    index_b[p * num_samples:(p + 1) * num_samples] = first + np.arange(num_samples)
  return seed_b, index_b


def _is_seed(seed) -> bool:
  return not isinstance(seed, bool) and isinstance(seed, (int, np.integer)) and 0 <= seed < 2**32


def sample(llama: Llama, prompts: Sequence[Sequence[int]], cfg: SamplerConfig, *,
           num_samples: int = 1, seed: int = 0, mesh: Mesh | None = None,
           keys_from: Sequence[tuple[int, int]] | None = None) -> SampleOutput:
  """`generate` with the settings as a SamplerConfig (see `generate`). `keys_from`: per prompt,
  the (seed, row) its samples' keys start from (`row_keys`); None: `seed` and the call's rows."""
  if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or (
      num_samples < 1):
    raise ValueError(f"num_samples={num_samples!r} is not accepted; expected an integer >= 1")
  if not _is_seed(seed):
    raise ValueError(f"seed={seed!r} is not accepted; expected an integer in [0, 2**32)")
  model_cfg = llama.cfg
  for name, token in cfg.token_ids_used():
    if token >= model_cfg.vocab_size:
      raise ValueError(f"{name} has token id {token}; expected ids in "
                       f"[0, vocab_size={model_cfg.vocab_size})")
  prompt_ids = batching.validate_prompts(prompts, model_cfg.vocab_size)
  batching.validate_lengths(prompt_ids, cfg.max_new_tokens, model_cfg.max_position_embeddings)

  mesh = model_mesh(llama) if mesh is None else mesh
  sharding.check_divisible(model_cfg, mesh)
  graphdef, params = nnx.split(llama)
  params = jax.device_put(params, sharding.state_shardings(params, mesh))  # no copy if placed
  params = operand_params(params, model_cfg)

  batch_shards = sharding.batch_shards(mesh)
  batch = batching.pad_prompts(prompt_ids, num_samples, batch_shards, cfg.pad_id)
  shapes = Shapes(batch.tokens_pt.shape[0], int(num_samples), batch.tokens_pt.shape[1])
  prefill, decode = programs(graphdef, cfg, mesh, shapes)

  prompt_sharding = prompt_shardings(mesh, shapes.prompt_rows).mask_pt  # the prompts' rows
  tokens_pt, mask_pt = jax.device_put((batch.tokens_pt, batch.mask_pt), prompt_sharding)
  rows = batch.num_prompts * num_samples
  if weights_first_applies(cfg, mesh, shapes.rows):
    decode = functools.partial(decode, weights_t=weights_first(params, model_cfg))
  keys = ((np.uint32(seed),) if keys_from is None else
          row_keys(batch.num_prompts, int(num_samples), shapes.rows, seed, keys_from))
  prompt, ds = prefill(params, tokens_pt, mask_pt, np.int32(rows), *keys)
  floor = max(cfg.compact_rows, batch_shards)
  if cfg.compact_rows and jax.process_count() == 1 and shapes.rows // 2 >= floor:
    out = decode_compacting(decode, compact_program(mesh), params, prompt, ds, floor=floor,
                            batch_shards=batch_shards)
    tokens, lengths, logprobs, finished = (jnp.asarray(out[name][:rows]) for name in
                                           ("tokens", "lengths", "logprobs", "finished"))
  else:  # one loop over the whole batch (multi-process: the done flags are not all on this host)
    ds = decode(params, prompt, ds, np.int32(-1))
    tokens, lengths, logprobs, finished = (ds.tokens_bn[:rows], ds.lengths_b[:rows],
                                           ds.logprobs_bn[:rows], ds.finished_b[:rows])

  prompt_lengths_p = batch.mask_pt[:batch.num_prompts].sum(axis=1).astype(np.int32)
  return SampleOutput(
      tokens=tokens, lengths=lengths, logprobs=logprobs, finished=finished,
      prompt_tokens=jnp.asarray(np.repeat(batch.tokens_pt[:batch.num_prompts], num_samples, 0)),
      prompt_lengths=jnp.asarray(np.repeat(prompt_lengths_p, num_samples)))
