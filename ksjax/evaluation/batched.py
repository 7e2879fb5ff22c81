"""The evaluation's throughput path: a checkpoint's problems sampled in large calls, and the KL's
reference log-probs computed over each completion's own length.

`evaluate` returns what `ksjax.run.scoring.evaluate` returns for the same settings, from the
same random draws (see "Records" below), at a fraction of the CPU time
(benchmarks/eval_throughput.py; docs/benchmarks.md, "Evaluation throughput"):

* Chunks merged into calls. The records' draws are defined by chunks of `batch_prompts`
  problems, chunk c sampling with seed `seed + c * batch_prompts` and its rows numbered from 0
  (`scoring.evaluate`; the registered designs fix batch_prompts, 8 x 16 and 2 x 64 rows). Here
  consecutive chunks go into one sampler call of up to `call_rows` rows, each row keeping the
  key its chunk's own call would have given it (`sampling.sampler.row_keys`), so the uniforms
  drawn are the same ones; only the matmuls' batch size changes. Why: a decode step costs less
  per row in a larger call, and a call's tail, the rows still running after the others stopped,
  is larger too (the figures: docs/benchmarks.md, "Evaluation throughput").
* The KL's reference forward over lengths. `runner.Evaluator.kl` ran the reference over every
  row at the full max_new_tokens (80 for SmolLM2's evaluation), while the completions are 34
  tokens long on average: most of the forward was padding. Here the problems' prompts go through
  the reference once into a KV cache, and every scored completion of the checkpoint runs over its
  prompt's cache in calls of `KL_ROWS` rows sorted by length, each call at the width of its
  longest completion rounded up to `WIDTH_STEP` (`reference_logprobs`). Same values as the full
  forward within float32 rounding: the same products over fewer padded positions.

Records: with float32 products the samples are the per-chunk path's, token for token. With
bfloat16 operands (the SmolLM2 configs') a product's float32 result depends on the batch it runs
in by a last bit, which the next product's rounding to bfloat16 can widen to one of its ulps, so a
merged call's log-probs differ from the chunk's call's by rounding (up to 0.03 over 24 tokens of
SmolLM2) and a row whose uniform falls near a boundary of the inverse CDF draws another token:
the records are then equal in distribution, not draw for draw (tests/sampling/test_row_keys.py
tests it; benchmarks/eval_throughput.py compares the two paths' per-problem counts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ksjax import distributed
from ksjax.model import logprobs as logprobs_lib
from ksjax.model import sharding
from ksjax.model.llama import default_positions
from ksjax.run import scoring
from ksjax.sampling import batching, sampler
from ksjax.sampling.config import SamplerConfig
from ksjax.tasks.base import Prompt, Task

# Sampler rows per call on a CPU: larger calls decode a row for less CPU time, and twice as many
# rows hold a KV cache that a shared 2-CPU machine's memory no longer fits (docs/benchmarks.md,
# "Evaluation throughput"). The record's batch_prompts still decides every draw.
CALL_ROWS = 512


def call_rows(batch_rows: int | None) -> int:
  """The evaluation's sampler rows per call (`runner.Evaluator.call_rows`): CALL_ROWS on a CPU,
  within config.batch_rows; 0 elsewhere, the per-chunk path: this one was measured on CPUs only,
  an accelerator's memory for a large model's KV cache is what batch_prompts was chosen for, and
  the KL's calls here hold every layer's cache of their rows where the per-chunk forward holds
  one layer's at a time."""
  if jax.default_backend() != "cpu":
    return 0
  return CALL_ROWS if batch_rows is None else min(CALL_ROWS, batch_rows)
# The KL's reference forward: rows per call, prompts per group (their KV cache is held while
# their rows run), and the steps the completions' widths and the prompts' length are rounded up
# to: chosen by measurement at SmolLM2's evaluation shape against 128 rows, the sampler's
# power-of-two prompt bucket and the per-chunk path (docs/benchmarks.md, "Evaluation
# throughput").
KL_ROWS = 64
KL_PROMPTS = 64
WIDTH_STEP = 16
PROMPT_STEP = 16


