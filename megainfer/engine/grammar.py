"""Grammars compiled with xgrammar, for a tokenizer's vocabulary, cached by their spec.

``Grammars(tokenizer, vocab_size)`` is a handle on the process-wide cache: ``get`` compiles
(or finds) a spec's grammar and waits for it, a ``RequestError`` naming the field when it does
not compile (a frontend's intake, off the engine loop); ``future`` starts the
compilation on a background thread and returns at once (the engine, when a request arrives:
it compiles while the prompt is prefilled). The cache is a bounded LRU per process keyed by
(tokenizer, vocab size, spec); compiled grammars never leave their process (they are native
objects): each rank that samples builds its own, once."""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

from .errors import RequestError
from .structured_outputs import StructuredOutputsParams
from .tokenizer import ByteTokenizer, HFTokenizer

MAX_CACHED = 256  # compiled grammars kept per process (least recently used dropped first)
COMPILE_THREADS = 2

_lock = threading.Lock()
_compilers: dict = {}  # tokenizer key -> xgrammar.GrammarCompiler
_cache: "OrderedDict[tuple, Future]" = OrderedDict()
_pool: Optional[ThreadPoolExecutor] = None
stats = {"compiled": 0, "hits": 0}


def tokenizer_key(tokenizer, vocab_size: int) -> tuple:
    """What a tokenizer's compiled grammars depend on: its vocabulary and the model's vocab
    size (the logits' width); the stop tokens are the matchers' (``Grammars.stop_ids``)."""
    if isinstance(tokenizer, HFTokenizer):
        ident = ("hf", os.path.realpath(tokenizer.path))
    elif isinstance(tokenizer, ByteTokenizer):
        ident = ("bytes", tuple(sorted(tokenizer.special)))
    else:
        ident = ("object", id(tokenizer))
    return ident + (vocab_size,)


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of the vocabulary: each id's bytes (special tokens empty: a grammar never
    allows them) and the vocabulary kind (byte-level BPE, byte fallback or raw)."""
    import xgrammar as xgr  # lazy: ~3 s and transformers; only structured outputs need it
    if isinstance(tokenizer, ByteTokenizer):
        vocab = [bytes([i]) if i not in tokenizer.special else b""
                 for i in range(min(256, vocab_size))]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=[])
    if not isinstance(tokenizer, HFTokenizer):
        raise RequestError(f"structured_outputs: needs the checkpoint's tokenizer.json or the "
                           f"byte tokenizer (not {type(tokenizer).__name__})")
    tok = tokenizer.tok
    added = {i: t for i, t in tok.get_added_tokens_decoder().items()}
    by_id = {i: s for s, i in tok.get_vocab(with_added_tokens=True).items()}
    n = min(vocab_size, max(by_id) + 1 if by_id else 0)
    decoder = json.dumps(json.loads(tok.to_str()).get("decoder"))
    if '"ByteLevel"' in decoder:  # each id's own bytes (added tokens: their text's)
        inv = {c: b for b, c in bytes_to_unicode().items()}
        vocab = [b"" if i in added and added[i].special else
                 added[i].content.encode() if i in added else
                 bytes(inv[c] for c in by_id[i]) if i in by_id and all(c in inv for c in by_id[i])
                 else by_id.get(i, "").encode() for i in range(n)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=[])
    vocab = ["" if i in added and added[i].special else by_id.get(i, "") for i in range(n)]
    kind = xgr.VocabType.BYTE_FALLBACK if '"ByteFallback"' in decoder else xgr.VocabType.RAW
    return xgr.TokenizerInfo(vocab, kind, vocab_size=vocab_size, stop_token_ids=[],
                             add_prefix_space='"Metaspace"' in decoder)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character byte-level BPE writes it as."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def _error_text(e: Exception) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)


class Grammars:
    """A tokenizer's compiled grammars (the process-wide cache); ``stop_ids``: the tokens a
    matcher accepts once its grammar is complete (the model's eos)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int] = ()):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids = sorted({t for t in stop_ids if 0 <= t < vocab_size})
        self.key = tokenizer_key(tokenizer, vocab_size)

    def _compiler(self):
        with _lock:
            c = _compilers.get(self.key)
        if c is None:
            import xgrammar as xgr  # lazy: ~3 s and transformers; only structured outputs need it
            info = tokenizer_info(self.tokenizer, self.vocab_size)
            c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            with _lock:
                c = _compilers.setdefault(self.key, c)
        return c

    def _compile(self, spec: StructuredOutputsParams):
        c, kind, value = self._compiler(), spec.kind, getattr(spec, spec.kind)
        ws = not spec.disable_any_whitespace
        try:
            if kind == "json":
                return c.compile_json_schema(value, any_whitespace=ws, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
            if kind == "regex":
                return c.compile_regex(value)
            if kind == "choice":
                return c.compile_regex("|".join(re.escape(s) for s in value))
            return c.compile_grammar(value)
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar's refusal of this spec
            raise RequestError(f"structured_outputs.{kind}: does not compile "
                               f"({_error_text(e)})") from e
        finally:
            stats["compiled"] += 1

    def future(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec`` (cached, or compiling on a background thread)."""
        global _pool
        key = self.key + spec.key
        with _lock:
            fut = _cache.get(key)
            if fut is not None:
                _cache.move_to_end(key)
                stats["hits"] += 1
                return fut
            if _pool is None:
                _pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
            fut = _pool.submit(self._compile, spec)
            _cache[key] = fut
            while len(_cache) > MAX_CACHED:
                _cache.popitem(last=False)
        fut.add_done_callback(lambda f, k=key: f.exception() is not None and _forget(k, f))
        return fut

    def get(self, spec: StructuredOutputsParams):
        """The compiled grammar (waits for its compilation); a ``RequestError`` if it fails."""
        return self.future(spec).result()


def _forget(key, fut) -> None:
    """A spec that failed to compile is not kept (the error is the request's, not cached)."""
    with _lock:
        if _cache.get(key) is fut:
            del _cache[key]


def clear_cache() -> None:
    with _lock:
        _cache.clear()
        _compilers.clear()
