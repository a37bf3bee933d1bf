"""Checkpoint planning over the state groups (a base class of
:class:`~kvcore.coordinator.coordinator.KVCacheCoordinator`): at admission
every state group chooses where to keep the request's checkpoints; a step
that does not fit with the optional ones sheds them, and a refused step
gets them back or forgets them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcore.coordinator.kind_effects import check_hashes_kept
from kvcore.coordinator.parts import CoordinatorParts
from kvcore.coordinator.plugin_results import answered_only, result_error, shown
from kvcore.coordinator.state_manager import CheckpointManager
from kvcore.errors import PluginError

if TYPE_CHECKING:
    from kvcore.coordinator.manager import SingleTypeManager
    from kvcore.coordinator.request import Request

__all__ = ["CheckpointSteps"]


class CheckpointSteps(CoordinatorParts):
    """The checkpoint steps of the coordinator, which supplies the pool, the
    planning groups, their twin classes and the error reports."""

    planning: tuple[SingleTypeManager, ...]
    _path_twins: Sequence[Sequence[CheckpointManager]]
    _kind_steps: dict[str, frozenset[int]]

    def _check_targets(
        self, manager: CheckpointManager, request_id: str, num_computed_tokens: int
    ) -> None:
        """After a kind's own ``plan_checkpoints``: the token counts a
        checkpoint group keeps states at, which the core's steps place a
        block at each, are ints past the computed tokens, ascending, each
        once (one named twice took two blocks for one position)."""
        targets = manager.targets.get(request_id)
        if not targets:
            return
        last = num_computed_tokens
        for target in targets:
            if type(target) is not int or target <= last:
                problem = (
                    f"planned checkpoint targets {shown(targets)} for request "
                    f"{request_id!r} at {num_computed_tokens} computed tokens; "
                    "they must be ints past the computed tokens, ascending, "
                    "each once"
                )
                error = result_error(manager, "plan_checkpoints", problem)
                raise self.plugin_error(manager.kv_cache_group_id, "plan", error)
            last = target

    def plan_checkpoints(self, request: Request, num_computed_tokens: int) -> None:
        """Let every state group choose where to keep checkpoints for a
        request being admitted."""
        self.forget_span(request.request_id)
        plan = "plan_checkpoints"
        own = self._kind_steps[plan]
        hashes = (request.block_hashes, list(request.block_hashes)) if own else None
        for manager in self.planning:
            self._each((manager,), plan, request, num_computed_tokens, reads=True)
            gid = manager.kv_cache_group_id
            if hashes is None or gid not in own:
                continue
            try:
                check_hashes_kept(manager, plan, request, hashes)
            except PluginError as exc:
                raise self.plugin_error(gid, plan, exc) from exc
            if isinstance(manager, CheckpointManager):
                self._check_targets(manager, request.request_id, num_computed_tokens)
        for twins in self._path_twins:
            CheckpointManager.agree_on_path(twins, request)

    def shed_checkpoints(self, request_id: str) -> list[Any] | None:
        """Let every state group give up the request's optional checkpoints
        (for a step that does not fit with them); what
        :meth:`restore_checkpoints` needs to undo it, or None when there was
        nothing to give up."""
        # A transaction: when a group raises, every group (that one
        # included, as far as it journaled its change) keeps its
        # checkpoints.
        saved: list[Any] = []
        pool = self.block_pool
        pool.begin()
        journal = pool.journal if pool.journal is not None else []
        try:
            for manager in self.planning:
                mark = len(journal)
                state = manager.shed_checkpoints(request_id)
                answered_only(manager, "shed_checkpoints", journal, mark)
                saved.append(state)
        except BaseException as exc:
            pool.rollback()
            if not isinstance(exc, Exception):
                raise  # an interrupt, after the rollback
            gid = self.planning[len(saved)].kv_cache_group_id
            raise self.plugin_error(gid, "shed_checkpoints", exc) from exc
        pool.commit()
        if not any(state is not None for state in saved):
            return None
        self.forget_span(request_id)
        return saved

    def restore_checkpoints(self, request_id: str, saved: list[Any]) -> None:
        """Undo :meth:`shed_checkpoints` (the step was refused anyway)."""
        self.forget_span(request_id)
        gid = 0
        try:
            for manager, state in zip(self.planning, saved, strict=True):
                if state is not None:
                    gid = manager.kv_cache_group_id
                    manager.restore_checkpoints(request_id, state)
        except Exception as exc:
            raise self.plugin_error(gid, "restore_checkpoints", exc) from exc

    def forget_checkpoints(self, request_id: str) -> None:
        """Undo :meth:`plan_checkpoints` after a refused admission."""
        self.forget_span(request_id)
        self._each(self.planning, "forget_checkpoints", request_id, reads=True)
