"""eval.bench_grammar's closing-search mode on a byte tokenizer: one sequence's mask work under a
regex whose greedy closing path never ends, step by step, at a long budget."""
from eval.bench_grammar import closing_cost
from models.gemma3.byte_tokenizer import ByteTokenizer


def test_closing_cost_measures_each_step():
    tok = ByteTokenizer(512)
    run = closing_cost(tok, (1, 106), "x+y", budget=5000, steps=6)
    assert run["budget"] == 5000 and run["first_step_ms"] > 0 and run["later_steps_ms_median"] > 0
    # Far from the end no closing search runs again: a later step is a plain mask.
    assert run["later_steps_ms_median"] < run["first_step_ms"]
