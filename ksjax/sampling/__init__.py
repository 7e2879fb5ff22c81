"""Fast sharded sampling from a ksjax Llama with a KV cache: `generate`.

Files: config.py (the frozen SamplerConfig), distribution.py (temperature / top-k / top-p and the
draw, pure), batching.py (prompt validation, shape buckets, left padding), sampler.py (the jitted
prefill and decode loop, their sharding and the program cache).
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from ksjax.model import Llama
from ksjax.sampling.config import SamplerConfig
from ksjax.sampling.sampler import SampleOutput, sample


def generate(llama: Llama, prompts: Sequence[Sequence[int]], *, num_samples: int = 1,
             max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, eos_id: int | Sequence[int] | None = None,
             mesh: Mesh | None = None, stop_sequences: Sequence[Sequence[int]] | None = None,
             pad_id: int = 0) -> SampleOutput:
  """Samples `num_samples` completions of up to `max_new_tokens` tokens for each prompt.

  Args:
    llama: the model; its parameters are placed on `mesh` by their partition specs if they are not
      there already.
    prompts: P prompts, each a non-empty list of token ids; lengths may differ.
    num_samples: completions per prompt (n). Output rows are prompt-major: row p * n + s.
    max_new_tokens: N; the longest prompt plus N must fit in max_position_embeddings.
    temperature: > 0 samples softmax(logits / temperature); 0 is greedy (argmax).
    top_p: nucleus truncation, 0 < top_p <= 1 (1: none).
    top_k: keep the k most likely tokens, k >= 0 (0: none). Applied before top_p, as in
      transformers; see distribution.py for the exact distribution and tie rules.
    seed: 0 <= seed < 2**32. Same seed, prompts and settings: same samples, whatever the mesh.
    eos_id: an id or a sequence of ids (Llama 3 Instruct ends with any of several); a row stops
      after emitting one. None: no EOS.
    mesh: a ("data", "fsdp", "tensor") mesh (`model.make_mesh`); None uses the model's. Rows go
      over data x fsdp, attention heads and the cache's kv heads over tensor.
    stop_sequences: token-id sequences; a row stops once its completion ends with one (matched on
      generated tokens only).
    pad_id: the id written after a row's end and left of shorter prompts (any valid id; masked).

  Returns:
    SampleOutput with R = P * n rows: tokens int32 [R, N] (pad_id after the end), lengths int32 [R]
    (generated tokens including the EOS / stop tokens), logprobs float32 [R, N] (log-prob of each
    token under the distribution it was drawn from: temperature-scaled and AFTER top-k/top-p
    truncation; without truncation equal to `model.token_logprobs` at that temperature; 0 past the
    end), finished bool [R] (stopped by EOS or a stop sequence), prompt_tokens / prompt_lengths,
    and `sequences()` for scoring prompt + completion.

  Raises:
    ValueError naming the argument: empty prompts or an empty prompt, token ids outside the
    vocabulary, a prompt longer than the context, max_new_tokens past the context, top_p outside
    (0, 1], negative temperature, top_k < 0, num_samples < 1.
  """
  cfg = SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                      top_k=top_k, eos_id=eos_id, stop_sequences=stop_sequences, pad_id=pad_id)
  return sample(llama, prompts, cfg, num_samples=num_samples, seed=seed, mesh=mesh)


__all__ = ["SampleOutput", "SamplerConfig", "generate", "sample"]
