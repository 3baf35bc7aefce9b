"""Streaming detokenization and stop strings: token ids in, text deltas that are safe to send out.

The coordinator commits tokens one or several at a time and streams text. Two things
make that harder than `decode(new_ids)`:

* **A token is not a piece of text.** A byte-level BPE token may hold half of a UTF-8
  character (an emoji often spans four tokens), and a SentencePiece decoder drops the
  leading space of whatever it decodes first, so `decode([▁world])` is "world" even
  after "hello". `IncrementalDetokenizer` uses the *prefix_offset / read_offset*
  scheme of vLLM and TGI: decode a window that starts a few tokens back (in the prompt,
  for the first token), emit only what extends the decode of the window without the new
  tokens, and hold back text that ends in U+FFFD (an incomplete character) until the
  bytes that complete it arrive.
* **A stop string may span tokens.** `StopStringMatcher` holds back the longest tail of
  the text that could still grow into a stop string, so a client never sees text that
  later turns out to be part of one, and cuts the output just before the stop string
  (the stop string itself is not output, as in vLLM and the OpenAI API, unless
  `include_stop_str_in_output` asks for it, as vLLM's option of that name does).
* **`min_tokens`** (vLLM's): the text of a request's first `min_tokens` tokens ends no
  generation. A stop string counts only if it ends in the text of a later token; it may
  start earlier, as in vLLM.

`TextStream` chains the two and ends at a stop token id too (eos among them); the
coordinator keeps one per request.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens the first decode window reaches back (vLLM and TGI use 5):
# enough for the decoder to see the word and byte context the first new token continues.
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer that detokenization needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without broken UTF-8 or lost spaces.

    State: `ids` is prompt + generated ids; the text of `ids[:read_offset]` has been
    emitted (or belongs to the prompt), and `ids[prefix_offset:read_offset]` is the
    context window that the next decode starts from. On each new token::

        prefix_text = decode(ids[prefix_offset:read_offset])
        new_text    = decode(ids[prefix_offset:])
        emit new_text[len(prefix_text):] unless it is empty or ends in U+FFFD,
        and then slide the window: prefix_offset, read_offset = read_offset, len(ids)

    A prompt that ends in the middle of a character is not supported: the character it
    completes is attributed to the prompt and not emitted.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (often "", never a broken character)."""
        self._ids.append(token_id)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """Release what is held back, as decoded (an incomplete character becomes U+FFFD)."""
        return self._advance(hold_incomplete=False)

    @property
    def text(self) -> str:
        """All text emitted so far (nothing held back)."""
        return "".join(self._chunks)

    def _advance(self, *, hold_incomplete: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            # A special token that is skipped, or bytes that do not make a character yet.
            return ""
        if hold_incomplete and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._chunks.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Cuts a stream of text at the first stop string and holds back text that may become one.

    Text goes in through `feed` and comes out (possibly delayed) as its return value:

    * once the text contains a stop string, the output ends just before it and `stopped`
      names it. The winner is the stop string that is completed first (earliest end; on
      a tie, the one that starts first), so the result does not depend on how the text
      was chunked;
    * otherwise the longest tail of the text that is a proper prefix of some stop string
      is held back, and released by a later `feed` (if the text diverges) or `finish`.

    Because held-back text is the only text a future match can start in, each `feed`
    searches just the held-back tail (at most max stop length - 1 characters) plus the
    new text, for a stop string that ends in the new text. A `feed(text, match=False)`
    (text that may not end the stream: vLLM's ``min_tokens``) holds back and releases
    text as usual but matches nothing. ``include_stop``: the output ends just after
    the stop string instead.
    """

    def __init__(self, stop: Sequence[str] = (), *, include_stop: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._held = ""
        self._stopped: str | None = None

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet released (it may be the start of a stop string)."""
        return self._held

    def feed(self, text: str, *, match: bool = True) -> str:
        """Add text; return the text that is now safe to emit. ``match``:
        whether a stop string ending in this text ends the stream."""
        if self._stopped is not None:
            raise RuntimeError(f"stop string {self._stopped!r} already matched")
        window = self._held + text
        found = self._first_completed(window, new_from=len(self._held)) if match else None
        if found is not None:
            start, self._stopped = found
            self._held = ""
            return window[: start + len(self._stopped) if self._include_stop else start]
        keep = self._longest_stop_prefix_at_end(window)
        self._held = window[len(window) - keep :]
        return window[: len(window) - keep]

    def finish(self) -> str:
        """Release the held-back text (generation ended for another reason)."""
        held, self._held = self._held, ""
        return held

    def _first_completed(self, window: str, new_from: int) -> tuple[int, str] | None:
        """The first stop string that ends past ``new_from`` (in the new text)."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = window.find(s, max(new_from - len(s) + 1, 0))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _longest_stop_prefix_at_end(self, window: str) -> int:
        for k in range(min(len(window), self._max_len - 1), 0, -1):
            tail = window[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


class TextStream:
    """Per-request text output: token ids in, text deltas out, until the first stop.

    Call `add` for each committed token and send what it returns; once `ended` is set
    (a stop string matched, or a stop token id came) the request is done and `add`
    raises `RuntimeError`. When generation ends for another reason (max tokens,
    cancellation), call `finish` and send that too.

    As in vLLM: the first `min_tokens` tokens end nothing, and the text of the stop
    token that ends the stream (eos or a stop token id), like a stop string, is left
    out unless `include_stop` (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        *,
        stop_token_ids: Collection[int] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._matcher = StopStringMatcher(stop, include_stop=include_stop)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._chunks: list[str] = []
        self._num_tokens = 0
        self._stop_token_id: int | None = None
        self._finished = False

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text delta that is safe to send now."""
        if self.ended:
            raise RuntimeError(f"the stream has ended ({self._ended_by()})")
        if self._finished:
            raise RuntimeError("the stream is finished")
        self._num_tokens += 1
        if self._may_stop and token_id in self._stop_token_ids:
            self._stop_token_id = token_id
            return self._release(self._detokenizer.add(token_id) if self._include_stop else "")
        return self._emit(self._matcher.feed(self._detokenizer.add(token_id), match=self._may_stop))

    def finish(self) -> str:
        """Return the remaining text: held-back bytes and a held-back partial stop string."""
        if self._finished or self.ended:
            self._finished = True
            return ""
        return self._release("")

    @property
    def ended(self) -> bool:
        """Whether a stop string or a stop token id ended the stream."""
        return self._matcher.stopped is not None or self._stop_token_id is not None

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._matcher.stopped

    @property
    def num_tokens(self) -> int:
        """Tokens added, including the one that completed a stop string or was a stop token."""
        return self._num_tokens

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._chunks)

    @property
    def _may_stop(self) -> bool:
        """Whether the last token added may end the stream (past ``min_tokens``)."""
        return self._num_tokens > self._min_tokens

    def _ended_by(self) -> str:
        if self._stop_token_id is not None:
            return f"stop token id {self._stop_token_id}"
        return f"stop string {self._matcher.stopped!r}"

    def _release(self, text: str) -> str:
        """The stream's last text: ``text`` and all that is held back, up to a stop string."""
        self._finished = True
        text = self._matcher.feed(text + self._detokenizer.flush(), match=self._may_stop)
        if self._matcher.stopped is None:
            text += self._matcher.finish()
        return self._emit(text)

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
