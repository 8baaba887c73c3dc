"""What structured output costs a decode step: batch-8 decode steps of a real engine, plain and with
a JSON-schema grammar on every row, run the way the engine core runs them (masks of step t+1 start
on the worker thread once step t's tokens are accepted; the engine waits for them only after it has
dispatched the model's step). Also the host-side mask work alone, per step.

    python -m eval.bench_grammar --model gemma3-270m --dtype float32 --steps 64

Reports median step times, the grammar's cost as a fraction of the plain step, and how many rows
produced schema-valid JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)

    from models.gemma3 import load_model
    from serving import (DecodeInputs, SlotRunner, SamplingParams, Sequence, SlotSampling,
                         StructuredOutputs, build_grammar, pad_prefill_batch, step_extras)
    from eval.reports import write_json

    b = args.batch
    model = load_model(args.model, tp=1, dtype=args.dtype)
    # Two engines over one model (a cache each): plain and constrained steps alternate, so that
    # the load of a shared machine weighs on both alike.
    engines = {}
    for kind in ("plain", "grammar"):
        engines[kind] = SlotRunner(model, num_slots=b, max_seq_len=args.max_seq_len, prefill_batch_sizes=(1,))
        engines[kind].warmup(lambda _: None)
    tok, info = model.tokenizer, engines["plain"].info
    t0 = time.perf_counter()
    grammar = build_grammar("json_schema", SCHEMA, "bench", tok, info.eos_ids)
    compile_s = time.perf_counter() - t0
    prompt = [tok.bos_id] + tok.encode("A user record as JSON: ")

    def run(with_grammar: bool):
        """Yields each decode step's seconds; returns (texts, host mask seconds)."""
        engine = engines["grammar" if with_grammar else "plain"]
        host: list[float] = []  # the worker's mask work, timed where it runs
        structured = StructuredOutputs(info.vocab_size, info.eos_ids, info.max_seq_len, tok,
                                       mask_timer=host.append)
        seqs = []
        for i in range(b):
            params = SamplingParams(max_tokens=args.steps + 1, temperature=1.0, seed=i,
                                    grammar=grammar if with_grammar else None)
            s = Sequence(i + 1, list(prompt), params, seed=i, slot=i)
            structured.add(s)
            seqs.append(s)
        for s in seqs:  # first tokens (not timed)
            sampling = SlotSampling.of([s.params], [s.seed])._replace(extras=step_extras([s], structured, info.eos_ids))
            out = engine.run_prefill(pad_prefill_batch([(s.prompt, s.slot, sampling)], info.bucket_for(len(prompt)), 1))
            s.generated.append(int(out.tokens[0]))
            structured.accept(s.id, s.generated[-1])
        structured.prefetch()
        live = list(seqs)
        for _ in range(args.steps):
            rows = [s if s in live else None for s in seqs]
            t = time.perf_counter()
            extras = step_extras(rows, structured, info.eos_ids)
            sampling = SlotSampling.of([s.params for s in seqs], [s.seed for s in seqs])._replace(extras=extras)
            tokens = np.array([s.generated[-1] for s in seqs], np.int32)
            positions = np.array([s.length - 1 for s in seqs], np.int32)
            out = engine.run_decode(DecodeInputs(tokens, positions, sampling))
            for s in list(live):
                tok_id = int(out.tokens[s.slot])
                if with_grammar and tok_id in info.eos_ids:
                    live.remove(s)  # ended; its row keeps decoding (the step stays batch-8)
                    continue
                s.generated.append(tok_id)
                if with_grammar and structured.accept(s.id, tok_id):
                    live.remove(s)
            structured.prefetch()
            yield time.perf_counter() - t
        texts = [tok.decode([t for t in s.generated if t not in info.eos_ids]) for s in seqs]
        structured.close()
        return texts, host

    plain_run, grammar_run = run(False), run(True)
    plain, constrained = [], []
    while True:
        try:
            plain.append(next(plain_run))
        except StopIteration:
            pass
        try:
            constrained.append(next(grammar_run))
        except StopIteration as e:
            texts, host = e.value
            break
    valid = 0
    for text in texts:
        try:
            import jsonschema

            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except Exception:
            pass
    med_plain, med_grammar = statistics.median(plain), statistics.median(constrained)
    report = {
        "model": args.model, "dtype": args.dtype, "batch": b, "steps": args.steps,
        "grammar_compile_s": round(compile_s, 4),
        "plain_step_ms": round(med_plain * 1e3, 2), "grammar_step_ms": round(med_grammar * 1e3, 2),
        "grammar_cost_fraction": round(med_grammar / med_plain - 1, 4),
        "host_mask_ms_median": round(statistics.median(host) * 1e3, 3) if host else None,
        "host_mask_ms_max": round(max(host) * 1e3, 3) if host else None,
        "valid_json_rows": f"{valid}/{b}",
        "example": texts[0][:200],
    }
    print(json.dumps(report, indent=1, ensure_ascii=False))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
