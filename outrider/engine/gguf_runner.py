"""A model runner on llama.cpp: a GGUF file's model, its weights in their
own quantized formats, run by llama.cpp's CPU kernels through
``llama-cpp-python``'s low-level API (the ``gguf`` drafter).

The engine drives it as it drives :class:`~outrider.engine.runner.PagedRunner`:

* **One context per worker.** Its KV cache (``n_ctx`` cells, unified:
  every sequence draws cells from one pool) holds every session's tokens,
  sized once from ``--max-cached-tokens``; each session is one of its
  sequences (``n_seq_max`` = ``--max-sessions``), as llama.cpp's server
  gives each slot one.
* **One decode per step.** A step's rows — every session drafting at that
  moment, a sync's catch-up, a prompt's chunk — go into one ``llama_batch``,
  each token tagged with its sequence and position, the rows' last tokens
  marked for logits, and run as one ``llama_decode`` (in pieces of
  ``n_batch`` tokens for a long prompt).
* **Rollback is a sequence removal.** Cropping a session's cache to n
  tokens removes its positions from n on (``llama_memory_seq_rm``); the
  cells return to the pool. Nothing is copied.

Its :class:`SequenceCache` keeps the same block bookkeeping as the paged
cache, so the scheduler, the session store and the memory limits work
unchanged (no prefix cache: sessions share no cells). The logits come back
as float32 tensors on the CPU, so the drafter draws, and computes q, from
them exactly as from a torch model's.

llama.cpp prints to stderr from C; its log is routed here, its errors and
warnings into the worker's log.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from outrider.engine.kv_cache import BlockPool, KVCache
from outrider.engine.runner import Logits
from outrider.engine.scheduler import Row
from outrider.errors import ResourceExhausted
from outrider.logging import get_logger
from outrider.prefix import BLOCK_SIZE

log = get_logger(__name__)

INSTALL_HINT = (
    "install llama-cpp-python (pip install 'outrider[gguf]'; it builds llama.cpp from source "
    "with gcc, g++ and cmake), or draft with another drafter (--drafter int4)"
)
MAX_BATCH_TOKENS = 512
"""Tokens per ``llama_decode``: a longer step (a prompt's prefill) runs in
pieces of this many; llama.cpp's own default batch."""
KV_BYTES_PER_ELEMENT = 2
"""The cache holds float16 keys and values (llama.cpp's default)."""
GGML_LOG_LEVELS_KEPT = (3, 4)
"""ggml's WARN and ERROR (its DEBUG, INFO and CONT lines are dropped)."""


class LlamaCppMissing(ImportError):
    """``llama_cpp`` does not import: the message says what to do."""


def llama_cpp() -> Any:
    """The ``llama_cpp`` module, its backend initialised once and its log
    routed to ours."""
    try:
        import llama_cpp as lib
    except (ImportError, OSError) as exc:  # OSError: its shared library does not load
        raise LlamaCppMissing(f"llama.cpp is not installed here ({exc}): {INSTALL_HINT}") from None
    if not _callback:
        _callback.append(_log_callback(lib))
        lib.llama_log_set(_callback[0], None)
        lib.llama_backend_init()
    return lib


_recent_errors: deque[str] = deque(maxlen=8)
"""llama.cpp's last error lines: what a failed load says."""
_callback: list[Any] = []
"""The ctypes log callback, held for the process's life (llama.cpp keeps a
pointer to it); set once, when the library is first made ready."""


def _log_callback(lib: Any) -> Any:
    def on_log(level: int, text: bytes, _user: object) -> None:
        line = text.decode("utf-8", errors="replace").strip() if text else ""
        if level in GGML_LOG_LEVELS_KEPT and line:
            _recent_errors.append(line)
            log.debug("llama.cpp", message=line)

    return lib.llama_log_callback(on_log)


@dataclass(frozen=True)
class GgufModel:
    """What a loaded GGUF model is, as the worker reports it."""

    description: str
    """llama.cpp's one-line description: architecture, size, quantization."""
    vocab_size: int
    context_length: int
    kv_bytes_per_token: int


class GgufRunner:
    """Rows of a step as one ``llama_decode`` over one llama.cpp context (see
    the module docstring). Build it with :meth:`load`."""

    device = torch.device("cpu")

    def __init__(self, lib: Any, model: Any, context: Any, info: GgufModel, pool: BlockPool):
        self._lib = lib
        self._model = model
        self._context = context
        self._memory = lib.llama_get_memory(context)
        self._batch = lib.llama_batch_init(MAX_BATCH_TOKENS, 0, 1)
        self.info = info
        self.vocab_size = info.vocab_size
        self.pool = pool
        self._free_sequences = list(range(lib.llama_n_seq_max(context) - 1, -1, -1))

    @classmethod
    def load(
        cls, path: Path, *, max_sessions: int, max_cached_tokens: int | None, threads: int
    ) -> GgufRunner:
        """llama.cpp's model of ``path`` and one context for ``max_sessions``
        sequences over ``max_cached_tokens`` cells (None: sized by
        :func:`outrider.memory.gguf_cache_tokens`), run on ``threads`` threads.
        Raises ValueError saying why it cannot."""
        from outrider.memory import gguf_cache_tokens

        lib = llama_cpp()
        if max_sessions > (most := lib.llama_max_parallel_sequences()):
            raise ValueError(
                f"llama.cpp runs at most {most} sequences in one context: "
                f"give --max-sessions {most} or fewer"
            )
        _recent_errors.clear()
        params = lib.llama_model_default_params()
        model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ValueError(f"llama.cpp does not load it: {_errors()}")
        info = _model_info(lib, model)
        tokens = gguf_cache_tokens(
            info.kv_bytes_per_token,
            max_sessions=max_sessions,
            max_context=info.context_length,
            max_cached_tokens=max_cached_tokens,
        )
        context_params = lib.llama_context_default_params()
        context_params.n_ctx = tokens
        context_params.n_batch = context_params.n_ubatch = MAX_BATCH_TOKENS
        context_params.n_seq_max = max_sessions
        context_params.n_threads = context_params.n_threads_batch = threads
        context_params.kv_unified = True  # sessions draw cells from one pool, as blocks do
        context_params.no_perf = True
        context = lib.llama_init_from_model(model, context_params)
        if not context:
            lib.llama_model_free(model)
            raise ValueError(
                f"llama.cpp cannot make a context of {tokens} cached tokens: "
                f"{_errors()}; lower --max-cached-tokens"
            )
        # A cell per token: the pool's blocks never hold more than the context has cells.
        pool = BlockPool(max(1, tokens // BLOCK_SIZE), BLOCK_SIZE)
        log.info(
            "gguf model loaded",
            model=info.description,
            cached_tokens=pool.capacity,
            kv_mib=round(pool.capacity * info.kv_bytes_per_token / 2**20, 1),
            sequences=max_sessions,
            threads=threads,
        )
        return cls(lib, model, context, info, pool)

    def new_kv(self) -> SequenceCache:
        return SequenceCache(self)

    def warm_up(self, **_: object) -> None:
        """Nothing to tune or capture: llama.cpp chose its kernels when it loaded."""

    def close(self) -> None:
        """Frees the context, the model and the batch (idempotent)."""
        if self._context is None:
            return
        self._lib.llama_batch_free(self._batch)
        self._lib.llama_free(self._context)
        self._lib.llama_model_free(self._model)
        self._context = self._model = None

    # --- sequences ------------------------------------------------------------------

    def take_sequence(self) -> int:
        if not self._free_sequences:
            raise ResourceExhausted(
                "the draft worker's llama.cpp context has no free sequence; retry later"
            )
        return self._free_sequences.pop()

    def release_sequence(self, sequence: int) -> None:
        self._free_sequences.append(sequence)

    def remove(self, sequence: int, start: int) -> None:
        """Forgets the sequence's positions from ``start`` on (its cells freed)."""
        self._lib.llama_memory_seq_rm(self._memory, sequence, start, -1)

    # --- a step -----------------------------------------------------------------------

    def execute(self, rows: Sequence[Row]) -> list[Logits | None]:
        """Every row's tokens in one batch (pieces of ``MAX_BATCH_TOKENS``),
        each row's last ``num_logits`` tokens' logits handed back."""
        wanted: list[list[np.ndarray]] = [[] for _ in rows]
        pending: list[int] = []  # the rows whose logits the piece under way holds, in order
        batch, n = self._batch, 0
        try:
            for i, row in enumerate(rows):
                kv = row.kv
                assert isinstance(kv, SequenceCache)  # made by new_kv
                first_wanted = len(row.tokens) - row.num_logits
                for offset, token in enumerate(row.tokens):
                    batch.token[n] = token
                    batch.pos[n] = len(kv) + offset
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = kv.sequence
                    batch.logits[n] = offset >= first_wanted
                    if offset >= first_wanted:
                        pending.append(i)
                    n += 1
                    if n == MAX_BATCH_TOKENS:
                        self._decode(n, pending, wanted)
                        n, pending = 0, []
            if n:
                self._decode(n, pending, wanted)
        except BaseException:
            for row in rows:  # what this step wrote is not recorded: forget it in llama.cpp too
                self.remove(row.kv.sequence, len(row.kv))  # type: ignore[attr-defined]
            raise
        outputs: list[Logits | None] = []
        for row, parts in zip(rows, wanted, strict=True):
            row.kv.appended(row.tokens)
            if not parts:
                outputs.append(None)
                continue
            values = parts[0] if len(parts) == 1 else np.concatenate(parts)
            outputs.append(Logits(torch.from_numpy(values), values.argmax(axis=1).tolist()))
        return outputs

    def _decode(self, n: int, pending: list[int], wanted: list[list[np.ndarray]]) -> None:
        """Runs the batch's first ``n`` tokens and copies out their logits,
        to the rows ``pending`` names (one row per logits row, in order)."""
        self._batch.n_tokens = n
        _recent_errors.clear()
        status = self._lib.llama_decode(self._context, self._batch)
        if status != 0:
            raise RuntimeError(
                f"llama_decode of {n} tokens failed with status {status}: {_errors()}"
            )
        if not pending:
            return
        logits = np.ctypeslib.as_array(
            self._lib.llama_get_logits(self._context), shape=(len(pending), self.vocab_size)
        ).copy()
        at = 0
        for i in range(len(pending)):
            if i + 1 == len(pending) or pending[i + 1] != pending[i]:
                wanted[pending[i]].append(logits[at : i + 1])
                at = i + 1


class SequenceCache(KVCache):
    """A session's cache in the runner's llama.cpp context: one of its
    sequences, taken when the session first reserves room and given back
    when it is freed, beside the block bookkeeping."""

    def __init__(self, runner: GgufRunner) -> None:
        super().__init__(runner.pool)
        self.runner = runner
        self.sequence = -1
        """Its sequence id in the context (-1: none yet)."""

    def reserve(self, length: int) -> None:
        if self.sequence < 0:
            self.sequence = self.runner.take_sequence()
        super().reserve(length)

    def crop(self, length: int) -> None:
        dropped = length < len(self)
        super().crop(length)
        if dropped:
            self.runner.remove(self.sequence, length)

    def free(self) -> None:
        if self.freed:
            return
        super().free()
        if self.sequence >= 0:
            self.runner.remove(self.sequence, 0)
            self.runner.release_sequence(self.sequence)
            self.sequence = -1


def _model_info(lib: Any, model: Any) -> GgufModel:
    description = ctypes.create_string_buffer(256)
    lib.llama_model_desc(model, description, len(description))
    heads = lib.llama_model_n_head(model)
    head_dim = lib.llama_model_n_embd(model) // max(1, heads)
    per_token = (
        lib.llama_model_n_layer(model)
        * lib.llama_model_n_head_kv(model)
        * head_dim
        * 2
        * KV_BYTES_PER_ELEMENT
    )
    return GgufModel(
        description=description.value.decode("utf-8", errors="replace"),
        vocab_size=lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)),
        context_length=lib.llama_model_n_ctx_train(model),
        kv_bytes_per_token=per_token,
    )


def _errors() -> str:
    """What llama.cpp logged as errors and warnings since it was last asked, on one line."""
    return "; ".join(_recent_errors) or "no reason given"
