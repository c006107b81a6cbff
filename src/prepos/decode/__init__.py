"""An answer token by token: sampling, structured output's grammars, prompt-lookup drafts,
the output's assembly (stop sequences, end of turn) and the `Stream` a caller reads."""
