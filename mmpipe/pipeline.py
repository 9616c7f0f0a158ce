"""The Python API: load a checkpoint once, then chat, generate, caption or stream.

    pipe = Pipeline.from_pretrained()                     # the bundled model, best device
    outs = pipe.chat([[{"role": "user", "content": [{"type": "image", "image": "cat.jpg"},
                                                    {"type": "text", "text": "What is this?"}]}]])
    print(outs[0].text)

Requests run on the continuous-batching engine. Images are decoded and preprocessed on worker
threads a bounded distance ahead of the engine, so host work overlaps GPU work and memory stays
flat however many requests a call holds. A request whose input is bad (unreadable image,
too-long prompt, rejected chat) comes back with `finish_reason="error"` and a message naming
the input, and every other request completes; pass errors="raise" to raise instead (requests
already running are then aborted). Several threads may call one Pipeline at once: their
requests are batched together. `chat_stream` yields outputs as they finish, from an iterable of
any length; `stream` yields one answer's text as it is generated (a `TextStream`).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from mmpipe import settings
from mmpipe.captioning import caption_conversation, caption_prompt, caption_video_options
from mmpipe.config import EngineConfig, GraphMode, SamplingParams, resolve_device, resolve_dtype
from mmpipe.engine.engine import Engine
from mmpipe.engine.feed import RequestFeed
from mmpipe.engine.model_runner import ModelRunner
from mmpipe.engine.processor import InputProcessor, Prepared
from mmpipe.errors import CheckpointError, InputError
from mmpipe.models import LoadedModel, check_tensor_parallel_split, load_model
from mmpipe.outputs import RequestOutput
from mmpipe.startup import StartupReport
from mmpipe.stream_loop import StreamLoop
from mmpipe.text_stream import TextStream
from mmpipe.tokenizer import generation_defaults, load_tokenizer
from mmpipe.video_parts import video_of_part
from mmpipe.vision.gpu_decode import require_gpu_decode
from mmpipe.vision.preprocess import ImageProcessorConfig
from mmpipe.vision.video_sampling import VideoOptions
from mmpipe.weights import read_json

log = logging.getLogger("mmpipe")

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(_REPO_ROOT, "assets", "mmpipe-tiny-scenes")
PROGRESS_THRESHOLD = 64  # calls with at least this many requests show a progress bar by default


def default_model_path() -> str:
    """The bundled model (or $MMPIPE_MODEL when set)."""
    path = settings.current().model or DEFAULT_MODEL_DIR
    if not os.path.isdir(path):
        raise CheckpointError(f"the default model is not at {path!r}; pass a checkpoint directory or set "
                              "MMPIPE_MODEL")
    return path


class Pipeline:
    def __init__(self, model: LoadedModel, tokenizer: Any, engine_config: EngineConfig,
                 startup: StartupReport | None = None, startup_sampling: SamplingParams | None = None,
                 workers: Any = None) -> None:
        """`workers`: the tensor-parallel ranks 1..N-1 (`mmpipe.engine.tensor_parallel.Workers`),
        started by `from_pretrained`; this process is rank 0."""
        self.model = model
        self.tokenizer = tokenizer
        self.engine_config = engine_config
        self.startup = startup if startup is not None else StartupReport()
        self.defaults = generation_defaults(model.path, tokenizer)
        resolved = startup_sampling.resolve(self.defaults) if startup_sampling is not None else None
        if workers is not None:
            from mmpipe.engine.tensor_parallel import start_runner

            self.runner = start_runner(model, engine_config, workers, self.startup, resolved)
        else:
            self.runner = ModelRunner(model, engine_config, self.startup, resolved)
        self.engine = Engine(self.runner, engine_config)
        self.processor = InputProcessor(tokenizer, model, self.defaults, self.runner.max_model_len,
                                        engine_config.max_banned_tokens, engine_config.preprocessed_cache_bytes,
                                        engine_config.image_decode)
        self._pool = futures.ThreadPoolExecutor(engine_config.preprocess_workers, thread_name_prefix="mmpipe-img")
        self._text_lock = threading.Lock()  # tokenizers are not safe to share across threads
        self._feed = RequestFeed(self.engine, self.processor, self._pool, self._text_lock)
        self._streams = StreamLoop(self.engine)  # steps the engine for `stream`'s TextStreams

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str] | None = None, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, engine_config: EngineConfig | None = None,
                        graph_mode: GraphMode | str | None = None, min_pixels: int | None = None,
                        max_pixels: int | None = None, startup_sampling: SamplingParams | None = None,
                        **engine_options: Any) -> "Pipeline":
        """Load a local checkpoint directory (None: the bundled model). `graph_mode`: which parts
        of the language model run as CUDA graphs (`GraphMode`; default full_and_piecewise on CUDA,
        none on the CPU). `min_pixels` / `max_pixels`: every image's area limits, in place of the
        checkpoint's preprocessor_config.json values (as transformers' `AutoProcessor.
        from_pretrained(..., min_pixels=, max_pixels=)`; None keeps the checkpoint's); an image
        part's own `min_pixels` / `max_pixels` / `resized_height` + `resized_width` keys override
        them for that image. `startup_sampling`: the sampling most requests will use; the decode
        graphs captured at start-up are those it needs (default: greedy's; other settings capture
        theirs at `warm_up` or on first use). `engine_options` override fields of `engine_config`
        (e.g. `kv_page_size=32`)."""
        settings.current()  # a malformed or retired MMPIPE_* variable is refused before anything loads
        path = os.fspath(path) if path is not None else default_model_path()
        limits = min_pixels is not None or max_pixels is not None
        if limits and os.path.isdir(path):  # a mistake is reported before the weights load
            try:
                checkpoint_limits = ImageProcessorConfig.from_dir(path)
            except CheckpointError:
                checkpoint_limits = None  # load_model names what the directory lacks
            if checkpoint_limits is not None:
                _with_pixel_limits(checkpoint_limits, min_pixels, max_pixels)
        dev = resolve_device(device)
        hf_config = read_json(path, "config.json") if os.path.isdir(path) else {}
        dt = resolve_dtype(dtype, dev, hf_config.get("dtype") or hf_config.get("torch_dtype"))
        config = engine_config or EngineConfig()
        if graph_mode is not None:
            engine_options["graph_mode"] = graph_mode
        if engine_options:
            try:
                config = config.replace(**engine_options)
            except TypeError as exc:
                raise InputError(f"Pipeline.from_pretrained: {exc}") from None
        if config.image_decode == "gpu":  # before the weights load
            require_gpu_decode(dev)
        startup = StartupReport()
        workers = None
        if config.tensor_parallel_size > 1:
            from mmpipe.engine.tensor_parallel import Workers, check_tensor_parallel

            check_tensor_parallel(config.tensor_parallel_size, dev, config)
            if not os.path.isdir(path):
                raise CheckpointError(f"{path!r}: not a directory (models load from a local checkpoint directory)")
            check_tensor_parallel_split(path, config.tensor_parallel_size, config.vit_parallel == "tensor",
                                        config.expert_parallel)
            workers = Workers(path, dev, dt, config)  # they load their weights beside this process
        try:
            with startup.phase("weights"):
                # Under tensor parallelism only this rank's shard is read.
                tp = None
                if workers is not None:
                    from mmpipe.layers.parallel import TPGroup

                    tp = TPGroup(0, config.tensor_parallel_size, expert_parallel=config.expert_parallel)
                model = load_model(path, dev, dt, config.attention_backend, config.extend_attention,
                                   config.quantization, tp=tp, shard_vision=config.vit_parallel == "tensor",
                                   load_format=config.load_format)
            if limits:
                model.image_processor = _with_pixel_limits(model.image_processor, min_pixels, max_pixels)
            with startup.phase("tokenizer"):
                tokenizer = load_tokenizer(path)
            pipe = cls(model, tokenizer, config, startup, startup_sampling, workers)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        log.info("%s", startup.line())
        return pipe

    def warm_up(self, images: Sequence[Any] = (), sampling: SamplingParams | None = None) -> int:
        """Capture now the graphs a run of requests like these will use, so a long run captures
        nothing once it has started: the vision encoder's for packs of these images (1 to as many
        as fit of each distinct size, as the engine packs them), and with `sampling`, the decode
        step's for its sampler (greedy is captured at start-up already; a sampled or
        min_new_tokens run uses other variants). Images that cannot be read are skipped (the run
        reports them). Timed as start-up phases; returns the graphs captured."""
        grids = []
        for i, source in enumerate(images):
            try:
                grids.append(self.processor.load_image(source, f"warm_up image {i}").grid_thw)
            except InputError:
                continue
        with self.engine.lock:  # no step between the ranks' captures (tensor parallelism)
            captured = 0
            if grids:
                with self.startup.phase("ViT graphs") as phase:
                    captured = self.runner.capture_vision(grids)
                    phase.detail = f"{captured} graphs for packs of {len(set(grids))} image size(s)"
            if sampling is not None and self.runner.decoder is not None:
                resolved = sampling.resolve(self.defaults)
                with self.startup.phase("decode graphs for the sampling") as phase:
                    more = self.runner.capture_decode_sampling(resolved)
                    phase.detail = f"{more} graphs"
                captured += more
        log.info("%s", self.startup.line())
        return captured

    def startup_report(self) -> str:
        """One line: how long each start-up phase took (weights, tokenizer, KV cache, each graph
        runner's start-up schedule, with Triton's compile time inside them)."""
        return self.startup.line()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # ------------------------------------------------------------------ API

    def chat(self, conversations: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             errors: str = "return", progress: bool | None = None) -> list[RequestOutput]:
        """Answer one conversation or a list of them; results in input order."""
        submitted = time.monotonic()  # metrics count from the call
        convs = _as_list_of_conversations(conversations)
        params = _per_request(sampling, len(convs))

        def spec(i: int) -> Callable[[], Prepared]:
            def prepare() -> Prepared:
                where = f"conversation {i}"
                return self.processor.prepare(i, *self.processor.render_chat(convs[i], where), params[i], where,
                                              submitted=submitted)
            return prepare

        return self._execute(((i, spec(i)) for i in range(len(convs))), len(convs), errors, progress)

    def chat_stream(self, conversations: Iterable[Any], sampling: SamplingParams | None = None,
                    errors: str = "return") -> Iterator[RequestOutput]:
        """Answer conversations from an iterable of any length (a generator is read lazily, a
        bounded distance ahead), yielding each `RequestOutput` as soon as it finishes; `.index`
        is the conversation's position in the iterable. All of them share one continuous stream
        of engine steps (no batch boundaries), and memory stays flat however many there are.
        Closing the iterator aborts the requests still running."""
        params = sampling or SamplingParams()

        def specs() -> Iterator[tuple[int, Callable[[], Prepared]]]:
            for i, conversation in enumerate(conversations):
                read = time.monotonic()  # a lazy iterable submits each conversation when it is read

                def prepare(i: int = i, conversation: Any = conversation, submitted: float = read) -> Prepared:
                    where = f"conversation {i}"
                    return self.processor.prepare(i, *self.processor.render_chat(conversation, where), params, where,
                                                  submitted=submitted)
                yield i, prepare

        return self._feed.outputs_as_completed(specs(), errors)

    def generate(self, prompts: str | Sequence[str], images: Sequence[Sequence[Any]] | None = None,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, errors: str = "return",
                 progress: bool | None = None) -> list[RequestOutput]:
        """Complete pre-formatted prompts. Each image needs one `<|vision_start|><|image_pad|>
        <|vision_end|>` placeholder in its prompt, each video one `<|vision_start|><|video_pad|>
        <|vision_end|>`; `images[i]` lists prompt i's images and videos in order (a video as its
        chat part, `{"type": "video", "video": ..., keys...}`)."""
        submitted = time.monotonic()
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        if images is not None and len(images) != len(prompt_list):
            raise InputError(f"generate: {len(prompt_list)} prompts but {len(images)} image lists")
        params = _per_request(sampling, len(prompt_list))

        def spec(i: int) -> Callable[[], Prepared]:
            def prepare() -> Prepared:
                if not isinstance(prompt_list[i], str):
                    raise InputError(f"prompt {i}: must be a string, got {type(prompt_list[i]).__name__}")
                imgs = [_video_or_image(item, f"prompt {i}, item {k}")
                        for k, item in enumerate(images[i] if images is not None else [])]
                return self.processor.prepare(i, prompt_list[i], imgs, params[i], f"prompt {i}", submitted=submitted)
            return prepare

        return self._execute(((i, spec(i)) for i in range(len(prompt_list))), len(prompt_list), errors, progress)

    def caption(self, images: Sequence[Any] | Any, prompt: str | None = None, sampling: SamplingParams | None = None,
                errors: str = "return", progress: bool | None = None, *, video_prompt: str | None = None,
                video: VideoOptions | dict[str, Any] | None = None) -> list[str | None]:
        """Caption each image or video file (a path or file:// URI ending in a video extension,
        `mmpipe.captioning.VIDEO_EXTENSIONS`, any case); a file that cannot be read gives None
        (errors="raise" raises). `prompt`: the question (default "Describe this image."); videos
        are asked `video_prompt`, else `prompt`, else "Describe this video.". `video`: how every
        video is sampled and sized, a dict of `VideoOptions` keys (fps or nframes, min_frames,
        max_frames, min_pixels, max_pixels, total_pixels, resized_height + resized_width,
        video_start, video_end; default Qwen's: 2 fps, 4 to 768 frames), checked before any
        request runs."""
        options = caption_video_options(video, self.model.image_processor.factor, "caption: video")
        sources = list(images) if isinstance(images, (list, tuple)) else [images]
        conversations = [caption_conversation(source, caption_prompt(source, prompt, video_prompt), options)
                         for source in sources]
        outputs = self.chat(conversations, sampling, errors, progress)
        return [o.text.strip() if o.ok else None for o in outputs]

    def stream(self, conversation: Sequence[dict[str, Any]], sampling: SamplingParams | None = None) -> "TextStream":
        """Yield the answer's text as it is generated. Deltas never split a character and never
        include text a stop string later removes; closing the iterator aborts the request and
        frees its KV pages. The returned `TextStream` also reports the request's live counts and
        timings (prompt and image tokens, tokens so far, time to first token from this call)."""
        submitted = time.monotonic()
        with self._text_lock:
            prompt, media = self.processor.render_chat(conversation, "conversation")
        return self._stream(prompt, media, sampling, "conversation", submitted)

    def stream_prompt(self, prompt: str, images: Sequence[Any] = (), sampling: SamplingParams | None = None
                      ) -> "TextStream":
        """`stream` for a pre-formatted prompt and its media, as `generate` takes them."""
        submitted = time.monotonic()
        if not isinstance(prompt, str):
            raise InputError(f"prompt: must be a string, got {type(prompt).__name__}")
        media = [_video_or_image(item, f"prompt, item {k}") for k, item in enumerate(images)]
        return self._stream(prompt, media, sampling, "prompt", submitted)

    def _stream(self, prompt: str, media: Sequence[Any], sampling: SamplingParams | None, where: str,
                submitted: float) -> "TextStream":
        with self._text_lock:
            prepared = self.processor.prepare(0, prompt, media, sampling or SamplingParams(), where, stream=True,
                                              submitted=submitted)
        loaded = [self.processor.load_image(src, self.processor.image_where(prepared, k))
                  for k, src in enumerate(prepared.image_sources)]
        with self._text_lock:
            request = self.processor.assemble(prepared, loaded)
        return TextStream(self.engine, request, self._streams)

    def prepare_structured_output(self) -> None:
        """Build what `SamplingParams(json_schema=...)` needs now, on a thread of its own (a server
        calls this at start; else the first request with a schema waits for it)."""
        self.processor.grammars.build_in_background(self.model.path)

    def stats(self) -> dict[str, Any]:
        """Engine statistics: graph mode; ViT, decode and prefill graphs (graphs, captures, capture
        seconds, bytes held, replays, eager fallbacks); step counters and decode host time; KV
        pages, requests, the encoder cache and the prefix cache; tensor parallelism (size, and with several ranks
        the vision split and the images the workers encoded)."""
        with self.engine.lock:
            scheduler = self.engine.scheduler
            return {
                **self.runner.graph_stats(),
                "runner": self.runner.stats.as_dict(),
                "kv_pages": {"total": self.runner.pages.capacity, "free": self.runner.pages.num_free,
                             "page_size": self.runner.page_size},
                "requests": {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                             "preemptions": scheduler.preemptions},
                "encoder_cache": self.engine.cache.stats(),
                "prefix_cache": {"enabled": scheduler.prefix_caching, **scheduler.prefix.as_dict(),
                                 **self.runner.pages.cache_stats(), "kept_logits": len(scheduler.first_tokens)},
                "preprocessed_cache": self.processor.preprocessed.stats(),
                "steps": self.engine.steps,
                "overlap_schedule": self.engine.overlap,
                "tensor_parallel": self.runner.parallel_stats(),
                "vision_stream": self.runner.vision_stream is not None,
                "startup": self.startup.as_dict(),
            }

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV page, e.g. between benchmark runs that must not share them; the
        number of pages forgotten (pages running requests hold stay theirs, uncached)."""
        with self.engine.lock:
            return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Release the model and KV cache (GPU memory)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if "_streams" in self.__dict__:
            self._streams.close()  # its step in flight ends first; streams still running end aborted
        engine = self.__dict__.get("engine")
        with engine.lock if engine is not None else contextlib.nullcontext():  # no step mid-teardown
            if engine is not None:
                try:
                    engine.drain()  # the step in flight finishes before its graphs and cache go
                except Exception:  # closing must not fail; a broken step has nothing left to give
                    log.debug("draining the engine at close failed", exc_info=True)
            if "runner" in self.__dict__:
                self.runner.close()
            for name in ("engine", "runner", "model", "processor"):
                self.__dict__.pop(name, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the driver

    def _execute(self, specs: Iterable[tuple[int, Callable[[], Prepared]]], count: int, errors: str,
                 progress: bool | None) -> list[RequestOutput]:
        """Run every request; results in input order."""
        outputs: list[RequestOutput | None] = [None] * count
        bar = _progress_bar(count, progress)
        try:
            for output in self._feed.outputs_as_completed(specs, errors):
                outputs[output.index] = output
                bar.update(1)
        finally:
            bar.close()
        missing = [i for i, o in enumerate(outputs) if o is None]
        if missing:  # a bug, never a silently shorter list
            raise RuntimeError(f"no output for request(s) {missing[:10]}")
        return outputs  # type: ignore[return-value]


def _with_pixel_limits(config: ImageProcessorConfig, min_pixels: int | None,
                       max_pixels: int | None) -> ImageProcessorConfig:
    try:
        return config.with_limits(min_pixels, max_pixels)
    except InputError as exc:
        raise InputError(f"Pipeline.from_pretrained: {exc}") from None


def _progress_bar(count: int, progress: bool | None) -> Any:
    from tqdm import tqdm

    enabled = progress if progress is not None else count >= PROGRESS_THRESHOLD
    return tqdm(total=count, unit="req", disable=not enabled, dynamic_ncols=True)


def _as_list_of_conversations(conversations: Any) -> list[Any]:
    if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
        return [conversations]  # a single conversation
    if not isinstance(conversations, (list, tuple)):
        raise InputError("chat: pass a conversation (list of messages) or a list of conversations")
    return list(conversations)


def _per_request(sampling: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * count
    if isinstance(sampling, SamplingParams):
        return [sampling] * count
    params = list(sampling)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise InputError(f"sampling: give one SamplingParams or a list of {count}")
    return params


def _video_or_image(item: Any, where: str) -> Any:
    """A `generate` media item: a video part (dict) becomes its `ChatVideo`; anything else is an
    image source."""
    if isinstance(item, dict) and item.get("type") in ("video", "video_url"):
        return video_of_part(item, where)
    return item
