"""Hostile input is refused with one clear kvcore error before anything is
allocated: files that are not UTF-8 JSON, JSON that is not strict, names and
dtypes that are not what they claim, worker configs that do not add up,
token ids that are not ids, and pools of absurd numbers of blocks.

Every input is a row of :data:`CASES` (what it is, the input as shown, the
error class, a fragment of the message); ``docs/bad-input.md`` is that table
rendered, and a test checks it is, so the docs cannot drift.  Regenerate the
page with ``python tests/test_hostile_input.py --write``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import kvcore
from kvcore import KVCachePool
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.hashing import TOKEN_ID_LIMIT as HASHED_TOKEN_LIMIT
from kvcore.coordinator.hashing import BlockHasher
from kvcore.errors import (
    BlockSizeError,
    InvalidRequestError,
    InvalidSpecError,
    KvcoreKeyError,
    KvcoreTypeError,
    KvcoreValueError,
    PlanError,
    SerializationError,
    UnknownKindError,
    UnsafePlanError,
)
from kvcore.integrations.distributed import checked_records, load_pipeline_plan
from kvcore.integrations.events import ZmqEventPublisher
from kvcore.limits import MAX_JSON_FILE_BYTES, MAX_NUM_BLOCKS, TOKEN_ID_LIMIT
from kvcore.serialize import dump_config, load_config, load_model_file
from kvcore.tools import zoo
from kvcore.tools.cli import main
from kvcore.tools.simulate.workload import synthetic_workload
from kvcore.tools.units import UnitError, parse_tokens
from kvcore_full_attention import FullAttentionSpec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "bad-input.md"
REPROS = Path("/work/shared/repros")

#: Built-in kinds only: what is installed must not change these answers.
REGISTRY = kvcore.KindRegistry.from_plugin_manager(
    kvcore.get_plugin_manager(load_entrypoints=False)
)

LAYER = {
    "kind": "full_attention",
    "block_size": 16,
    "num_kv_heads": 8,
    "head_size": 64,
    "dtype": "bfloat16",
}
GOOD = json.dumps({"name": "m", "layers": {"a": LAYER}})


def layer(**fields: Any) -> dict[str, Any]:
    return {**LAYER, **fields}


# -- how each input is tried -----------------------------------------------


def model_bytes(body: bytes | str) -> Callable[[Path], object]:
    """Write ``body`` as a model file and read it."""

    def run(tmp: Path) -> object:
        path = tmp / "m.json"
        path.write_bytes(body.encode() if isinstance(body, str) else body)
        return load_model_file(path, REGISTRY)

    return run


def model_json(data: Any) -> Callable[[Path], object]:
    return model_bytes(json.dumps(data))


def model_mapping(data: dict[str, Any]) -> Callable[[Path], object]:
    """Read an already parsed model file (as engines pass one)."""
    return lambda tmp: load_model_file(data, REGISTRY)


def model_path(make: Callable[[Path], object]) -> Callable[[Path], object]:
    """Read the model file at the path ``make`` returns."""
    return lambda tmp: load_model_file(make(tmp), REGISTRY)  # type: ignore[arg-type]


def fifo(tmp: Path) -> Path:
    path = tmp / "fifo.json"
    os.mkfifo(path)
    return path


def spec_dtype(dtype: str) -> Callable[[Path], object]:
    return model_json({"layers": {"a": layer(dtype=dtype)}})


def small_plan_json() -> dict[str, Any]:
    """A two-layer plan as a scheduler ships it, each layer in its own
    tensor: layer ``b``'s pages start 512 bytes into each 1024-byte block."""
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC", max_block_growth=1)
    )
    plan = kvcore.plan_kv_cache(config, {"a": spec, "b": spec}, 8192, registry=REGISTRY)
    data: dict[str, Any] = json.loads(dump_config(plan, REGISTRY))
    (tensor,) = data["kv_cache_tensors"]
    data["kv_cache_tensors"] = [
        {**tensor, "layers": ["a"]},
        {**tensor, "layers": ["b"], "offset": tensor["layer_stride"]},
    ]
    return data


def worker_config(**edits: Any) -> Callable[[Path], object]:
    """Load the small plan with ``edits`` applied (``tensor1_offset`` etc.
    edit the second tensor)."""

    def run(tmp: Path) -> object:
        data = small_plan_json()
        for key, value in edits.items():
            if key.startswith("tensor"):
                index, field = key.removeprefix("tensor").split("_", 1)
                data["kv_cache_tensors"][int(index)][field] = value
            else:
                data[key] = value
        return load_config(json.dumps(data), REGISTRY)

    return run


