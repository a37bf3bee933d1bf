"""The docs document every hook with its exact signature, every public name
and every layout."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kvcore import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
HOOKS = [name for name in dir(hookspecs) if name.startswith("kvcore_")]


def test_there_are_hooks() -> None:
    assert "kvcore_register_kinds" in HOOKS


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name: str) -> None:
    params = inspect.signature(getattr(hookspecs, name)).parameters
    heading = f"### {name}({', '.join(params)})"
    assert heading in DOCS.read_text().splitlines()


ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_documents_every_public_name() -> None:
    import kvcore

    text = (ROOT / "docs" / "api.md").read_text()
    entries = re.findall(
        r"^\.\. (?:auto)?(?:class|function|exception|data):: ([\w.]+)$", text, re.M
    )
    documented = {name for name in entries if "." not in name}
    assert sorted(set(kvcore.__all__) - documented) == []
    assert sorted(documented - set(kvcore.__all__)) == []
    # Names of other modules are given in full, and exist.
    import kvcore.coordinator

    for dotted in (name for name in entries if "." in name):
        module, _, attr = dotted.rpartition(".")
        assert module == "kvcore.coordinator", dotted
        assert attr in kvcore.coordinator.__all__, dotted


def test_layouts_page_and_picture_show_every_layout() -> None:
    from kvcore.layout import KVCacheLayout

    page = (ROOT / "docs" / "layouts.md").read_text()
    picture = (ROOT / "docs" / "layouts.svg").read_text()
    for layout in KVCacheLayout:
        assert f"`{layout.name}`" in page
        assert f">{layout.name}<" in picture


def test_the_gpu_table_is_documented_with_its_memory() -> None:
    from kvcore.tools.accelerators import ACCELERATORS

    text = (DOCS.parent / "cli.md").read_text()
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and " GiB" not in line
    ]
    for acc in ACCELERATORS:
        assert any(
            line.startswith(f"| {acc.name} | {acc.vendor} | {acc.memory_gib} |")
            for line in rows
        ), acc.name


def test_the_manager_contract_lists_every_method_with_its_signature() -> None:
    from kvcore.coordinator.manager import SingleTypeManager
    from kvcore.coordinator.managers import CheckpointManager, FixedBlocksManager

    text = DOCS.read_text()
    public = [
        (SingleTypeManager, name)
        for name, value in vars(SingleTypeManager).items()
        if not name.startswith("_") and callable(getattr(SingleTypeManager, name))
    ] + [
        (FixedBlocksManager, "blocks_per_request"),
        (CheckpointManager, "keeps_every_state"),
        (CheckpointManager, "checkpoint_policy"),
    ]
    for cls, name in public:
        sig = inspect.signature(getattr(cls, name))
        params = ", ".join(str(p) for p in sig.parameters.values())
        ret = (
            ""
            if sig.return_annotation is inspect.Signature.empty
            else f" -> {sig.return_annotation}"
        )
        line = f"- `{name}({params}){ret}`:".replace("'", "")
        assert line in text, name
