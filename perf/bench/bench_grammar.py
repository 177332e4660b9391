"""What a JSON-schema grammar costs a decode step, against the same step without one, in one
run; and a schema's compile time, first and cached.

    python perf/bench/bench_grammar.py [--batches 8 32 --steps 30 --repeats 5 --vocab 32768]

Model: the 54.5M Mixtral shape of bench_decode_step (hidden 512, inter 1024, 4 layers, 8/4
heads, 8 experts top-2) with a ``--vocab`` of 32768 ids (Mixtral's size) and a byte-level BPE
``tokenizer.json`` of as many tokens (the 256 bytes and pieces of words, digits and
punctuation: a grammar's mask is computed over every one), random weights, fp32, CPU.

* step:  ``LLMEngine.step_outputs`` of B running sequences (context ``--context``), no grammar:
  the decode step as the engine runs it (schedule, forward, sample, postprocess).
* grammar: per step, what structured outputs add to it for B sequences under the schema:
  ``grammar_masks`` (each matcher catches up on its sampled token and fills its bitmask row),
  the bitmask applied to the logits (``apply_bitmask``), and the accept of the sampled token;
  the matchers walk real outputs (the masked random logits' argmax), a finished one restarting;
  only the grammar calls are timed (not the argmax standing for the sampler).
* engine: ``LLMEngine.step_outputs`` of B running sequences each under ``LONG`` (a JSON schema
  whose output cannot end within the run: an array of at least 64 strings), against *step*:
  the whole cost as the engine pays it (masks filled on a thread during the forward).
Rounds alternate the two; figures are medians over rounds of the per-step mean. Writes
``perf/results/bench_grammar.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
from megainfer.bench.results_io import write_json  # noqa: E402
from perf_paths import RESULTS  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
LONG = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                   "minItems": 64}}, "required": ["notes"]}


def write_vocab_tokenizer(path: str, vocab: int) -> None:
    """A byte-level BPE ``tokenizer.json`` of ``vocab`` tokens (no merges: encoding gives
    bytes; the vocabulary is what a grammar's mask runs over)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from megainfer.engine.grammar import bytes_to_unicode
    alphabet = bytes_to_unicode()
    toks = [alphabet[b] for b in range(256)]
    rng = random.Random(0)
    pieces = "abcdefghijklmnopqrstuvwxyz" * 3 + "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + ' ",:{}[]._-'
    seen = set(toks)
    while len(toks) < vocab - 1:
        word = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 8)))
        word = (alphabet[ord(" ")] + word) if rng.random() < 0.5 else word
        word = "".join(alphabet[ord(c)] if c == " " else c for c in word)
        if word not in seen:
            seen.add(word)
            toks.append(word)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])  # id vocab - 1: the eos
    tok.save(path)


def build(vocab: int) -> str:
    from megainfer.tools.make_tiny import make_tiny
    d = tempfile.mkdtemp(prefix="bench_grammar_")
    make_tiny("mixtral", d, seed=0, chat_template=False, vocab=vocab, hidden=512, inter=1024,
              layers=4, heads=8, kv_heads=4, experts=8, top_k=2)
    write_vocab_tokenizer(os.path.join(d, "tokenizer.json"), vocab)
    import json
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["eos_token_id"] = vocab - 1
    json.dump(cfg, open(cfg_path, "w"))
    return d


class GrammarWork:
    """B samples under SCHEMA: one step of the sampler's grammar work per call."""

    def __init__(self, engine, B: int, V: int):
        from megainfer import SamplingParams
        from megainfer.engine.request import Request
        self.grammars, self.V = engine.grammars, V
        self.params = SamplingParams(max_tokens=10_000, structured_outputs={"json": SCHEMA})
        self.reqs = [Request(i, str(i), None, [1], self.params, seed=i) for i in range(B)]
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(B, V, generator=g)
        self.rows = torch.arange(B)
        self.restarts = 0

    def __call__(self) -> float:
        """One step; returns the seconds of grammar work in it (the clone and argmax that
        stand for the rest of the sampler are not counted)."""
        from megainfer.engine.grammar_state import apply_bitmask, grammar_masks
        x = self.logits.clone()
        t0 = time.perf_counter()
        _, bits = grammar_masks(self.reqs, self.grammars, self.V)
        apply_bitmask(x, list(range(len(self.reqs))), bits)
        spent = time.perf_counter() - t0
        for r, t in zip(self.reqs, x.argmax(-1).tolist()):
            r.output_token_ids.append(t)
            t0 = time.perf_counter()
            ended = r.grammar.sync(r.output_token_ids, self.grammars)
            spent += time.perf_counter() - t0
            if ended is not None:  # restart
                r.output_token_ids, r.grammar = [], None
                self.restarts += 1
        return spent


