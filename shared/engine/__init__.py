"""The inference engine: request state, scheduler, engine loop (sync core + asyncio facade)."""

from shared.engine.request import Request, RequestStatus, SamplingParams  # noqa: F401
from shared.engine.errors import (EngineDeadError, EngineError, InvalidRequestError,  # noqa: F401
                                  InvalidSamplingParamsError, PromptTooLongError)
from shared.engine.config import EngineConfig, parse_size  # noqa: F401
from shared.engine.engine import (EngineOutput, EngineStats, LLMEngine, RemotePrefillSlot,  # noqa: F401
                                  TokenLogprobs, warmup)
from shared.engine.async_engine import AsyncEngine  # noqa: F401
