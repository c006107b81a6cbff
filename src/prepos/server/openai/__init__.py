"""The OpenAI-compatible room: /v1/chat/completions, /v1/completions, /v1/models, the
Responses and Conversations APIs; their checks, their flow onto the engine and their bodies."""
