"""``kvcore.testing.check_kind``: every built-in kind and the example
third-party kind pass it, including its allocate/skip/free cycle against
``num_blocks_held`` and its checks of ``grown`` and ``element_size``; a kind
whose declarations disagree with its manager fails it, by name.

Every registry here is built explicitly from the kinds under test, so the
result does not depend on which plugins are installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import pytest
import torch
from example_plugin import example_registry

from kvcore import KVCacheSpec
from kvcore.coordinator import HitQuery
from kvcore.kinds import CacheKind
from kvcore.registry import KindRegistry
from kvcore.testing import ConformanceError, check_kind
from kvcore_chunked_local import ChunkedLocalAttention, ChunkedLocalAttentionSpec
from kvcore_circular_buffer import CircularBuffer, CircularBufferSpec
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_full_attention.manager import FullAttentionManager
from kvcore_hisparse import HiSparseHot, HiSparseHotSpec
from kvcore_mamba import Mamba, MambaSpec
from kvcore_mla import MLA, MLAAttentionSpec
from kvcore_sliding_window import (
    SlidingWindow,
    SlidingWindowManager,
    SlidingWindowMLA,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

# check_kind runs a request of 16 blocks; every window below is shorter, so
# blocks fall out of it and are released during the run.


def _full() -> KVCacheSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )


def _mla() -> KVCacheSpec:
    return MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8
    )


def _sw() -> KVCacheSpec:
    # window 64 < 256 tokens of the run
    return SlidingWindowSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        sliding_window=64,
    )


def _sw_extra() -> KVCacheSpec:
    return SlidingWindowSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        sliding_window=40,
        extra_retained_tokens=8,
    )


def _swmla() -> KVCacheSpec:
    # window 128 < 1024 tokens of the run
    return SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        head_size=584,
        dtype=torch.uint8,
        sliding_window=128,
        alignment=576,
    )


def _mamba(mode: str, **kw: object) -> Callable[[], KVCacheSpec]:
    def make() -> KVCacheSpec:
        return MambaSpec(
            block_size=16,
            shapes=((32,),),
            dtypes=(torch.bfloat16,),
            mamba_cache_mode=mode,  # type: ignore[arg-type]
            **kw,  # type: ignore[arg-type]
        )

    return make


def _ring() -> KVCacheSpec:
    return CircularBufferSpec(
        block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype=torch.bfloat16
    )


def _hot() -> KVCacheSpec:
    return HiSparseHotSpec(block_size=16, page_size=5120, blocks_per_request=2)


def _chunked(chunk: int) -> Callable[[], KVCacheSpec]:
    def make() -> KVCacheSpec:
        return ChunkedLocalAttentionSpec(
            block_size=16,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.bfloat16,
            attention_chunk_size=chunk,
        )

    return make


BUILTIN_CASES = [
    pytest.param(FullAttention(), _full, id="full_attention"),
    pytest.param(MLA(), _mla, id="mla"),
    pytest.param(SlidingWindow(), _sw, id="sliding_window"),
    pytest.param(SlidingWindow(), _sw_extra, id="sliding_window-extra-retained"),
    pytest.param(SlidingWindowMLA(), _swmla, id="sliding_window_mla"),
    pytest.param(Mamba(), _mamba("none"), id="mamba-none"),
    pytest.param(
        Mamba(), _mamba("none", num_speculative_blocks=2), id="mamba-none-speculative"
    ),
    pytest.param(Mamba(), _mamba("align"), id="mamba-align"),
    pytest.param(Mamba(), _mamba("all"), id="mamba-all"),
    pytest.param(CircularBuffer(), _ring, id="circular_buffer"),
    pytest.param(HiSparseHot(), _hot, id="hisparse_hot"),
    pytest.param(ChunkedLocalAttention(), _chunked(64), id="chunked-64-skips"),
    pytest.param(ChunkedLocalAttention(), _chunked(8192), id="chunked-8192"),
]


@pytest.mark.parametrize(("kind", "factory"), BUILTIN_CASES)
def test_builtin_kind_passes(
    kind: CacheKind, factory: Callable[[], KVCacheSpec]
) -> None:
    spec = factory()
    check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))


@pytest.mark.parametrize(("kind", "factory"), BUILTIN_CASES)
def test_builtin_kind_passes_with_its_default_registry(
    kind: CacheKind, factory: Callable[[], KVCacheSpec]
) -> None:
    """Without ``registry=``, check_kind builds one holding just the kind."""
    check_kind(kind, factory())


def test_the_window_run_releases_blocks() -> None:
    """The sliding-window sample really skips blocks over check_kind's run of
    16 blocks, so the cycle checks the released count, not just the total."""
    spec = _sw()
    total = 16 * spec.block_size
    assert spec.num_blocks_held(total, total, spec.block_size) < 16


def test_the_example_third_party_kind_passes() -> None:
    # Loaded through its entry point, as an installed distribution is.
    registry = example_registry()
    kind = registry["attention_sinks"]
    spec = kind.spec_type(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        sink_tokens=4,
        window=64,
    )
    # Over a 16-block run the window moves past the sinks: blocks are released.
    total = 16 * spec.block_size
    assert spec.num_blocks_held(total, total, spec.block_size) == 16 - 11
    check_kind(kind, spec)
    check_kind(kind, spec, registry=registry)


# ---------------------------------------------------------------------------
# Kinds whose declarations break the rules
# ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LyingWindowSpec(SlidingWindowSpec):
    """Says it holds one block more than its manager does."""

    kind: ClassVar[str] = "lying_window"

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        return super().num_blocks_held(num_computed_tokens, num_tokens, block_size) + 1


class LyingWindow(SlidingWindow):
    name: ClassVar[str] = "lying_window"
    spec_type = LyingWindowSpec


def _lying() -> LyingWindowSpec:
    return LyingWindowSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        sliding_window=64,
    )


def test_num_blocks_held_that_lies_fails_naming_the_kind() -> None:
    kind = LyingWindow()
    with pytest.raises(ConformanceError, match="'lying_window'") as info:
        check_kind(kind, _lying(), registry=KindRegistry.from_kinds([kind]))
    message = str(info.value)
    assert "step 1" in message
    # the manager holds 1 block after tokens 0..8; the spec claims 2
    assert "holds 1 blocks" in message
    assert "num_blocks_held(0, 8, 16) says 2" in message
    assert "make the manager and num_blocks_held agree" in message
    assert isinstance(info.value, AssertionError)


class HoardingManager(SlidingWindowManager):
    """Never releases the blocks that leave the window."""

    skips_blocks: ClassVar[bool] = False


@attrs.frozen(kw_only=True)
class HoardingWindowSpec(SlidingWindowSpec):
    kind: ClassVar[str] = "hoarding_window"


class HoardingWindow(SlidingWindow):
    name: ClassVar[str] = "hoarding_window"
    spec_type = HoardingWindowSpec
    manager_type = HoardingManager


def test_a_manager_that_keeps_skipped_blocks_fails_once_the_window_passes() -> None:
    """Correct while the request fits the window.  check_kind's steps are
    8, 48, 33, 64, ... tokens; step 4 starts at 89 computed tokens, whose
    window (64) leaves token 25 and below, so block 0, unread: declared
    cdiv(153, 16) - 1 = 9 blocks, held 10."""
    kind = HoardingWindow()
    spec = HoardingWindowSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        sliding_window=64,
    )
    with pytest.raises(ConformanceError, match="'hoarding_window'") as info:
        check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))
    message = str(info.value)
    assert "step 4 (tokens 89..153)" in message
    assert "holds 10 blocks" in message
    assert "num_blocks_held(89, 153, 16) says 9" in message


@attrs.frozen(kw_only=True)
class BadGrowthSpec(FullAttentionSpec):
    """Grows its block by the wrong amount."""

    kind: ClassVar[str] = "bad_growth"

    def grown(self, factor: int) -> BadGrowthSpec | None:
        if factor == 1:
            return self
        return attrs.evolve(self, block_size=self.block_size * factor + 16)


class BadGrowth(FullAttention):
    name: ClassVar[str] = "bad_growth"
    spec_type = BadGrowthSpec


def test_grown_with_the_wrong_block_size_fails() -> None:
    kind = BadGrowth()
    spec = BadGrowthSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    with pytest.raises(ConformanceError, match=r"'bad_growth': grown\(2\)"):
        check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))


@attrs.frozen(kw_only=True)
class NoIdentityGrowthSpec(FullAttentionSpec):
    kind: ClassVar[str] = "no_identity_growth"

    def grown(self, factor: int) -> NoIdentityGrowthSpec | None:
        return None


class NoIdentityGrowth(FullAttention):
    name: ClassVar[str] = "no_identity_growth"
    spec_type = NoIdentityGrowthSpec


def test_grown_1_must_be_the_spec() -> None:
    kind = NoIdentityGrowth()
    spec = NoIdentityGrowthSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    with pytest.raises(ConformanceError, match=r"grown\(1\) must return the spec"):
        check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))


@attrs.frozen(kw_only=True)
class ZeroElementSpec(FullAttentionSpec):
    kind: ClassVar[str] = "zero_element"

    @property
    def element_size(self) -> int:
        return 0


class ZeroElement(FullAttention):
    name: ClassVar[str] = "zero_element"
    spec_type = ZeroElementSpec


def test_element_size_must_be_positive() -> None:
    kind = ZeroElement()
    spec = ZeroElementSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    with pytest.raises(ConformanceError, match="'zero_element': element_size"):
        check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))


# ---------------------------------------------------------------------------
# The whole cycle: hits exactly where declared, every block back
# ---------------------------------------------------------------------------


class NeverHitsManager(FullAttentionManager):
    """Caches nothing a later request can find, yet its spec keeps the default
    ``hit_policy = PREFIX``: every hit in a model using it would be lost."""

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[Any]]:
        return [[] for _ in query.group_ids]


@attrs.frozen(kw_only=True)
class NeverHitsSpec(FullAttentionSpec):
    kind: ClassVar[str] = "never_hits"


class NeverHits(FullAttention):
    name: ClassVar[str] = "never_hits"
    spec_type = NeverHitsSpec
    manager_type = NeverHitsManager


def test_a_cacheable_kind_that_never_hits_fails() -> None:
    kind = NeverHits()
    spec = NeverHitsSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    with pytest.raises(ConformanceError, match="'never_hits'") as info:
        check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))
    assert "repeating a 192-token prompt got no hit" in str(info.value)
    assert "hit_policy=PREFIX" in str(info.value)
    assert "HitPolicy.NOT_HASHED" in str(info.value)


@attrs.frozen(kw_only=True)
class UnderDeclaredSpec(SlidingWindowSpec):
    """Declares a per-request bound below what decoding through its window
    holds (the window's blocks plus the one being written)."""

    kind: ClassVar[str] = "under_declared"

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        return 2


class UnderDeclared(SlidingWindow):
    name: ClassVar[str] = "under_declared"
    spec_type = UnderDeclaredSpec


def test_a_bound_below_what_decoding_holds_fails() -> None:
    kind = UnderDeclared()
    spec = UnderDeclaredSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        sliding_window=64,
    )
    with pytest.raises(ConformanceError, match="'under_declared'") as info:
        check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))
    assert "more than max_num_blocks_per_request(224) = 2" in str(info.value)


