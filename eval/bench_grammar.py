"""What structured output costs a decode step: batch-8 decode steps of the paged engine
(PagedRunner.run_step over all rows, each row one token), plain and with a JSON-schema grammar on
every row, with the rows' logits processing built as the engine core builds it (`step_extras` into
the step's inputs: masks of step t+1 start on the worker thread once step t's tokens are accepted;
the step waits for them only after it has dispatched the model's program). Also the host-side
mask work alone, per step.

    python -m eval.bench_grammar --model gemma3-270m --dtype float32 --steps 64
    python -m eval.bench_grammar --closing-regex 'x+y' --budgets 2000,32000

Reports median step times, the grammar's cost as a fraction of the plain step, and how many rows
produced schema-valid JSON. With --closing-regex, only the host's mask work of one sequence whose
grammar is that regex, a step at a time with the given token budgets (the closing-path search near
a budget's end is the part that grows with it; `x+y` is a grammar whose greedy closing path never
ends).

Both kinds of step run one at a time (the engine core's overlapped
loop cannot run a step whose rows need logits processing before the last one's tokens are back),
so the difference is the grammar's alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)?$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "role", "scores", "address"],
}


def decode_run(engine, grammar, prompt: list[int], batch: int, steps: int):
    """A generator: the seconds of each of `steps` decode steps of `batch` rows (sampled, one
    seed a row), constrained by `grammar` (or None); returns (texts, host mask seconds). A row
    whose grammar ended keeps decoding without it, so that every step stays batch-`batch`."""
    from eval.paged_decode import DecodeBatch
    from serving import SamplingParams, Sequence, StructuredOutputs, step_extras

    info, tok = engine.info, engine.tokenizer
    host: list[float] = []  # the worker's mask work, timed where it runs
    structured = StructuredOutputs(info.vocab_size, info.eos_ids, info.max_seq_len, tok,
                                   mask_timer=host.append)
    seqs = [Sequence(i + 1, list(prompt), SamplingParams(max_tokens=steps + 1, temperature=1.0,
                                                         seed=i, grammar=grammar), seed=i)
            for i in range(batch)]
    for s in seqs:
        structured.add(s)
    rows = DecodeBatch(info, seqs)
    live = {s.id: s for s in seqs}
    ends: dict[int, int] = {}  # sequence id -> its output's length when its grammar ended

    def extras(step_rows):
        return step_extras([r if r is not None and r.id in live else None for r in step_rows],
                           structured, info.eos_ids)

    def accept(tokens) -> None:
        rows.accept(tokens)
        for s in list(live.values()):
            token = s.generated[-1]
            if grammar is not None and (token in info.eos_ids or structured.accept(s.id, token)):
                del live[s.id]
                structured.remove(s.id)  # as the engine core does with an ended sequence
                ends[s.id] = len(s.generated) - (token in info.eos_ids)

    accept(engine.run_step(rows.inputs(extras)).tokens)  # the prompts: first tokens, not timed
    structured.prefetch()
    for _ in range(steps):
        t = time.perf_counter()
        accept(engine.run_step(rows.inputs(extras)).tokens)
        structured.prefetch()
        yield time.perf_counter() - t
    texts = [tok.decode([t for t in s.generated[:ends.get(s.id)] if t not in info.eos_ids])
             for s in seqs]
    structured.close()
    return texts, host


def alternate(plain_run, grammar_run) -> tuple[list[float], list[float], tuple]:
    """Steps of the two runs taken in turn (a shared machine's load weighs on both alike):
    their seconds, and the grammar run's result."""
    plain, constrained = [], []
    while True:
        try:
            plain.append(next(plain_run))
        except StopIteration:
            pass
        try:
            constrained.append(next(grammar_run))
        except StopIteration as e:
            return plain, constrained, e.value


def valid_rows(texts: list[str]) -> int:
    valid = 0
    for text in texts:
        try:
            import jsonschema

            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except Exception:
            pass
    return valid


def closing_cost(tok, eos_ids, regex: str, budget: int, steps: int = 12) -> dict:
    """Host milliseconds of one sequence's masks under `regex` with `budget` tokens left: its
    first step (where the closing path is first searched) and the median of the next ones."""
    from serving import SamplingParams, Sequence, StructuredOutputs, build_grammar

    grammar = build_grammar("regex", regex, "bench", tok, eos_ids)
    structured = StructuredOutputs(tok.vocab_size, eos_ids, budget + 8, tok)
    structured.add(Sequence(0, [tok.bos_id] * 8, SamplingParams(max_tokens=budget, grammar=grammar),
                            seed=0))
    allowed = None  # the first token allowed at the first step, taken at every step
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        bits = structured.masks([0]).result()[0].view("uint32")
        times.append(time.perf_counter() - t)
        if allowed is None:
            allowed = next(i for i in range(len(bits) * 32) if bits[i // 32] >> (i % 32) & 1)
        if structured.accept(0, allowed) is not None:
            break
    structured.close()
    return {"budget": budget, "first_step_ms": round(times[0] * 1e3, 2),
            "later_steps_ms_median": round(statistics.median(times[1:]) * 1e3, 2)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--closing-regex", help="measure only the mask work under this regex")
    p.add_argument("--budgets", default="2000,32000", help="token budgets, with --closing-regex")
    args = p.parse_args(argv)

    from models.gemma3 import load_model
    from serving import PagedRunner, build_grammar
    from eval.reports import write_json

    if args.closing_regex:
        tok = load_model(args.model, tp=1, dtype=args.dtype).tokenizer
        eos = (tok.eos_id, tok.end_of_turn_id)
        report = {"regex": args.closing_regex, "runs": [
            closing_cost(tok, eos, args.closing_regex, int(b)) for b in args.budgets.split(",")]}
        print(json.dumps(report, indent=1))
        write_json(args.json, report)
        return

    b = args.batch
    model = load_model(args.model, tp=1, dtype=args.dtype, max_seq_len=args.max_seq_len)
    # Two engines over one model (pages each): plain and constrained steps alternate.
    engines = {}
    for kind in ("plain", "grammar"):
        engines[kind] = PagedRunner(model, max_num_seqs=b, max_seq_len=args.max_seq_len,
                                    prefix_caching=False, model_name="bench")
        engines[kind].warmup(lambda _: None)
    tok, info = model.tokenizer, engines["plain"].info
    t0 = time.perf_counter()
    grammar = build_grammar("json_schema", SCHEMA, "bench", tok, info.eos_ids)
    compile_s = time.perf_counter() - t0
    prompt = [tok.bos_id] + tok.encode("A user record as JSON: ")
    plain, constrained, (texts, host) = alternate(
        decode_run(engines["plain"], None, prompt, b, args.steps),
        decode_run(engines["grammar"], grammar, prompt, b, args.steps))
    med_plain, med_grammar = statistics.median(plain), statistics.median(constrained)
    report = {
        "model": args.model, "dtype": args.dtype, "batch": b, "steps": args.steps,
        "grammar_compile_s": round(compile_s, 4),
        "plain_step_ms": round(med_plain * 1e3, 2), "grammar_step_ms": round(med_grammar * 1e3, 2),
        "grammar_cost_fraction": round(med_grammar / med_plain - 1, 4),
        "host_mask_ms_median": round(statistics.median(host) * 1e3, 3) if host else None,
        "host_mask_ms_max": round(max(host) * 1e3, 3) if host else None,
        "valid_json_rows": f"{valid_rows(texts)}/{b}",
        "example": texts[0][:200],
    }
    print(json.dumps(report, indent=1, ensure_ascii=False))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