def one_tensor_config(**edits: Any) -> Callable[[Path], object]:
    """The small plan with both layers in one tensor (512-byte pages, a
    1024-byte block), ``edits`` applied to that tensor."""

    def run(tmp: Path) -> object:
        data = small_plan_json()
        first, _ = data["kv_cache_tensors"]
        data["kv_cache_tensors"] = [{**first, "layers": ["a", "b"], **edits}]
        return load_config(json.dumps(data), REGISTRY)

    return run


def _coordinator_call(call: str) -> object:
    """``call`` on a fresh one-group manager (``mgr``), a request (``req``)
    and its lookup's hit (``hit``)."""
    spec = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = kvcore.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[kvcore.KVCacheGroupSpec(["a"], spec)],
    )
    mgr = KVCacheManager(config, 64, scheduler_block_size=4, registry=REGISTRY)
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    hit, _ = mgr.get_computed_blocks(req)
    return eval(call, {"mgr": mgr, "req": req, "hit": hit})


def config_text(text: str) -> Callable[[Path], object]:
    return lambda tmp: load_config(text, REGISTRY)


def plan_tiny_pages(override: int | None = None) -> Callable[[Path], object]:
    """A 2-byte page (one token of a 1-byte K and V) in 256 MiB."""

    def run(tmp: Path) -> object:
        spec = FullAttentionSpec(
            block_size=1, num_kv_heads=1, head_size=1, dtype=torch.uint8
        )
        config = kvcore.EngineConfig(
            cache_config=kvcore.CacheConfig(
                kv_cache_layout="BLHNC", num_gpu_blocks_override=override
            )
        )
        return kvcore.plan_kv_cache(config, {"a": spec}, 2**28, registry=REGISTRY)

    return run


def request(prompt: object, **kw: Any) -> Callable[[Path], object]:
    return lambda tmp: Request("r", prompt, hash_block_size=4, **kw)  # type: ignore[arg-type]


def append(tokens: object) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        req = Request("r", [1, 2, 3], hash_block_size=4)
        req.append_output_token_ids(tokens)  # type: ignore[arg-type]
        return req

    return run


def zoo_escape(tmp: Path) -> object:
    """A shipped-model name that walks out of the package's model folder to
    a valid model file."""
    (tmp / "evil.json").write_text(GOOD)
    return zoo.path(os.path.relpath(tmp / "evil", zoo.path("gemma-3-27b").parent))


@attrs.frozen
class Case:
    """One hostile input: what it is, the input as the docs show it, how to
    try it, and the refusal expected."""

    description: str
    shown: str
    run: Callable[[Path], object]
    error: type[Exception]
    fragment: str


DEEP = "[" * 100_000 + "]" * 100_000
WIDE = {"layers": {"a": layer(block_size=[0] * 2_000_000)}}

