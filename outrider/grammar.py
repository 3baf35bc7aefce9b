"""Structured output: a request's constraint compiled for a tokenizer, and
the matcher that follows a session's generated tokens (docs/design.md#structured-output).

The grammars are llguidance's: it compiles JSON schemas, regular
expressions, choice lists and Lark or GBNF grammars against the tokenizer
in a millisecond or two, fills a token's bitmask in 3 to 8 µs, and needs no
torch, so the coordinator checks a request's constraint with the same
compiler the workers run. Every process that serves structured output
holds one :class:`Grammars` (its tokenizer, read once, and a compiled
matcher per constraint, copied for each session); each session one
:class:`Matcher`.

A bitmask row holds ``ceil(V / 32)`` int32 words: bit ``j`` of word ``i``
allows token ``32 i + j``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from outrider.errors import InvalidArgument
from outrider.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_TEMPLATES = 64
"""Compiled constraints kept per process, least recently used dropped."""

PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
"""What llguidance lets one grammar cost, in every process that runs one
(so the coordinator's check refuses what a worker would): its defaults —
at most 2,000 items in a parser row, 200,000 units of lexer fuel a token
(about 14 ms), 500,000 grammar symbols, 250,000 lexer states — with errors
that name the limit but not the grammar or the parser's state (verbose
errors quote the whole grammar, tens of kilobytes of client text)."""


class GrammarError(InvalidArgument):
    """The request's structured output cannot be run to the end: a step of
    the parser broke one of :data:`PARSER_LIMITS`. The request's fault, as a
    grammar that does not compile is: it fails wherever it runs."""


JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "key_separator": ": ",
    "item_separator": ", ",
}
"""How JSON is laid out under a constraint: as ``json.dumps`` lays it out
(vLLM's ``disable_any_whitespace``). Free whitespace lets a weak model pad
its JSON with blanks and newlines until its token limit: SmolLM2-135M did,
on 1 of the 20 ``describe`` prompts."""


def grammar_text(output: StructuredOutput) -> str:
    """The constraint as an llguidance grammar; ValueError for a spec its kind cannot read."""
    kind, spec = output.kind, output.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=JSON_LAYOUT
        )
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError:
            choices = None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise ValueError("a choice constraint is a non-empty list of strings")
        return choice_grammar(choices)
    if kind == "regex":
        return llguidance.grammar_from("regex", spec)
    # A grammar: GBNF ("root ::= ...") or Lark ("start: ...").
    return llguidance.grammar_from("ebnf" if "::=" in spec else "lark", spec)


def choice_grammar(choices: Sequence[str]) -> str:
    """One of ``choices``, as a single lexeme: the lexer's automaton follows
    any number of them, where llguidance's own choice grammar (a rule of one
    alternative each) puts every choice in one parser row, and a row holds
    at most 2,000 items."""
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")


def _reason(error: str) -> str:
    """An llguidance error, less its prefix and what follows its first line."""
    line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return line.removeprefix("Parser Error: ").removeprefix("Error: ")


class Grammars:
    """The constraints one process compiles for its tokenizer; the tokenizer
    is read at the first use (``tokenizer()``: an ``LLTokenizer``)."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer]) -> None:
        self._load = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher | InvalidArgument] = (
            OrderedDict()
        )
        """Compiled constraints, and refused ones (with why), by (kind, spec)."""
        self._lock = threading.Lock()
        """Guards ``_templates``: compiles run on threads (:meth:`compile`)."""

    @classmethod
    def of_tokenizer(cls, hf_tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> Grammars:
        """For a Hugging Face fast tokenizer, with ``vocab_size`` logits a
        row (the model's, which may exceed the tokenizer's) and the model's
        end-of-sequence ids (what a finished constraint allows)."""
        return cls(lambda: _llguidance_tokenizer(hf_tokenizer, vocab_size, eos))

    @classmethod
    def of_checkpoint(
        cls, spec: str | None, vocab_size: int, *, trust_remote_code: bool = False
    ) -> Grammars:
        """For a checkpoint's tokenizer (``outrider.model_specs.resolve`` reads
        ``spec``) and end-of-sequence ids, as the coordinator reads them."""

        def load() -> tuple[Any, Iterable[int]]:
            from outrider import model_specs

            tokenizer = model_specs.load_tokenizer(spec, trust_remote_code=trust_remote_code)
            return tokenizer, model_specs.eos_token_ids(
                tokenizer, model_specs.generation_config(spec)
            )

        return cls.loading(load, vocab_size)

    @classmethod
    def loading(cls, load: Callable[[], tuple[Any, Iterable[int]]], vocab_size: int) -> Grammars:
        """For the Hugging Face tokenizer and end-of-sequence ids ``load``
        returns, called at the first use."""

        def tokenizer() -> llguidance.LLTokenizer:
            hf_tokenizer, eos = load()
            return _llguidance_tokenizer(hf_tokenizer, vocab_size, eos)

        return cls(tokenizer)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = self._load()
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def check(self, output: StructuredOutput) -> None:
        """Refuses a constraint that does not compile, saying why."""
        self._template(output)

    def compile(self, output: StructuredOutput) -> None:
        """Compiles ``output`` into the cache, or its refusal: for a thread
        of its own (a large grammar takes up to about half a second), ahead of
        :meth:`check` or :meth:`matcher` on another."""
        self._template(output, reraise=False)

    def matcher(self, output: StructuredOutput) -> Matcher:
        """A matcher at the start of the constraint, for one session."""
        template = self._template(output)
        return Matcher(template.deep_copy(), self.vocab_size, frozenset(self.tokenizer.eos_tokens))

    def _template(self, output: StructuredOutput, *, reraise: bool = True) -> llguidance.LLMatcher:
        key = (output.kind, output.spec)
        with self._lock:
            compiled = self._templates.get(key)
            if compiled is not None:
                self._templates.move_to_end(key)
        if compiled is None:
            compiled = self._compiled(output)
            with self._lock:
                self._templates[key] = compiled
                if len(self._templates) > MAX_TEMPLATES:
                    self._templates.popitem(last=False)
        if isinstance(compiled, InvalidArgument) and reraise:
            raise InvalidArgument(str(compiled))
        return compiled  # type: ignore[return-value]

    def _compiled(self, output: StructuredOutput) -> llguidance.LLMatcher | InvalidArgument:
        """The constraint's matcher at its start, its first step taken (the
        lexer and parser row it opens with); or why it is refused."""
        try:
            grammar = grammar_text(output)
        except ValueError as exc:
            return InvalidArgument(f"{output.kind}: {exc}")
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if not template.is_error():
            template.compute_bitmask()
        if template.is_error():
            return InvalidArgument(
                f"{output.kind} does not compile: {_reason(template.get_error())}"
            )
        return template


def _llguidance_tokenizer(
    hf_tokenizer: Any, vocab_size: int, eos: Iterable[int]
) -> llguidance.LLTokenizer:
    from llguidance.hf import from_tokenizer  # (imports transformers: at the first use)

    return from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos))


