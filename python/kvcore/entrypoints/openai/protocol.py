"""OpenAI's request bodies as pydantic models, and OpenAI's error body.

Bodies are parsed from the raw bytes in strict JSON mode (``parse_body``): malformed JSON, a wrong
type (``"max_tokens": "5"``) and an unknown top-level field are all a 400 with OpenAI's error body,
as OpenAI answers (it rejects "Unrecognized request argument supplied"). Fields that OpenAI
defines but kvcore cannot honour (tools, logit_bias, echo, ...) are accepted only at their
neutral value. kvcore's extras beside OpenAI's fields follow vLLM's names: ``top_k``, ``min_p``,
``repetition_penalty``, ``priority``, ``cache_salt``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``return_token_ids``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class ApiError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints (OpenAI's, then kvcore's extras)."""

    model: str
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # kvcore's extras (vLLM's names)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


_TYPE_NAMES = ("str", "int", "float", "bool", "list", "dict", "none")


def _param(loc: tuple[Any, ...]) -> str | None:
    """``messages.0.content`` from pydantic's location, without union-member names."""
    parts = []
    for p in loc:
        s = str(p)
        if s in _TYPE_NAMES or "[" in s or s[:1].isupper() or s.startswith("function-"):
            continue
        parts.append(s)
    return ".".join(parts) or None


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body; raise ApiError(400) with OpenAI's wording on any problem."""
    if not raw.strip():
        raise ApiError(400, "We could not parse the JSON body of your request: it is empty.")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        kind, loc = err["type"], tuple(err["loc"])
        if kind == "json_invalid":
            raise ApiError(
                400,
                "We could not parse the JSON body of your request. (HINT: This likely means "
                f"you aren't using your HTTP library correctly.) {err['msg']}",
            ) from None
        if kind == "extra_forbidden":
            name = _param(loc)
            raise ApiError(
                400, f"Unrecognized request argument supplied: {name}", param=name
            ) from None
        if kind == "missing":
            name = _param(loc)
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name) from None
        if kind == "model_type":  # the body is JSON but not an object
            raise ApiError(400, "The request body must be a JSON object.") from None
        name = _param(loc)
        raise ApiError(
            400,
            f"Invalid value for '{name}': {err['msg']}.",
            param=name,
            code="invalid_value" if "type" not in kind else "invalid_type",
        ) from None


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Reject OpenAI fields set to something kvcore cannot honour (400, naming the field)."""
    bad: list[tuple[str, bool]] = [
        ("logit_bias", bool(req.logit_bias)),
        ("stream_options", req.stream_options is not None and not req.stream),
    ]
    if isinstance(req, CompletionRequest):
        bad += [
            ("echo", req.echo),
            ("suffix", bool(req.suffix)),
            ("best_of", req.best_of is not None and req.best_of != req.n),
        ]
    else:
        fmt = (req.response_format or {}).get("type", "text")
        bad += [
            ("tools", bool(req.tools)),
            ("tool_choice", req.tool_choice not in (None, "none", "auto")),
            ("response_format", fmt != "text"),
            ("modalities", req.modalities not in (None, ["text"])),
            ("top_logprobs", req.top_logprobs is not None and not req.logprobs),
        ]
    for name, is_bad in bad:
        if is_bad:
            why = (
                "is only allowed when 'stream' is true"
                if name == "stream_options"
                else "needs 'logprobs': true"
                if name == "top_logprobs"
                else "is not supported by this server"
            )
            raise ApiError(400, f"'{name}' {why}.", param=name, code="unsupported_parameter")