# ---------------------------------------------------------------------------
# Two live requests, two groups: each one's blocks and keys are its own
# ---------------------------------------------------------------------------


def _other(manager: Any, request_id: str) -> str | None:
    """Another request holding blocks in ``manager``'s group."""
    tables = manager.req_to_blocks.items()
    return next((r for r, t in tables if r != request_id and any(t)), None)


class StealingManager(FullAttentionManager):
    """Adds another live request's first block to its table after the
    blocks a step took (an answer listing that block is refused by the
    coordinator itself)."""

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new = super().allocate_new_blocks(request_id, num_tokens)
        other = _other(self, request_id)
        if new and other is not None:
            self.req_to_blocks[request_id].append(self.req_to_blocks[other][0])
        return new


class HandingManager(FullAttentionManager):
    """Puts the blocks a step takes into another live request's table."""

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new = super().allocate_new_blocks(request_id, num_tokens)
        other = _other(self, request_id)
        if new and other is not None:
            del self.req_to_blocks[request_id][-len(new) :]
            self.req_to_blocks[other].extend(new)
        return new


class OverPoppingManager(FullAttentionManager):
    """Frees, with a freed request's table, another live request's last
    block from under it (a pop answer listing that block is refused by the
    coordinator itself)."""

    def pop_blocks(self, request_id: str) -> list[int] | None:
        blocks = super().pop_blocks(request_id)
        other = _other(self, request_id)
        if blocks and other is not None:
            self.block_pool.free_blocks([self.req_to_blocks[other][-1]])
        return blocks


