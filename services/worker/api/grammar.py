"""Structured output, the compile side: a request's Grammar (common.proto) compiled for the
served tokenizer with llguidance, cached, and handed to its sequence as a fresh matcher.

llguidance reads the checkpoint's tokenizer.json itself (LLTokenizer), so the worker needs no
transformers tokenizer; a matcher is the grammar's parser state for one sequence: the runner
advances it with each sampled token and asks it for the next token mask
(services.worker.executor.token_mask). docs/ARCHITECTURE.md says why llguidance rather than
xgrammar.

Compiling (building the grammar's lexer and parser for this tokenizer) runs on the compile
threads (llguidance drops the GIL meanwhile), never on the event loop or the engine thread,
and a request waits for it before it is submitted: nothing compiles on the serving path. It
is bounded twice: llguidance's own limits (lexer fuel, grammar size) make a pathological
grammar an error, and `timeout_s` answers a request whose compile is still running then
INVALID_ARGUMENT (the compile finishes on its thread and is cached). Compiled grammars are
cached per (digest of the grammar's kind and text, digest of tokenizer.json), LRU, `cache`
entries; each request gets a deep copy of the cached matcher in its start state (~10 us).
Concurrent requests for one grammar share one compile.

JSON schemas are written compactly (", " between items, ": " after keys, no other
whitespace): a sampled model given free whitespace may emit it without end. A schema's own
"x-guidance" object overrides that (llguidance's JSON options).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import importlib.metadata
import json
import logging
import threading
import time

import llguidance

from services.common.errors import InvalidArgument
from services.worker.config import GrammarOptions

log = logging.getLogger(__name__)
# LLTokenizer takes the list of EOS tokens (eos_token=[...]) from llguidance 1.7 (pyproject's
# floor); 1.6 takes one int and fails with a TypeError that does not name the version
MIN_LLGUIDANCE = (1, 7)


def check_llguidance(version: str | None = None) -> None:
    """Refuse an llguidance older than MIN_LLGUIDANCE, naming both versions (version: the
    installed one's, read from its metadata when None)."""
    version = version or importlib.metadata.version("llguidance")
    try:
        have = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return                                   # a development build: let it try
    if have < MIN_LLGUIDANCE:
        need = ".".join(map(str, MIN_LLGUIDANCE))
        raise RuntimeError(f"structured output needs llguidance >= {need}; {version} is "
                           f"installed (pip install 'llguidance>={need}')")
KINDS = ("json_schema", "regex", "choice", "lark", "ebnf")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_TEXT = 256 << 10             # the largest grammar text (bytes)
MAX_CHOICES = 1024               # choice options, each at most MAX_CHOICE bytes
MAX_CHOICE = 1024


def grammar_text(grammar) -> tuple[str, str]:
    """A Grammar message -> (its kind, llguidance's grammar text); INVALID_ARGUMENT naming
    the field for one that is malformed before any compile (not JSON, too large, empty)."""
    kind = grammar.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("sampling.grammar: set one of " + ", ".join(KINDS))
    field = f"sampling.grammar.{kind}"
    if kind == "choice":
        options = list(grammar.choice.options)
        if not options or len(options) > MAX_CHOICES or \
                any(len(o.encode()) > MAX_CHOICE for o in options):
            raise InvalidArgument(f"{field}: 1 to {MAX_CHOICES} options of at most "
                                  f"{MAX_CHOICE} bytes each")
        if any(not o for o in options):
            raise InvalidArgument(f"{field}: an option is empty")
        return kind, llguidance.grammar_from("choice", json.dumps(options))
    text = getattr(grammar, kind)
    if not text.strip():
        raise InvalidArgument(f"{field}: empty")
    if len(text.encode()) > MAX_TEXT:
        raise InvalidArgument(f"{field}: larger than {MAX_TEXT >> 10} KiB")
    if kind == "json_schema":
        return kind, _schema_grammar(field, text)
    try:
        return kind, llguidance.grammar_from({"regex": "regex", "lark": "lark",
                                              "ebnf": "gbnf"}[kind], text)
    except ValueError as exc:                      # a GBNF grammar that does not convert
        raise InvalidArgument(f"{field}: {exc}") from None


def _schema_grammar(field: str, text: str) -> str:
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidArgument(f"{field}: not JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument(f"{field}: a JSON Schema is an object (or true/false)")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{field}: {exc}") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...],
                 opts: GrammarOptions):
        """tokenizer_json: the checkpoint's tokenizer.json text; vocab_size: the model's logits
        width (tokens past the tokenizer's are never allowed); eos_ids: the end tokens a
        complete grammar allows."""
        self.opts = opts
        check_llguidance()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_ids) or None)
        self.tokenizer_digest = hashlib.blake2b(tokenizer_json.encode(),
                                                digest_size=8).hexdigest()
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(opts.compile_threads,
                                                           thread_name_prefix="grammar")
        self._cache: collections.OrderedDict[tuple, llguidance.LLMatcher] = \
            collections.OrderedDict()
        self._running: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()          # the cache: the loop reads, compile threads add
        self.compiles = 0
        self.compile_seconds = 0.0

    def key(self, kind: str, text: str) -> tuple[str, str]:
        """The cache key: (digest of the grammar, digest of the tokenizer)."""
        digest = hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=16).hexdigest()
        return digest, self.tokenizer_digest

    async def matcher(self, grammar) -> llguidance.LLMatcher:
        """A fresh matcher for this Grammar message (compiled or from the cache);
        INVALID_ARGUMENT naming the field when it does not compile, or not in time."""
        kind, text = grammar_text(grammar)
        key = self.key(kind, text)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
            else:
                future = self._running.get(key)
                if future is None:
                    future = self._pool.submit(self._compile, text)
                    self._running[key] = future
                    future.add_done_callback(lambda f: self._compiled(key, f))
        if cached is None:
            try:
                cached = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                                self.opts.timeout_s)
            except asyncio.TimeoutError:
                raise InvalidArgument(f"sampling.grammar.{kind}: did not compile within "
                                      f"{self.opts.timeout_s:g}s (too complex)") from None
            if isinstance(cached, str):
                raise InvalidArgument(f"sampling.grammar.{kind}: {cached}")
        return cached.deep_copy()

    def _compile(self, text: str):
        """On a compile thread: the matcher in its start state, or the error's text."""
        start = time.perf_counter()
        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            self.compiles += 1
        return _first_line(m.get_error()) if m.is_error() else m

    def _compiled(self, key: tuple, future: concurrent.futures.Future) -> None:
        """Done callback (compile thread): cache a compiled grammar (errors are not kept)."""
        result = None if future.cancelled() or future.exception() else future.result()
        with self._lock:
            self._running.pop(key, None)
            if isinstance(result, llguidance.LLMatcher):
                self._cache[key] = result
                while len(self._cache) > self.opts.cache:
                    self._cache.popitem(last=False)

    def compile_now(self, kind: str, text: str) -> llguidance.LLMatcher:
        """Compile synchronously, uncached (benchmarks); ValueError on a bad grammar."""
        result = self._compile(text)
        if isinstance(result, str):
            raise ValueError(f"{kind}: {result}")
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compiler_for(tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...],
                 opts: GrammarOptions) -> GrammarCompiler | None:
    """The checkpoint's compiler, or None (structured output off, said in the log) for a
    tokenizer llguidance cannot read (a WordPiece one, say)."""
    try:
        return GrammarCompiler(tokenizer_json, vocab_size, eos_ids, opts)
    except ValueError as exc:
        log.warning("structured output is off: llguidance cannot read this tokenizer (%s)",
                    exc)
        return None


def _first_line(message: str) -> str:
    """llguidance's error, its first lines (a regex error draws the pattern over several)."""
    lines = [x for x in message.strip().splitlines() if x.strip()]
    return " ".join(x.strip() for x in lines[:4])[:500] or "does not compile"
