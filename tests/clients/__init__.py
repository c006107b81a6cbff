"""Stock clients unchanged: the SDKs, LangChain, LiteLLM, the coding agents, the web console,
`prepos demo`."""
