"""Gemma 3 (text) in JAX with explicit tensor parallelism over the mesh axis "tp".

Public API: `load_model`, `Gemma3Model`, `Gemma3Config`, `get_config`, `CONFIGS`, `KVCache`.
"""
from models.gemma3.api import Gemma3Model, load_model, prefill_buckets
from models.gemma3.config import CONFIGS, Gemma3Config, get_config
from models.gemma3.kv_cache import KVCache, LayerCache, bytes_per_sequence

__all__ = ["CONFIGS", "Gemma3Config", "Gemma3Model", "KVCache", "LayerCache", "bytes_per_sequence",
           "get_config", "load_model", "prefill_buckets"]
