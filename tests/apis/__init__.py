"""The client-facing APIs end to end: OpenAI chat and completions, Responses, Conversations,
Anthropic's Messages."""
