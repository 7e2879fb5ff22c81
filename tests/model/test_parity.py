"""Parity of ksjax's Llama with transformers' LlamaForCausalLM (the levanter recipe).

Tiny random reference models (eager attention, float32) are saved with `save_pretrained`, loaded
through the real loader (`model.load_hf`), and compared on left-padded batches; then exported with
`model.save_hf` and reloaded in transformers. Tolerance: max abs logit difference 1e-4. (The
cached forward is checked against this full forward in test_model_llama.py.)
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ksjax import model  # noqa: E402

VOCAB = 97
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# (num_kv_heads, tied embeddings, llama3 rope scaling): covers kv in {1, 2, 4}, tied/untied and
# scaling on/off without the full product.
CASES = [(1, True, True), (2, False, False), (4, False, True), (2, True, False)]


@nnx.jit
def forward(llama, tokens, mask=None):
  """The model under jit: eager dispatch compiles every op separately and is slower in tests."""
  return llama(tokens, attention_mask=mask)


def hf_model(kv_heads: int, tied: bool, scaling: bool, seed: int = 0):
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
      max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
      rope_scaling=LLAMA3_SCALING if scaling else None, tie_word_embeddings=tied,
      initializer_range=0.1, attn_implementation="eager", torch_dtype=torch.float32)
  torch.manual_seed(seed)
  hf = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # random norm scales so the norm parameters are exercised too
    for name, p in hf.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
  return hf


def left_padded_batch(seed: int = 0, b: int = 3, t: int = 11):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, VOCAB, (b, t)).astype(np.int32)
  lengths = np.array([t, t - 4, 2])[:b]
  mask = (np.arange(t)[None, :] >= (t - lengths)[:, None]).astype(np.int32)
  tokens = np.where(mask == 1, tokens, 0).astype(np.int32)
  return tokens, mask


def hf_logits(hf, tokens, mask) -> np.ndarray:
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(tokens, dtype=torch.long),
             attention_mask=torch.tensor(mask, dtype=torch.long),
             position_ids=torch.tensor(positions, dtype=torch.long))
  return out.logits.float().numpy()


def max_diff_on_real(a, b, mask) -> float:
  return float(np.abs(a - b)[mask.astype(bool)].max())


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"kv{c[0]}-tied{c[1]}-scaled{c[2]}")
def saved(request, tmp_path_factory):
  kv, tied, scaling = request.param
  hf = hf_model(kv, tied, scaling)
  path = tmp_path_factory.mktemp("hf")
  hf.save_pretrained(path)
  return hf, str(path), request.param


def test_load_hf_matches_transformers_on_left_padded_batch(saved):
  hf, path, (kv, tied, scaling) = saved
  llama, cfg = model.load_hf(path)
  assert (cfg.num_kv_heads, cfg.tie_embeddings) == (kv, tied)
  assert (cfg.rope_scaling_dict is not None) == scaling
  assert cfg.rope_theta == 5000.0
  tokens, mask = left_padded_batch()
  ours = np.asarray(forward(llama, jnp.asarray(tokens), jnp.asarray(mask)))
  assert ours.dtype == np.float32 and ours.shape == tokens.shape + (VOCAB,)
  ref = hf_logits(hf, tokens, mask)
  assert np.abs(ref).max() > 0.1  # the comparison is not between near-zero logits
  assert max_diff_on_real(ours, ref, mask) <= 1e-4


def test_save_hf_round_trips_through_transformers(saved, tmp_path):
  hf, path, _ = saved
  llama, cfg = model.load_hf(path)
  out = tmp_path / "export"
  model.save_hf(llama, cfg, str(out))
  reloaded = transformers.LlamaForCausalLM.from_pretrained(
      out, attn_implementation="eager", torch_dtype=torch.float32).eval()
  tokens, mask = left_padded_batch(seed=1)
  assert max_diff_on_real(hf_logits(reloaded, tokens, mask), hf_logits(hf, tokens, mask),
                          mask) <= 1e-6
