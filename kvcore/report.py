"""Human-readable summaries of a plan."""

from __future__ import annotations

from collections import Counter

from kvcore.plan.block_sizes import plan_hit_granularity
from kvcore.structs import KVCacheConfig

#: Why each built-in policy is chosen, for the plan's report.
POLICY_REASONS = {
    "min_waste": "the grouping and block sizes that hold the most requests of "
    "the target context (a search over one-stride plans)",
    "seed": "the reference grouping rules, file block sizes kept",
}

__all__ = ["format_bytes", "format_plan"]


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def format_plan(config: KVCacheConfig, *, title: str = "KV cache plan") -> str:
    """A table of the plan's groups: kinds, layers, bytes per block and fill."""
    bpb = config.bytes_per_block
    lines = [
        f"{title}",
        f"  layout {config.kv_cache_layout.name if config.kv_cache_layout else '?'}, "
        f"{len(config.kv_cache_groups)} groups, {config.num_blocks} blocks of "
        f"{format_bytes(bpb)} ({format_bytes(bpb * config.num_blocks)} in one allocation)",
        "",
        f"  {'group':>5}  {'kinds':<34} {'layers':>6} {'block':>6} {'bytes/block':>12} {'fill':>6}",
    ]
    if config.packing_policy:
        reason = POLICY_REASONS.get(config.packing_policy, "")
        lines.insert(
            2,
            f"  policy {config.packing_policy} for {config.target_context} tokens: {reason}",
        )
    hits = plan_hit_granularity(config)
    if hits is not None:
        lines.insert(
            3 if config.packing_policy else 2,
            f"  scheduler block {config.scheduler_block_size} tokens, hash block "
            f"{config.hash_block_size} tokens; prefix hits are multiples of {hits} tokens",
        )
    for i, group in enumerate(config.kv_cache_groups):
        kinds = Counter(group.layer_spec(n).kind for n in group.layer_names)
        kind_text = ", ".join(f"{k}x{v}" for k, v in kinds.items())
        packed = group.packed_bytes
        fill = f"{100 * packed / bpb:.0f}%" if bpb else "-"
        lines.append(
            f"  {i:>5}  {kind_text:<34} {len(group.layer_names):>6} "
            f"{group.kv_cache_spec.block_size:>6} {packed:>12} {fill:>6}"
        )
    return "\n".join(lines)
