"""Check the ``vllm`` policy against vLLM 0.33's own planner on random models.

Random model files (mixes of full, sliding-window, chunked-local, MLA,
sliding-window MLA, Mamba and circular-buffer layers, with random block
sizes, heads, windows, memory, contexts, batch sizes and layouts) are
planned twice: by vLLM's own ``get_global_kv_cache_groups``,
``get_kv_cache_configs`` and ``get_kv_cache_capacity`` (the figures its log
prints), run in vLLM's virtual environment, and by kvcore's ``vllm`` policy.
The two figures must be equal (tokens exactly, concurrency to 1e-9), and
vLLM must refuse exactly the models the policy refuses::

    python benchmarks/vllm_agreement.py --vllm-python ~/.cache/vllm-baseline/bin/python

Without ``--vllm-python`` it checks the policy against the figures stored in a
``--cases`` file written by an earlier run (``--write-cases``).

Mamba hybrids are drawn with the attention block already at vLLM's hybrid
alignment and the states padded to the attention page, as vLLM's platform
hands them to the planner; the alignment step itself is checked on the shipped
Mamba models against ``capacity.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

DTYPES = {"bfloat16": 2, "float32": 4, "uint8": 1}


def _attention(rng: random.Random, kind: str) -> dict[str, Any]:
    if kind in ("mla", "sliding_window_mla"):
        layer: dict[str, Any] = {
            "kind": kind,
            "block_size": rng.choice([64, 128, 256]),
            "num_kv_heads": 1,
            "head_size": rng.choice([576, 584, 132, 656]),
            "dtype": rng.choice(["bfloat16", "uint8"]),
        }
        if rng.random() < 0.3:
            layer["alignment"] = 576
        if kind == "mla" and rng.random() < 0.3:
            layer["tokens_per_state"] = rng.choice([4, 64])
            layer["block_size"] = 256
    else:
        layer = {
            "kind": kind,
            "block_size": rng.choice([16, 16, 32, 64]),
            "num_kv_heads": rng.choice([1, 2, 4, 8, 16]),
            "head_size": rng.choice([64, 128, 256]),
            "dtype": rng.choice(["bfloat16", "bfloat16", "uint8"]),
        }
    if kind.startswith("sliding_window"):
        layer["sliding_window"] = rng.choice([128, 512, 1024, 4096, 8192])
    if kind == "chunked_local_attention":
        layer["attention_chunk_size"] = rng.choice([2048, 8192])
    if kind == "circular_buffer":
        layer.update(
            block_size=rng.choice([8, 128]),
            num_kv_heads=1,
            head_size=rng.choice([512, 1024, 2048]),
            head_size_v=0,
            dtype="float32",
        )
    return layer


def random_model(rng: random.Random) -> dict[str, Any]:
    """A random model file, with the settings to plan it with."""
    family = rng.choice(["gqa", "gqa", "mla", "mamba", "mixed"])
    kinds: list[str]
    if family == "gqa":
        pool = ["full_attention", "sliding_window", "chunked_local_attention"]
        kinds = rng.sample(pool, rng.randint(1, 2))
    elif family == "mla":
        kinds = rng.sample(
            ["mla", "sliding_window_mla", "circular_buffer", "sliding_window"],
            rng.randint(1, 3),
        )
        kinds = kinds if "mla" in kinds else ["mla", *kinds]
    elif family == "mamba":
        kinds = ["full_attention", "mamba"]
    else:
        kinds = rng.sample(
            ["full_attention", "sliding_window", "mla", "circular_buffer"], 2
        )
    specs = {k: _attention(rng, k) for k in kinds if k != "mamba"}
    # A second full-attention spec (another head count) now and then; not
    # beside Mamba, where vLLM gives every attention layer one block size.
    if "full_attention" in specs and "mamba" not in kinds and rng.random() < 0.2:
        other = dict(specs["full_attention"], num_kv_heads=rng.choice([1, 4, 32]))
        specs["full_attention_2"] = other
    counts = {k: rng.randint(1, 40) for k in specs}
    if "mamba" in kinds:
        attn = specs["full_attention"]
        per_token = attn["num_kv_heads"] * attn["head_size"] * 2
        per_token *= DTYPES[attn["dtype"]]
        heads = rng.choice([8, 16, 32])
        conv, dim = rng.choice([2048, 4096, 8192]), rng.choice([16, 64, 128])
        shapes = [[3, conv], [heads, 64, dim]]
        state = (3 * conv + heads * 64 * dim) * 2
        aligned = 16 * -(-state // (16 * per_token))
        attn["block_size"] = max(attn["block_size"], aligned)
        specs["mamba"] = {
            "kind": "mamba",
            "block_size": attn["block_size"],
            "shapes": shapes,
            "dtypes": ["bfloat16", "bfloat16"],
        }
        counts["mamba"] = rng.randint(3, 40)
    layers = {}
    order = [k for k, n in counts.items() for _ in range(n)]
    rng.shuffle(order)
    for i, key in enumerate(order):
        layers[f"model.layers.{i}.{key}"] = specs[key]
    return {
        "name": f"random-{rng.getrandbits(32):08x}",
        "layers": layers,
        "memory": rng.randint(1, 80) * 2**30 + rng.randint(0, 2**20),
        "context": rng.choice([1024, 4096, 10000, 32768, 131072]),
        "max_num_batched_tokens": rng.choice([2048, 8192, 16384]),
        "block_outermost": rng.random() < 0.3,
        "mamba_cache_mode": rng.choice(["none", "align"]),
    }


# ---------------------------------------------------------------------------
# vLLM's side: run in vLLM's virtual environment
# ---------------------------------------------------------------------------


def _vllm_specs(layers: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm.v1 import kv_cache_interface as ki

    dtypes = {
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "uint8": torch.uint8,
    }
    attn_page = None
    for layer in layers.values():
        if layer["kind"] == "full_attention":
            attn_page = (
                layer["block_size"] * layer["num_kv_heads"] * layer["head_size"] * 2
            ) * DTYPES[layer["dtype"]]
            break
    out = {}
    for name, layer in layers.items():
        kind = layer["kind"]
        common: dict[str, Any] = {"block_size": layer["block_size"]}
        if kind == "mamba":
            state = sum(
                math.prod(s) * DTYPES[d]
                for s, d in zip(layer["shapes"], layer["dtypes"], strict=True)
            )
            out[name] = ki.MambaSpec(
                shapes=tuple(tuple(s) for s in layer["shapes"]),
                dtypes=tuple(dtypes[d] for d in layer["dtypes"]),
                page_size_padded=attn_page if attn_page != state else None,
                **common,
            )
            continue
        common.update(
            num_kv_heads=layer["num_kv_heads"],
            head_size=layer["head_size"],
            dtype=dtypes[layer["dtype"]],
        )
        if kind == "full_attention":
            out[name] = ki.FullAttentionSpec(**common)
        elif kind == "sliding_window":
            out[name] = ki.SlidingWindowSpec(
                sliding_window=layer["sliding_window"], **common
            )
        elif kind == "chunked_local_attention":
            out[name] = ki.ChunkedLocalAttentionSpec(
                attention_chunk_size=layer["attention_chunk_size"], **common
            )
        elif kind == "circular_buffer":
            out[name] = ki.CircularBufferSpec(head_size_v=0, **common)
        elif kind == "mla":
            out[name] = ki.MLAAttentionSpec(
                alignment=layer.get("alignment"),
                tokens_per_state=layer.get("tokens_per_state", 1),
                **common,
            )
        elif kind == "sliding_window_mla":
            out[name] = ki.SlidingWindowMLASpec(
                sliding_window=layer["sliding_window"],
                head_size_v=0,
                alignment=layer.get("alignment"),
                **common,
            )
        else:
            raise ValueError(kind)
    return out


def _vllm_config(case: dict[str, Any]) -> Any:
    from types import SimpleNamespace

    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout.BLNHC if case["block_outermost"] else KVCacheLayout.LBNHC
    cache = SimpleNamespace(
        num_gpu_blocks_override=None,
        mamba_cache_mode=case.get("mamba_cache_mode", "none"),
        prefix_cache_retention_interval=None,
        get_resolved_kv_cache_layout=lambda: layout,
        kv_cache_size_tokens=None,
        kv_cache_max_concurrency=None,
    )
    return SimpleNamespace(
        cache_config=cache,
        model_config=SimpleNamespace(
            max_model_len=case["context"],
            original_max_model_len=case["context"],
            supports_kv_cache_grouping=False,
        ),
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=False,
            max_num_batched_tokens=case["max_num_batched_tokens"],
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        num_prefill_lookahead_tokens=0,
        max_in_flight_tokens=2 * case["max_num_batched_tokens"],
        device_config=SimpleNamespace(device_type="cuda"),
    )


def vllm_figures(case: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.33's own figures for one case, or its refusal."""
    from vllm.v1.core import kv_cache_config_builder as builders
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core import kv_cache_utils as utils

    builders.get_kv_cache_config_builder = lambda _cfg: (
        planning.DefaultKVCacheConfigBuilder()
    )
    config = _vllm_config(case)
    specs = _vllm_specs(case["layers"])
    try:
        groups = planning.get_global_kv_cache_groups(config, [dict(specs)])
        configs = planning.get_kv_cache_configs(
            config, [specs], [case["memory"]], groups
        )
        scheduler = utils.generate_scheduler_kv_cache_config(configs)
        tokens, concurrency = utils.get_kv_cache_capacity(config, scheduler)
    except (ValueError, NotImplementedError, AssertionError) as exc:
        return {"refusal": f"{type(exc).__name__}: {exc}"[:200]}
    return {"tokens": tokens, "concurrency": concurrency}


