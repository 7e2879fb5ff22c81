"""Greedy sampling equals transformers' greedy `generate`, token for token.

A tiny random `LlamaForCausalLM` (eager attention, float32, GQA, llama3 RoPE scaling, random norm
scales) is saved with `save_pretrained` and loaded through `model.load_hf`. Prompts of mixed
lengths go in one batch on both sides (transformers: left padding and an attention mask) and every
completion is compared up to and including its EOS.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ksjax import model, sampling  # noqa: E402

VOCAB = 101
PAD = 0
N_NEW = 16
PROMPTS = [[11, 42, 7, 99, 3, 3, 58, 20, 1, 64, 9], [5, 77], [31, 8, 8, 90, 14, 2]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
      rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1,
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
      attn_implementation="eager", torch_dtype=torch.float32)
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("hf_llama")
  hf.save_pretrained(path)
  llama, _ = model.load_hf(str(path))
  return hf, llama


def hf_greedy(hf, prompts, eos_id) -> list[list[int]]:
  """transformers' greedy completions of a left-padded batch, each cut after its first EOS."""
  t = max(len(p) for p in prompts)
  ids = torch.tensor([[PAD] * (t - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
  with torch.no_grad():
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                      eos_token_id=eos_id, pad_token_id=PAD)
  completions = []
  for row in out[:, t:].tolist():
    ends = [j + 1 for j, x in enumerate(row) if x in (eos_id or [])]
    completions.append(row[:min(ends, default=len(row))])
  return completions


def test_greedy_equals_transformers_generate_on_mixed_length_prompts(models):
  hf, llama = models
  free = hf_greedy(hf, PROMPTS, None)
  assert all(len(c) == N_NEW for c in free)
  assert all(len(set(c)) > 3 for c in free), "degenerate model: completions repeat one token"
  # Two EOS ids taken from the free completions, so that some rows stop early and some do not.
  eos = [free[0][6], free[2][3]]
  expected = hf_greedy(hf, PROMPTS, eos)
  assert any(len(c) < N_NEW for c in expected)

  out = sampling.generate(llama, PROMPTS, max_new_tokens=N_NEW, temperature=0.0, eos_id=eos,
                          pad_id=PAD)
  for r, completion in enumerate(expected):
    length = int(out.lengths[r])
    assert np.asarray(out.tokens[r, :length]).tolist() == completion, r
    assert bool(out.finished[r]) == (completion[-1] in eos), r
    assert (np.asarray(out.tokens[r, length:]) == PAD).all()
