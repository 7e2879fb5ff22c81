"""ksjax's Llama 3 (Flax NNX): config and presets, model, KV cache.

The contract with the sampler and trainer is the surface exported here; see each module for the why.
"""

from ksjax.model.config import PRESETS, LlamaConfig, from_hf_config, preset, to_hf_config
from ksjax.model.checkpoint import CheckpointError
from ksjax.model.checkpoint import load as load_checkpoint
from ksjax.model.checkpoint import save as save_checkpoint
from ksjax.model.hf_io import load_hf, save_hf
from ksjax.model.gguf_io import GGUFError, load_gguf, read_gguf_config, read_gguf_tokenizer
from ksjax.model.llama import Cache, Llama, default_positions, init_cache, with_config
from ksjax.model.logprobs import sharded_token_logprobs, token_logprobs
from ksjax.model.sharding import make_mesh, shard

__all__ = [
    "PRESETS", "LlamaConfig", "from_hf_config", "preset", "to_hf_config",
    "Cache", "Llama", "default_positions", "init_cache", "with_config",
    "CheckpointError", "load_checkpoint", "save_checkpoint", "load_hf", "save_hf",
    "make_mesh", "shard", "sharded_token_logprobs", "token_logprobs",
    "GGUFError", "load_gguf", "read_gguf_config", "read_gguf_tokenizer",
]
