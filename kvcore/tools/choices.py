"""The tools' named choices and defaults, without torch.

``kvcore simulate``'s parser reads them from here, so ``kvcore --help``
never imports the simulator (and torch); the simulator imports these same
names.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_DECODE_RATE",
    "DEFAULT_PREFILL_RATE",
    "NAMED_WORKLOADS",
    "TRACE_FORMATS",
]

#: Prefill tokens a second the simulated clock charges (a timed workload).
DEFAULT_PREFILL_RATE = 10_000.0

#: Decode steps a second the simulated clock charges (a timed workload): a
#: step with any decode costs ``1 / decode_rate`` seconds on top of its
#: prefill tokens.
DEFAULT_DECODE_RATE = 50.0

#: The formats ``--trace-format`` names.
TRACE_FORMATS = ("mooncake", "bailian", "kvcore")

#: Named synthetic workloads: the :func:`synthetic_workload` options each
#: sets (the same names and text as ``kvcore simulate``'s options; the seed
#: is given apart).
NAMED_WORKLOADS: dict[str, dict[str, str]] = {
    # 16 conversations over one shared system prompt, 7 turns each: every
    # turn's prompt is the last prompt and output plus a new user message.
    "chat": {
        "requests": "112",
        "prompt_len": "300-2000",
        "output_len": "100-400",
        "shared_prefixes": "1",
        "prefix_len": "1024",
        "turns": "7",
        "arrival_gap": "0-8",
    },
    # Many single-turn requests over 4 shared system prompts of 1536 tokens.
    "shared-prefix": {
        "requests": "128",
        "prompt_len": "50-500",
        "output_len": "50-300",
        "shared_prefixes": "4",
        "prefix_len": "1536",
        "turns": "1",
        "arrival_gap": "0-2",
    },
    # Agents over 2 long tool preambles of 6144 tokens: many short turns,
    # small new messages and short outputs.
    "agentic": {
        "requests": "96",
        "prompt_len": "20-200",
        "output_len": "10-80",
        "shared_prefixes": "2",
        "prefix_len": "6144",
        "turns": "12",
        "arrival_gap": "0-16",
    },
}
