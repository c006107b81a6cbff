"""The Anthropic-compatible room: `POST /v1/messages` and `/v1/messages/count_tokens`, a
translation onto the chat route's flow (`server/openai/flow.py`), as the Responses API is."""
