"""The encoder cross-attention kind (plugins/kvcore_cross_attention): a
group sized by the request's encoder tokens at admission, never grown by
decoder tokens, never hashed or hit, empty without encoder inputs.

Block ids come from the free queue, which starts in id order with block 0
taken out as the null block; within a step groups allocate in group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import coordinator_setup as setup
import pytest
import torch

from kvcore.coordinator import KVCacheManager, Request
from kvcore.errors import (
    InvalidRequestError,
    InvalidSpecError,
    KvcoreError,
    UnknownRequestError,
)
from kvcore.spec import HitPolicy
from kvcore.testing import check_kind
from kvcore_cross_attention import (
    CrossAttention,
    CrossAttentionManager,
    CrossAttentionSpec,
)


def xattn(block_size: int = 4, **kw: Any) -> CrossAttentionSpec:
    return CrossAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16, **kw
    )


def manager(
    specs: Sequence[object], num_blocks: int, *, caching: bool = True
) -> KVCacheManager:
    return setup.manager_for(
        specs,
        num_blocks,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=setup.builtin_registry(),
        max_model_len=64,
        enable_caching=caching,
    )


def req(rid: str, tokens: Sequence[int]) -> Request:
    return Request(rid, list(tokens), hash_block_size=4)


def test_the_kind_is_built_in_and_conforms() -> None:
    registry = setup.builtin_registry()
    assert registry.owner("cross_attention") == "cross_attention"
    assert registry["cross_attention"].spec_type is CrossAttentionSpec
    check_kind(CrossAttention(), xattn(16))
    check_kind(CrossAttention(), xattn(16, max_encoder_tokens=1500))


def test_spec_declarations() -> None:
    spec = xattn(16, max_encoder_tokens=1500)
    assert spec.hit_policy is HitPolicy.NOT_HASHED
    assert not spec.prefix_cacheable
    # Decoder tokens take no block; the encoder bounds the request.
    assert spec.num_blocks_held(0, 4096, 16) == 0
    assert spec.max_num_blocks_per_request(8192) == 94  # ceil(1500 / 16)
    assert xattn(16).max_num_blocks_per_request(8192) == 512
    with pytest.raises(InvalidSpecError):
        xattn(16, max_encoder_tokens=0)


def test_admission_sizes_the_group_by_encoder_tokens() -> None:
    mgr = manager([setup.fa(4), xattn(4)], 20)
    a = req("A", range(1, 11))
    # 10 decoder tokens: 3 full-attention blocks; 9 encoder tokens: 3 blocks.
    out = mgr.allocate_slots(a, 10, num_encoder_tokens=9)
    assert out is not None
    assert out.get_block_ids() == ([1, 2, 3], [4, 5, 6])
    assert mgr.get_num_free_blocks() == 13
    # Decoding past the encoder's length grows only the decoder's group.
    a.num_computed_tokens = 10
    a.append_output_token_ids([11, 12, 13])
    out = mgr.allocate_slots(a, 3)
    assert out is not None
    assert out.get_block_ids() == ([7], [])
    assert mgr.get_block_ids("A") == ([1, 2, 3, 7], [4, 5, 6])
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 19


@pytest.mark.parametrize(
    ("encoder", "blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (40, 10), (41, 11)]
)
def test_every_encoder_token_has_a_slot_and_no_more(encoder: int, blocks: int) -> None:
    mgr = manager([setup.fa(4), xattn(4)], 30)
    assert mgr.allocate_slots(req("A", range(1, 5)), 4, num_encoder_tokens=encoder)
    assert len(mgr.get_block_ids("A")[1]) == blocks


def test_no_encoder_inputs_no_blocks() -> None:
    mgr = manager([setup.fa(4), xattn(4)], 10)
    a = req("A", range(1, 9))
    out = mgr.allocate_slots(a, 8)
    assert out is not None
    assert mgr.get_block_ids("A") == ([1, 2], [])
    assert mgr.get_num_free_blocks() == 7


def test_encoder_blocks_count_against_the_pool() -> None:
    # 9 usable blocks: 2 decoder blocks + 8 encoder blocks do not fit,
    # and a refused step changes nothing.
    mgr = manager([setup.fa(4), xattn(4)], 10)
    a = req("A", range(1, 9))
    assert mgr.allocate_slots(a, 8, num_encoder_tokens=32) is None
    assert mgr.get_num_free_blocks() == 9
    assert mgr.live_request_ids() == ()
    with pytest.raises(UnknownRequestError):
        mgr.get_blocks("A")
    # The full-sequence check counts them too: 7 encoder blocks and the
    # 1 decoder block of a 12-token prompt's first chunk would fit (8), but
    # not with the 3 of the whole prompt (10); 6 encoder blocks do (9).
    b = req("B", range(1, 13))
    assert (
        mgr.allocate_slots(b, 4, num_encoder_tokens=28, full_sequence_must_fit=True)
        is None
    )
    assert mgr.allocate_slots(b, 4, num_encoder_tokens=24, full_sequence_must_fit=True)
    assert mgr.get_block_ids("B") == ([1], [2, 3, 4, 5, 6, 7])


def test_never_hashed_or_hit() -> None:
    mgr = manager([setup.fa(4), xattn(4)], 20)
    a = req("A", range(1, 13))
    assert mgr.allocate_slots(a, 12, num_encoder_tokens=8)
    mgr.free(a)
    b = req("B", range(1, 13))
    blocks, hit = mgr.get_computed_blocks(b)
    # The decoder's prefix hits (the last token is recomputed); the
    # cross-attention group brings nothing and takes fresh encoder blocks.
    assert hit == 8
    assert blocks.get_block_ids()[1] == []
    out = mgr.allocate_slots(
        b,
        4,
        num_new_computed_tokens=hit,
        new_computed_blocks=blocks,
        num_encoder_tokens=5,
    )
    assert out is not None
    assert len(mgr.get_block_ids("B")[1]) == 2


def test_encoder_tokens_refused_without_a_group_that_takes_them() -> None:
    mgr = manager([setup.fa(4)], 10)
    with pytest.raises(InvalidRequestError) as info:
        mgr.allocate_slots(req("A", range(1, 9)), 8, num_encoder_tokens=4)
    assert isinstance(info.value, KvcoreError)
    assert str(info.value) == (
        "allocate_slots for request 'A': 4 encoder tokens, but no cache group "
        "of this plan takes encoder tokens (no cross-attention layer); pass "
        "num_encoder_tokens=0 for this plan"
    )
    assert mgr.get_num_free_blocks() == 9


def test_encoder_tokens_only_at_admission() -> None:
    mgr = manager([setup.fa(4), xattn(4)], 20)
    a = req("A", range(1, 13))
    assert mgr.allocate_slots(a, 8, num_encoder_tokens=4)
    a.num_computed_tokens = 8
    with pytest.raises(InvalidRequestError, match="already holds blocks"):
        mgr.allocate_slots(a, 4, num_encoder_tokens=4)
    assert mgr.get_block_ids("A") == ([1, 2], [3])


def test_manager_declaration_not_the_kind_name() -> None:
    # The core routes encoder tokens by the manager's declaration.
    assert CrossAttentionManager.takes_encoder_tokens is True
    assert CrossAttentionManager.position_indexed is False
    mgr = manager([xattn(4), setup.fa(4)], 20)
    assert mgr.coordinator.encoder_groups == (0,)
    out = mgr.allocate_slots(req("A", range(1, 5)), 4, num_encoder_tokens=6)
    assert out is not None
    assert out.get_block_ids() == ([1, 2], [3])
