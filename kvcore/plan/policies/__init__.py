"""Grouping policies: how buckets of layers are cut into cache groups.

``seed``: the reference rules, bit for bit (the seed test file pins them).
``min_waste``: the grouping that holds the most requests of a target context
length, found by exact search.
"""

from __future__ import annotations

from kvcore.plan.policies.min_waste import min_waste_groups
from kvcore.plan.policies.seed import seed_groups

__all__ = ["POLICIES", "min_waste_groups", "seed_groups"]

#: Built-in policies by name.
POLICIES = {"seed": seed_groups, "min_waste": min_waste_groups}
