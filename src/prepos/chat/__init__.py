"""Chat templates and conversations: `ChatFormat` (rendering, tokenizing, entries), control
tokens kept out of text, tool support and tool-call formats, a client's conversation
against a session's."""
