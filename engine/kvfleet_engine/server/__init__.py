"""The HTTP front of the engine: OpenAI-compatible routes, health, readiness, metrics.

HTTP types (pydantic request/response models, status codes) stay inside this package; the
engine below it sees only token ids, `SamplingParams` and `RequestOutput`.
"""
