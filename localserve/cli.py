"""The `localserve` command."""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import LocalserveError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="localserve")
def main() -> None:
    """Serve quantized LLMs on one machine: paged KV cache, continuous batching."""


@main.command()
@click.argument("model", type=click.Path(exists=True))
@click.argument("prompt")
@click.option("--max-tokens", default=128, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 is no limit.")
@click.option("--seed", type=int, default=None)
@click.option("--device", default=None, help="cpu or cuda; default cuda when available.")
@click.option("--dtype", default=None, help="float32, float16 or bfloat16; default picks per device.")
def run(model: str, prompt: str, max_tokens: int, temperature: float, top_p: float, top_k: int,
        seed: int | None, device: str | None, dtype: str | None) -> None:
    """Generate from MODEL (a .gguf file or an HF checkpoint folder) for PROMPT, streaming the text."""
    from .engine.config import EngineConfig
    from .engine.engine import Engine
    from .engine.sampling_params import SamplingParams

    try:
        engine = Engine(model, EngineConfig(), device=device, dtype=dtype)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        engine.add_request(prompt, params)
        shown = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                sys.stdout.write(output.text[shown:])
                sys.stdout.flush()
                shown = len(output.text)
        sys.stdout.write("\n")
    except LocalserveError as exc:
        raise click.ClickException(str(exc)) from exc


if __name__ == "__main__":
    main()
