"""The ``min_waste`` policy: the grouping that holds the most requests of a
target context length, by exact search over one-stride plans.

Concurrency at context ``T`` is the pool's bytes over the bytes one request
holds: the block stride ``S`` times the blocks every group holds at ``T``.  A
group of a bucket holds the bucket's blocks-per-request at ``T`` (all of
``T`` for full attention, a window's blocks, a fixed state), so a bucket cut
into ``n`` groups costs ``S * n * blocks(T)``.

For every candidate stride (every width a bucket can take, rounded to the
plan's alignment), each bucket takes its cheapest option that fits: the
fewest groups whose widest fits the stride, jointly with a block-size growth
factor where its kind declares one (:meth:`KVCacheSpec.grown`).  The stride
and choices with the fewest bytes per request win.  Plans within
:data:`TIE_TOLERANCE` of the best are ties and go to fewer groups, then to
fewer bytes and the narrower stride, but never to a plan that needs more
bytes per request than ``seed``.  The memory is not known here, and the
grouping must not depend on it (every rank of an engine plans the same
groups): at one memory a tie of fewer, wider groups can hold fewer requests
than ``seed`` by what its wider stride rounds away (the null block and the
prefill peak are paid in whole strides), never more.

No plan has more than ``CacheConfig.max_kv_cache_groups`` groups (each costs
the scheduler a block table and a manager), with two exceptions that both
keep ``min_waste`` from needing more bytes per request than ``seed``: a model with
more buckets than the cap gets one group a bucket at least (no fewer can
hold it), and where ``seed``'s own plan has more groups than the cap, the
cap rises to that count.  ``seed`` is the reference engine's grouping, which
runs that many groups whatever the cap; refusing them would cost requests
against the very plan ``min_waste`` must never fall below (100 distinct
windows and 10 full layers: ``seed`` makes 110 groups of one layer, while a
cap of 101 forces the 10 full layers into one group ten times wider).  Past
the cap the search is exact (see :mod:`~kvcore.plan.policies.stride_search`).

With ``CacheConfig.target_lengths`` (a :class:`~kvcore.length_mix.LengthMix`)
the target is the mix instead of one context: a bucket option's cost is the
blocks a request holds summed over the mix's lengths with their weights
(:class:`~kvcore.plan.policies.stride_search.MixTarget`), so bytes per
request become bytes per request of the mix times its total weight, and the
plan found holds the most requests of the mix
(:func:`kvcore.plan.mix_capacity`).  The search, the cap and the ``seed``
ceiling are the same; only the blocks a request holds are counted over the
mix.  A mix of one length plans as ``target_context`` of that length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from kvcore.config import EngineConfig
from kvcore.errors import KvcoreError
from kvcore.plan.block_sizes import effective_block_size, resolve_block_sizes
from kvcore.plan.buckets import Bucket, bucket_layers
from kvcore.plan.declarations import checked_grown, layer_alignment
from kvcore.plan.groups import make_group
from kvcore.plan.policies.stride_search import (
    TIE_TOLERANCE,
    Choice,
    MixTarget,
    Option,
    Target,
    held_blocks,
    search,
)
from kvcore.spec import KVCacheSpec, round_up
from kvcore.structs import KVCacheGroupSpec

__all__ = [
    "TIE_TOLERANCE",
    "Choice",
    "MixTarget",
    "Option",
    "min_waste_groups",
    "search",
]


def min_waste_groups(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Group the model for the most concurrent requests at the target context
    (``CacheConfig.target_context``, else ``max_model_len``), or of the mix
    ``CacheConfig.target_lengths`` where one is set."""
    cache = config.cache_config
    distinct = _distinct(specs)
    pages = {s.page_size_bytes for s in distinct}
    layout = cache.kv_cache_layout
    packing = layout is not None and layout.can_pack
    if len(pages) > 1 and not packing:
        # Mixed pages need a packing layout: the reference rules say so
        # (or plan the single group a layer-outer layout can hold).
        from kvcore.plan.policies.seed import seed_groups

        return seed_groups(config, specs)
    buckets = bucket_layers(specs)
    context: Target = config.resolved_target_context()
    if cache.target_lengths is not None:
        context = MixTarget(cache.target_lengths)
    dcp = config.parallel_config.decode_context_parallel_size
    growth = cache.max_block_growth if packing else 1
    alignment = _alignment(distinct)
    seed = _seed_plan_cost(config, specs, context, dcp, alignment)
    max_groups = max(cache.max_kv_cache_groups, seed[1] if seed else 0)

    def plan(caps: list[int]) -> list[KVCacheGroupSpec]:
        choice = search(
            buckets,
            context=context,
            alignment=alignment,
            max_groups=max_groups,
            dcp=dcp,
            growth_caps=caps,
            ceiling=seed[0] if seed else None,
            ceiling_groups=seed[1] if seed else None,
        )
        groups: list[KVCacheGroupSpec] = []
        for bucket, option in zip(buckets, choice.options, strict=True):
            grown = _grown_bucket(bucket, option.factor)
            wrap = len(pages) > 1 or option.factor > 1
            groups.extend(
                make_group(grown, names, wrap=wrap)
                for names in grown.split(option.groups)
            )
        return groups

    groups = plan([growth] * len(buckets))
    if not _hash_compatible(groups, config):
        # Some layer forbids hashing finer than the scheduler block, so every
        # hashed group must hold whole scheduler blocks: keep the hashed
        # kinds at their own block sizes and grow only the others.
        groups = plan([1 if b.first.hashes_blocks else growth for b in buckets])
    return groups


