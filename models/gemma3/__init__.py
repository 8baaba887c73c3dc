"""Gemma 3 (text and images) in JAX with explicit tensor parallelism over the mesh axis "tp".

Public API: `load_model`, `Gemma3Model` (the step API + score / save), `Gemma3Config`,
`get_config`, `CONFIGS`; for model runners, `Gemma3StepAPI` (the step API alone),
`ModelPrograms` / `ProgramKey` (the compiled programs, by key) and `StepShape`. They load on
first use, so that importing a jax-free module of the package (`shapes`) starts no jax.
"""
import importlib

_PUBLIC = {
    "CONFIGS": "models.gemma3.config",
    "Gemma3Config": "models.gemma3.config",
    "get_config": "models.gemma3.config",
    "Gemma3Model": "models.gemma3.api",
    "load_model": "models.gemma3.api",
    "Gemma3StepAPI": "models.gemma3.step_api",
    "ModelPrograms": "models.gemma3.programs",
    "Program": "models.gemma3.programs",
    "ProgramKey": "models.gemma3.programs",
    "StepShape": "models.gemma3.shapes",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'models.gemma3' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
