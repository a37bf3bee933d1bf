"""What another serving engine would plan for the same model and memory.

A plugin that models an engine's own KV-cache planner (the built-in
``kvcore_vllm`` models vLLM 0.33) answers ``kvcore_engine_estimate`` with an
:class:`EngineEstimate`: the figures that engine reports for each context,
or the reason it refuses the model.  kvcore's tools print them beside
kvcore's own plan, so a user sees what their engine would do and what
kvcore gains over it.
"""

from __future__ import annotations

import attrs

__all__ = ["EngineEstimate", "EngineFigure"]


@attrs.frozen
class EngineFigure:
    """What the engine reports for requests of ``context`` tokens (its
    ``max_model_len``): the tokens its cache holds and how many requests of
    that length fit at once (a fraction, as the engine prints it)."""

    context: int
    tokens: int
    concurrency: float


@attrs.frozen
class EngineEstimate:
    """An engine's plan of a model: its figures per context, or a refusal.

    :param policy: the policy name (``vllm``).
    :param engine: the engine and version modelled (``vLLM 0.33``).
    :param figures: one per context asked for, in order; empty when the
        engine refuses the model (:attr:`refusal` then says why).
    :param num_groups: the engine's cache groups.
    :param bytes_per_block: the engine's block stride, in bytes.
    :param num_blocks: the blocks its pool holds.
    :param refusal: the engine's reason for refusing the model, or ``None``.
    :param notes: the settings the estimate assumed, for a person.
    """

    policy: str
    engine: str
    figures: tuple[EngineFigure, ...] = ()
    num_groups: int = 0
    bytes_per_block: int = 0
    num_blocks: int = 0
    refusal: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return self.refusal is not None

    def figure(self, context: int) -> EngineFigure | None:
        """The figure for ``context`` tokens, or ``None``."""
        return next((f for f in self.figures if f.context == context), None)
