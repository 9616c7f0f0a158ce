"""Tensor parallelism for a Pipeline: one worker process per extra GPU, each holding a shard of the
language model (the family's `ModelSpec.shard_language`, `mmpipe.language.tensor_parallel`) and
running rank 0's forwards in lockstep.

Rank 0 is the caller's process. It alone holds requests: the scheduler, the vision tower, the
encoder cache, sampling for the first token, detokenising. The workers hold shards and the same
graph runners; for every model call that runs collectives, rank 0 first sends the call's host
inputs over a pipe to each worker, which replays it on its own `ModelRunner`:

- vision (`EngineConfig.vit_parallel="data"`, the default): a step's images are split into one
  contiguous share per rank, balanced by patches; each rank encodes its share with its own full
  copy of the tower (its own lazily captured ViT graphs: no collectives inside) and the workers
  send their embeddings back to rank 0, whose encoder cache keeps them all. `"tensor"`: the tower
  is split too (`mmpipe.vision.tensor_parallel`); every rank runs every pack, two collectives per
  block, in line on the language model's stream (one communicator: its collectives run one after
  another), with its ViT graphs captured in lockstep. `"rank0"`: rank 0 encodes every image.
  A worker's answer carries its ViT calls so far, by graph and eager
  (`Pipeline.stats()["tensor_parallel"]["worker_vit_runs"]`).
- prefill: the step's `PrefillInputs` (numpy), then each image span's embeddings, broadcast from
  rank 0's GPU (one copy per image span);
- decode: each row's state (length, new KV pages; prompt, sampling and tokens when the request
  joins the decode batch). A worker keeps a mirror per request for the decode batch's
  bookkeeping. Sampling runs inside the decode step on every rank over the gathered, identical
  logits, so each rank's device batch advances the same way; only rank 0 reads the tokens;
- release, and capturing a sampling's decode graphs (`Pipeline.warm_up`).

Graphs stay in lockstep by construction: every rank captures the same sizes in the same order at
start-up (same configuration), and a graph captured later is captured by every rank in the same
step, since the same inputs make the same decision. The collectives inside them (NCCL on GPUs)
are captured like any other kernel. The ranks' groups are standalone backends on a store of
their own (not the default `torch.distributed` group), so a process that already belongs to
another group (`mmpipe caption --gpus N` under accelerate) can hold a tensor-parallel Pipeline.

A worker that fails reports the error on its pipe and exits; rank 0 raises it at its next call
(`EngineError`), and the Pipeline is then unusable. Workers end with rank 0's process however it
ends (at its exit, Ctrl-C included; a watch thread in each worker when it is killed), and
`Pipeline.close` stops and reaps them. A failed graph capture is fatal under tensor parallelism
(a rank running eagerly would issue other collectives), as is anything that stops rank 0 between
sending a call and making its own part of it.

The package: `workers` (rank 0's handle on the worker processes, and the group's joining),
`runner` (rank 0's model runner, which sends each call before making its own part), `worker`
(a worker process's life: load, join, serve rank 0's calls).
"""

from mmpipe.engine.tensor_parallel.runner import TensorParallelRunner, embedding_tail, split_shares, start_runner
from mmpipe.engine.tensor_parallel.workers import Workers, check_tensor_parallel, rank_device

__all__ = ["TensorParallelRunner", "Workers", "check_tensor_parallel", "embedding_tail", "rank_device",
           "split_shares", "start_runner"]
