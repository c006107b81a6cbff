"""The engine and what it is made of above the worker: sessions, the gate, decoding, the chat
formats, the bundled and real models."""
