"""How long one image takes to prepare and encode at a real model's shape: Gemma-3-4B's
image side (SigLIP so400m at 896 px, 4,096 patches pooled to 256 tokens projected to 2,560),
random weights, one 1024 x 768 JPEG, in the engine's CPU dtype (float32) unless told.

    python benchmarks/image_encode.py
    python benchmarks/image_encode.py --dtype bfloat16 --repeats 3

This is the encoder's part of an image request's time to first token (the text prefill of
its 256 tokens comes on top); benchmarks/image_ttft.py measures whole image requests against llama-server.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
import torch
from PIL import Image

from host_facts import cpu_summary
from localserve.vision.config import Gemma3ImageConfig
from localserve.vision.gemma3 import Gemma3Vision
from localserve.vision.image_input import image_from_bytes

# Gemma-3-4B's vision_config and image tokens (its config.json), and its text width.
GEMMA3_4B = {"vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                               "num_attention_heads": 16, "image_size": 896, "patch_size": 14},
             "mm_tokens_per_image": 256}
TEXT_HIDDEN = 2560


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(cpu_summary(), f"| torch threads {torch.get_num_threads()}")
    model = Gemma3Vision(Gemma3ImageConfig.from_hf(GEMMA3_4B, None), TEXT_HIDDEN)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model = model.to(getattr(torch, args.dtype)).eval()
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (768, 1024, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG")
    image = image_from_bytes(buffer.getvalue())
    prepare, encode = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        batch = model.pixels(image)[None]
        prepared = time.perf_counter()
        with torch.inference_mode():
            model(batch)
        prepare.append(prepared - start)
        encode.append(time.perf_counter() - prepared)
    print(f"Gemma-3-4B's image side, {args.dtype}, one 1024 x 768 JPEG, {args.repeats} repeats: "
          f"prepare {statistics.median(prepare):.3f} s, encode {statistics.median(encode):.2f} s "
          f"({min(encode):.2f}-{max(encode):.2f})")


if __name__ == "__main__":
    main()
