"""The engine: add requests, step, read outputs. Usable step by step."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..kernels import cpu_library
from ..errors import InsufficientMemoryError, LocalserveError
from ..formats import open_checkpoint
from ..formats.layout import layout
from ..formats.weights import weight_sizes
from ..text.tokenizer import Tokenizer
from .config import EngineConfig
from . import cuda_graphs
from .kv_cache import BlockPool, KVCacheManager, allocate_kv_tensors
from .loading import load_model
from .kv_transfer import KVTransfer
from ..kernels.dispatch import KernelChoice, using
from .memory import check_weights_fit, context_limit, measured_gpu_budget, most_pool_tokens, pool_sizes
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Request
from .runner import ModelRunner, RunnerOutput, warmup_token_counts
from .sampling_params import PoolingParams, SamplingParams
from .scheduler import Scheduler, ScheduledBatch
from .speculative.draft_model import DraftModel, load_draft_model
from .speculative.speculator import Speculator
from .stats import EngineStats, LoadProgress
from .structured_output import StructuredOutputs
from ..vision import load_image_encoder
from ..vision.encoder import ImageSpan
from ..vision.image_input import ImageInput
from ..vision.placement import ImagePlacement

log = logging.getLogger(__name__)


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str | torch.dtype | None, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}
    if dtype not in (None, "auto"):
        if dtype not in names:
            raise LocalserveError(f"dtype {dtype!r} is not supported (float32, float16, bfloat16)")
        return names[dtype]
    if device.type == "cpu":
        return torch.float32  # half-precision matmuls are slow on most CPUs
    stored = names.get(checkpoint_dtype or "", torch.float32)
    return torch.bfloat16 if stored == torch.float32 else stored


def build_engine(model: str | Path, config: EngineConfig, device: str | None, dtype: str | None,
                 progress: LoadProgress, name: str) -> Engine:
    """``Engine(...)`` as the daemon loads one: a device that runs out of memory during the
    load is an InsufficientMemoryError (the daemon then unloads an idle model and retries)."""
    try:
        return Engine(model, config, device=device, dtype=dtype, progress=progress)
    except torch.OutOfMemoryError as exc:
        raise InsufficientMemoryError(f"{name}: out of device memory while loading ({exc})") from exc


class Engine:
    def __init__(
        self,
        model: str | Path,
        config: EngineConfig | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        progress: LoadProgress | None = None,
    ) -> None:
        """Load ``model``; ``progress`` follows the load (the daemon shows it)."""
        progress = progress or LoadProgress()
        progress.step("reading the checkpoint")
        self.device = pick_device(device)
        self.config = (config or EngineConfig()).for_device(self.device.type)
        checkpoint = open_checkpoint(model)
        self.tokenizer: Tokenizer | None = checkpoint.check_loadable()  # before anything is allocated
        self.spec = spec = checkpoint.spec
        self.dtype = pick_dtype(dtype, spec.torch_dtype, self.device)
        self.checkpoint = checkpoint

        if self.device.type == "cpu":
            cpu_library.set_threads(self.config.cpu_threads())
        block_size = self.config.block_size
        self.kv_dtype = self.config.resolve_kv_cache_dtype(self.dtype, self.device, checkpoint.quantized_gguf)
        # The context the model is built for: no longer than the pool could ever hold (a
        # checkpoint may declare 2**28 positions; its rotary tables would not fit).
        wanted = context_limit(spec, self.config.max_model_len)
        context = min(wanted, most_pool_tokens(self.config, spec, self.kv_dtype, self.device))
        # The kernels this engine runs, chosen once: every forward is made under it.
        self.kernels = KernelChoice(triton=not self.config.disable_triton,
                                    cpu_kernels=not self.config.disable_cpu_kernels)
        if self.device.type == "cuda":
            check_weights_fit(weight_sizes(checkpoint, self.dtype), self.config, spec.num_layers, self.device)
        progress.step("loading weights", total=len(layout(spec).shapes))
        self.model = load_model(checkpoint, self.config, self.device, self.dtype, self.kernels, context, progress)
        self.draft = draft = self._load_draft_model(context, progress)
        # An image-text model's vision side, loaded before the pool is sized: its weights count.
        self.images = load_image_encoder(checkpoint, self.tokenizer, self.device, self.dtype)
        progress.step("sizing the KV cache")
        with using(self.kernels):  # a GPU's budget is measured by running a step
            pools = pool_sizes(self.config, spec, self.kv_dtype, self.device.type, lambda: measured_gpu_budget(
                self.config, self.model, spec, self.kv_dtype, self.device, context,
                draft.checkpoint.spec.hidden_size if draft else 0, self.images.activation_bytes() if self.images else 0),
                companion_block_bytes=draft.block_bytes(block_size) if draft else 0)
        block_bytes, num_blocks, num_cpu_blocks = pools.block_bytes, max(1, pools.device_blocks), pools.cpu_blocks
        # <= context: the CPU's default pool follows the free memory, read again now that
        # the weights are in, and memory freed meanwhile must not outgrow the model's tables.
        self.max_model_len = self._cap_to_pool(wanted, min(num_blocks * block_size, context))
        kv_caches = allocate_kv_tensors(spec, num_blocks, block_size, self.kv_dtype, self.device)
        cpu_caches = allocate_kv_tensors(spec, num_cpu_blocks, block_size, self.kv_dtype, torch.device("cpu"),
                                         pin_memory=self.device.type == "cuda")
        log.info(
            "KV cache on %s: %d blocks of %d tokens = %d tokens (%.2f GiB, %s), %s; shared by all running sequences; "
            "largest context that fits: %d tokens per sequence; CPU tier: %d blocks (%d tokens)",
            self.device, num_blocks, block_size, num_blocks * block_size, num_blocks * block_bytes / (1 << 30),
            str(self.kv_dtype).removeprefix("torch."), pools.reason, self.max_model_len, num_cpu_blocks,
            num_cpu_blocks * block_size,
        )

        self.kv = KVCacheManager(BlockPool(num_blocks), BlockPool(num_cpu_blocks), block_size,
                                 self.config.enable_prefix_caching)
        self.transfer = KVTransfer(kv_caches, cpu_caches)
        self.scheduler = Scheduler(self.config, self.kv)
        self.runner = ModelRunner(self.model, kv_caches, block_size, self.device, self.kernels)
        self.drafter = draft.drafter(num_blocks, block_size, self.device, self.kernels,
                                     self.config.step_tokens(self.device.type)) if draft else None
        self.speculator = Speculator(self.config.speculative, self.max_model_len, self.device.type, self.drafter)
        if self.device.type == "cuda":
            progress.step("warming up")
            self._warm_up()
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.eos_token_ids = frozenset(spec.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer and self.tokenizer.eos_token_id is not None else set()
        )
        self.structured = StructuredOutputs(self.tokenizer, spec.vocab_size, self.eos_token_ids) \
            if self.tokenizer is not None else None
        self.runner.structured = self.structured
        self.num_prompt_tokens_total = 0
        self.num_generated_tokens_total = 0
        self.num_finished_requests = 0

    def _load_draft_model(self, context: int, progress: LoadProgress) -> DraftModel | None:
        """The speculative config's draft model, loaded before the KV pools are sized: its
        weights count in the memory left, its cache shares the pool's budget."""
        path = self.config.speculative.draft_model
        if path is None:
            return None
        progress.step("loading the draft model")
        return load_draft_model(path, self.checkpoint, self.tokenizer, self.config, self.device, self.dtype,
                                self.kernels, context, progress)

    def _warm_up(self) -> None:
        """Compile the kernels of prefill steps and capture the decode steps' CUDA graphs,
        so the first request waits for neither."""
        start = time.monotonic()
        token_counts = warmup_token_counts(min(self.config.step_tokens("cuda"), self.max_model_len))
        self.runner.warm_up(token_counts)
        if self.drafter is not None:
            self.drafter.warm_up(token_counts)
        reason = cuda_graphs.why_eager(self.config, self.spec.num_layers)
        if reason:
            log.info("CUDA graphs are off: %s; decode steps run eagerly", reason)
        else:
            shapes = cuda_graphs.graph_shapes(self.config.max_num_seqs, self.config.speculative.num_tokens)
            # One pool for the model's graphs and the draft model's: one replays at a time.
            capture = cuda_graphs.CudaGraphCapture(self.device)
            graphs = cuda_graphs.DecodeGraphs(self.model, self.runner.kv_caches, shapes, self.max_model_len,
                                              self.config.block_size, self.device, capture)
            try:
                with using(self.kernels), torch.inference_mode():
                    graphs.capture()
                if self.drafter is not None:
                    self.drafter.capture_graphs(shapes, self.max_model_len, capture)
            except torch.OutOfMemoryError:
                del graphs, capture  # and the pool of those captured
                torch.cuda.empty_cache()
                log.warning("CUDA graphs are off: capturing them ran out of GPU memory (lower "
                            "gpu_memory_utilization or max_num_seqs to leave them room)")
            else:
                self.runner.graphs = graphs
                log.info("CUDA graphs captured for %s%s", cuda_graphs.describe(shapes),
                         "; the draft model's steps the same" if self.drafter is not None else "")
        log.info("warm-up took %.1f s", time.monotonic() - start)

    def _cap_to_pool(self, wanted: int, pool_tokens: int) -> int:
        if wanted > pool_tokens:
            log.warning("max_model_len %d capped to %d: the KV pool holds no more (give it more memory with "
                        "kv_cache_memory or gpu_memory_utilization)", wanted, pool_tokens)
            return pool_tokens
        return wanted

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        pooling: PoolingParams | None = None, images: Sequence[ImageInput] = (),
    ) -> str:
        """Queue a request: a generation, or with ``pooling`` an embedding (an embedding
        model's only kind); its id. ``images`` go where the prompt has an image marker
        (``<start_of_image>`` for Gemma 3, ``<|image_pad|>`` for Qwen2.5-VL, as their chat
        templates write them), in order."""
        self._check_kind(pooling)
        params = params or (SamplingParams(max_tokens=1) if pooling is not None else SamplingParams())
        spans: list[ImageSpan] = []
        mrope: tuple[torch.Tensor, int] | None = None
        if images:
            if self.images is None or pooling is not None:
                raise LocalserveError("this model does not read images" if self.images is None
                                      else "embeddings of images are not supported")
            prompt_ids, spans = self.images.place(prompt, images)
            if self.spec.rope.mrope_section is not None:  # Qwen-VL: image tokens turn by their row and column
                mrope = self.images.rope_positions(prompt_ids, spans)
            prompt_ids = self.images.prompt_ids(prompt_ids)
        else:
            prompt_ids = self._encode(prompt)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise LocalserveError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise LocalserveError("the prompt is empty")
        if max(prompt_ids) >= self.spec.vocab_size or min(prompt_ids) < 0:
            raise LocalserveError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        if params.speculative_method == "draft_model" and self.drafter is None:
            raise LocalserveError("speculative_method draft_model: this model is served without a draft model "
                                  "(--draft-model); ngram needs none")
        if params.logit_bias and max(params.logit_bias) >= self.spec.vocab_size:
            raise LocalserveError(f"logit_bias token ids must be in [0, {self.spec.vocab_size})")
        if pooling is not None and len(prompt_ids) > self.max_model_len:
            raise LocalserveError(f"the input ({len(prompt_ids)} tokens) exceeds the context of "
                                  f"{self.max_model_len} tokens; shorten it")
        if pooling is None and len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise LocalserveError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        request = Request(request_id, prompt_ids, params, self.eos_token_ids, generator, images=spans)
        if mrope is not None:
            request.mrope_positions, request.position_delta = mrope
        if pooling is not None:
            request.pooling, request.pooling_method = pooling, self.spec.pooling
        if params.output_format is not None:
            if self.structured is None:
                raise LocalserveError("structured output needs the model's tokenizer (this one has none)")
            request.constraint = self.structured.constraint(params.output_format)
        self.requests[request_id] = request
        self.outputs.add(request)
        self.scheduler.add(request)
        return request_id

    @property
    def image_placement(self) -> ImagePlacement | None:
        """Where images go in this model's prompts; None when it reads none."""
        return self.images.placement if self.images is not None else None

    def _check_kind(self, pooling: PoolingParams | None) -> None:
        if pooling is None and self.spec.pooling is not None:
            raise LocalserveError("this is an embedding model: it makes embeddings, not text")
        if pooling is not None:
            if self.spec.pooling is None:
                raise LocalserveError("this model makes text, not embeddings (its file names no pooling); "
                                      "serve an embedding model such as Qwen3-Embedding")
            pooling.check(self.spec.hidden_size)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LocalserveError("this model has no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.finish(request)
        self.speculator.release(request)
        request.finish_reason = "abort"
        self.outputs.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the loop ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, process its outputs: those of the requests that
        produced a token."""
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.transfer.run(batch.copies)
        self.kv.end_step()
        if not batch.requests:
            return []
        if self.images is not None:
            self.images.encode_step([(r.images, r.num_computed_tokens, r.num_computed_tokens + n)
                                     for r, n in zip(batch.requests, batch.num_new_tokens) if r.images])
        result = self.runner.execute(batch)
        self._record_computed(batch, result)
        now = time.monotonic()
        outputs = self._sampled_outputs(result, now) if result.sampled else []
        outputs += self.outputs.embedded(result.embeddings, now)
        for request in result.sampled + [request for request, _ in result.embeddings]:
            if request.finish_reason is not None:
                self._release(request)
        return outputs

    def _sampled_outputs(self, result: RunnerOutput, now: float) -> list[RequestOutput]:
        """Each sampling request's new tokens, its drafts' verdict applied: the tokens it
        keeps join it, and the cache keeps the K/V of those alone."""
        assert result.sampler_output is not None
        tokens, logprobs = result.sampler_output.token_ids, result.sampler_output.logprobs
        kept_tokens, kept_logprobs, row = [], [], 0
        for request in result.sampled:
            rows = 1 + len(request.draft_token_ids)
            kept = self.speculator.accept(request, tokens[row:row + rows])
            kept_tokens.append(tokens[row:row + kept])
            kept_logprobs.append(logprobs[row:row + kept])
            row += rows
        lengths = [request.num_tokens for request in result.sampled]
        outputs = self.outputs.process(result.sampled, kept_tokens, kept_logprobs, now)
        for request, length in zip(result.sampled, lengths):
            self.num_generated_tokens_total += request.num_tokens - length
            if request.draft_token_ids:
                # The step wrote K/V for the drafts too: those of the accepted ones stay (all
                # tokens but the new last are computed), the rest are overwritten later.
                request.draft_token_ids = []
                if request.finish_reason is None:
                    request.num_computed_tokens = request.num_tokens - 1
                    self.kv.trim(request)
                    self.kv.cache_full_blocks(request)
        return outputs

    def _record_computed(self, batch: ScheduledBatch, result: RunnerOutput) -> None:
        """The batch's tokens now have K/V in the cache; full blocks join the prefix cache."""
        for request, logprobs in result.prompt_logprobs:
            request.prompt_logprobs.append(logprobs)  # type: ignore[union-attr]  # a list when asked for
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.num_prompt_tokens_total += min(num_new, request.num_prompt_tokens - request.num_computed_tokens)
            # Draft tokens count once accepted (Engine._sampled_outputs).
            request.num_computed_tokens += num_new - len(request.draft_token_ids)
            self.kv.cache_full_blocks(request)

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        self.speculator.release(request)
        self.outputs.remove(request.request_id)
        del self.requests[request.request_id]
        self.num_finished_requests += 1

    # -- statistics -------------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv, scheduler = self.kv, self.scheduler
        return EngineStats(
            kv_blocks_total=kv.device.num_blocks, kv_blocks_used=kv.device.num_used,
            kv_blocks_cached=kv.device.num_cached, kv_block_size=self.config.block_size,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            cpu_blocks_total=kv.cpu.num_blocks, cpu_blocks_used=kv.cpu.num_used,
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped), num_preemptions=scheduler.num_preemptions,
            num_recomputes=scheduler.num_recomputes,
            swap_out_blocks=kv.stats.swap_out_blocks, swap_in_blocks=kv.stats.swap_in_blocks,
            prefix_cache_queries=kv.stats.prefix_cache_queries, prefix_cache_hits=kv.stats.prefix_cache_hits,
            prefix_cache_cpu_hits=kv.stats.prefix_cache_cpu_hits,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generated_tokens_total=self.num_generated_tokens_total,
            num_finished_requests=self.num_finished_requests,
            spec_decode_num_drafts=self.speculator.stats.num_drafts,
            spec_decode_num_draft_tokens=self.speculator.stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.speculator.stats.num_accepted_tokens,
        )
