"""Engine-level configuration: frozen dataclasses shared by the pipeline, engine and runners.

Model hyper-parameters live next to the model code (`vision/`, `language/`); this module holds
what is independent of any one architecture: where and how to run (how to sample: `sampling_params`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import torch

from mmpipe.errors import InputError

IMAGE_DECODERS = ("cpu", "gpu")


class GraphMode(str, enum.Enum):
    """Which parts of the model run as CUDA graphs (names as in vLLM), one behaviour each:
    `none`: no graphs at all; `piecewise`: prefill pieces and the ViT; `full_decode_only`: whole
    decode steps and the ViT; `full_and_piecewise`: all three. A runner's own
    `GraphConfig.enabled` (True or False) overrides its mode's choice."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @classmethod
    def parse(cls, mode: "GraphMode | str") -> "GraphMode":
        """A mode or its name (any case); an `InputError` naming the modes otherwise."""
        if isinstance(mode, str) and mode.lower() == "full":
            raise InputError("graph_mode='full' was removed (it did what 'full_decode_only' does: whole decode "
                             "steps, prefill without graphs); use 'full_decode_only', or 'full_and_piecewise' for both")
        try:
            return cls(mode.lower() if isinstance(mode, str) else mode)
        except ValueError:
            raise InputError(f"graph_mode={mode!r}: use one of {', '.join(m.value for m in cls)}") from None


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` picks CUDA when it is available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device={str(device)!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device={str(device)!r}: only 'cpu' and 'cuda' are supported")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device,
                  checkpoint_dtype: str | None = None) -> torch.dtype:
    """`None` gives float32 on the CPU and bfloat16 on CUDA (float16 if the checkpoint is float16)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InputError(f"dtype={dtype}: use float32, bfloat16 or float16")
        return dtype
    if dtype is not None:
        try:
            return _DTYPES[str(dtype).lower().removeprefix("torch.")]
        except KeyError:
            raise InputError(f"dtype={dtype!r}: use 'float32', 'bfloat16' or 'float16'") from None
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype in ("float16", "torch.float16") else torch.bfloat16


def effective_graph_mode(mode: GraphMode | None, device: torch.device) -> GraphMode:
    """The mode a run on `device` uses: `None` gives `full_and_piecewise` on CUDA and `none`
    elsewhere; on the CPU every mode runs as `none` (there is nothing to capture)."""
    if device.type != "cuda":
        return GraphMode.NONE
    return GraphMode.FULL_AND_PIECEWISE if mode is None else mode


_MODE_RUNNERS = {
    GraphMode.NONE: (),
    GraphMode.PIECEWISE: ("prefill", "vit"),
    GraphMode.FULL_DECODE_ONLY: ("decode", "vit"),
    GraphMode.FULL_AND_PIECEWISE: ("decode", "prefill", "vit"),
}


def graphs_wanted(mode: GraphMode, runner: str, config: "GraphConfig") -> bool:
    """Whether `runner` ("vit", "decode" or "prefill") asks for CUDA graphs: its config's
    `enabled` when set, else what `mode` says."""
    return config.enabled if config.enabled is not None else runner in _MODE_RUNNERS[mode]


_GRAPH_MEMORY = ("arena", "shared", "per_graph")


# How a tensor-parallel Pipeline runs its vision tower (`EngineConfig.vit_parallel`).
VIT_PARALLEL = ("data", "tensor", "rank0")
VIT_PARALLEL_HELP = ("with --tp: each GPU encodes a share of the images (data, the default), the vision tower is "
                     "split over the GPUs too (tensor), or the first GPU encodes them all (rank0)")

@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs of one runner (ViT, decode or prefill).

    `enabled` None follows the graph mode; True or False overrides it. Either way graphs need CUDA
    and an attention backend that can be captured (else the runner runs eagerly).
    `buckets` are the sizes captured (patch counts, batch sizes, token counts); None takes the
    runner's default schedule. `max_graphs` bounds live graphs (least recently used evicted).
    `memory`: "arena" (VMM: any capture order costs about the largest graph), "shared" (one pool,
    best when captured largest first), "per_graph" (a pool each; memory grows with every shape).
    """

    enabled: bool | None = None
    buckets: tuple[int, ...] | None = None
    max_graphs: int = 64
    memory: str = "shared"

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise InputError(f"GraphConfig.enabled={self.enabled!r}: use True, False or None")
        if not isinstance(self.max_graphs, int) or isinstance(self.max_graphs, bool) or self.max_graphs <= 0:
            raise InputError(f"GraphConfig.max_graphs={self.max_graphs!r}: must be a positive integer")
        if self.memory not in _GRAPH_MEMORY:
            raise InputError(f"GraphConfig.memory={self.memory!r}: use 'arena', 'shared' or 'per_graph'")
        if self.buckets is not None:
            try:
                buckets = tuple(sorted({int(b) for b in self.buckets}))
            except (TypeError, ValueError):
                raise InputError(f"GraphConfig.buckets={self.buckets!r}: give positive integers") from None
            if not buckets or buckets[0] <= 0:
                raise InputError(f"GraphConfig.buckets={self.buckets!r}: give positive integers")
            object.__setattr__(self, "buckets", buckets)



@dataclass(frozen=True)
class EngineConfig:
    """How a loaded model runs. Defaults suit one GPU or a CPU; every limit is checked at start."""

    # KV cache: fixed-size pages; page 0 is reserved for padding writes.
    kv_page_size: int = 16
    # Number of KV pages; None sizes the cache from `kv_memory_fraction` (CUDA) or
    # `cpu_kv_tokens` (CPU).
    num_kv_pages: int | None = None
    kv_memory_fraction: float = 0.85
    cpu_kv_tokens: int = 65536
    # Longest prompt + generation a request may reach; None uses the model's limit.
    max_model_len: int | None = None
    # Most sequences decoded together in one step.
    max_running_requests: int = 256
    # Token budget of one prefill forward (prompt chunks of several requests are packed).
    max_prefill_tokens: int = 8192
    # Patch budget of one vision-encoder call (several images are packed).
    max_vision_patches: int = 16384
    # Vision embeddings kept for reuse (same image in several requests or turns), in bytes.
    encoder_cache_bytes: int = 1 << 30
    # Prefix caching: full KV pages stay cached after their request, and a request whose
    # sequence starts with cached pages (a chat's earlier turns, a repeated image and question)
    # prefills only the rest. Cached pages nobody holds are evicted before any preemption.
    prefix_caching: bool = True
    # Preprocessed images kept by the content of their encoded file (the same file again is not
    # decoded and resized again: a chat's later turns, repeated images), in bytes of resized pixels;
    # 0 turns it off.
    preprocessed_cache_bytes: int = 256 << 20
    # Threads decoding and preprocessing images and videos ahead of the engine.
    preprocess_workers: int = 4
    # Resized pixels that requests read ahead of the engine may hold (images, video frames), in
    # bytes: no further input is read while unfinished requests hold more (long videos).
    input_bytes_ahead: int = 4 << 30
    # Where JPEG files are decoded and resized: "cpu" (Pillow, matching transformers'
    # Qwen2VLImageProcessorPil exactly) or "gpu" (nvJPEG and torchvision's resize on the GPU,
    # matching its torchvision-backed Qwen2VLImageProcessor; needs CUDA and torchvision). Other
    # formats, and JPEGs the GPU cannot take as Pillow would, use Pillow either way. "gpu" also
    # decodes videos with NVDEC (FFmpeg's CUDA decoding in PyAV; CPU decoding where it has none).
    image_decode: str = "cpu"
    # Overlapped scheduling: plan and launch step N+1 before reading step N's tokens, so host
    # work runs while the GPU computes (same results; see engine.py). None: on for CUDA, off on
    # the CPU (where nothing runs asynchronously); False for debugging.
    overlap_schedule: bool | None = None
    # The vision encoder on its own CUDA stream: a step's ViT work starts while the GPU still runs
    # the previous step's prefill and decode, and the step's prefill waits for it on the device
    # (same results). None: on for CUDA; it needs CUDA, so the CPU ignores it (with a log line).
    vision_stream: bool | None = None
    # Progress bars while graphs are captured at start-up (the log line is written either way).
    startup_progress: bool = True
    # Which parts of the language model run as CUDA graphs (GraphMode or its name); None:
    # full_and_piecewise on CUDA, none on the CPU.
    graph_mode: GraphMode | str | None = None
    # Decode graphs: one per batch-size bucket (default 1, 2, 4, 8, 16, 24, 32, then steps of 16
    # to 256, capped by max_running_requests), captured at start, largest first, in one pool.
    decode_graph: GraphConfig = GraphConfig()
    # ViT graphs, captured lazily per bucket of packed patch count (default buckets: 64-patch
    # steps to 1024, 256 to 4096, 1024 above, to max_vision_patches). On by default on CUDA when
    # the ViT attention can be captured (half precision).
    vit_graph: GraphConfig = GraphConfig(max_graphs=32, memory="arena")
    vit_graph_max_images: int = 64  # images in one ViT graph call (segment slots are sized for it)
    # Piecewise prefill graphs: the forward cut at its attention calls, each piece between them
    # captured at start for every token count of the schedule (default 20 sizes from 8 to 2048,
    # `language.prefill_schedule`, then every 512 up to max_prefill_tokens
    # or 8192, whichever is less: 32 sizes at 8192), largest first, in the pool the decode
    # graphs use ("shared" only).
    prefill_graph: GraphConfig = GraphConfig()
    # Compiler of the prefill pieces: "eager" (captured straight from the eager forward, nothing
    # traced; fast start) or "inductor" (the forward traced by torch.compile and each piece
    # compiled to fused kernels; compiled artifacts kept in the compile cache).
    prefill_compiler: str = "eager"
    # Compile cache directory; None: $MMPIPE_CACHE_DIR, else $XDG_CACHE_HOME/mmpipe, else
    # ~/.cache/mmpipe (subfolder "compile", entries keyed by torch, GPU, model and compiler).
    compile_cache_dir: str | None = None
    # Most token ids a request may hold back at once (its stop and eos ids, before
    # min_new_tokens): the width of the decode batch's ban list. A request with more is rejected
    # with an InputError naming the limit.
    max_banned_tokens: int = 16
    # Attention implementation for the language model and the ViT: "auto" picks the fastest
    # one available on the device; "torch" is the reference.
    attention_backend: str = "auto"
    # Weights quantized at load: None (the checkpoint's dtype; FP8 checkpoints keep their FP8
    # layers where the GPU has FP8 tensor cores, else are dequantized), "fp8" (the language
    # model's linear layers in FP8 E4M3, per-channel weight scales, activations quantized per
    # token) or "fp8-all" (the vision tower's too); both need CUDA compute capability 8.9+.
    quantization: str | None = None
    # Prefill (extend) attention on CUDA: "triton" (reads the cache's pages), "varlen"
    # (FlashAttention on contiguous K/V) or "auto" (by context length; see cuda_backend).
    extend_attention: str = "auto"
    # Tensor parallelism: the language model split over this many GPUs (the device given and the
    # next ones; one worker process per extra GPU; gloo processes on the CPU). See
    # mmpipe.engine.tensor_parallel.
    tensor_parallel_size: int = 1
    # Under tensor parallelism, a mixture-of-experts model's experts split whole over the ranks
    # (E/N experts each) instead of along every expert's width; attention and the dense layers
    # split as before. See language/tensor_parallel.py.
    expert_parallel: bool = False
    # Where the weights come from: "auto" (the checkpoint's files) or "dummy" (drawn at random on
    # the device, `mmpipe.weights.fill_random`: for timing shapes too large to write to disk; the
    # directory then needs only its configs and tokenizer).
    load_format: str = "auto"
    # The vision tower under tensor parallelism: "data" (each rank encodes a share of a step's
    # images with its own copy of the tower; the embeddings come back to rank 0), "tensor" (the
    # tower split over the ranks too, every rank running every pack: one image's latency falls,
    # at the cost of two collectives per block) or "rank0" (rank 0 encodes them all).
    vit_parallel: str = "data"

    def __post_init__(self) -> None:
        for name in ("kv_page_size", "max_running_requests", "max_prefill_tokens", "max_vision_patches",
                     "cpu_kv_tokens", "preprocess_workers", "vit_graph_max_images", "max_banned_tokens",
                     "tensor_parallel_size", "input_bytes_ahead"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(f"EngineConfig.{name}={value!r}: must be a positive integer")
        if self.image_decode not in IMAGE_DECODERS:
            raise InputError(f"EngineConfig.image_decode={self.image_decode!r}: use one of {', '.join(IMAGE_DECODERS)}")
        if not isinstance(self.expert_parallel, bool):
            raise InputError(f"EngineConfig.expert_parallel={self.expert_parallel!r}: use True or False")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise InputError("EngineConfig.expert_parallel=True splits experts over tensor-parallel ranks: "
                             "give tensor_parallel_size > 1")
        for name in ("overlap_schedule", "vision_stream"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InputError(f"EngineConfig.{name}={getattr(self, name)!r}: use True, False or None")
        if self.num_kv_pages is not None and (not isinstance(self.num_kv_pages, int) or self.num_kv_pages < 2):
            raise InputError(f"EngineConfig.num_kv_pages={self.num_kv_pages!r}: must be an integer >= 2")
        for name in ("decode_graph", "vit_graph", "prefill_graph"):
            if not isinstance(getattr(self, name), GraphConfig):
                raise InputError(f"EngineConfig.{name}: give a GraphConfig, got {getattr(self, name)!r}")
        if self.graph_mode is not None:  # parsed once, here: the runner reads a GraphMode
            object.__setattr__(self, "graph_mode", GraphMode.parse(self.graph_mode))
        if self.prefill_graph.memory != "shared":
            raise InputError(f"EngineConfig.prefill_graph.memory={self.prefill_graph.memory!r}: prefill pieces "
                             "share the language model's pool; only 'shared' is supported")
        if self.prefill_compiler not in ("eager", "inductor"):
            raise InputError(f"EngineConfig.prefill_compiler={self.prefill_compiler!r}: use 'eager' or 'inductor'")
        for name in ("encoder_cache_bytes", "preprocessed_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InputError(f"EngineConfig.{name}={value!r}: must be an integer >= 0")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise InputError(f"EngineConfig.kv_memory_fraction={self.kv_memory_fraction!r}: must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise InputError(f"EngineConfig.max_model_len={self.max_model_len!r}: must be positive")
        if self.extend_attention not in ("auto", "triton", "varlen"):
            raise InputError(f"EngineConfig.extend_attention={self.extend_attention!r}: "
                             "use 'auto', 'triton' or 'varlen'")
        if self.load_format not in ("auto", "dummy"):
            raise InputError(f"EngineConfig.load_format={self.load_format!r}: use 'auto' or 'dummy'")
        if self.vit_parallel not in VIT_PARALLEL:
            raise InputError(f"EngineConfig.vit_parallel={self.vit_parallel!r}: use 'data', 'tensor' or 'rank0'")
        if self.attention_backend not in ("auto", "torch", "cuda"):
            raise InputError(f"EngineConfig.attention_backend={self.attention_backend!r}: "
                             "use 'auto', 'torch' or 'cuda'")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


# How to sample lives in its own module; imported here too, where callers have always found it.
from mmpipe.sampling_params import GenerationDefaults, ResolvedSampling, SamplingParams  # noqa: E402,F401