class Matcher:
    """Where a session stands in its constraint: the generated tokens it
    has consumed (``tokens``), rolled back and forward to follow the
    session's tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: frozenset[int]) -> None:
        self._matcher = matcher
        self.words = (vocab_size + 31) // 32
        self.eos = eos
        """What the constraint allows once it has ended."""
        self.tokens: list[int] = []
        self._pushed: list[bool] = []
        """Whether llguidance counted each token in its history: an
        end-of-sequence token after the constraint ended is not (vLLM's
        rollback lag)."""

    def sync(self, generated: Sequence[int]) -> None:
        """Moves to the end of ``generated``: rolls back to what it shares
        with what was consumed, then consumes the rest."""
        shared = 0
        for a, b in zip(self.tokens, generated, strict=False):
            if a != b:
                break
            shared += 1
        self.rollback_to(shared)
        self.extend(generated[shared:])

    def extend(self, tokens: Sequence[int]) -> None:
        """Consumes ``tokens``; InvalidArgument if the constraint forbids one
        (GrammarError if it can no longer say)."""
        for token in tokens:
            if not self.consume(token):
                raise InvalidArgument(
                    f"token {token} at generated position {len(self.tokens)} does not follow "
                    "the request's structured output"
                )

    def consume(self, token: int) -> bool:
        """Consumes ``token`` if the constraint allows it (else False, and
        nothing changes); GrammarError once the parser has broken a limit."""
        # (Once the constraint has ended it allows end-of-sequence tokens
        # only, which llguidance's validation then refuses.)
        self._check()
        stopped = self._matcher.is_stopped()
        if stopped and token not in self.eos:
            return False
        if not stopped and self._matcher.validate_tokens([token]) != 1:
            self._check()
            return False
        if not self._matcher.consume_token(token):
            self._check()
            raise RuntimeError(f"llguidance refused token {token} it had validated")
        self.tokens.append(token)
        self._pushed.append(not stopped)
        return True

    def rollback_to(self, length: int) -> None:
        """Forgets the tokens consumed after the first ``length``."""
        if length >= len(self.tokens):
            return
        count = sum(self._pushed[length:])
        if count and not self._matcher.rollback(count):
            self._check()
            raise RuntimeError(f"llguidance could not roll back {count} tokens")
        del self.tokens[length:], self._pushed[length:]

    def fill(self, row: np.ndarray) -> None:
        """Fills ``row`` (``words`` int32) with the tokens allowed next."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()

    def _check(self) -> None:
        """GrammarError once llguidance's matcher is in its error state
        (which it never leaves)."""
        if self._matcher.is_error():
            raise GrammarError(
                f"the structured output broke a limit of the grammar engine at generated token "
                f"{len(self.tokens) + 1}: {_reason(self._matcher.get_error())}"
            )

    def mask(self) -> np.ndarray:
        """The tokens allowed next, as a bitmask row."""
        row = np.empty(self.words, dtype=np.int32)
        self.fill(row)
        return row

    def masks(self, drafts: Sequence[int]) -> tuple[np.ndarray, int]:
        """The bitmasks of a round's positions, ``[len(drafts) + 1, words]``:
        row ``t`` allows what may follow ``drafts[:t]``, for ``t`` up to the
        number of leading drafts the constraint allows (also returned);
        the rows after it allow everything (no such position is reached).
        The matcher ends where it started."""
        rows = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        start = len(self.tokens)
        allowed = 0
        for draft in drafts:
            self.fill(rows[allowed])
            if not self.consume(draft):
                break
            allowed += 1
        else:
            self.fill(rows[allowed])
        self.rollback_to(start)
        return rows, allowed
