"""The back ends: torch, llama.cpp in process, GGUF export, the remote back end (stand-ins,
llama-server, vLLM)."""
