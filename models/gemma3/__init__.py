"""Gemma 3 (text and images) in JAX with explicit tensor parallelism over the mesh axis "tp".

Public API: `load_model`, `Gemma3Model` (the step API + score / save), `Gemma3Config`,
`get_config`, `CONFIGS`; for model runners, `Gemma3StepAPI` (the step API alone),
`ModelPrograms` / `ProgramKey` (the compiled programs, by key) and `StepShape`.
"""
from models.gemma3.api import Gemma3Model, load_model
from models.gemma3.config import CONFIGS, Gemma3Config, get_config
from models.gemma3.step_api import Gemma3StepAPI
from models.gemma3.programs import ModelPrograms, Program, ProgramKey
from models.shapes import StepShape

__all__ = ["CONFIGS", "Gemma3Config", "Gemma3StepAPI", "Gemma3Model", "ModelPrograms", "Program",
           "ProgramKey", "StepShape", "get_config", "load_model"]
