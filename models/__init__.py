"""Model implementations. `models.gemma3` is Gemma 3 (text and images) with explicit tensor
parallelism; `models.shapes` the ragged step's shape, which the engine and the programs share."""
