from pydantic import Field, model_validator

from services.framework.command import ENV_ONLY
from services.framework.settings import QosSettings, ServiceSettings
from shared.openai_api.reasoning import ReasoningParser
from shared.openai_api.tool_formats import ToolCallParser


class GatewaySettings(ServiceSettings, QosSettings):
    host: str = Field("127.0.0.1", description="HTTP listen address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free port)")
    model: str = Field("smollm2-135m", description="served model (its tokenizer is loaded here)")
    api_keys: str | None = Field(None, json_schema_extra=ENV_ONLY, description="comma-separated key:tier pairs "
                                 "(tiers from --qos; a key without one gets the default tier); unset (and no "
                                 "--api-keys-file): no auth")
    api_keys_file: str | None = Field(None, description="file of API keys, one KEY or KEY:TIER a line (# comments); "
                                      "instead of --api-keys, read once at start")
    operator_key_file: str | None = Field(None, description="file holding the operator key, which /status, /metrics "
                                          "and /dashboard then require (Bearer, or Basic with it as password); "
                                          "unset: those pages are open")
    default_max_tokens: int = Field(1024, ge=1, description="max_tokens when the request gives none")
    reasoning_parser: ReasoningParser = Field("auto", description="return a thinking model's <think>…</think> "
                                              "apart from the answer (chat: reasoning_content; responses: a "
                                              "reasoning item): auto, when the model's chat template mentions "
                                              "</think>, or harmony when it writes <|channel|> or <|start|>; "
                                              "think, always; harmony, gpt-oss's analysis channel as the "
                                              "reasoning, its final channel the answer; none, never (it stays "
                                              "in the content)")
    tool_call_parser: ToolCallParser = Field("auto", description="how the model writes tool calls, read back "
                                             "from its output and written into the prompt for earlier turns: "
                                             "hermes, <tool_call>{json}</tool_call> (Qwen2/2.5/3, SmolLM3, "
                                             "Hermes); mistral, [TOOL_CALLS][{json}, ...] or [TOOL_CALLS]name"
                                             "[ARGS]{json}; llama3_json, a bare {\"name\", \"parameters\"} "
                                             "object, several separated by ';' (Llama 3.x); harmony, a "
                                             "commentary message to=functions.NAME with JSON arguments "
                                             "(gpt-oss); auto, chosen from the chat template's markers (hermes "
                                             "when none shows)")
    admission_timeout_s: float = Field(2.0, gt=0, description="wait for admission's answer")
    admission_retry_s: float = Field(10.0, ge=0, description="ask admission again (another instance of its "
                                     "queue group, or its restart) for this long after an unanswered ask")
    gateway_urls: str | None = Field(None, description="comma-separated URLs of every gateway of the stack, "
                                     "for /status (tandem up passes them)")
    redis_url: str | None = Field(None, description="the stack's Redis (tandem up passes it): where every gateway "
                                  "of the stack keeps the rate limit's buckets (rate_limit_per_s), and shown with "
                                  "its password masked in /status and tandem status")
    request_timeout_s: float = Field(600.0, gt=0, description="wait for a request's first token")
    token_idle_timeout_s: float = Field(60.0, gt=0, description="max gap between two tokens")
    lost_request_check_s: float = Field(5.0, ge=0, description="while a request waits for its first token, "
                                        "ask its worker this often whether the request is running there; "
                                        "two noes in a row: it or its first replies were lost on the way, "
                                        "so it is admitted again (0: never ask)")
    status_timeout_s: float = Field(1.0, gt=0, description="wait for the autoscaler's cluster view")
    refresh_interval_s: float = Field(0.5, gt=0, description="how often to re-read the registry")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="largest accepted request body (413 above)")
    max_tokenize_chars: int = Field(1 << 20, ge=1, description="longest text /tokenize takes, in characters "
                                    "(the prompt, or the rendered messages; 413 above)")
    max_detokenize_tokens: int = Field(1 << 18, ge=1, description="most token ids /detokenize takes (413 above)")
    rate_limit_per_s: float | None = Field(None, gt=0, description="requests per second per API key (per "
                                           "client address without keys) to every /v1/ endpoint, /tokenize and "
                                           "/detokenize, 429 above; one limit for all the stack's gateways "
                                           "through redis_url (without it, per gateway); unset: no limit")
    rate_limit_burst: int = Field(10, ge=1, description="requests a key may send at once before "
                                  "rate_limit_per_s applies")
    rate_limit_redis_timeout_s: float = Field(0.25, gt=0, description="wait this long for Redis's answer to "
                                              "a rate-limit check; past it (or Redis down) this gateway limits "
                                              "on its own, asking Redis again 5 s later")
    max_file_bytes: int = Field(100 << 20, ge=1, description="largest file accepted by /v1/files (413 above); "
                                "the gateway holds an upload in memory while it stores it")
    batch_max_in_flight: int = Field(8, ge=0, description="batch lines this gateway runs at once (0: it runs "
                                     "none, but still serves /v1/batches)")
    batch_in_flight_beside_online: int = Field(2, ge=0, description="batch lines this gateway runs at once "
                                               "while it has online requests in flight or had one in the last "
                                               "batch_online_quiet_s (no more than batch_max_in_flight): batch "
                                               "rows lengthen every engine step, and so online TTFT and ITL")
    batch_online_quiet_s: float = Field(2.0, ge=0, description="seconds without an online request before "
                                        "batch lines go back to batch_max_in_flight")
    batch_max_line_bytes: int = Field(512 << 10, ge=1024, description="largest line of a batch input file "
                                      "(each line travels as one NATS message)")
    batch_ack_wait_s: float = Field(30.0, gt=0, description="a batch line its gateway stopped confirming for "
                                    "this long is run by another gateway")
    batch_max_deliver: int = Field(20, ge=1, description="deliveries of a batch line before a failure is its result")
    responses_ttl_s: float = Field(30 * 24 * 3600.0, gt=0, description="how long a stored /v1/responses "
                                   "response lives (fixed when the NATS bucket is created: a changed value "
                                   "applies to a new namespace or a deleted bucket)")
    background_retry_max_wait_s: float = Field(600.0, ge=0, description="how long a background /v1/responses "
                                               "response keeps waiting out admission's 429s (each for its "
                                               "Retry-After) before it fails with the last one; 0: no retry")
    flex_max_wait_s: float = Field(60.0, ge=0, description="how long a service_tier: flex request keeps "
                                   "waiting out admission's 429s for load (each for its Retry-After) before it "
                                   "is answered with the last one; 0: no wait")
    batch_sweep_interval_s: float = Field(1.0, gt=0, description="how often to move batches along (validate, "
                                          "finalize, expire, finish a cancel)")

    @model_validator(mode="after")
    def _keys_load(self) -> "GatewaySettings":
        """API keys with tiers that exist, from one source; an operator key file that holds one."""
        from shared.openai_api.auth import ApiKeys, OperatorKey  # noqa: PLC0415
        from shared.policy.qos import load_qos  # noqa: PLC0415

        ApiKeys.load(self.api_keys, self.api_keys_file, load_qos(self.qos))
        OperatorKey.load(self.operator_key_file)
        return self
