"""Where does a 2-rank standalone NCCL group stop? (It was `shutdown()`, replaced by `abort()`.) Each rank prints each step and dumps its
stack after 40 s."""
import datetime, faulthandler, os, socket, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, port, mode):
    faulthandler.dump_traceback_later(40, exit=True)
    say = lambda *a: print(f"[rank {rank} {time.strftime('%X')}]", *a, flush=True)
    torch.cuda.set_device(rank)
    say("store")
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    say("store ok")
    if mode == "default":
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
        x = torch.ones(4, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize(); say("default all_reduce", x.tolist())
        dist.destroy_process_group(); return
    from mmpipe.engine.tensor_parallel import join_group
    from mmpipe.layers.parallel import TPGroup
    group = join_group(TPGroup(rank, 2), store, torch.device("cuda", rank))
    say("joined")
    x = torch.ones(4, device="cuda"); group.all_reduce(x); torch.cuda.synchronize(); say("all_reduce", x.tolist())
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        group.all_reduce(x)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize(); say("side stream ok")
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        group.all_reduce(x)
    say("captured"); g.replay(); torch.cuda.synchronize(); say("replayed", x.tolist())
    del g
    group.backend.abort(); say("aborted")


if __name__ == "__main__":
    for mode in sys.argv[1:]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        print("mode", mode, flush=True)
        mp.spawn(rank_main, args=(port, mode), nprocs=2, join=True)
