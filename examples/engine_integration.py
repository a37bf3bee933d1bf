"""An engine's life with kvcore, in one file, on a torch.distributed group.

Every rank loads kvcore and its kind plugins through entry points, takes its
tensor-parallel share of a model file's layers, plans its pipeline stage
from its own free memory, and agrees with the other ranks on one plan (the
smallest block count, equal fingerprints).  Rank 0 (the scheduler) ships the
plan as JSON; every worker binds its views from that JSON alone; the
scheduler then runs a few steps through the coordinator, two requests
sharing a prefix, and the second one hits.

    torchrun --nproc-per-node 2 examples/engine_integration.py
    torchrun --nproc-per-node 4 examples/engine_integration.py --pp 2

On CPU the group runs gloo; on GPUs an engine would pass ``--backend nccl``
and ``--device cuda`` (one device per rank).
"""

from __future__ import annotations

import argparse
import datetime

import torch.distributed as dist

import kvcore
from kvcore.coordinator import KVCacheManager, Request
from kvcore.integrations.distributed import (
    agree_plan,
    bind_worker_cache,
    broadcast_text,
    dump_pipeline_plan,
    load_pipeline_plan,
    plan_local,
)
from kvcore.integrations.stages import split_pipeline_stages
from kvcore.serialize import load_model_file
from kvcore.serving import ServingChoices, apply_serving_choices
from kvcore.tools import zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="jamba-1-5-mini", help="a kvcore/tools/zoo model"
    )
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--memory-mib", type=int, default=64, help="KV memory a rank")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args(argv)

    # 1. The process group, with a timeout that bounds every collective.
    timeout = datetime.timedelta(seconds=args.timeout_s)
    dist.init_process_group(args.backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.pp:
        msg = f"{world} ranks do not split into {args.pp} pipeline stages"
        raise SystemExit(msg)
    tp = world // args.pp
    stage = rank // tp  # ranks 0..tp-1 run stage 0, and so on

    # 2. kvcore and its plugins, found through the ``kvcore`` entry points.
    registry = kvcore.default_registry()
    model = load_model_file(zoo.path(args.model), registry)
    if rank == 0:
        print(f"kinds from plugins: {', '.join(sorted(registry))}", flush=True)

    # 3. This rank's specs: its tensor-parallel share of every layer.
    served = apply_serving_choices(
        model.layers, ServingChoices(tensor_parallel_size=tp, mamba_cache_mode="align")
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC",
            enable_prefix_caching=True,
            mamba_cache_mode="align",  # recurrent states cached at block ends
        ),
        parallel_config=kvcore.ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=args.pp
        ),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=512,
    )

    # 4. Plan locally from this rank's free memory (each rank a little less,
    #    as after unequal activations), then agree.
    memory = (args.memory_mib - rank) * 2**20
    local = plan_local(config, served.layers, memory, stage=stage, registry=registry)
    agreed = agree_plan(local, timeout=timeout, registry=registry)
    print(
        f"rank {rank} (stage {stage}, TP {tp}): planned {local.num_blocks} blocks, "
        f"agreed {agreed.num_blocks}",
        flush=True,
    )

    # 5. The scheduler (rank 0) ships its config as JSON.
    text = broadcast_text(
        dump_pipeline_plan(agreed, registry) if rank == 0 else None, timeout=timeout
    )

    # 6. Every worker binds its own layers' views from that JSON alone.
    own = split_pipeline_stages(list(served.layers), args.pp)[stage]
    pool = bind_worker_cache(
        text,
        {n: served.layers[n] for n in own},
        device=args.device,
        registry=registry,
    )
    view = pool.views[own[0]]  # a tensor, or a tuple of state tensors
    first = view[0] if isinstance(view, tuple) else view
    first[1].fill_(rank + 1)  # block 1 of this worker's first layer, in place
    # The write shows in the pool's own bytes of that block (read back from
    # the block's page alone: a pool is most of a device's memory).
    page = pool.raw_view(own[0])[1]
    same = (
        first.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
    )
    if not (same and bool(page.ne(0).any())):
        raise SystemExit("a view is not a view of the pool")
    print(
        f"rank {rank}: bound {len(pool.views)} layers in one "
        f"{pool.buffer.numel()}-byte pool",
        flush=True,
    )

    # 7. The scheduler runs a few steps through the coordinator.
    if rank == 0:
        shipped = load_pipeline_plan(text, registry)
        manager = KVCacheManager.from_plan(
            shipped.scheduler_config(), registry=registry
        )
        plan = shipped.stages[0]
        block = plan.scheduler_block_size or 1
        # Chunked prefill in whole scheduler blocks: a recurrent state is
        # cached where a step ends, so steps end on block boundaries.
        chunk = 4 * block
        # A system prompt of up to 12 scheduler blocks, leaving room in
        # max_model_len for each question and three decode steps.
        num_shared = min(12, (args.max_model_len - 8) // block)
        if num_shared < 1:
            msg = (
                f"--max-model-len {args.max_model_len} holds no shared prompt of "
                f"one {block}-token scheduler block and a question; pass at least "
                f"{block + 8}"
            )
            raise SystemExit(msg)
        shared = [(7 * i) % 50_000 + 1 for i in range(num_shared * block)]
        hits = []
        for i, question in enumerate(([11, 12, 13], [21, 22, 23, 24])):
            request = Request(
                f"r{i}", shared + question, hash_block_size=plan.hash_block_size
            )
            hit, num_hit = manager.get_computed_blocks(request)
            hits.append(num_hit)
            done = num_hit
            while done < request.num_prompt_tokens:  # one scheduler step each
                step = min(request.num_prompt_tokens - done, chunk - done % block)
                first = done == num_hit
                blocks = manager.allocate_slots(
                    request,
                    step,
                    num_hit if first else 0,
                    hit if first else None,
                )
                if blocks is None:
                    raise SystemExit("the pool cannot admit the request")
                done += step
                request.num_computed_tokens = done
            for token in (5, 6, 7):  # three decode steps
                request.append_output_token_ids(token)
                if manager.allocate_slots(request, 1) is None:
                    raise SystemExit("the pool ran out of blocks while decoding")
                request.num_computed_tokens += 1
            manager.free(request)
        print(
            f"scheduler: {len(shipped.stages)} stage(s), "
            f"{len(shipped.scheduler_config().kv_cache_groups)} cache groups, "
            f"prefix hit of the second request: {hits[1]} tokens",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
