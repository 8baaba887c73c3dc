"""Model implementations. `models.gemma3` is Gemma 3 (text) with explicit tensor parallelism."""