# ---------------------------------------------------------------------------
# kvcore's side
# ---------------------------------------------------------------------------


def policy_figures(case: dict[str, Any]) -> dict[str, Any]:
    from kvcore.registry import default_registry
    from kvcore.serialize import load_model_file
    from kvcore_vllm import in_flight_tokens, vllm_estimate

    model = load_model_file(
        {"name": case["name"], "layers": case["layers"]}, default_registry()
    )
    estimate = vllm_estimate(
        model.layers,
        case["memory"],
        [case["context"]],
        in_flight=in_flight_tokens(case["max_num_batched_tokens"]),
        mamba_cache_mode=case.get("mamba_cache_mode", "none"),
        block_outermost=case["block_outermost"],
    )
    if estimate.refusal is not None:
        return {"refusal": estimate.refusal}
    figure = estimate.figures[0]
    return {"tokens": figure.tokens, "concurrency": figure.concurrency}


def zoo_cases() -> list[dict[str, Any]]:
    """The shipped model files at 64 GiB and three contexts, in both of
    vLLM's layouts, as ``vllm serve`` runs them (8,192-token batches, async
    scheduling).  A Mamba hybrid reaches vLLM with its attention block at the
    hybrid alignment (in multiples of 16 tokens, until an attention page
    holds a state), as vLLM's platform sets it before planning."""
    from kvcore.tools import zoo

    cases = []
    for name in zoo.names():
        layers = json.loads(zoo.path(name).read_text())["layers"]
        states = [x for x in layers.values() if x["kind"] == "mamba"]
        if states:
            attn = next(x for x in layers.values() if x["kind"] == "full_attention")
            per_token = attn["num_kv_heads"] * attn["head_size"] * 2
            per_token *= DTYPES[attn["dtype"]]
            state = max(
                sum(
                    math.prod(s) * DTYPES[d]
                    for s, d in zip(x["shapes"], x["dtypes"], strict=True)
                )
                for x in states
            )
            block = max(attn["block_size"], 16 * -(-state // (16 * per_token)))
            layers = {
                k: dict(v, block_size=block) if v["kind"] == "full_attention" else v
                for k, v in layers.items()
            }
        for outer in (False, True):
            for context in (4096, 32768, 131072):
                cases.append(
                    {
                        "name": f"{name} {'BLNHC' if outer else 'LBNHC'} {context}",
                        "layers": layers,
                        "memory": 64 * 2**30,
                        "context": context,
                        "max_num_batched_tokens": 8192,
                        "block_outermost": outer,
                    }
                )
    return cases


def compact(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Cases with each distinct layer spec stored once (a stored file's form)."""
    specs: list[dict[str, Any]] = []
    keys: dict[str, int] = {}
    out = []
    for case in cases:
        order = []
        for layer in case["layers"].values():
            key = json.dumps(layer, sort_keys=True)
            if key not in keys:
                keys[key] = len(specs)
                specs.append(layer)
            order.append(keys[key])
        out.append({**case, "layers": order})
    return {"specs": specs, "cases": out}


def expand(data: Any) -> list[dict[str, Any]]:
    """:func:`compact`'s inverse (a plain list passes through)."""
    if isinstance(data, list):
        return data
    specs = data["specs"]
    return [
        {
            **case,
            "layers": {
                f"model.layers.{i}.l{k}": specs[k] for i, k in enumerate(case["layers"])
            },
        }
        for case in data["cases"]
    ]


def _show(figures: dict[str, Any]) -> str:
    if "refusal" in figures:
        return "refused"
    return f"{figures['tokens']:,} tokens, {figures['concurrency']:.4f}x"


def agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if "refusal" in a or "refusal" in b:
        return ("refusal" in a) == ("refusal" in b)
    return a["tokens"] == b["tokens"] and abs(
        a["concurrency"] - b["concurrency"]
    ) <= 1e-9 * max(1.0, a["concurrency"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of a venv with vLLM 0.33")
    parser.add_argument("--cases", type=Path, help="cases with vLLM's figures")
    parser.add_argument("--write-cases", type=Path)
    parser.add_argument("-n", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--zoo", action="store_true", help="the shipped models, not random ones"
    )
    parser.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.emit:
        cases = json.load(sys.stdin)
        for case in cases:
            case["vllm"] = vllm_figures(case)
        json.dump(cases, sys.stdout)
        return 0
    if args.cases is not None:
        cases = expand(json.loads(args.cases.read_text()))
    elif args.vllm_python:
        rng = random.Random(args.seed)
        draw = (
            zoo_cases
            if args.zoo
            else lambda: [random_model(rng) for _ in range(args.n)]
        )
        cases = draw()
        run = subprocess.run(
            [args.vllm_python, __file__, "--emit"],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            check=True,
        )
        cases = json.loads(run.stdout)
    else:
        parser.error("give --vllm-python (vLLM 0.33's venv) or --cases")
    if args.write_cases is not None:
        args.write_cases.write_text(json.dumps(compact(cases), separators=(",", ":")))
    bad = 0
    refused = 0
    for case in cases:
        ours = policy_figures(case)
        refused += "refusal" in case["vllm"]
        ok = agree(case["vllm"], ours)
        bad += not ok
        if args.zoo:
            print(
                f"{'ok' if ok else 'DISAGREE'} | {case['name']} | vLLM "
                f"{_show(case['vllm'])} | policy {_show(ours)}"
            )
        elif not ok:
            print(f"DISAGREE {case['name']}: vLLM {case['vllm']} policy {ours}")
    print(
        f"{len(cases) - bad} of {len(cases)} models agree ({refused} refused by vLLM)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