def _hash_compatible(groups: Sequence[KVCacheGroupSpec], config: EngineConfig) -> bool:
    """Whether every group whose blocks are hashed holds whole hash blocks
    (the coordinator refuses a plan where one does not)."""
    if not (config.cache_config.enable_prefix_caching or config.kv_transfer_enabled):
        return True
    dcp = config.parallel_config.decode_context_parallel_size
    try:
        _, hash_block = resolve_block_sizes(groups, config)
    except KvcoreError:
        return False
    return all(
        effective_block_size(g, dcp) % hash_block == 0
        for g in groups
        if g.manager_spec.hashes_blocks
    )


def _seed_plan_cost(
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    context: Target,
    dcp: int,
    alignment: int,
) -> tuple[int, int] | None:
    """Bytes per request and groups of the ``seed`` plan, which a tie must
    not exceed (``None`` where ``seed`` cannot plan the model), costed as
    the search costs a plan: the widest group rounded to the alignment."""
    from kvcore.plan.policies.seed import seed_groups

    try:
        groups = seed_groups(config, specs)
    except KvcoreError:
        return None
    widest = max(g.packed_bytes for g in groups)
    stride = round_up(widest, alignment)
    held = sum(
        held_blocks(g.manager_spec, context, effective_block_size(g, dcp))
        for g in groups
    )
    return stride * held, len(groups)


def _alignment(specs: Iterable[KVCacheSpec]) -> int:
    return math.lcm(*(layer_alignment(s) for s in specs))


def _distinct(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheSpec]:
    """Each spec object once (layers often share one): what is asked of
    every layer is asked once of each."""
    return list({id(s): s for s in specs.values()}.values())


def _grown_bucket(bucket: Bucket, factor: int) -> Bucket:
    if factor == 1:
        return bucket
    # Each distinct spec grows once (layers share equal specs, often one
    # object), so the grown bucket costs a look-up a layer.
    by_spec: dict[KVCacheSpec, KVCacheSpec] = {}
    for spec in bucket.counts:
        g = checked_grown(spec, factor)
        if g is None:  # pragma: no cover - the search only offers valid factors
            msg = f"{spec.kind} cannot grow by {factor}"
            raise AssertionError(msg)
        by_spec[spec] = g
    by_id: dict[int, KVCacheSpec] = {}
    grown: dict[str, KVCacheSpec] = {}
    for name, spec in bucket.specs.items():
        g = by_id.get(id(spec))
        if g is None:
            g = by_id[id(spec)] = by_spec[spec]
        grown[name] = g
    return Bucket(grown)
