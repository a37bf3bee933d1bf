"""Physical orders of the logical cache ``[L, B, H, N, C]`` and their strides.

``L`` is the layer, ``B`` the block, ``H`` the head slot, ``N`` the state
(token) within a block and ``C`` the content bytes of one state.  Each
:class:`KVCacheLayout` member lists the logical axis stored at each physical
position, outermost first.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from kvcore.errors import LayoutError

__all__ = [
    "AXIS_B",
    "AXIS_C",
    "AXIS_H",
    "AXIS_L",
    "AXIS_N",
    "KVCacheLayout",
    "compute_layout_strides",
]

AXIS_L, AXIS_B, AXIS_H, AXIS_N, AXIS_C = range(5)

_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


class KVCacheLayout(enum.Enum):
    """The six physical orders of ``[L, B, H, N, C]`` that keep ``C`` innermost."""

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)

    @classmethod
    def from_name(cls, name: str | KVCacheLayout) -> KVCacheLayout:
        """Look a layout up by name; ``NHD`` and ``HND`` are aliases of
        ``LBNHC`` and ``LBHNC``."""
        if isinstance(name, KVCacheLayout):
            return name
        key = str(name).upper()
        key = _ALIASES.get(key, key)
        try:
            return cls[key]
        except KeyError:
            known = ", ".join([*cls.__members__, *_ALIASES])
            msg = f"unknown KV cache layout {name!r}; known layouts: {known}"
            raise LayoutError(msg) from None

    @property
    def is_layer_compact(self) -> bool:
        """The layer axis is outermost: each layer owns one contiguous region."""
        return self.value[0] == AXIS_L

    @property
    def is_block_outermost(self) -> bool:
        """The block axis is outermost: each block is one contiguous row."""
        return self.value[0] == AXIS_B

    @property
    def is_block_compact(self) -> bool:
        """The two outermost axes are L and B, so each page is contiguous."""
        return set(self.value[:2]) == {AXIS_L, AXIS_B}

    @property
    def can_pack(self) -> bool:
        """Whether groups with different page sizes can overlay in one block."""
        return self.is_block_outermost and self.is_block_compact

    @property
    def is_block_contiguous(self) -> bool:
        """The innermost three axes are H, N, C in that order."""
        return self.value[2:] == (AXIS_H, AXIS_N, AXIS_C)


def compute_layout_strides(
    layout: KVCacheLayout,
    shape: tuple[int, int, int, int, int],
    *,
    page_bytes: int,
    fixed: Mapping[int, int] | None = None,
) -> tuple[int, int, int, int, int]:
    """Byte strides of the logical axes ``[L, B, H, N, C]`` for ``layout``.

    Walks the physical positions from the innermost out, each axis taking the
    running stride unless ``fixed`` gives it one.  The position that closes
    the page grid (the inner of L and B) first raises the running stride to
    ``page_bytes``, so a padded page keeps its padding.

    :param shape: ``(layers, blocks, H, N, C)`` with C in bytes.
    :param page_bytes: the padded page size of one layer.
    :param fixed: strides already decided, by logical axis.
    """
    fixed = fixed or {}
    strides = [0, 0, 0, 0, 0]
    running = 1
    page_closed = False
    padded = page_bytes != shape[AXIS_H] * shape[AXIS_N] * shape[AXIS_C]
    if padded and not layout.is_block_compact:
        msg = (
            f"KV cache layout {layout.name} cannot hold a padded page "
            f"({page_bytes} bytes): it splits a page across the outer axes; use a "
            "block-compact layout (LBHNC, LBNHC, BLHNC or BLNHC)"
        )
        raise LayoutError(msg)
    for axis in reversed(layout.value):
        if padded and axis in (AXIS_L, AXIS_B) and not page_closed:
            running = max(running, page_bytes)
            page_closed = True
        stride = fixed.get(axis) or running
        strides[axis] = stride
        running = stride * shape[axis]
    return (strides[0], strides[1], strides[2], strides[3], strides[4])