CASES = [
    # -- files ---------------------------------------------------------------
    Case(
        "Latin-1 text",
        '{"name": "caf\\xe9", ...} in Latin-1',
        model_bytes('{"name": "caf\xe9", "layers": {}}'.encode("latin-1")),
        SerializationError,
        "m.json is not UTF-8 text (byte 13 is 0xe9); a model file is UTF-8 JSON",
    ),
    Case(
        "UTF-16 text with a byte-order mark",
        "the good file saved as UTF-16",
        model_bytes(GOOD.encode("utf-16")),
        SerializationError,
        "m.json is not UTF-8 text (byte 0 is 0xff)",
    ),
    Case(
        "UTF-16 text without a byte-order mark",
        "the good file saved as UTF-16-LE",
        model_bytes(GOOD.encode("utf-16-le")),
        SerializationError,
        "m.json holds a NUL byte at byte 1 (a binary or UTF-16 file)",
    ),
    Case(
        "a binary file",
        "a PNG header",
        model_bytes(b"\x89PNG\r\n\x1a\n\x00\x00"),
        SerializationError,
        "m.json is not UTF-8 text (byte 0 is 0x89)",
    ),
    Case(
        "a file over the size limit",
        f"{MAX_JSON_FILE_BYTES + 1:,} bytes",
        model_bytes(b" " * (MAX_JSON_FILE_BYTES + 1)),
        SerializationError,
        "m.json is larger than 16 MiB (MAX_JSON_FILE_BYTES)",
    ),
    Case(
        "100,000 nested arrays",
        "[[[[...]]]]",
        model_bytes(DEEP),
        SerializationError,
        "m.json: the JSON is nested deeper than 32 levels (MAX_JSON_DEPTH)",
    ),
    Case(
        "nesting past the depth limit",
        '{"layers": {"a": [[[...]]]}} (40 levels)',
        model_bytes('{"layers": {"a": ' + "[" * 38 + "]" * 38 + "}}"),
        SerializationError,
        "m.json: the JSON at $.layers.a[0][0][0][0]",
    ),
    Case(
        "an integer literal of 5,000 digits",
        '"weights_bytes": 999...9',
        model_bytes('{"weights_bytes": ' + "9" * 5000 + ', "layers": {}}'),
        SerializationError,
        "an integer literal of 5000 digits",
    ),
    Case(
        "a number that overflows a float",
        '"block_size": 1e999',
        model_bytes('{"layers": {"a": {"block_size": 1e999}}}'),
        SerializationError,
        "m.json is not valid JSON: the number '1e999' overflows a float",
    ),
    Case(
        "NaN",
        '"block_size": NaN',
        model_bytes('{"layers": {"a": {"block_size": NaN}}}'),
        SerializationError,
        "m.json is not valid JSON: NaN is not a JSON number",
    ),
    Case(
        "-Infinity",
        '"head_size": -Infinity',
        model_bytes('{"layers": {"a": {"head_size": -Infinity}}}'),
        SerializationError,
        "-Infinity is not a JSON number (JSON has no NaN or Infinity)",
    ),
    Case(
        "a character device",
        "/dev/zero",
        model_path(lambda tmp: "/dev/zero"),
        SerializationError,
        "/dev/zero is not a regular file (a FIFO, device or socket)",
    ),
    Case(
        "a FIFO with no writer (must not hang)",
        "mkfifo fifo.json",
        model_path(fifo),
        SerializationError,
        "fifo.json is not a regular file (a FIFO, device or socket)",
    ),
    Case(
        "a directory",
        ".",
        model_path(lambda tmp: tmp),
        SerializationError,
        "is a directory; give a model file inside it",
    ),
    Case(
        "a NUL byte in the path",
        '"m\\x00.json"',
        model_path(lambda tmp: "m\x00.json"),
        SerializationError,
        "the model file path 'm\\x00.json' holds a NUL byte",
    ),
    Case(
        "a source that is not a path",
        "123",
        model_path(lambda tmp: 123),
        KvcoreTypeError,
        "a model file is read from a path (str or pathlib.Path), got int 123",
    ),
    # -- strict JSON -----------------------------------------------------------
    Case(
        "a layer defined twice",
        '{"layers": {"l.0": {...}, "l.0": {...}}}',
        model_bytes(
            '{"layers": {"l.0": ' + json.dumps(LAYER) + ', "l.0": {"kind": "x"}}}'
        ),
        SerializationError,
        "m.json: key 'l.0' appears twice in the object at $.layers; JSON keys "
        "must be unique (kvcore does not pick one), remove or rename one",
    ),
    Case(
        "a field given twice",
        '{"block_size": 16, "block_size": 32}',
        model_bytes(
            '{"layers": {"a": {"kind": "mla", "block_size": 16, "block_size": 32}}}'
        ),
        SerializationError,
        "key 'block_size' appears twice in the object at $.layers.a;",
    ),
    Case(
        "`layers` given twice",
        '{"layers": {...}, "layers": {...}}',
        model_bytes('{"layers": {}, "name": "m", "layers": {}}'),
        SerializationError,
        "key 'layers' appears twice in the object at $;",
    ),
    # -- names -----------------------------------------------------------------
    Case(
        "a model name that is a number",
        '"name": 123',
        model_json({"name": 123, "layers": {"a": LAYER}}),
        SerializationError,
        "m.json: the model 'name' must be a non-empty string of at most 256 characters, got 123 (int)",
    ),
    Case(
        "a model name that is null",
        '"name": null',
        model_json({"name": None, "layers": {"a": LAYER}}),
        SerializationError,
        "the model 'name' must be a non-empty string of at most 256 characters, got None (NoneType)",
    ),
    Case(
        "a model name that is a list",
        '"name": ["m"]',
        model_json({"name": ["m"], "layers": {"a": LAYER}}),
        SerializationError,
        "the model 'name' must be a non-empty string of at most 256 characters, got ['m'] (list)",
    ),
    Case(
        "a model name that is NaN (a parsed mapping)",
        "name=float('nan')",
        model_mapping({"name": float("nan"), "layers": {"a": LAYER}}),
        SerializationError,
        "the model 'name' must be a non-empty string of at most 256 characters, got nan (float)",
    ),
    Case(
        "an empty layer name",
        '"layers": {"": {...}}',
        model_json({"layers": {"": LAYER}}),
        SerializationError,
        "m.json: layers: a layer name must be a non-empty string of at most 256 characters, got ''",
    ),
    Case(
        "a layer name with terminal escapes",
        '"layers": {"a\\u001b[2J": {...}}',
        model_json({"layers": {"a\x1b[2J": LAYER}}),
        SerializationError,
        "a layer name 'a\\x1b[2J' holds control characters; names must be printable",
    ),
    Case(
        "notes that are not a string",
        '"notes": 7',
        model_json({"notes": 7, "layers": {"a": LAYER}}),
        SerializationError,
        "m.json: 'notes' must be a string, got 7",
    ),
    Case(
        "a shipped-model name walking out of the zoo",
        "kvcore plan ../../../tmp/evil",
        zoo_escape,
        KvcoreKeyError,
        "no shipped model file '../",
    ),
    # -- dtypes ----------------------------------------------------------------
    Case(
        "a torch module attribute as a dtype",
        '"dtype": "_dynamo"',
        spec_dtype("_dynamo"),
        SerializationError,
        "'_dynamo' is not a torch dtype name (e.g. 'bfloat16', 'uint8') or a cache "
        "dtype alias (fp8, ",
    ),
    Case(
        "a torch function as a dtype",
        '"dtype": "has_cuda"',
        spec_dtype("has_cuda"),
        SerializationError,
        "known dtype names: float64, double, float32,",
    ),
    Case(
        "a bool dtype",
        '"dtype": "bool"',
        spec_dtype("bool"),
        SerializationError,
        "'bool' is not a cache element type (bool and complex dtypes are refused)",
    ),
    Case(
        "a complex dtype",
        '"dtype": "complex64"',
        spec_dtype("complex64"),
        SerializationError,
        "'complex64' is not a cache element type",
    ),
    Case(
        "a complex dtype from Python",
        "FullAttentionSpec(dtype=torch.complex64)",
        lambda tmp: FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=8, dtype=torch.complex64
        ),
        InvalidSpecError,
        "FullAttentionSpec.dtype is torch.complex64, which is not a cache element type",
    ),
    # -- worker configs ----------------------------------------------------------
    Case(
        "bytes_per_block of 0",
        '"bytes_per_block": 0',
        worker_config(bytes_per_block=0),
        SerializationError,
        "$.bytes_per_block must be a positive number of bytes, got 0",
    ),
    Case(
        "a negative bytes_per_block",
        '"bytes_per_block": -64',
        worker_config(bytes_per_block=-64),
        SerializationError,
        "$.bytes_per_block must be a positive number of bytes, got -64",
    ),
    Case(
        "a group's layer with no tensor",
        'a tensor of layer "b" renamed "c"',
        worker_config(tensor1_layers=["c"]),
        SerializationError,
        "$.kv_cache_tensors[1].layers: layer 'c' is in no cache group",
    ),
    Case(
        "a layer left without a tensor",
        "the second tensor dropped",
        lambda tmp: load_config(
            json.dumps(
                {
                    **(data := small_plan_json()),
                    "kv_cache_tensors": data["kv_cache_tensors"][:1],
                }
            ),
            REGISTRY,
        ),
        SerializationError,
        "$.kv_cache_groups[0].layer_names: layer 'b' has no tensor in "
        "$.kv_cache_tensors, so a worker could bind no view for it",
    ),
    Case(
        "a tensor beyond the pool",
        '"offset": 8000',
        worker_config(tensor1_offset=8000),
        SerializationError,
        "$.kv_cache_tensors[1]: the pages of layers ['b'] reach byte 15,680 of a "
        "8,192-byte device pool",
    ),
    Case(
        "overlapping tensors of one group",
        '"offset": 256',
        worker_config(tensor1_offset=256),
        SerializationError,
        "$.kv_cache_tensors[1]: layer 'b' (cache group 0) may share bytes with layer "
        "'a' ($.kv_cache_tensors[0], cache group 0) within bytes 256 to 7,680",
    ),
    Case(
        "tensors of different sizes",
        '"size": 4096',
        worker_config(tensor1_size=4096),
        SerializationError,
        "$.kv_cache_tensors[1].size is 4096, but the other tensors of its residency",
    ),
    Case(
        "more blocks than the limit",
        '"num_blocks": 33554432',
        worker_config(num_blocks=2**25),
        SerializationError,
        "$.num_blocks: 33,554,432 blocks is more than kvcore's limit of "
        "16,777,216 (MAX_NUM_BLOCKS)",
    ),
    Case(
        "a token count past 2**32",
        '"max_model_len": 2**40',
        worker_config(max_model_len=2**40),
        KvcoreValueError,
        "$.max_model_len must be a token count in [1, 2**32), got "
        "1,099,511,627,776; check the unit",
    ),
    Case(
        "a config key given twice",
        '{"num_blocks": 8, "num_blocks": 9, ...}',
        config_text('{"num_blocks": 8, "num_blocks": 9}'),
        SerializationError,
        "the KV cache config: key 'num_blocks' appears twice in the object at $",
    ),
    Case(
        "Infinity in a config",
        '"available_memory": Infinity',
        config_text('{"available_memory": Infinity}'),
        SerializationError,
        "the KV cache config is not valid JSON: Infinity is not a JSON number",
    ),
    # -- tokens ------------------------------------------------------------------
    Case(
        "a bool token id inside a hashed chunk",
        "Request(prompt=[True, 1, 1, 1])",
        request([True, 1, 1, 1]),
        KvcoreTypeError,
        "request 'r': prompt: token id at position 0 is True (bool); token ids "
        "must be ints",
    ),
    Case(
        "a hash block size past a u32",
        "Request(prompt=[1, 2], hash_block_size=2**32)",
        lambda tmp: Request("r", [1, 2], hash_block_size=2**32),
        BlockSizeError,
        "hash_block_size must be a positive int below 2**32 (a chunk's token "
        "count is hashed as a u32), got 4294967296",
    ),
    Case(
        "a 0-d bool tensor token id",
        "Request(prompt=[1, torch.tensor(True), 1, 1])",
        request([1, torch.tensor(True), 1, 1]),
        KvcoreTypeError,
        "token id at position 1 is tensor(True) (Tensor); token ids must be ints",
    ),
    Case(
        "a 0-d float tensor token id",
        "Request(prompt=[torch.tensor(5.0), 1, 1, 1])",
        request([torch.tensor(5.0), 1, 1, 1]),
        KvcoreTypeError,
        "token id at position 0 is tensor(5.) (Tensor)",
    ),
    Case(
        "a token id of 2**32",
        "Request(prompt=[1, 1, 1, 2**32])",
        request([1, 1, 1, 2**32]),
        KvcoreValueError,
        "token id at position 3 is 4294967296; token ids must lie in [0, 4294967296)",
    ),
    Case(
        "a dict as a prompt",
        "Request(prompt={1: 2})",
        request({1: 2}),
        KvcoreTypeError,
        "request 'r': prompt must be a list or tuple of token ids, got dict {1: 2}",
    ),
    Case(
        "a set as a prompt",
        "Request(prompt={1, 2})",
        request({1, 2}),
        KvcoreTypeError,
        "prompt must be a list or tuple of token ids, got set {1, 2}",
    ),
    Case(
        "bytes as output tokens",
        'append_output_token_ids(b"ab")',
        append(b"ab"),
        KvcoreTypeError,
        "appended tokens must be a list or tuple of token ids, got bytes b'ab'",
    ),
    Case(
        "a bool output token",
        "append_output_token_ids(True)",
        append(True),
        KvcoreTypeError,
        "appended tokens: token id at position 3 is True (bool)",
    ),
    Case(
        "a context past 2**32 tokens",
        "--context 1000000000000",
        lambda tmp: parse_tokens("1000000000000", what="--context"),
        UnitError,
        "--context '1000000000000' is more than 4,294,967,295 tokens; check the unit",
    ),
    Case(
        "an engine max_model_len past 2**32",
        "EngineConfig(max_model_len=2**32)",
        lambda tmp: kvcore.EngineConfig(max_model_len=2**32),
        KvcoreValueError,
        "EngineConfig.max_model_len must be a token count in [1, 2**32), got "
        "4,294,967,296",
    ),
    # -- blocks ------------------------------------------------------------------
    Case(
        "a 2-byte page in 256 MiB",
        "plan_kv_cache(..., 2**28)",
        plan_tiny_pages(),
        PlanError,
        "268,435,456 bytes of memory in blocks of 2 bytes make 134,217,728 blocks, "
        "more than kvcore's limit of 16,777,216 (MAX_NUM_BLOCKS): use larger "
        "blocks (--block-size; blocks of at least 16 bytes), set "
        "num_gpu_blocks_override to at most 16,777,216, or give the cache less memory",
    ),
    Case(
        "an override past the block limit",
        "num_gpu_blocks_override=2**25",
        plan_tiny_pages(override=2**25),
        PlanError,
        "num_gpu_blocks_override=33,554,432 make 33,554,432 blocks, more than "
        "kvcore's limit",
    ),
    Case(
        "a block pool past the block limit",
        "BlockPool(2**30, ...)",
        lambda tmp: BlockPool(2**30, enable_caching=True, hash_block_size=16),
        KvcoreValueError,
        "num_blocks is 1,073,741,824, more than kvcore's limit of 16,777,216 "
        "(MAX_NUM_BLOCKS), checked before the per-block state is built",
    ),
    # -- messages ----------------------------------------------------------------
    Case(
        "a 2,000,000-item list field",
        '"block_size": [0, 0, ...]',
        model_mapping(WIDE),
        SerializationError,
        "expected int, got [0, 0, 0, 0, 0, 0, 0, 0, ...] (list)",
    ),
    Case(
        "a 2,000,000-character kind name",
        '"kind": "xxx...x"',
        model_mapping({"layers": {"a": {"kind": "x" * 2_000_000}}}),
        UnknownKindError,
        "no cache kind named 'xxxxxxxxxx",
    ),
    Case(
        "a 100,000-character unknown field",
        '"xxx...x": 1',
        model_mapping({"layers": {"a": {**LAYER, "x" * 100_000: 1}}}),
        SerializationError,
        "invalid 'full_attention' spec: unknown field(s) ['xxxxxxxx",
    ),
    Case(
        "a 2,000,000-character layer name",
        '"layers": {"yyy...y": {...}}',
        model_mapping({"layers": {"y" * 2_000_000: LAYER}}),
        SerializationError,
        "a layer name must be a non-empty string of at most 256 characters, got 'yyyy",
    ),
    Case(
        "two layers of one tensor on the same bytes",
        '"layers": ["a", "b"], "layer_stride": 0',
        one_tensor_config(layer_stride=0),
        UnsafePlanError,
        "$.kv_cache_tensors[0]: the pages of layers ['a', 'b'] overlap one another "
        "(layer stride 0",
    ),
    Case(
        "blocks half a page apart",
        '"block_stride": 256',
        one_tensor_config(block_stride=256),
        UnsafePlanError,
        "$.kv_cache_tensors[0]: the pages of layers ['a', 'b'] overlap one another "
        "(layer stride 512, block stride 256",
    ),
    Case(
        "a workload of a billion requests",
        "synthetic_workload(10**9)",
        lambda tmp: synthetic_workload(10**9),
        KvcoreValueError,
        "num_requests 1,000,000,000 is more than kvcore's limit of 1,000,000",
    ),
    Case(
        "shared prefixes of a billion tokens",
        "synthetic_workload(8, shared_prefixes=1000, prefix_len=10**6)",
        lambda tmp: synthetic_workload(8, shared_prefixes=1000, prefix_len=10**6),
        KvcoreValueError,
        "1,000 shared prefixes of 1,000,000 tokens are more than kvcore's limit",
    ),
    Case(
        "a request count that is no int",
        "manager.allocate_slots(request, 1.5)",
        lambda tmp: _coordinator_call("mgr.allocate_slots(req, 1.5)"),
        KvcoreTypeError,
        "allocate_slots for request 'a' asks for 1.5 new tokens",
    ),
    Case(
        "freeing something that is no request",
        "manager.free(5)",
        lambda tmp: _coordinator_call("mgr.free(5)"),
        KvcoreTypeError,
        "expected a kvcore.coordinator.Request, got int",
    ),
    Case(
        "caching a negative token count",
        "manager.cache_blocks(request, -4)",
        lambda tmp: _coordinator_call("mgr.cache_blocks(req, -4)"),
        KvcoreValueError,
        "num_computed_tokens must be a non-negative int number of tokens, got -4",
    ),
    Case(
        "caching tokens no step was given slots for",
        "manager.cache_blocks(request, 8) after a 4-token step",
        lambda tmp: _coordinator_call(
            "(mgr.allocate_slots(req, 4), mgr.cache_blocks(req, 8))"
        ),
        InvalidRequestError,
        "num_computed_tokens=8 is past the 4 tokens its steps have been given slots",
    ),
    Case(
        "truncating a hit to a negative length",
        "manager.truncate_computed_blocks(hit, -4)",
        lambda tmp: _coordinator_call("mgr.truncate_computed_blocks(hit, -4)"),
        KvcoreValueError,
        "truncate_computed_blocks: num_computed_tokens must be a non-negative int",
    ),
    Case(
        "bytes hashed as a prompt",
        'BlockHasher(4, "sha256").hash_prompt(b"abcdefgh")',
        lambda tmp: BlockHasher(4, "sha256").hash_prompt(b"abcdefgh"),  # type: ignore[arg-type]
        KvcoreTypeError,
        "BlockHasher.hash_prompt must be a list or tuple of token ids, got bytes",
    ),
    Case(
        "a shipped pipeline plan that is not JSON",
        'load_pipeline_plan("{")',
        lambda tmp: load_pipeline_plan("{", REGISTRY),
        SerializationError,
        "the shipped KV cache plan is not valid JSON",
    ),
    Case(
        "a rank that sends garbage",
        "checked_records([b'\\xff'])",
        lambda tmp: checked_records([b"\xff"], REGISTRY),
        PlanError,
        "rank 0 sent a plan record that is not a valid kvcore plan",
    ),
    Case(
        "an event publisher queue of zero batches",
        'ZmqEventPublisher("inproc://x", max_queued_batches=0)',
        lambda tmp: ZmqEventPublisher("inproc://x", max_queued_batches=0),
        KvcoreValueError,
        "max_queued_batches must be between 1 and",
    ),
    Case(
        "a stride past what torch addresses",
        '"layer_stride": 9223372036854775808',
        worker_config(tensor1_layer_stride=2**63),
        SerializationError,
        "$.kv_cache_tensors[1].layer_stride is 9,223,372,036,854,775,808",
    ),
    Case(
        "a pool bound from something that is not a plan",
        'KVCachePool("not a plan")',
        lambda tmp: KVCachePool("not a plan"),  # type: ignore[arg-type]
        KvcoreTypeError,
        "a KV cache pool is bound from a KVCacheConfig",
    ),
    Case(
        "a pool on a device torch does not know",
        'KVCachePool(plan, "tpu")',
        lambda tmp: KVCachePool(
            load_config(json.dumps(small_plan_json()), REGISTRY), "tpu"
        ),
        KvcoreValueError,
        "'tpu' is not a torch device",
    ),
    Case(
        "a pool on a device that is not a device",
        "KVCachePool(plan, 5)",
        lambda tmp: KVCachePool(
            load_config(json.dumps(small_plan_json()), REGISTRY), 5
        ),  # type: ignore[arg-type]
        KvcoreTypeError,
        "device must be a torch.device or a device string",
    ),
    Case(
        "a layer in two groups of a worker config",
        'layer "a" listed in a second group',
        lambda tmp: load_config(
            json.dumps(
                {
                    **(data := small_plan_json()),
                    "kv_cache_groups": [
                        *data["kv_cache_groups"],
                        {**data["kv_cache_groups"][0], "layer_names": ["a"]},
                    ],
                }
            ),
            REGISTRY,
        ),
        SerializationError,
        "$.kv_cache_groups[1].layer_names: layer 'a' is also in group 0",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.description for c in CASES])
