"""Rank 0's model runner under tensor parallelism: each model call that runs collectives is first
sent to the workers, then made here; a step's images are shared out by patches (data-parallel
vision) or run by every rank (a split tower)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch

from mmpipe.config import EngineConfig
from mmpipe.step_io import PendingDecode, PrefillInputs
from mmpipe.engine.model_runner import ModelRunner
from mmpipe.engine.request import Request
from mmpipe.engine.tensor_parallel.workers import Workers, abort_group, join_group
from mmpipe.errors import EngineError, InputError
from mmpipe.models import LoadedModel
from mmpipe.startup import StartupReport


def start_runner(model: LoadedModel, cfg: EngineConfig, workers: Workers, startup: StartupReport,
                 startup_sampling: Any) -> "TensorParallelRunner":
    """Rank 0's side of the start: once every worker has loaded its shard, all ranks join the
    group and build their runners (capturing the same graphs in lockstep)."""
    try:
        with startup.phase("tensor-parallel workers"):
            workers.wait_for("loaded")
        workers.send("start", startup_sampling)
        workers.group = model.tp
        join_group(model.tp, workers.store, model.device)
        runner = TensorParallelRunner(model, cfg, workers, startup, startup_sampling)
        workers.wait_for("ready")
        return runner
    except BaseException:
        workers.close()
        raise


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: each call that runs collectives is first sent to the workers."""

    def __init__(self, model: LoadedModel, cfg: EngineConfig, workers: Workers, startup: StartupReport | None = None,
                 startup_sampling: Any = None) -> None:
        self.workers = workers
        self._pages_sent: dict[int, int] = {}  # request id -> KV pages its worker mirror holds
        self.images_on_workers = 0  # images the workers encoded (data-parallel vision)
        self.worker_vit_runs: dict[int, dict[str, int]] = {}  # each worker's ViT calls, from its last answer
        super().__init__(model, cfg, startup, startup_sampling)

    def parallel_stats(self) -> dict[str, Any]:
        return {"size": self.workers.size if self.workers is not None else self.model.tp.size,
                "expert_parallel": self.cfg.expert_parallel, "vit_parallel": self.cfg.vit_parallel,
                "vision_sharded": self.vision_sharded,
                "images_encoded_by_workers": self.images_on_workers, "worker_vit_runs": dict(self.worker_vit_runs)}

    def _encode_packs(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """Data-parallel vision: rank r encodes share r, rank 0 gathers the embeddings in order.
        Tensor-parallel vision: every rank runs every pack on its shard of the tower."""
        size = self.workers.size
        if self.cfg.vit_parallel == "tensor":
            return self._encode_together(images)
        if self.cfg.vit_parallel != "data" or len(images) < 2:
            return super()._encode_packs(images)
        shares = split_shares([image.num_patches for image in images], size)
        for rank in range(1, size):
            lo, hi = shares[rank]
            if hi > lo:
                self.workers.send_to(rank, "encode", [_portable(image) for image in images[lo:hi]])
                self.images_on_workers += hi - lo
        lo, hi = shares[0]
        own: BaseException | None = None
        failures = []
        with self._in_lockstep("vision encode"):
            try:
                results = super()._encode_packs(images[lo:hi])
            except (torch.OutOfMemoryError, MemoryError, InputError) as exc:  # the workers' answers are read first
                own, results = exc, []
            tail = embedding_tail(self.model.language)
            for rank in range(1, size):
                lo, hi = shares[rank]
                if hi == lo:
                    continue
                for image in images[lo:hi]:
                    out = torch.empty(image.num_tokens, *tail, dtype=self.dtype, device=self.device)
                    results.append(self.model.tp.recv(out, rank))
                kind, detail = self.workers.reply(rank)
                if kind != "encoded":
                    failures.append(detail)
                elif detail is not None:
                    self.worker_vit_runs[rank] = detail
        # A share that failed (out of memory, a file the GPU cannot decode) fails the pack as it
        # would on one GPU: the engine then encodes its images one by one, on this rank.
        if own is not None:
            raise own
        if failures:
            what, message = failures[0]
            raise torch.OutOfMemoryError(message) if what == "memory" else InputError(message)
        return results

    def _encode_together(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """Every rank runs the same packs (same images, same order: the same buckets and captures)
        on its shard of the tower; rank 0 keeps the embeddings. A file the GPU cannot decode fails
        on every rank at the same pack, before that pack's collectives: the ranks stay in step and
        the engine retries the images one by one, as on one GPU. Anything else failing here ends
        the group (the ranks' collectives may be out of step)."""
        self.workers.send("encode_together", [_portable(image) for image in images])
        own: InputError | None = None
        with self._in_lockstep("vision encode"):
            try:
                results = super()._encode_packs(images)
            except InputError as exc:
                own, results = exc, []
            answers = [self.workers.reply(rank) for rank in range(1, self.workers.size)]
            self.worker_vit_runs.update((rank, detail) for rank, (kind, detail) in enumerate(answers, start=1)
                                        if kind == "encoded" and detail is not None)
            agree = all(kind == ("encode_failed" if own is not None else "encoded") and
                        (own is None or detail[0] == "input") for kind, detail in answers)
            if not agree:
                raise EngineError(f"tensor-parallel vision ranks disagree: rank 0 {own or 'encoded'}, the others "
                                  f"{[detail or kind for kind, detail in answers]}")
        if own is not None:
            raise own
        return results

    def capture_vision(self, grids: Sequence[tuple[int, int, int]]) -> int:
        if self.cfg.vit_parallel == "rank0" or not grids:
            return super().capture_vision(grids)
        # Data: their shares are packs of the same sizes. Tensor: the same graphs in the same order.
        self.workers.send("capture_vision", list(grids))
        with self._in_lockstep("vision graph capture") if self.cfg.vit_parallel == "tensor" else \
                contextlib.nullcontext():
            return super().capture_vision(grids)

    @contextlib.contextmanager
    def _in_lockstep(self, what: str) -> Iterator[None]:
        """Around a call the workers replay: if it fails or is interrupted here after they were
        sent it, the ranks' collectives are out of step for good; every later call then raises
        (`EngineError`) rather than pair collectives of different steps."""
        try:
            yield
        except BaseException as exc:
            if self.workers is not None and self.workers.failure is None:
                self.workers.failure = (f"tensor-parallel ranks out of step: rank 0's {what} failed after the "
                                        f"workers were sent it ({type(exc).__name__}: {exc}); start a new Pipeline")
            raise

    def forward_prefill(self, inputs: PrefillInputs) -> torch.Tensor:
        spans = [(span.row, tuple(span.values.shape)) for span in inputs.images]
        self.workers.send("prefill", (replace(inputs, images=[]), spans))
        with self._in_lockstep("prefill"):
            for span in inputs.images:
                self.model.tp.broadcast(span.values.contiguous())
            return super().forward_prefill(inputs)

    def launch_decode(self, requests: Sequence[Request]) -> PendingDecode:
        self.workers.send("decode", [self._row_state(r) for r in requests])
        with self._in_lockstep("decode step"):
            return super().launch_decode(requests)

    def _share_masks(self, masks: Any, rows: list[int]) -> None:
        """Every rank samples the step over the same logits, so each needs the same masks: the
        constrained rows' (the rest allow every token)."""
        self.workers.send("decode_masks", (rows, masks[rows].copy()))

    def _row_state(self, request: Request) -> tuple[Any, ...]:
        """What a worker's mirror of `request` needs for this decode step: the request's full
        state when the decode batch (re)writes its row, else its length and new pages."""
        rid = id(request)
        sent = self._pages_sent.get(rid)
        intro = None
        if sent is None:
            seen = list(request.prompt_ids) if request.sampling.repetition_penalty != 1.0 else []
            intro = (seen, request.sampling, request.seed, request.mrope_delta)
            sent = 0
        if len(request.pages) < sent:  # pages handed back and taken again: send them all
            sent = 0
        row = self.decoder.row_of.get(rid)
        joins = row is None or int(self.decoder.lens[row]) + 1 != request.seq_len
        self._pages_sent[rid] = len(request.pages)
        return (rid, request.seq_len, request.total_len, sent, list(request.pages[sent:]),
                list(request.output_ids) if joins else None, intro)

    def release(self, requests: Sequence[Request]) -> None:
        gone = [id(r) for r in requests if self._pages_sent.pop(id(r), None) is not None]
        if gone and self.workers is not None and self.workers.failure is None:  # (after a failure: local only)
            self.workers.send("release", gone)
        super().release(requests)

    def capture_decode_sampling(self, sampling: Any) -> int:
        if self.decoder is None:
            return 0
        self.workers.send("capture_sampling", sampling)
        with self._in_lockstep("decode graph capture"):
            return super().capture_decode_sampling(sampling)

    def close(self) -> None:
        workers, self.workers = self.__dict__.get("workers"), None
        if workers is not None:
            workers.close()
        super().close()
        group = self.model.tp
        if group is not None and group.backend is not None:
            abort_group(group.backend)


def embedding_tail(lm: Any) -> tuple[int, ...]:
    """An image embedding's shape after its token rows: [hidden], or [1 + levels, hidden] with
    deepstack features."""
    levels = int(getattr(lm, "deepstack_levels", 0))
    return (1 + levels, lm.hidden_size) if levels else (lm.hidden_size,)


def split_shares(patches: Sequence[int], size: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) index ranges, one per rank, with about equal patch counts (an image
    goes to the rank whose equal share its middle falls in; shares may be empty)."""
    total = sum(patches)
    bounds = [0] * (size + 1)
    bounds[size] = len(patches)
    done = 0
    rank = 1
    for index, count in enumerate(patches):
        while rank < size and done + count / 2 > total * rank / size:
            bounds[rank] = index
            rank += 1
        done += count
    for r in range(rank, size):
        bounds[r] = len(patches)
    return [(bounds[r], bounds[r + 1]) for r in range(size)]


def _portable(image: Any) -> Any:
    """An image to send to a worker: its uint8 pixels as numpy (pinned host memory does not
    travel through a pipe), made a tensor again there (`_restored`)."""
    pixels = getattr(image, "pixels", None)
    return replace(image, pixels=pixels.numpy()) if isinstance(pixels, torch.Tensor) else image
