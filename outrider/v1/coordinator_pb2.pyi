from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verification(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFICATION_UNSPECIFIED: _ClassVar[Verification]
    VERIFICATION_GREEDY: _ClassVar[Verification]
    VERIFICATION_REJECTION: _ClassVar[Verification]
    VERIFICATION_GUMBEL: _ClassVar[Verification]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
VERIFICATION_UNSPECIFIED: Verification
VERIFICATION_GREEDY: Verification
VERIFICATION_REJECTION: Verification
VERIFICATION_GUMBEL: Verification
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "temperature", "top_k", "top_p", "min_p", "seed", "min_tokens", "include_stop_str_in_output", "logprobs", "structured_output")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    min_tokens: int
    include_stop_str_in_output: bool
    logprobs: int
    structured_output: StructuredOutput
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("num_speculative_tokens", "verification", "adaptive", "pipeline")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    verification: Verification
    adaptive: bool
    pipeline: bool
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., verification: _Optional[_Union[Verification, str]] = ..., adaptive: _Optional[bool] = ..., pipeline: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "token_ids", "sampling", "speculation", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    sampling: SamplingParams
    speculation: SpeculationParams
    request_id: str
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rounds", "draft_tokens", "accepted_tokens", "accepted_per_position", "mean_acceptance_length", "acceptance_rate", "draft_time_s", "verify_time_s", "overhead_time_s", "time_to_first_token_s", "total_time_s", "num_speculative_tokens", "seed", "verification", "draft_probs_bytes", "adaptive", "overhead_s_p50", "num_drafts", "pipeline", "speculation_hits", "speculation_misses", "critical_path_overhead_s_p50", "rounds_by_k", "proposed_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_S_P50_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_HITS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MISSES_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_PATH_OVERHEAD_S_P50_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_BY_K_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    mean_acceptance_length: float
    acceptance_rate: float
    draft_time_s: float
    verify_time_s: float
    overhead_time_s: float
    time_to_first_token_s: float
    total_time_s: float
    num_speculative_tokens: int
    seed: int
    verification: Verification
    draft_probs_bytes: int
    adaptive: bool
    overhead_s_p50: float
    num_drafts: int
    pipeline: bool
    speculation_hits: int
    speculation_misses: int
    critical_path_overhead_s_p50: float
    rounds_by_k: _containers.RepeatedScalarFieldContainer[int]
    proposed_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., mean_acceptance_length: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., draft_time_s: _Optional[float] = ..., verify_time_s: _Optional[float] = ..., overhead_time_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., total_time_s: _Optional[float] = ..., num_speculative_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., verification: _Optional[_Union[Verification, str]] = ..., draft_probs_bytes: _Optional[int] = ..., adaptive: _Optional[bool] = ..., overhead_s_p50: _Optional[float] = ..., num_drafts: _Optional[int] = ..., pipeline: _Optional[bool] = ..., speculation_hits: _Optional[int] = ..., speculation_misses: _Optional[int] = ..., critical_path_overhead_s_p50: _Optional[float] = ..., rounds_by_k: _Optional[_Iterable[int]] = ..., proposed_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("target_model", "draft_model", "drafter", "vocab_size", "max_context_length", "default_num_speculative_tokens", "max_num_speculative_tokens", "default_max_new_tokens", "default_adaptive", "target_device", "target_dtype", "draft_device", "draft_dtype", "default_pipeline")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    drafter: str
    vocab_size: int
    max_context_length: int
    default_num_speculative_tokens: int
    max_num_speculative_tokens: int
    default_max_new_tokens: int
    default_adaptive: bool
    target_device: str
    target_dtype: str
    draft_device: str
    draft_dtype: str
    default_pipeline: bool
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., drafter: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., default_num_speculative_tokens: _Optional[int] = ..., max_num_speculative_tokens: _Optional[int] = ..., default_max_new_tokens: _Optional[int] = ..., default_adaptive: _Optional[bool] = ..., target_device: _Optional[str] = ..., target_dtype: _Optional[str] = ..., draft_device: _Optional[str] = ..., draft_dtype: _Optional[str] = ..., default_pipeline: _Optional[bool] = ...) -> None: ...
