"""The engine's one entry into encoders: an ``EncoderModel`` loaded from a folder, called
with a batch of whole inputs (token ids) and returning one vector or score per input.

The engine would call ``embed`` or ``score`` once per step with the inputs it scheduled
(any mix of lengths up to ``max_length``; it bounds the step's tokens); nothing is kept
between calls. Texts become inputs through ``tokenizer`` on the server's side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LocalserveError
from .config import EncoderConfig, read_config
from .gguf import load_gguf_encoder
from .model import Encoder
from .packing import pack
from .pipeline import Pipeline, read_pipeline
from .pooling import normalize, pool
from .tokenizer import EncodedInput, EncoderTokenizer
from .weights import load_state

_SCORE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "identity": lambda x: x, "tanh": torch.tanh}


@dataclass(slots=True)
class EncoderModel:
    model: Encoder
    config: EncoderConfig
    pipeline: Pipeline
    tokenizer: EncoderTokenizer
    max_length: int  # tokens an input may have: the pipeline's limit within what the positions cover
    device: torch.device

    @classmethod
    def load(cls, folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             ) -> EncoderModel:
        """From a sentence-transformers or HF folder, or a llama.cpp GGUF file (gguf.py)."""
        if folder.suffix == ".gguf" and folder.is_file():
            model, pipeline, tokenizer = load_gguf_encoder(folder, dtype)
            device = torch.device(device)
            return cls(model.to(device).eval(), model.config, pipeline, tokenizer, tokenizer.max_length, device)
        pipeline = read_pipeline(folder)
        config = read_config(pipeline.model_dir)
        if (pipeline.task == "score") != config.classifies:
            raise LocalserveError(f"{folder}: the pipeline and config.json disagree on what the model is")
        max_length = min(pipeline.max_length or config.max_positions, config.max_positions)
        tokenizer = EncoderTokenizer.from_dir(pipeline.model_dir, max_length, pipeline.lowercase)
        with torch.device("meta"):
            model = Encoder(config)
        expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
        model.load_state_dict(load_state(pipeline.model_dir, config, expected, dtype), assign=True)
        device = torch.device(device)
        return cls(model.to(device).eval(), config, pipeline, tokenizer, max_length, device)

    @property
    def dimensions(self) -> int:
        """The embedding's length."""
        return self.config.hidden_size

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[inputs, dimensions] float32 on the CPU: each input's pooled vector, normalized
        when the pipeline normalizes (what SentenceTransformer.encode returns)."""
        if self.pipeline.task != "embed":
            raise LocalserveError("this model is a reranker: it scores pairs, it makes no embeddings")
        batch = pack(inputs, None, self.config, self.max_length, self.device)
        assert self.pipeline.pooling is not None
        vectors = pool(self.model(batch), batch, self.pipeline.pooling)
        return (normalize(vectors) if self.pipeline.normalize else vectors).cpu()

    @torch.inference_mode()
    def score(self, pairs: Sequence[EncodedInput]) -> torch.Tensor:
        """[pairs] float32 on the CPU: each (query, document) input's relevance, through
        the pipeline's activation (what CrossEncoder.predict returns)."""
        if self.model.head is None:
            raise LocalserveError("this model makes embeddings; scoring pairs needs a reranker")
        batch = pack([p.ids for p in pairs], [p.type_ids for p in pairs], self.config, self.max_length, self.device)
        logits = self.model.head(self.model(batch)[batch.starts]).float()
        assert self.pipeline.activation is not None
        return _SCORE_ACTIVATIONS[self.pipeline.activation](logits[:, 0]).cpu()
