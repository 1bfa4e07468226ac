"""What the model reads: synthetic tokens, the byte-level text corpus and token files
(``batches``), the token-file and text-file rules (standard library only, shared with config),
and ``parallel4d tokenize``."""
