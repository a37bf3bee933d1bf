"""What a kind's spec declares to the planner, checked where it crosses in.

A spec's planning methods are plugin code: a grown spec of another type or
block size, or a block count that is not a non-negative int, would plan
memory the manager never holds.  These wrappers refuse such answers with an
error naming the kind.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

from kvcore.errors import PluginError, echo
from kvcore.owners import call_plugin, declared, spec_plugin_error
from kvcore.spec import KVCacheSpec

__all__ = [
    "check_spec_answers",
    "resolved_defaults",
    "checked_blocks_held",
    "checked_event_window",
    "checked_state_cache_mode",
    "checked_grown",
    "checked_variant",
    "checked_merge",
    "checked_page",
    "checked_positive",
    "layer_alignment",
]


#: The yes-or-no declarations the planner reads of every spec.
_FLAGS = (
    "scales_with_context_parallel",
    "allows_sub_block_hashing",
    "caches_partial_block_hits",
    "copies_partial_block_hits",
)


def check_spec_answers(specs: Iterable[KVCacheSpec]) -> None:
    """Each distinct spec's declarations, checked once as a plan starts (a
    raising one is its plugin's failure): a positive int page, a grid of
    three positive ints that fits in it, a key (and spec) that hash, the
    positive int sizes and alignments, the yes-or-no flags, and the tokens
    it skips (an int from 0 to the tokens computed)."""
    seen: set[int] = set()
    for spec in specs:
        if id(spec) in seen:
            continue
        seen.add(id(spec))
        grid = declared(spec, "page_grid")
        if (
            not isinstance(grid, tuple)
            or len(grid) != 3
            or any(type(d) is not int or d <= 0 for d in grid)
        ):
            raise spec_plugin_error(
                spec,
                f"page_grid is {echo(grid)}; it must be a tuple of three positive "
                "ints (heads, states per block, bytes per state)",
            )
        page = checked_page(spec)
        if math.prod(grid) > page:
            raise spec_plugin_error(
                spec,
                f"page_grid {grid} holds {math.prod(grid):,} bytes, more than its "
                f"page_size_bytes of {page:,}; the grid must fit in the page",
            )
        _check_group_key(spec)
        _check_hashable(spec, "the spec itself", spec)
        layer_alignment(spec)
        checked_positive(spec, "tokens_per_state", declared(spec, "tokens_per_state"))
        for flag in _FLAGS:
            value = declared(spec, flag)
            if type(value) is not bool:
                raise spec_plugin_error(
                    spec, f"{flag} is {echo(value)}; it must be True or False"
                )
        _check_skipped_tokens(spec)


def _check_group_key(spec: KVCacheSpec) -> None:
    """``group_key()``, asked of the spec and of a copy: a hashable value,
    the same both times with the same hash.  Buckets, groups and managers
    each ask for it again, so a key that changes between calls (an id, a
    counter, a clock) splits layers of one bucket apart later, where no
    plugin is named."""
    key: object = call_plugin(spec, "group_key()", spec.group_key)
    _check_hashable(spec, f"what group_key() returned ({echo(key)})", key)
    again: object = call_plugin(
        spec, "group_key() of a copy", lambda: copy.copy(spec).group_key()
    )
    _check_hashable(spec, f"what group_key() returned ({echo(again)})", again)
    same = call_plugin(
        spec,
        "comparing two group_key() answers",
        lambda: bool(key == again) and hash(key) == hash(again),
    )
    if not same:
        shown = f"{echo(key)}, then {echo(again)}"
        if echo(key) == echo(again):
            shown += f" (hashes {hash(key)} and {hash(again)})"
        raise spec_plugin_error(
            spec,
            f"group_key() returned {shown} for the same spec (asked again, of a "
            "copy); the key must be a deterministic hashable function of the "
            "spec's fields, equal with an equal hash every time (no ids, counters, "
            "clocks or random values)",
        )


def checked_page(spec: KVCacheSpec) -> int:
    """``spec.page_size_bytes``, which must be a positive int."""
    page = declared(spec, "page_size_bytes")
    if type(page) is not int or page <= 0:
        raise spec_plugin_error(
            spec,
            f"page_size_bytes is {page!r} ({type(page).__name__}); it must be a "
            "positive int number of bytes (a bool or float is not one)",
        )
    return page


def _check_skipped_tokens(spec: KVCacheSpec) -> None:
    """``skipped_tokens(n)`` at a few ``n``: an int from 0 to ``n`` (a
    negative count would make a request hold more blocks than its tokens)."""
    for n in (0, 1, spec.block_size, 4 * spec.block_size + 1, 1 << 20):
        skipped: object = call_plugin(
            spec, f"skipped_tokens({n})", functools.partial(spec.skipped_tokens, n)
        )
        if type(skipped) is not int or not 0 <= skipped <= n:
            raise spec_plugin_error(
                spec,
                f"skipped_tokens({n}) returned {echo(skipped)}; it must return an "
                f"int from 0 to {n} (the leading tokens never read again)",
            )


def resolved_defaults(
    specs: Mapping[str, KVCacheSpec],
    *,
    prefix_caching: bool,
    state_cache_mode: str | None,
) -> dict[str, KVCacheSpec]:
    """Every layer's spec with its engine-dependent defaults settled (see
    :meth:`KVCacheSpec.resolve_defaults`), checked: the same kind's spec,
    or ``None`` for no change.

    Equal specs come back as one object, so everything planning asks of
    each distinct spec (keyed by object) is asked once however many layers
    share it: a model file's layers are separate but equal objects."""
    out: dict[str, KVCacheSpec] = {}
    memo: dict[int, KVCacheSpec] = {}
    canonical: dict[KVCacheSpec, KVCacheSpec] = {}
    for name, spec in specs.items():
        done = memo.get(id(spec))
        if done is None:
            answer: object = call_plugin(
                spec,
                "resolve_defaults()",
                functools.partial(
                    spec.resolve_defaults,
                    prefix_caching=prefix_caching,
                    state_cache_mode=state_cache_mode,
                ),
            )
            if answer is None:
                done = spec
            elif type(answer) is type(spec):
                done = answer
            else:
                raise spec_plugin_error(
                    spec,
                    f"resolve_defaults() returned {echo(answer)}; it must return "
                    f"a {type(spec).__name__} or None",
                )
            # An unhashable spec stays as it is: check_spec_answers refuses it.
            with contextlib.suppress(TypeError):
                done = canonical.setdefault(done, done)
            memo[id(spec)] = done
        out[name] = done
    return out


