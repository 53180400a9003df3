"""Grammar engines side by side on the default model's tokenizer: llguidance and xgrammar.

For each: the compile time of a realistic nested JSON schema, the per-token cost of computing
the allowed-token bitmask while a valid instance is fed token by token (the cost the engine step
pays per constrained request), and JSON-schema coverage: of a set of schemas using the features
applications send, how many compile and accept a valid instance.

    .venv/bin/pip install xgrammar   # only for this comparison; kvmesh depends on llguidance alone
    .venv/bin/python bench/structured_backends.py
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "address", "role"],
    "additionalProperties": False,
}
NESTED_INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"],
                   "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"}, "role": "admin"}

COVERAGE = [
    ("enum", {"enum": ["a", "b", 3]}, 3),
    ("const", {"const": "fixed"}, "fixed"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}}]}, {"a": 1}),
    ("$ref/$defs", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}},
                                     "required": ["x"]}},
                    "type": "array", "items": {"$ref": "#/$defs/pt"}}, [{"x": 1.5}]),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}, "$ref": "#/$defs/node"}, {"v": 1, "kids": [{"v": 2}]}),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12"),
    ("format date-time", {"type": "string", "format": "date-time"}, "2026-12-02T10:00:00Z"),
    ("number bounds", {"type": "number", "minimum": -1.5, "exclusiveMaximum": 10}, 3.25),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2]),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}}, {"k": 1}),
    ("type list", {"type": ["string", "null"]}, None),
    ("nested", NESTED, NESTED_INSTANCE),
]


def _cpu() -> str:
    try:
        text = open("/proc/cpuinfo").read()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
        return f"{model}; avx512_bf16={'avx512_bf16' in flags}, amx={'amx_bf16' in flags}"
    except (OSError, StopIteration):
        return platform.processor()


class Llg:
    name = "llguidance"

    def __init__(self, hf_tok, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                               defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self):
        return self.lt.allocate_token_bitmask(1, self.vocab)

    def fill(self, m, mask) -> None:
        self.lt.fill_next_token_bitmask(m, mask, 0)

    def consume(self, m, t) -> bool:
        return m.consume_token(t)


class Xgr:
    name = "xgrammar"

    def __init__(self, hf_tok, vocab: int) -> None:
        import xgrammar

        self.x = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema):
        return self.x.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                        separators=(",", ":")))

    def bitmask(self):
        return self.x.allocate_token_bitmask(1, self.vocab)

    def fill(self, m, mask) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def consume(self, m, t) -> bool:
        return m.accept_token(t)


def _allowed(mask: torch.Tensor, t: int) -> bool:
    return bool((int(mask[0, t // 32]) >> (t % 32)) & 1)


def measure(backend, tokenizer, schema, instance, eos: int) -> dict:
    t0 = time.perf_counter()
    m = backend.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    ids = tokenizer.encode(json.dumps(instance, separators=(",", ":")))
    mask = backend.bitmask()
    fills = []
    ok = True
    for t in ids:
        s = time.perf_counter()
        backend.fill(m, mask)
        fills.append(time.perf_counter() - s)
        if not _allowed(mask, t) or not backend.consume(m, t):
            ok = False
            break
    if ok:
        backend.fill(m, mask)
        ok = _allowed(mask, eos)
    return {"compile_ms": compile_ms, "fill_us": statistics.median(fills) * 1e6 if fills else 0.0,
            "fill_p90_us": sorted(fills)[int(0.9 * (len(fills) - 1))] * 1e6 if fills else 0.0, "ok": ok,
            "tokens": len(ids)}


def main() -> None:
    from kvmesh.engine.model.loader import load_model

    loaded = load_model("default", torch.float32)
    tok = loaded.tokenizer
    vocab = loaded.config.vocab_size
    eos = tok.eos_token_ids[0]
    print(f"CPU: {_cpu()}; vocab {vocab}")
    for cls in (Llg, Xgr):
        try:
            backend = cls(tok.hf, vocab)
        except ImportError as e:  # xgrammar is not a kvmesh dependency: `pip install xgrammar` to compare
            print(f"{cls.name}: not installed ({e})")
            continue
        nested = [measure(backend, tok, NESTED, NESTED_INSTANCE, eos) for _ in range(3)]
        covered = []
        for name, schema, inst in COVERAGE:
            try:
                covered.append((name, measure(backend, tok, schema, inst, eos)["ok"]))
            except Exception as e:  # noqa: BLE001 - a schema the backend refuses counts as not covered
                covered.append((name, False))
                print(f"  {backend.name} refused {name}: {type(e).__name__}: {str(e)[:100]}")
        missing = [n for n, ok in covered if not ok]
        print(f"{backend.name}: nested schema compile {min(r['compile_ms'] for r in nested):.1f} ms, "
              f"mask {statistics.median(r['fill_us'] for r in nested):.0f} us/token median "
              f"(p90 {statistics.median(r['fill_p90_us'] for r in nested):.0f} us) over {nested[0]['tokens']} tokens, "
              f"valid={nested[0]['ok']}; coverage {sum(ok for _, ok in covered)}/{len(covered)}"
              + (f" (missing: {', '.join(missing)})" if missing else ""))


if __name__ == "__main__":
    main()
