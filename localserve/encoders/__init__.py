"""Bidirectional encoders: embedding models (BERT, RoBERTa / XLM-RoBERTa, nomic-bert)
and cross-encoder rerankers, read from sentence-transformers or HF folders and run as a
batch of whole inputs (no KV cache, no prefix cache).

``pipeline.py`` and ``config.py`` read a folder without torch (what the model does, and its
architecture); ``tokenizer.py`` turns texts and (query, document) pairs into ids, truncated
as sentence-transformers truncates; ``weights.py`` reads the safetensors into the layout of
``model.py``; ``packing.py`` concatenates a batch without padding; ``pooling.py`` turns
hidden states into one vector per input. ``runner.EncoderModel`` is the one entry: load a
folder, then ``embed`` or ``score`` a batch of token-id inputs.
"""