class WrongGroupManager(FullAttentionManager):
    """Keys the blocks of whichever group it serves under group 0."""

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        cached = self.num_cached_block.get(rid, 0)
        hashes = request.block_hashes
        full = min(num_tokens // self.block_size, len(hashes), len(blocks))
        if full > cached:
            self.block_pool.cache_full_blocks(
                block_hashes=hashes,
                blocks=blocks,
                num_cached_blocks=cached,
                num_full_blocks=full,
                group_id=0,
            )
            self.num_cached_block[rid] = full


@attrs.frozen(kw_only=True)
class StealingSpec(FullAttentionSpec):
    kind: ClassVar[str] = "stealing"


@attrs.frozen(kw_only=True)
class HandingSpec(FullAttentionSpec):
    kind: ClassVar[str] = "handing"


@attrs.frozen(kw_only=True)
class OverPoppingSpec(FullAttentionSpec):
    kind: ClassVar[str] = "over_popping"


@attrs.frozen(kw_only=True)
class WrongGroupSpec(FullAttentionSpec):
    kind: ClassVar[str] = "wrong_group"


def _kind(spec_type: type[FullAttentionSpec], manager: type) -> CacheKind:
    """A full-attention kind named by ``spec_type`` running ``manager``."""
    attrs_ = {"name": spec_type.kind, "spec_type": spec_type, "manager_type": manager}
    return type(f"{spec_type.__name__}Kind", (FullAttention,), attrs_)()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("spec_type", "manager", "broken"),
    [
        pytest.param(
            StealingSpec,
            StealingManager,
            r"'stealing': kvcore refused its manager's answer in a step: "
            r".*StealingManager.allocate_twins returned \[\d+(, \d+)*\] as the "
            r"new blocks of cache group 0 for request 'two-b', but that group's "
            r"table grew by \[\d+(, \d+)*, 1\]",
            id="steals-another-requests-block",
        ),
        pytest.param(
            HandingSpec,
            HandingManager,
            r"'handing': kvcore refused its manager's answer in a step: "
            r".*HandingManager.allocate_twins returned \[\d+(, \d+)*\] as the new "
            r"blocks of cache group 0 for request 'two-b', but that group's "
            r"table grew by \[\]",
            id="admits-into-another-requests-table",
        ),
        pytest.param(
            OverPoppingSpec,
            OverPoppingManager,
            r"'over_popping': kvcore refused its manager's answer in a step: "
            r".*OverPoppingManager.pop_twins returned .* without taking, freeing "
            r"or keying a block itself",
            id="pops-another-requests-block",
        ),
        pytest.param(
            WrongGroupSpec,
            WrongGroupManager,
            r"'wrong_group': kvcore refused its manager's answer in a step: "
            r".*WrongGroupManager.cache_twins keyed block \d+ under group 0 for "
            r"request 'two-a', but it is not in that group's table",
            id="keys-under-another-group",
        ),
    ],
)
def test_a_manager_that_corrupts_another_request_or_group_fails(
    spec_type: type[FullAttentionSpec], manager: type, broken: str
) -> None:
    """Each passes every single-request run: the corruption shows only with
    two live requests (or two groups of the kind)."""
    kind = _kind(spec_type, manager)
    spec = spec_type(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    with pytest.raises(ConformanceError, match=broken):
        check_kind(kind, spec, registry=KindRegistry.from_kinds([kind]))
