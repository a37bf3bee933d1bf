"""Host-resident tensors: the host side of a HiSparse cache.

HiSparse keeps its sparse source KV in host memory and only the hot pages on
the device.  The plan below is built by hand so every offset is known: a
device group of hot pages and a host source group of two full-attention
layers, in a BLHNC layout, with 4 blocks.
"""

from __future__ import annotations

import pytest
import torch

from kvcore import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCachePool,
    KVCacheTensor,
    PlanError,
    allocate_kv_cache,
)
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec, build_hisparse_kv_cache_tensors

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYOUT = KVCacheLayout.BLHNC
NUM_BLOCKS = 4
# a hot page is 1024 B: one hot layer -> 1024 B per device block
HOT = HiSparseHotSpec(block_size=16, page_size=1024, blocks_per_request=2)
DEVICE_BPB = 1024
DEVICE_SIZE = NUM_BLOCKS * DEVICE_BPB  # 4096
# bs 16, 2 heads, head 16 (+16 V), bf16: C=(16+16)*2=64, N=16, H=2 -> 2048 B;
# two source layers -> 4096 B per host block
SRC = FullAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16
)
HOST_BPB = 4096
HOST_SIZE = NUM_BLOCKS * HOST_BPB  # 16384


def _groups() -> list[KVCacheGroupSpec]:
    return [
        KVCacheGroupSpec(["hot.0"], HOT),
        KVCacheGroupSpec(["src.0", "src.1"], SRC),
    ]


def _plan() -> KVCacheConfig:
    hot, src = _groups()
    device = build_hisparse_kv_cache_tensors(
        [hot], NUM_BLOCKS, DEVICE_SIZE, LAYOUT, DEVICE_BPB
    )
    host = build_hisparse_kv_cache_tensors(
        [src], NUM_BLOCKS, HOST_SIZE, LAYOUT, HOST_BPB, host_resident=True
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[*device, *host],
        kv_cache_groups=[hot, src],
        kv_cache_layout=LAYOUT,
    )


def _view(pool: KVCachePool, name: str) -> torch.Tensor:
    view = pool.views[name]
    assert isinstance(view, torch.Tensor)
    return view


def test_the_plan_has_one_host_resident_tensor() -> None:
    tensors = _plan().kv_cache_tensors
    assert [(t.layers, t.host_resident, t.size) for t in tensors] == [
        (["hot.0"], False, DEVICE_SIZE),
        (["src.0", "src.1"], True, HOST_SIZE),
    ]


def test_each_residency_gets_its_own_buffer() -> None:
    pool = KVCachePool(_plan())
    assert pool.buffer.numel() == DEVICE_SIZE
    assert pool.host_buffer is not None
    assert pool.host_buffer.numel() == HOST_SIZE
    assert pool.host_buffer.dtype == torch.uint8
    assert pool.host_buffer.device.type == "cpu"
    assert (
        pool.host_buffer.untyped_storage().data_ptr()
        != pool.buffer.untyped_storage().data_ptr()
    )


def test_host_views_share_the_host_buffer_storage() -> None:
    pool = KVCachePool(_plan())
    assert pool.host_buffer is not None
    base = pool.host_buffer.untyped_storage().data_ptr()
    start = pool.host_buffer.data_ptr()
    for li, name in enumerate(["src.0", "src.1"]):
        view = _view(pool, name)
        assert view.device.type == "cpu"
        assert view.shape == (NUM_BLOCKS, 2, 16, 32)
        assert view.dtype == torch.bfloat16
        assert view.untyped_storage().data_ptr() == base
        for b in range(NUM_BLOCKS):
            assert view[b].data_ptr() - start == b * HOST_BPB + li * 2048


def test_device_views_are_in_the_device_buffer() -> None:
    pool = KVCachePool(_plan())
    view = _view(pool, "hot.0")
    assert view.shape == (NUM_BLOCKS, 1, 1, 1024)
    assert view.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
    for b in range(NUM_BLOCKS):
        assert view[b].data_ptr() - pool.buffer.data_ptr() == b * DEVICE_BPB


