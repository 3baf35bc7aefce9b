from outrider.v1 import coordinator_pb2 as _coordinator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "drafter", "vocab_size", "vocab_fingerprint", "max_context_length", "active_sessions", "cached_tokens", "device", "dtype", "load", "graphed_tokens_per_row", "hidden_state_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    GRAPHED_TOKENS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    drafter: str
    vocab_size: int
    vocab_fingerprint: str
    max_context_length: int
    active_sessions: int
    cached_tokens: int
    device: str
    dtype: str
    load: EngineLoad
    graphed_tokens_per_row: int
    hidden_state_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., drafter: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., max_context_length: _Optional[int] = ..., active_sessions: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., graphed_tokens_per_row: _Optional[int] = ..., hidden_state_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("bfloat16", "rows")
    BFLOAT16_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    bfloat16: bytes
    rows: int
    def __init__(self, bfloat16: _Optional[bytes] = ..., rows: _Optional[int] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("curve_tokens", "curve_seconds", "curve_rows", "tokens_per_step", "rows_per_step", "steps", "running_s", "work_per_row_s")
    CURVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CURVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CURVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_S_FIELD_NUMBER: _ClassVar[int]
    WORK_PER_ROW_S_FIELD_NUMBER: _ClassVar[int]
    curve_tokens: _containers.RepeatedScalarFieldContainer[float]
    curve_seconds: _containers.RepeatedScalarFieldContainer[float]
    curve_rows: _containers.RepeatedScalarFieldContainer[float]
    tokens_per_step: float
    rows_per_step: float
    steps: int
    running_s: float
    work_per_row_s: float
    def __init__(self, curve_tokens: _Optional[_Iterable[float]] = ..., curve_seconds: _Optional[_Iterable[float]] = ..., curve_rows: _Optional[_Iterable[float]] = ..., tokens_per_step: _Optional[float] = ..., rows_per_step: _Optional[float] = ..., steps: _Optional[int] = ..., running_s: _Optional[float] = ..., work_per_row_s: _Optional[float] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("token_ids", "request_id", "target_vocab_size", "target_vocab_fingerprint", "sampling", "first_token", "hidden_state_layers", "hidden_states")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    target_vocab_size: int
    target_vocab_fingerprint: str
    sampling: Sampling
    first_token: bool
    hidden_state_layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_states: HiddenStates
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., target_vocab_size: _Optional[int] = ..., target_vocab_fingerprint: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., first_token: _Optional[bool] = ..., hidden_state_layers: _Optional[_Iterable[int]] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "verification", "logprobs", "grammar", "min_tokens", "stop_token_ids", "start")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    verification: _coordinator_pb2.Verification
    logprobs: int
    grammar: Grammar
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    start: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., verification: _Optional[_Union[_coordinator_pb2.Verification, str]] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_logprobs", "num_top", "top_token_ids", "top_logprobs")
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    probs: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("committed_len", "compute_s", "load", "first_token_id", "logprobs", "hidden_states", "cached_tokens")
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    committed_len: int
    compute_s: float
    load: EngineLoad
    first_token_id: int
    logprobs: Logprobs
    hidden_states: HiddenStates
    cached_tokens: int
    def __init__(self, committed_len: _Optional[int] = ..., compute_s: _Optional[float] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., first_token_id: _Optional[int] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class DraftRound(_message.Message):
    __slots__ = ("committed_len", "new_token_ids", "num_speculative_tokens", "speculate", "assumed_token_ids", "round_id", "hidden_states")
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    committed_len: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    speculate: bool
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    round_id: int
    hidden_states: HiddenStates
    def __init__(self, committed_len: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., speculate: _Optional[bool] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., round_id: _Optional[int] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ...) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "round", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    round: DraftRound
    close: SessionClose
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., round: _Optional[_Union[DraftRound, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("draft_token_ids", "compute_s", "draft_probs", "round_id", "follows_len", "guess_token_id", "load")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_LEN_FIELD_NUMBER: _ClassVar[int]
    GUESS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    compute_s: float
    draft_probs: _containers.RepeatedCompositeFieldContainer[DraftProbs]
    round_id: int
    follows_len: int
    guess_token_id: int
    load: EngineLoad
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., compute_s: _Optional[float] = ..., draft_probs: _Optional[_Iterable[_Union[DraftProbs, _Mapping]]] = ..., round_id: _Optional[int] = ..., follows_len: _Optional[int] = ..., guess_token_id: _Optional[int] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("opened", "proposal")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    proposal: DraftProposal
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., proposal: _Optional[_Union[DraftProposal, _Mapping]] = ...) -> None: ...

class VerifyRound(_message.Message):
    __slots__ = ("committed_len", "draft_token_ids", "draft_probs")
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    committed_len: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[DraftProbs]
    def __init__(self, committed_len: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[DraftProbs, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("open", "round", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    round: VerifyRound
    close: SessionClose
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., round: _Optional[_Union[VerifyRound, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "compute_s", "load", "num_verified", "queued_s", "hidden_states", "logprobs")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    compute_s: float
    load: EngineLoad
    num_verified: int
    queued_s: float
    hidden_states: HiddenStates
    logprobs: Logprobs
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., compute_s: _Optional[float] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., num_verified: _Optional[int] = ..., queued_s: _Optional[float] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("opened", "verdict")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    verdict: Verdict
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...