def merged_calls(num_prompts: int, batch_prompts: int, num_samples: int,
                 call_rows: int) -> list[tuple[int, int]]:
  """[start, stop) problem ranges of the sampler calls: whole chunks of `batch_prompts`, as many
  per call as fit `call_rows` rows once the call's prompts are padded to a power of two
  (`batching.bucket_prompt_batch`), at least one chunk."""
  per_call = max(1, call_rows // num_samples)
  per_call = max(batch_prompts, 1 << (per_call.bit_length() - 1))  # the sampler pads to 2**j
  per_call -= per_call % batch_prompts
  return [(start, min(start + per_call, num_prompts)) for start in range(0, num_prompts, per_call)]


def sample_merged(llama, tokenizer, prompts: Sequence[Prompt], draw: scoring.Draw, *, seed: int,
                  batch_prompts: int, call_rows: int = CALL_ROWS,
                  mesh=None) -> list[sampler.SampleOutput]:
  """The samples of `scoring.evaluate`'s chunks, drawn `call_rows` rows at a time; one host
  SampleOutput per chunk of `batch_prompts` problems, equal to the chunk's own call's."""
  cfg = SamplerConfig(max_new_tokens=draw.max_new_tokens, temperature=draw.temperature,
                      top_p=draw.top_p, top_k=draw.top_k, eos_id=tuple(tokenizer.eos_ids),
                      pad_id=tokenizer.pad_id)
  n = draw.num_samples
  chunks = []
  for start, stop in merged_calls(len(prompts), batch_prompts, n, call_rows):
    # Problem p of chunk c = (p // batch_prompts) draws as row (p % batch_prompts) * n + s of
    # that chunk's call, whose seed is seed + c * batch_prompts (`scoring.evaluate`).
    keys_from = [(seed + p - p % batch_prompts, (p % batch_prompts) * n)
                 for p in range(start, stop)]
    out = distributed.to_host(sampler.sample(
        llama, [list(p.tokens) for p in prompts[start:stop]], cfg, num_samples=n, seed=seed,
        mesh=mesh, keys_from=keys_from))
    for first in range(start, stop, batch_prompts):
      rows = slice((first - start) * n, (min(first + batch_prompts, stop) - start) * n)
      chunks.append(_rows(out, rows))
  return chunks


def _rows(out: sampler.SampleOutput, rows: slice) -> sampler.SampleOutput:
  """Rows `rows` of a host SampleOutput, the prompts trimmed to their longest (as a call of
  those rows alone pads them)."""
  lengths = np.asarray(out.prompt_lengths)[rows]
  width = batching.bucket_length(int(lengths.max()))
  return sampler.SampleOutput(
      tokens=np.asarray(out.tokens)[rows], lengths=np.asarray(out.lengths)[rows],
      logprobs=np.asarray(out.logprobs)[rows], finished=np.asarray(out.finished)[rows],
      prompt_tokens=np.asarray(out.prompt_tokens)[rows, -width:], prompt_lengths=lengths)


def score(task: Task, prompts: Sequence[Prompt], out: sampler.SampleOutput) -> scoring.Scored:
  """`scoring.sample_and_score`'s decoding and scoring of a host SampleOutput (its second half,
  which ksjax.run does not offer apart from its sampling)."""
  tokens_rn = np.asarray(out.tokens)
  n = tokens_rn.shape[0] // len(prompts)
  texts = tuple(task.tokenizer.decode(row) for row in tokens_rn)
  return scoring.from_scores(out, texts, task.score(list(prompts),
                                                    [texts[i * n:(i + 1) * n] for i in
                                                     range(len(prompts))]))


def evaluate(llama, task: Task, prompts: Sequence[Prompt], draw: scoring.Draw, *, seed: int,
             batch_prompts: int, mesh=None, call_rows: int = CALL_ROWS,
             measure: Callable[[Sequence[scoring.Scored]], dict[str, np.ndarray]] | None = None
             ) -> scoring.Outcomes:
  """`scoring.evaluate` with merged sampler calls (module doc); `measure` maps every chunk's
  Scored at once to more per-problem values ([G] each over all the problems, e.g. `kl`)."""
  outputs = sample_merged(llama, task.tokenizer, prompts, draw, seed=seed,
                          batch_prompts=batch_prompts, call_rows=call_rows, mesh=mesh)
  scored = [score(task, prompts[c * batch_prompts:(c + 1) * batch_prompts], out)
            for c, out in enumerate(outputs)]
  cat = lambda name: np.concatenate([getattr(s, name) for s in scored])
  return scoring.Outcomes(draw.num_samples, cat("correct_gn"), cat("answer_ids_gn"),
                          cat("rewards_gn"), {} if measure is None else dict(measure(scored)))


# ---------------------------------------------------------------------------------------------
# The KL's reference log-probs over each completion's own length
# ---------------------------------------------------------------------------------------------

def _prompts_program(llama, prompt_pt, pmask_pt):
  """The prompts [P, T] through the model into their KV cache (`Llama.prefill`, as the sampler's
  prefill): the final-normed hidden state of each prompt's last position [P, D] and the cache."""
  hidden_ptd, cache = llama.prefill(prompt_pt, default_positions(pmask_pt), pmask_pt)
  return hidden_ptd[:, -1], cache


def _rows_program(llama, last_pd, cache, pmask_pt, prompt_of_b, completion_bn, mask_bn):
  """float32 log-probs [B, N] of completions `completion_bn` (valid where `mask_bn`, a prefix of
  each row; 0 elsewhere), row b continuing prompt `prompt_of_b[b]`, whose cache and last hidden
  state `_prompts_program` made: each row's cache is its prompt's keys and values followed by N
  empty slots, and the completions go through `Llama.hidden_cached` at slot T, as
  `Llama.hidden_continuations` runs a group's rows over their repeated prompt cache (the same
  products, so equal within float32 rounding), but with rows of unequal numbers per prompt."""
  t, n = pmask_pt.shape[1], completion_bn.shape[1]
  take = lambda x: jnp.take(x, prompt_of_b, axis=0)
  cache = {"k": [jnp.pad(take(k), ((0, 0), (0, 0), (0, 0), (0, n))) for k in cache["k"]],
           "v": [jnp.pad(take(v), ((0, 0), (0, 0), (0, n), (0, 0))) for v in cache["v"]]}
  pmask_bt = take(pmask_pt)
  positions_bn = (default_positions(pmask_bt)[:, -1:] + 1
                  + jnp.arange(n, dtype=jnp.int32)[None, :])
  kv_mask_bs = jnp.concatenate([pmask_bt, mask_bn], axis=1)
  hidden_bnd, _ = llama.hidden_cached(completion_bn, positions_bn, cache, jnp.int32(t), kv_mask_bs)
  # Token j is predicted by the position before it: the prompt's last for j = 0.
  before_bnd = jnp.concatenate([take(last_pd)[:, None], hidden_bnd[:, :-1]], axis=1)
  w, vocab_axis = llama.head_weight()
  logp_bn, _ = logprobs_lib.chunked_logprobs(before_bnd, w, vocab_axis, completion_bn,
                                             operand_dtype=llama.cfg.operand_dtype)
  return jnp.where(mask_bn, logp_bn, 0.0)


@functools.lru_cache(maxsize=8)
def _programs(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh):
  """The jitted `_prompts_program` and `_rows_program` (each compiles once per shape: a call's
  prompts, rows and width are fixed, so once per width bucket)."""
  def under_mesh(fn):
    def apply(state, *args):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # activation shardings
        return fn(nnx.merge(graphdef, state), *args)
    return jax.jit(apply)
  return under_mesh(_prompts_program), under_mesh(_rows_program)


def reference_logprobs(reference, mesh: jax.sharding.Mesh, prompts: Sequence[np.ndarray],
                       prompt_of_r: np.ndarray, completions_rn: np.ndarray, lengths_r: np.ndarray,
                       *, rows: int = KL_ROWS, prompts_per_call: int = KL_PROMPTS,
                       width_step: int = WIDTH_STEP) -> np.ndarray:
  """float32 [R, N]: the reference's log-prob of each completion token (0 past `lengths_r`),
  row r continuing prompt `prompts[prompt_of_r[r]]` (token ids).

  The prompts go through the model `prompts_per_call` at a time, into a KV cache; that group's
  rows then run over it `rows` at a time, each call at one width, the longest completion of its
  rows rounded up to `width_step`: rows sorted by length fill calls at the narrowest width that
  holds them, and the rows left over at a width (fewer than a call) move on to the next, so only
  the group's last call is padded (with copies of its first row, dropped). A group's prompts are
  left-padded to its longest, rounded up to PROMPT_STEP, so the programs compile once per width
  and prompt length."""
  r_total, n = completions_rn.shape
  graphdef, state = nnx.split(reference)
  state = jax.device_put(state, sharding.state_shardings(state, mesh))
  prompts_fn, rows_fn = _programs(graphdef, mesh)
  shards = sharding.batch_shards(mesh)
  rows = -(-rows // shards) * shards
  prompts_per_call = -(-prompts_per_call // shards) * shards
  width_r = np.minimum(np.maximum(-(-lengths_r // width_step), 1) * width_step, n)
  out = np.zeros((r_total, n), np.float32)
  for first in range(0, len(prompts), prompts_per_call):
    group = np.arange(first, min(first + prompts_per_call, len(prompts)))
    t = -(-max(len(prompts[i]) for i in group) // PROMPT_STEP) * PROMPT_STEP
    prompt_pt = np.zeros((prompts_per_call, t), np.int32)
    pmask_pt = np.zeros((prompts_per_call, t), bool)
    for j in range(prompts_per_call):  # padding prompts repeat the group's last
      ids = prompts[group[min(j, group.size - 1)]]
      prompt_pt[j, t - len(ids):], pmask_pt[j, t - len(ids):] = ids, True
    last_pd, cache = prompts_fn(state, prompt_pt, pmask_pt)
    mine = np.flatnonzero((prompt_of_r >= first) & (prompt_of_r < first + prompts_per_call))
    mine = mine[np.argsort(width_r[mine], kind="stable")]
    while mine.size:
      batch, mine = mine[:rows], mine[rows:]
      width = int(width_r[batch[-1]])  # the widest of them (sorted)
      take = np.concatenate([batch, np.full(rows - batch.size, batch[0])])
      logp_bn = rows_fn(state, last_pd, cache, pmask_pt,
                        (prompt_of_r[take] - first).astype(np.int32), completions_rn[take, :width],
                        np.arange(width)[None, :] < lengths_r[take][:, None])
      out[batch, :width] = np.asarray(logp_bn)[:batch.size]
  return out


def kl(reference, mesh: jax.sharding.Mesh, prompts: Sequence[Prompt],
       scored: Sequence[scoring.Scored], kl_samples: int) -> dict[str, np.ndarray]:
  """Per problem, the mean over its first `kl_samples` completions of KL(policy || reference)
  (`scoring.kl_per_completion`, k1 and k3), as `runner.Evaluator.kl` computes it chunk by chunk:
  log pi from the sampler, log pi_ref from `reference_logprobs` over every chunk's rows at
  once."""
  m = kl_samples
  tokens, lengths, logp, prompt_of = [], [], [], []
  first = 0
  for s in scored:
    out = s.output
    n = np.asarray(out.tokens).shape[0] // len(s.correct_gn)
    g = len(s.correct_gn)
    rows = (np.arange(g)[:, None] * n + np.arange(m)[None, :]).reshape(-1)
    tokens.append(np.asarray(out.tokens)[rows])
    lengths.append(np.asarray(out.lengths)[rows])
    logp.append(np.asarray(out.logprobs)[rows])
    prompt_of.append(first + np.repeat(np.arange(g), m))
    first += g
  tokens_rn, lengths_r = np.concatenate(tokens), np.concatenate(lengths)
  ref_logp_rn = reference_logprobs(reference, mesh, [np.asarray(p.tokens, np.int32)
                                                     for p in prompts],
                                   np.concatenate(prompt_of), tokens_rn, lengths_r)
  mask_rn = np.arange(tokens_rn.shape[1])[None, :] < lengths_r[:, None]
  k1_r, k3_r = scoring.kl_per_completion(np.concatenate(logp), ref_logp_rn, mask_rn)
  return {"kl_k1": k1_r.reshape(-1, m).mean(1), "kl_k3": k3_r.reshape(-1, m).mean(1)}


__all__ = ["CALL_ROWS", "call_rows", "evaluate", "kl", "merged_calls", "reference_logprobs",
           "sample_merged"]
