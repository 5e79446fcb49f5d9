"""Text in and out of a model: tokenizers (HF ``tokenizers``, and the same built from a
GGUF vocabulary), incremental detokenization, and chat templates rendered in a sandbox."""