def test_hostile_input_is_refused(case: Case, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's has_cuda deprecation
        with pytest.raises(case.error) as info:
            case.run(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, kvcore.KvcoreError)
    assert case.fragment in message
    assert "\n" not in message
    assert message.isprintable()
    assert len(message) < 1000


# -- through the command line ------------------------------------------------

CLI_FILES = {
    "latin1.json": '{"name": "caf\xe9", "layers": {}}'.encode("latin-1"),
    "deep.json": DEEP.encode(),
    "dup.json": b'{"layers": {"a": {}, "a": {}}}',
    "nan.json": b'{"layers": {"a": {"block_size": NaN}}}',
    "esc.json": json.dumps({"name": "m\x1b[2J", "layers": {"a": LAYER}}).encode(),
    "dtype.json": json.dumps({"layers": {"a": layer(dtype="_dynamo")}}).encode(),
    "name.json": json.dumps({"name": 123, "layers": {"a": LAYER}}).encode(),
}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("latin1.json", "latin1.json is not UTF-8 text (byte 13 is 0xe9)"),
        ("deep.json", "deep.json: the JSON is nested deeper than 32 levels"),
        ("dup.json", "dup.json: key 'a' appears twice in the object at $.layers"),
        ("nan.json", "nan.json is not valid JSON: NaN is not a JSON number"),
        ("esc.json", "the model 'name' 'm\\x1b[2J' holds control characters"),
        ("dtype.json", "'_dynamo' is not a torch dtype name"),
        (
            "name.json",
            "the model 'name' must be a non-empty string of at most 256 characters, got 123",
        ),
        ("/dev/zero", "/dev/zero is not a regular file"),
    ],
)
def test_cli_refuses_hostile_files_in_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    expected: str,
) -> None:
    for file, body in CLI_FILES.items():
        (tmp_path / file).write_bytes(body)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", name]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcore: error: ")
    assert expected in lines[0]
    assert "\x1b" not in err