def _check_hashable(spec: KVCacheSpec, subject: str, value: object) -> None:
    try:
        hash(value)
    except TypeError as exc:
        raise spec_plugin_error(
            spec,
            f"{subject} is unhashable ({exc}); grouping keys and specs are dict "
            "keys, so build them from tuples, ints, strings and other frozen values",
        ) from exc
    except Exception as exc:
        raise spec_plugin_error(
            spec,
            f"hashing {subject} raised {type(exc).__name__}: {exc}",
            error=PluginError,
        ) from exc


def checked_merge(cls: type[KVCacheSpec], specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    """``cls.merge(specs)``, which must return a ``cls`` (a spec of the same
    kind) of the members' block size whose page is at least every member's
    (the group's layers are placed at its page), or raise
    :class:`~kvcore.errors.MergeError`."""
    merged: object = call_plugin(
        specs[0], f"{cls.__name__}.merge()", lambda: cls.merge(specs)
    )
    call = f"{cls.__name__}.merge() of {len(specs)} spec(s)"
    if type(merged) is not cls:
        raise spec_plugin_error(
            specs[0],
            f"{call} returned {echo(merged)}; merge must return an instance of "
            f"{cls.__name__} (the group's spec, of the same kind) or raise "
            "kvcore.MergeError when the specs do not merge",
        )
    members = list({id(s): s for s in specs}.values())
    blocks = sorted({s.block_size for s in members})
    block = declared(merged, "block_size")
    if type(block) is not int or [block] != blocks:
        theirs = f"block size{'s are' if len(blocks) > 1 else ' is'} "
        theirs += ", ".join(map(str, blocks))
        raise spec_plugin_error(
            specs[0],
            f"{call} returned a {cls.__name__} of block_size {echo(block)}, but its "
            f"members' {theirs}; merge must keep its members' block size (and "
            "raise kvcore.MergeError for members of different block sizes)",
        )
    page = checked_page(merged)
    widest = max(checked_page(s) for s in members)
    if page < widest:
        raise spec_plugin_error(
            specs[0],
            f"{call} returned a {cls.__name__} of page_size_bytes {page:,}, smaller "
            f"than a member's {widest:,}; the group's layers are placed at the "
            "merged page, so merge must return a spec whose page is at least every "
            "member's (or raise kvcore.MergeError)",
        )
    return merged


def checked_grown(spec: KVCacheSpec, factor: int) -> KVCacheSpec | None:
    """``spec.grown(factor)``, which must be ``None`` or a spec of the same
    type with ``factor`` times the block size."""
    grown: object = call_plugin(spec, f"grown({factor})", lambda: spec.grown(factor))
    if grown is None:
        return None
    return checked_variant(
        spec, f"grown({factor})", grown, spec.block_size * factor, none_ok=True
    )


def checked_variant(
    spec: KVCacheSpec,
    call: str,
    answer: object,
    block_size: int,
    *,
    none_ok: bool,
    why: str = "",
) -> KVCacheSpec:
    """``answer``, what ``spec``'s ``call`` gave for a variant of ``spec``
    (``grown``, a serving choice's ``with_*``, the spec of ``sharded``): it
    must be a spec of the same class, whose manager and binder are the
    kind's, with ``block_size`` tokens a block.

    :param none_ok: whether the hook may answer ``None`` (said in the error;
        the caller has already taken a ``None``).
    :param why: what the block size is, appended to the rule.
    """
    cls = type(spec)
    if type(answer) is cls:
        got_block = declared(answer, "block_size")
        if type(got_block) is int and got_block == block_size:
            return answer
        got = f"a {cls.__name__} of block_size {echo(got_block)}"
    else:
        got = echo(answer)
    either = "None or " if none_ok else ""
    raise spec_plugin_error(
        spec,
        f"{cls.__name__}.{call} returned {got}; it must return {either}a "
        f"{cls.__name__} with block_size {block_size}{why}",
    )


def checked_blocks_held(
    spec: KVCacheSpec, num_computed_tokens: int, num_tokens: int, block_size: int
) -> int:
    """``spec.num_blocks_held(...)``, which must be a non-negative int."""
    call = f"num_blocks_held({num_computed_tokens}, {num_tokens}, {block_size})"
    held: object = call_plugin(
        spec,
        call,
        lambda: spec.num_blocks_held(num_computed_tokens, num_tokens, block_size),
    )
    if type(held) is not int or held < 0:
        raise spec_plugin_error(
            spec,
            f"{type(spec).__name__}.{call} returned {echo(held)}; it must return "
            "the non-negative int number of blocks the kind's manager holds",
        )
    return held


def checked_event_window(spec: KVCacheSpec) -> int | None:
    """``spec.event_window`` (what its KV-cache events tell a router), which
    must be ``None`` or a positive int."""
    window = declared(spec, "event_window")
    if window is not None and (type(window) is not int or window < 1):
        raise spec_plugin_error(
            spec,
            f"event_window is {echo(window)} ({type(window).__name__}); it must "
            "be None (a router needs the whole prefix) or the positive int number "
            "of tokens of the window a hit needs (a bool or float is not one)",
        )
    return window


def checked_state_cache_mode(spec: KVCacheSpec) -> str | None:
    """``spec.state_cache_mode`` (the recurrent-state caching mode it runs
    under), which must be ``None`` or a str."""
    mode = declared(spec, "state_cache_mode")
    if mode is not None and type(mode) is not str:
        raise spec_plugin_error(
            spec,
            f"state_cache_mode is {echo(mode)} ({type(mode).__name__}); it must "
            "be None (the kind keeps no recurrent state) or the str name of the "
            "mode its states are cached under ('none', 'align' or 'all')",
        )
    return mode


def checked_positive(spec: KVCacheSpec, what: str, value: object) -> int:
    """A declared size (``element_size``, ``stride_alignment()``,
    ``max_block_growth``), which must be a positive int."""
    if type(value) is not int or value < 1:
        raise spec_plugin_error(
            spec,
            f"{type(spec).__name__}.{what} is {echo(value)}; it must be a positive int",
        )
    return value


def layer_alignment(spec: KVCacheSpec) -> int:
    """The byte alignment a layer imposes on the block stride: its stride
    alignment and its element size."""
    alignment = call_plugin(spec, "stride_alignment()", spec.stride_alignment)
    return math.lcm(
        checked_positive(spec, "stride_alignment()", alignment),
        checked_positive(spec, "element_size", declared(spec, "element_size")),
    )
