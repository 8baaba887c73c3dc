"""Benchmarks and evaluations of the collective, the model and the server, written against the
public APIs of equarx, models and serving (each module says what it measures and how to run it)."""