def test_cli_refuses_a_fifo_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.json")
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore.tools.cli", "plan", "fifo.json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "kvcore: error: fifo.json is not a regular file (a FIFO, device or "
        "socket); give a model file (a .json file)\n"
    )


def test_the_duplicate_keys_repro_is_refused() -> None:
    path = REPROS / "duplicate_keys.json"
    if not path.exists():
        pytest.skip("the shared repro files are not here")
    with pytest.raises(SerializationError, match=r"key 'l\.0' appears twice"):
        load_model_file(path, REGISTRY)


def test_a_dtype_name_imports_nothing() -> None:
    # In a fresh process: refusing "_dynamo" must not import torch._dynamo.
    code = (
        "import sys, kvcore\n"
        "from kvcore.serialize import load_model_file\n"
        "try:\n"
        "    load_model_file({'layers': {'a': {'kind': 'mla', 'block_size': 16,"
        " 'num_kv_heads': 1, 'head_size': 8, 'dtype': '_dynamo'}}})\n"
        "except kvcore.SerializationError:\n"
        "    print('torch._dynamo' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout == "False\n", proc.stderr


def test_good_inputs_still_load(tmp_path: Path) -> None:
    """The strict readers accept what kvcore writes."""
    assert model_bytes(GOOD)(tmp_path) == load_model_file(json.loads(GOOD), REGISTRY)
    config = worker_config()(tmp_path)
    assert isinstance(config, kvcore.KVCacheConfig)
    assert [t.layers for t in config.kv_cache_tensors] == [["a"], ["b"]]
    for name in zoo.names():
        load_model_file(zoo.path(name), REGISTRY)


def test_one_token_limit() -> None:
    assert TOKEN_ID_LIMIT == HASHED_TOKEN_LIMIT == 2**32
    assert MAX_NUM_BLOCKS == 2**24


# -- the docs table ----------------------------------------------------------

HEADER = """\
# Bad input

kvcore refuses hostile or broken input with one error before it allocates
anything: a subclass of `kvcore.KvcoreError` (and of the builtin
`ValueError`, `TypeError` or `KeyError` that fits), one line that names the
file, field or layer, the rule broken and the fix.  The command line prints
it as `kvcore: error: ...` and exits with status 2.

The limits live in `kvcore.limits` (the simulator's and the command line's
in `kvcore.tools.limits`):

| limit | value |
|---|---|
| `MAX_JSON_FILE_BYTES` | 16 MiB: the largest model file or plan read |
| `MAX_JSON_DEPTH` | 32 levels of nested objects and arrays |
| `MAX_JSON_INT_DIGITS` | 20 digits in one integer literal |
| `MAX_NUM_BLOCKS` | 2**24 blocks in one pool (planner and block pool) |
| `TOKEN_ID_LIMIT` | token ids and counts are ints in `[0, 2**32)`, never bools |
| `MAX_NAME_CHARS` | 256 characters in a model, layer or kind name |
| `MAX_BYTE_OFFSET` | 2**60: the largest byte size, offset or stride of a plan |
| `MAX_NUM_LAYERS` | 100,000 layers in a model configuration |
| `MAX_WORKLOAD_REQUESTS` | 10**6 requests in one simulated workload |
| `MAX_WORKLOAD_PREFIX_TOKENS` | 2**26 tokens of shared prefixes in a synthetic workload |
| `MAX_TRACE_*` | tokens per request and in all, line length, hash ids and block length of a replayed trace |
| `HUB_FETCH_TIMEOUT_S` | 30 s for a hub to deliver a config.json, retries included |
| `MAX_ECHO_CHARS` | 200 characters of a value quoted in a message |

A plan is checked the same way wherever it enters a process (a config file,
a shipped pipeline plan, another rank's record, the pool that binds it): a
proof by arithmetic that no two pages that may be live at once share a byte
(two groups share a block's bytes only within one block id), every layer
placed once, inside its pool; another rank's fingerprint is recomputed, never
trusted.  A cache manager that calls back into the `KVCacheManager` from
inside a step is refused (`ReentrantCallError`) and the step undone.  The
ZeroMQ event publisher queues at most `max_queued_batches` batches for a
subscriber that does not read, counting what it drops.

JSON is read strictly (model files and worker configs alike): a key given
twice in one object, `NaN`, `Infinity` and numbers that overflow a float are
refused, with the JSON path.  Files are read only when they are regular
files of UTF-8 text.  Names of shipped models are only the names
`kvcore.tools.zoo.names()` lists; a path is a path when it ends in `.json`, holds
a separator or names an existing file.  Dtype names come from a fixed table
(`kvcore.spec.CACHE_ELEMENT_DTYPES` and the engine aliases).  Values quoted
in messages are abbreviated and control characters escaped.

Every row below is an input `tests/test_hostile_input.py` tries; this page
is generated from that test (`python tests/test_hostile_input.py --write`)
and checked against it.

"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The page: the header and one row per case."""
    rows = [
        "| input | example | error | the message says |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        rows.append(
            f"| {_cell(case.description)} | `{_cell(case.shown)}` | "
            f"`{case.error.__name__}` | `{_cell(case.fragment)}` |"
        )
    return HEADER + "\n".join(rows) + "\n"


def test_docs_table_is_the_test_table() -> None:
    assert DOCS.read_text() == render(), (
        "docs/bad-input.md is stale: run python tests/test_hostile_input.py --write"
    )


def test_docs_page_is_in_the_toctree() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    assert "\nbad-input\n" in index
    assert "(bad-input.md)" in index


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        DOCS.write_text(render())
    else:
        sys.stdout.write(render())
