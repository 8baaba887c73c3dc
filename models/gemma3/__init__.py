"""Gemma 3 (text) in JAX with explicit tensor parallelism over the mesh axis "tp".

Public API: `load_model`, `Gemma3Model` (engine API + score / generate / save), `Gemma3Config`,
`get_config`, `CONFIGS`, `KVCache`; for engine builders, `Gemma3StepAPI` (the engine API alone)
and `ModelPrograms` / `ProgramKey` (the compiled programs, by key).
"""
from models.gemma3.api import Gemma3Model, load_model
from models.gemma3.config import CONFIGS, Gemma3Config, get_config
from models.gemma3.step_api import Gemma3StepAPI
from models.gemma3.kv_cache import KVCache, LayerCache, bytes_per_sequence
from models.gemma3.programs import ModelPrograms, Program, ProgramKey, prefill_buckets

__all__ = ["CONFIGS", "Gemma3Config", "Gemma3StepAPI", "Gemma3Model", "KVCache", "LayerCache",
           "ModelPrograms", "Program", "ProgramKey", "bytes_per_sequence", "get_config",
           "load_model", "prefill_buckets"]