def test_writes_through_a_host_view_land_in_the_host_buffer() -> None:
    pool = KVCachePool(_plan())
    assert pool.host_buffer is not None
    # block 2 of src.1: 2 * 4096 + 2048 = 10240, one 2048-B page
    _view(pool, "src.1")[2].view(torch.uint8).fill_(0xA5)
    touched = pool.host_buffer.nonzero().flatten()
    assert torch.equal(touched, torch.arange(10240, 12288))
    assert torch.all(pool.host_buffer[10240:12288] == 0xA5)
    assert not pool.buffer.any()


def test_writes_through_a_device_view_stay_out_of_the_host_buffer() -> None:
    pool = KVCachePool(_plan())
    assert pool.host_buffer is not None
    _view(pool, "hot.0")[1].fill_(0x5A)
    assert torch.equal(pool.buffer.nonzero().flatten(), torch.arange(1024, 2048))
    assert not pool.host_buffer.any()


def test_no_host_resident_tensor_means_no_host_buffer() -> None:
    config = _plan()
    config.kv_cache_tensors = [
        t for t in config.kv_cache_tensors if not t.host_resident
    ]
    config.kv_cache_groups = config.kv_cache_groups[:1]
    pool = KVCachePool(config)
    assert pool.host_buffer is None
    assert set(pool.views) == {"hot.0"}


def test_allocate_kv_cache_binds_host_views_on_the_host() -> None:
    views = allocate_kv_cache(_plan())
    src = views["src.0"]
    hot = views["hot.0"]
    assert isinstance(src, torch.Tensor)
    assert isinstance(hot, torch.Tensor)
    assert src.untyped_storage().data_ptr() != hot.untyped_storage().data_ptr()


def _extra(like: KVCacheTensor, *, size: int, name: str) -> KVCacheTensor:
    return KVCacheTensor(
        size=size,
        layers=[name],
        layer_stride=like.layer_stride,
        block_stride=like.block_stride,
        host_resident=like.host_resident,
    )


def test_host_resident_sizes_must_match() -> None:
    config = _plan()
    _, host = config.kv_cache_tensors
    config.kv_cache_tensors.append(_extra(host, size=HOST_SIZE + 1, name="src.1"))
    with pytest.raises(
        PlanError, match="host-resident KV cache tensors must share one backing"
    ):
        KVCachePool(config)


def test_device_sizes_must_match() -> None:
    config = _plan()
    device, _ = config.kv_cache_tensors
    config.kv_cache_tensors.append(_extra(device, size=DEVICE_SIZE * 2, name="hot.0"))
    with pytest.raises(PlanError, match="device KV cache tensors must share one"):
        KVCachePool(config)


def test_a_host_tensor_must_fit_the_host_buffer() -> None:
    """The bounds check is per buffer: the host tensor is checked against the
    host buffer, whatever the device buffer's size."""
    config = _plan()
    device, host = config.kv_cache_tensors
    # one block short of what the source layers reach
    host.size = HOST_SIZE - HOST_BPB
    with pytest.raises(PlanError, match="of a 12,288-byte host-resident pool"):
        KVCachePool(config)
    # the device tensor is checked against the device buffer alone
    host.size = HOST_SIZE
    device.size = DEVICE_SIZE - 1
    with pytest.raises(PlanError, match="of a 4,095-byte device pool"):
        KVCachePool(config)


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------


@cuda
@needs_cuda
def test_cuda_host_buffer_is_pinned_and_device_buffer_on_cuda() -> None:
    pool = KVCachePool(_plan(), "cuda")
    assert pool.buffer.is_cuda
    assert pool.host_buffer is not None
    assert pool.host_buffer.device.type == "cpu"
    assert pool.host_buffer.is_pinned()
    assert _view(pool, "hot.0").is_cuda
    for name in ("src.0", "src.1"):
        view = _view(pool, name)
        assert view.device.type == "cpu"
        assert view.is_pinned()
        assert (
            view.untyped_storage().data_ptr()
            == pool.host_buffer.untyped_storage().data_ptr()
        )
    # a page copied from the host side lands in the hot page on the device
    src = _view(pool, "src.0")
    src[1].view(torch.uint8).fill_(0x3C)
    hot = _view(pool, "hot.0")
    hot[0].view(-1).copy_(
        src[1].view(torch.uint8).reshape(-1)[:1024], non_blocking=True
    )
    torch.cuda.synchronize()
    assert torch.equal(pool.buffer.nonzero().flatten().cpu(), torch.arange(0, 1024))