def engine_steps(llm, B: int, ctx: int, V: int, schema=None):
    from megainfer import SamplingParams
    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    p = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True,
                       structured_outputs=None if schema is None else {"json": schema})
    for i in range(B):
        eng.add_request(f"b{B}-{i}", torch.randint(0, V - 1, (ctx,), generator=g).tolist(), p)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step_outputs()
    return eng.step_outputs


def timed(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def grammar_time(work, steps: int) -> float:
    return sum(work() for _ in range(steps)) / steps


def compile_times(engine, n: int) -> dict:
    """Per schema variant (``n`` of them, a fresh cache): first compile and a cached one."""
    from megainfer.engine import grammar
    from megainfer.engine.structured_outputs import StructuredOutputsParams
    grammar.clear_cache()
    first, cached = [], []
    for i in range(n):
        spec = StructuredOutputsParams(json=dict(SCHEMA, title=f"s{i}"))
        t0 = time.perf_counter()
        engine.grammars.get(spec)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.grammars.get(spec)
        cached.append(time.perf_counter() - t0)
    return {"first_ms": 1e3 * statistics.median(first), "cached_ms": 1e3 * statistics.median(cached),
            "first_ms_all": [1e3 * t for t in first]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_grammar.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from megainfer import LLM
    d = build(a.vocab)
    rows = []
    for B in a.batches:
        n = 2 * a.repeats * a.steps + 64
        kw = dict(max_model_len=a.context + n, max_num_seqs=B,
                  max_num_batched_tokens=max(B * a.context, 256),
                  num_blocks=B * (a.context + n) // 16 + 8, block_size=16)
        llm, llm_g = LLM(d, **kw), LLM(d, **kw)
        torch.set_num_threads(a.threads)  # LLM(...) sets the job's thread count
        step = engine_steps(llm, B, a.context, a.vocab)
        step_g = engine_steps(llm_g, B, a.context, a.vocab, LONG)
        work = GrammarWork(llm.engine, B, a.vocab)
        work()  # compiles the schema, builds the matchers
        s_t, g_t, e_t = [], [], []
        for _ in range(a.repeats):
            s_t.append(timed(step, a.steps))
            g_t.append(grammar_time(work, a.steps))
            e_t.append(timed(step_g, a.steps))
        assert all(len(r.output_token_ids) > a.repeats * a.steps
                   for r in llm_g.engine.requests.values()), "a LONG output ended"
        s, g, e = (statistics.median(t) for t in (s_t, g_t, e_t))
        rows.append({"B": B, "step_ms": 1e3 * s, "grammar_ms": 1e3 * g,
                     "grammar_per_seq_us": 1e6 * g / B, "overhead": g / s,
                     "engine_grammar_step_ms": 1e3 * e, "engine_overhead": e / s - 1,
                     "restarts": work.restarts})
        comp = compile_times(llm.engine, 5)
        del llm, llm_g
    print(f"vocab {a.vocab}, context {a.context}, {a.threads} thread(s), {a.repeats} rounds x "
          f"{a.steps} steps")
    print("| B | decode step ms | grammar ms / step | per sequence us | extra | step with "
          "grammars ms | extra |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['step_ms']:.2f} | {r['grammar_ms']:.2f} | "
              f"{r['grammar_per_seq_us']:.0f} | {100 * r['overhead']:.1f}% | "
              f"{r['engine_grammar_step_ms']:.2f} | {100 * r['engine_overhead']:.1f}% |")
    print(f"compile: first {comp['first_ms']:.1f} ms, cached {comp['cached_ms']:.3f} ms")
    write_json(a.out, {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "machine": platform.node(), "cpus": os.cpu_count(),
                       "loadavg": os.getloadavg(), "args": vars(a), "rows": rows,
                       "compile": comp, "schema": SCHEMA})


if __name__ == "__main__":
    main()
