"""A large pool on a real device: plan each model file for a memory size,
allocate its one buffer there, check every view, and time block copies.

What it checks, per model:

- the pool is one allocation of ``num_blocks * bytes_per_block`` bytes on the
  device, and every layer's view lies inside it (zero-copy);
- a pattern written into the pool's last block through each group's first
  layer reads back intact;
- ``KVCachePool.copy_blocks`` moves whole pages: after a batch of copies the
  destination pages equal their sources;
- on CUDA, a ``copy_blocks`` call made while the device is busy returns
  before the device's queued work ends (it never waits on the device).

It prints the allocation time and the copy rate of one ``copy_blocks`` call
beside the same copies made one call a copy and a plain ``torch`` copy of
the same bytes, all timed in the same run::

    python benchmarks/device_pool.py --device cuda --memory-gib 100

On a machine without a GPU, ``--device cpu --memory-gib 1`` runs the same
checks.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

import kvcore
from kvcore.coordinator import BlockCopy
from kvcore.serialize import load_model_file

ZOO = Path(__file__).resolve().parent.parent.parent / "shared" / "zoo"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inside(buffer: torch.Tensor, view: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    first = view.data_ptr()
    return (
        view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and (start <= first < end)
    )


def _parts(view: object) -> list[torch.Tensor]:
    return list(view) if isinstance(view, tuple) else [view]  # type: ignore[list-item]


def check_model(path: Path, memory: int, device: torch.device, copies: int) -> dict:
    registry = kvcore.default_registry()
    specs = load_model_file(path, registry).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True
        )
    )
    plan = kvcore.plan_kv_cache(config, specs, memory, registry=registry)
    _sync(device)
    start = time.perf_counter()
    pool = kvcore.KVCachePool(plan, device, registry=registry)
    _sync(device)
    allocate_s = time.perf_counter() - start
    buffer = pool.buffer
    size = buffer.numel() * buffer.element_size()
    one_allocation = size == plan.num_blocks * plan.bytes_per_block
    inside = all(_inside(buffer, p) for v in pool.views.values() for p in _parts(v))
    # The last block through each group's first layer, read back raw.
    last = plan.num_blocks - 1
    intact = True
    for gid, group in enumerate(plan.kv_cache_groups):
        raw = pool.raw_view(group.layer_names[0])
        ratio = raw.shape[0] // plan.num_blocks
        page = raw[last * ratio : (last + 1) * ratio]
        page.fill_(gid % 251 + 1)
        intact &= bool((page == gid % 251 + 1).all())
    # Copies: random distinct pairs in the first group, all its layers.
    rng = random.Random(0)
    ids = rng.sample(range(1, plan.num_blocks), min(2 * copies, plan.num_blocks - 1))
    pairs = list(zip(ids[0::2], ids[1::2], strict=False))
    group = plan.kv_cache_groups[0]
    raws = [pool.raw_view(n) for n in group.layer_names]
    for raw in raws:
        for src, _ in pairs[:64]:
            raw[src].random_(0, 255)
    batch = [BlockCopy(0, src, dst, 0) for src, dst in pairs]
    _sync(device)
    start = time.perf_counter()
    pool.copy_blocks(batch)
    _sync(device)
    copy_s = time.perf_counter() - start
    copied = all(
        torch.equal(raw[dst], raw[src]) for raw in raws for src, dst in pairs[:64]
    )
    # With the device busy, the call only queues work: the host is not held
    # until the queued work ends (block ids reach the device unblocked).
    stall_ms = busy_ms = 0.0
    if device.type == "cuda":
        _sync(device)
        start = time.perf_counter()
        torch.cuda._sleep(2_000_000_000)  # about a second of device time
        pool.copy_blocks(batch)
        stall_ms = (time.perf_counter() - start) * 1e3
        _sync(device)
        busy_ms = (time.perf_counter() - start) * 1e3
    # The same copies one call a copy: a launch per layer per copy.
    _sync(device)
    start = time.perf_counter()
    for one in batch:
        pool.copy_blocks([one])
    _sync(device)
    single_s = time.perf_counter() - start
    page_bytes = sum(r[0].numel() * r.element_size() for r in raws)
    moved = 2 * page_bytes * len(pairs)
    # A plain torch copy of the same number of bytes, timed the same way.
    scratch = torch.empty(page_bytes * len(pairs), dtype=torch.uint8, device=device)
    target = torch.empty_like(scratch)
    _sync(device)
    start = time.perf_counter()
    target.copy_(scratch)
    _sync(device)
    plain_s = time.perf_counter() - start
    del scratch, target, pool, raws, page, raw
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "model": path.stem,
        "groups": len(plan.kv_cache_groups),
        "blocks": plan.num_blocks,
        "GiB": size / 2**30,
        "alloc_s": allocate_s,
        "one_alloc": one_allocation,
        "views_inside": inside,
        "intact": intact,
        "copies": len(pairs),
        "copied": copied,
        "copy_GBps": moved / copy_s / 1e9,
        "one_by_one_GBps": moved / single_s / 1e9,
        "plain_GBps": moved / plain_s / 1e9,
        "host_ms_while_busy": stall_ms,
        "busy_ms": busy_ms,
        "no_host_stall": stall_ms < busy_ms / 2 or device.type != "cuda",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory-gib", type=float, default=1.0)
    parser.add_argument("--copies", type=int, default=256)
    parser.add_argument("models", nargs="*", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    models = args.models or sorted(ZOO.glob("*.json"))
    memory = int(args.memory_gib * 2**30)
    ok = True
    for path in models:
        row = check_model(path, memory, device, args.copies)
        ok &= row["one_alloc"] and row["views_inside"] and row["intact"]
        ok &= row["copied"] and row["no_host_stall"]
        print(
            "  ".join(
                f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in row.items()
            ),
            flush=True,
        )
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
