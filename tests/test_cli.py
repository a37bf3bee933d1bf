"""The ``kvcore`` command line, run in this process through
:func:`kvcore.tools.cli.main` (the function the installed console script
calls) with the environment a user's shell gives it; a few tests run the
installed script itself in a subprocess.  Numbers are worked by hand in the
comments."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import kvcore
from kvcore.serialize import dump_config, load_config
from kvcore.tools import zoo
from kvcore.tools.cli import main
from kvcore.tools.cli.document import SCHEMA_VERSION, load_schema

GIB = 2**30


def _kvcore() -> list[str]:
    script = shutil.which("kvcore")
    return [script] if script else [sys.executable, "-m", "kvcore.tools.cli"]


@dataclass(frozen=True)
class Run:
    """What one ``kvcore`` command did: its exit status and its output."""

    returncode: int
    stdout: str
    stderr: str


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Run:
    """``kvcore ARGS`` in this process, as the installed script runs it: 160
    columns and ``env`` on top of this process's environment, ``cwd`` the
    working directory (all restored after), stdout and stderr captured, and
    the exit status argparse raises (``--version``, a usage error) returned
    like any other.  No default registry is built yet, as in a new process
    (a plan's notes consult one only if it is)."""
    kvcore.default_registry.cache_clear()
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"COLUMNS": "160", **(env or {})}.items():
            mp.setenv(name, value)
        if cwd is not None:
            mp.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(bool(exc.code))
    return Run(code, out.getvalue(), err.getvalue())


def run_script(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``kvcore ARGS`` through the installed console script, in a new
    process, with the environment :func:`run` gives it."""
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run(
        [*_kvcore(), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
        check=False,
    )


def plan_json(*args: str) -> dict[str, Any]:
    proc = run("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    jsonschema.validate(doc, load_schema())
    return doc


# -- every shipped file, the default, and the JSON document ------------------


def test_default_plans_deepseek_v4_flash() -> None:
    proc = run("plan")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("DeepSeek-V4-Flash in 8.0 GiB of KV cache: ")
    assert "requests of 32K tokens (limit " in first
    assert "stride " in proc.stdout
    assert "cache groups" in proc.stdout
    assert "scratch" in proc.stdout  # the compressor rings serve no prefix hits


@pytest.mark.parametrize("name", zoo.names())
def test_every_shipped_file_plans_and_matches_the_schema(
    name: str, zoo_registry: kvcore.KindRegistry
) -> None:
    doc = plan_json(name, "--memory", "16GiB", "--context", "4K,32K")
    assert doc["schema"] == SCHEMA_VERSION
    assert [row["context"] for row in doc["capacity"]] == [4096, 32768]
    # The plan member is the plan itself: load_config reads it back whole.
    registry = zoo_registry
    plan = load_config(json.dumps(doc["plan"]), registry)
    assert plan.num_blocks == doc["summary"]["num_blocks"]
    assert plan.bytes_per_block == doc["summary"]["bytes_per_block"]
    assert json.loads(dump_config(plan, registry)) == doc["plan"]
    # Every layer of the file is in exactly one group of the summary.
    layers = [n for g in doc["summary"]["groups"] for n in g["layers"]]
    assert sorted(layers) == sorted(json.loads(zoo.path(name).read_text())["layers"])
    for row in doc["capacity"]:
        assert row["tokens"] == row["concurrency"] * row["context"]
        assert row["concurrency"] <= row["physical_limit"] + 1e-9
        assert doc["verdict"].startswith(doc["model"]["name"])


def test_the_schema_refuses_a_document_missing_capacity() -> None:
    doc = plan_json("llama-3-1-8b", "--memory", "1GiB")
    del doc["capacity"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, load_schema())


# -- hand-worked numbers -----------------------------------------------------


def test_llama_uniform_hand_worked() -> None:
    # Llama-3.1-8B: 32 layers, 8 KV heads x 128, bf16, 16-token blocks.
    # A page is 16 * 8 * 128 * 2 (K, V) * 2 B = 64 KiB; one group of 32
    # layers makes a 2 MiB stride; 40 GiB hold 20480 blocks.  A 32k request
    # holds 2048 blocks; the null block leaves 20479, so 1 + (20479 - 2048)
    # // 2048 = 9 requests.  The limit: 32 * 8 * 128 * 2 * 2 = 128 KiB a
    # token, 40 GiB / (32768 * 128 KiB) = 10.0 requests.  The plan packs
    # exactly (unreserved 20480 / 2048 = 10.0), so its ratio is 1.00.
    doc = plan_json("llama-3-1-8b", "--memory", "40GiB", "--context", "32K")
    s, row = doc["summary"], doc["capacity"][0]
    assert (s["bytes_per_block"], s["num_blocks"]) == (2 * 2**20, 20480)
    assert [g["block_size"] for g in s["groups"]] == [16]
    assert (row["blocks_per_request"], row["concurrency"]) == (2048, 9)
    assert row["physical_limit"] == pytest.approx(10.0)
    assert doc["verdict"] == (
        "Llama-3.1-8B in 40.0 GiB of KV cache: 9 requests of 32K tokens "
        "(limit 10, 1.00)"
    )


@pytest.mark.parametrize(
    ("extra", "stride", "requests", "limit"),
    [
        # TP 2: 4 heads a rank, a 1 MiB stride, 40960 blocks, 2048 a request:
        # 1 + (40959 - 2048) // 2048 = 20 - 1 = 19; limit 20.
        (["--tp", "2"], 2**20, 19, 20.0),
        # fp8 halves every page the same way.
        (["--kv-cache-dtype", "fp8"], 2**20, 19, 20.0),
        # Both: 512 KiB, 81920 blocks: 1 + (81919 - 2048) // 2048 = 39; limit 40.
        (["--tp", "2", "--kv-cache-dtype", "fp8_e4m3"], 2**19, 39, 40.0),
        # TP 16 > 8 heads: each rank keeps 1 head (replicated): 256 KiB.
        (["--tp", "16"], 2**18, 79, 80.0),
    ],
)
def test_llama_tp_and_dtype_hand_worked(
    extra: list[str], stride: int, requests: int, limit: float
) -> None:
    doc = plan_json("llama-3-1-8b", "--memory", "40GiB", "--context", "32K", *extra)
    assert doc["summary"]["bytes_per_block"] == stride
    assert doc["summary"]["num_blocks"] == 40 * GIB // stride
    assert doc["capacity"][0]["concurrency"] == requests
    assert doc["capacity"][0]["physical_limit"] == pytest.approx(limit)
    if "16" in extra:
        assert any("replicated" in note for note in doc["notes"])


def test_gemma_hybrid_on_h100_tp2_fp8_hand_worked() -> None:
    # Gemma-3-27B: 52 sliding-window (1024) and 10 full layers, 16 KV heads x
    # 128.  TP 2 and fp8: 8 heads * 128 * 2 * 1 B = 2 KiB a token a layer.
    # Memory: 80 GiB * 0.9 = 77309411328 B, minus 55 GB / 2 = 27.5e9 B of
    # weights a rank: 49809411328 B.  The limit at 32k: full layers 10 *
    # 32768 * 2048 = 671088640 B, windows 52 * 64 blocks * 16 * 2048 =
    # 109051904 B, 780140544 B a request: 63.85 requests.
    # The plan: 13 window groups of 4 layers at 16 tokens (4 * 32 KiB) and 5
    # full groups of 2 layers grown to 32 tokens (2 * 64 KiB): a 128 KiB
    # stride, 49809411328 // 131072 = 380015 blocks.  A request holds 13 * 64
    # + 5 * 1024 = 5952; its prefill peak (an 8192-token chunk) 13 * 576 +
    # 5120 = 12608: 1 + (380014 - 12608) // 5952 = 62.
    doc = plan_json(
        "gemma-3-27b",
        "--gpu",
        "H100",
        "--tp",
        "2",
        "--kv-cache-dtype",
        "fp8",
        "--weights",
        "55GB",
        "--context",
        "32K",
    )
    assert doc["settings"]["memory"]["kv_cache_bytes"] == 49809411328
    s, row = doc["summary"], doc["capacity"][0]
    assert (s["bytes_per_block"], s["num_blocks"]) == (131072, 380015)
    kinds = sorted(
        (next(iter(g["kinds"].items())), g["block_size"]) for g in s["groups"]
    )
    assert (
        kinds == [(("full_attention", 2), 32)] * 5 + [(("sliding_window", 4), 16)] * 13
    )
    assert row["blocks_per_request"] == 5952
    assert row["prefill_peak_blocks"] == 12608
    assert row["concurrency"] == 62
    assert row["physical_limit"] == pytest.approx(49809411328 / 780140544)
    assert doc["verdict"] == (
        "Gemma-3-27B on 2x H100 80GB (TP 2), fp8 KV cache: 62 requests of 32K "
        "tokens (limit 63, 1.00)"
    )
    # 5952 blocks of 128 KiB are the limit's 780140544 B a request: the
    # packing reaches the limit (ratio 1.00); the reservation and rounding
    # to whole requests take 62 of 63.85.
    assert row["ratio"] == pytest.approx(1.0)


def test_memory_units_agree() -> None:
    a = plan_json("llama-3-1-8b", "--memory", "64GB")
    b = plan_json("llama-3-1-8b", "--memory", str(64 * 10**9))
    c = plan_json("llama-3-1-8b", "--memory", "0.0625TiB")
    assert a["settings"]["memory"]["kv_cache_bytes"] == 64 * 10**9
    assert b["summary"] == a["summary"]
    assert c["settings"]["memory"]["kv_cache_bytes"] == 64 * GIB


def test_gpu_utilization_and_file_weights(tmp_path: Path) -> None:
    data = json.loads(zoo.path("llama-3-1-8b").read_text())
    data["weights_bytes"] = 16 * 10**9
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(data))
    doc = plan_json(str(path), "--gpu", "a100-40gb", "--gpu-memory-utilization", "0.8")
    memory = doc["settings"]["memory"]
    assert memory["gpu"] == "A100 40GB"
    assert memory["kv_cache_bytes"] == int(40 * GIB * 0.8) - 16 * 10**9
    headroom = 40 * GIB - int(40 * GIB * 0.8)
    assert memory["headroom_bytes"] == headroom
    assert memory["weights_source"] == "model file"
    assert doc["notes"][0] == (
        "memory: A100 40GB (40.0 GiB) = 14.9 GiB weights (model file) + "
        "17.1 GiB KV cache + 8.0 GiB headroom (--gpu-memory-utilization 0.80)"
    )


def test_too_small_for_one_request_says_what_it_needs() -> None:
    # 4 GiB: a 128k Llama request needs 131072 / 16 + 1 = 8193 blocks of 2 MiB.
    proc = run("plan", "llama-3-1-8b", "--memory", "4GiB", "--context", "128K")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == (
        "Llama-3.1-8B in 4.0 GiB of KV cache: no request of 128K tokens fits in "
        "4.0 GiB; one needs 16.0 GiB"
    )
    doc = plan_json("llama-3-1-8b", "--memory", "4GiB", "--context", "128K")
    assert doc["capacity"][0]["fits"] is False
    assert doc["capacity"][0]["bytes_for_one_request"] == 8193 * 2 * 2**20


def test_human_report_shows_groups_stride_and_capacity() -> None:
    proc = run("plan", "jamba-1-5-mini", "--memory", "8GiB", "--context", "4K,32K")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # Jamba's 4 attention layers (8 KV heads x 128, bf16) in one group grown
    # to 96-token blocks: 4 * 96 * 8 * 128 * 2 * 2 = 1572864 bytes, the widest.
    assert "stride 1.5 MiB (1572864 B): group 6 is the widest" in out
    assert "model.layers.{4,12,...,28}.self_attn" in out
    assert "cacheable" in out
    for context in ("4K", "32K"):
        assert any(line.strip().startswith(context) for line in out.splitlines())


def test_compare_sets_policies_side_by_side() -> None:
    proc = run("compare", "gemma-3-27b", "--memory", "8GiB", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    by_policy = {p["policy"]: p for p in doc["policies"]}
    assert [p["policy"] for p in doc["policies"]] == ["vllm", "min_waste", "seed"]
    assert (
        by_policy["min_waste"]["capacity"][0]["concurrency"]
        >= by_policy["seed"]["capacity"][0]["concurrency"]
    )
    text = run("compare", "gemma-3-27b", "--memory", "8GiB")
    assert text.returncode == 0
    assert "min_waste" in text.stdout
    assert "seed" in text.stdout


def test_svg_has_one_span_per_layer(tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    svg = tmp_path / "plan.svg"
    png = tmp_path / "plan.png"
    proc = run(
        "plan", "gemma-3-27b", "--memory", "8GiB", "--svg", str(svg), "--png", str(png)
    )
    assert proc.returncode == 0, proc.stderr
    ids = [el.get("id", "") for el in ET.parse(svg).iter()]
    layers = json.loads(zoo.path("gemma-3-27b").read_text())["layers"]
    assert sorted(i.removeprefix("layer:") for i in ids if i.startswith("layer:")) == (
        sorted(layers)
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- errors: one line, the fix, exit status 2 --------------------------------


def _bad_files(tmp: Path) -> dict[str, Path]:
    files = {
        "binary": b"\xff\xfe\x00{",
        "kind": json.dumps({"layers": {"a": {"kind": "warp_drive", "block_size": 16}}}),
        "field": json.dumps(
            {
                "layers": {
                    "a": {
                        "kind": "full_attention",
                        "block_size": 16,
                        "num_kv_heads": 1,
                        "head_size": 64,
                        "dtype": "bfloat16",
                        "colour": 3,
                    }
                }
            }
        ),
        "json": "{not json",
        "list": "[1, 2]",
        "string": json.dumps(str(zoo.path("gemma-3-27b"))),
    }
    out = {}
    for name, body in files.items():
        path = tmp / f"{name}.json"
        if isinstance(body, bytes):
            path.write_bytes(body)
        else:
            path.write_text(body)
        out[name] = path
    return out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["missing.json"], "no model file missing.json; give an existing file"),
        (["."], "is a directory; give a model file"),
        (["@binary"], "is not UTF-8 text (byte 0 is 0xff)"),
        (["@json"], "is not valid JSON"),
        (["@kind"], "no cache kind named 'warp_drive'"),
        (["@field"], "unknown field(s) ['colour']"),
        (["no-such-model"], "no shipped model file 'no-such-model'; known: "),
        (["--memory", "80XB"], "unknown unit 'XB'"),
        (["--memory", "nan"], "got 'nan'"),
        (["--memory", "inf"], "got 'inf'"),
        (["--memory", "0"], "--memory must be positive"),
        (["--memory", "-5GiB"], "got '-5GiB'"),
        (["--gpu", "Z100"], "unknown GPU 'Z100' (did you mean 'H100 80GB' or "),
        (["--gpu", "H100", "--gpu-memory-utilization", "nan"], "must be in (0, 1]"),
        (["--gpu", "H100", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--gpu", "L4", "--weights", "40GB"], "leave no KV cache"),
        (["--weights", "1GB"], "give --gpu with it"),
        (["--context", "0"], "--context must be positive, got '0'"),
        (["--context", "4q"], "unknown unit 'q'"),
        (["--context", "4K,,8K"], "got '4K,,8K': an item between commas is empty"),
        (["--context", "4K,"], "got '4K,': an item between commas is empty"),
        (["--context", ","], "separated by commas (e.g. 4K,32K,128K), got ','"),
        (["--tp", "0"], "--tp takes a positive whole number"),
        (["--kv-cache-dtype", "fp7"], "unknown KV cache dtype 'fp7'"),
        (["@list"], "holds a JSON list; a model file is a JSON object"),
        (["@string"], "holds a JSON str"),
        (["--tp", "\u00b2"], "--tp takes a positive whole number"),
        (["--tp", "-inf"], "--tp takes a positive whole number"),
        (["--tp", "9" * 5000], "--tp takes a positive whole number"),
        (["--memory", "-.5GiB"], "got '-.5GiB'"),
        (["--memory", "9" * 400], "check the unit"),
        (["--context", "4000000000"], "more than 65,536 prefill steps"),
        (["--gpu-memory-utilization", "0.5"], "give --gpu with it"),
        (["--svg", "nodir/x.svg"], "cannot write --svg nodir/x.svg"),
        (["--svg", "out.png"], "--svg writes SVG; name a .svg file"),
        (["--png", ""], "--png writes PNG; name a .png file"),
        (["--policy", "junk"], "invalid choice: 'junk'"),
        (["--gpu", "H100", "--memory", "8GiB"], "not allowed with argument --gpu"),
    ],
)
def test_errors_are_one_line_with_exit_status_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    # In process (the console script calls this same main); the subprocess
    # test below runs some of them through the installed script.
    files = _bad_files(tmp_path)
    argv = [str(files[a[1:]]) if a.startswith("@") else a for a in args]
    if argv[0].startswith("--"):
        argv = ["llama-3-1-8b", *argv]
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own errors exit from inside
        code = int(exc.code or 0)
    assert code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcore: error: ")
    assert expected in lines[0]
    assert out == ""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["missing.json"], "no model file missing.json"),
        # The rest run in process above; here, in the slow run (a new
        # process each).
        pytest.param(["@binary"], "is not UTF-8 text", marks=pytest.mark.slow),
        pytest.param(["--memory", "nan"], "got 'nan'", marks=pytest.mark.slow),
        pytest.param(["--memory", "-5GiB"], "got '-5GiB'", marks=pytest.mark.slow),
    ],
)
def test_the_installed_script_reports_errors_the_same_way(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    files = _bad_files(tmp_path)
    argv = [str(files[a[1:]]) if a.startswith("@") else a for a in args]
    proc = run_script("plan", *argv, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvcore: error: ")
    assert expected in lines[0]
    assert proc.stdout == ""


def test_unknown_gpu_lists_the_table() -> None:
    proc = run("plan", "--gpu", "Z100")
    for name in (
        "H100 80GB",
        "H200 141GB",
        "B200 180GB",
        "A100 40GB",
        "L40S",
        "MI300X",
    ):
        assert name in proc.stderr


@pytest.mark.parametrize(
    "args",
    [("--debug", "plan", "--memory", "nan"), ("plan", "--memory", "nan", "--debug")],
)
def test_debug_shows_the_traceback(args: tuple[str, ...]) -> None:
    proc = run(*args)
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    assert "UnitError" in proc.stderr


def test_unwritable_output_is_one_line() -> None:
    # The installed script, so a failed flush at interpreter exit would show.
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [*_kvcore(), "plan", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvcore: error: cannot write the output: [Errno 28] No space left on device"
    ]


def test_version() -> None:
    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("kvcore ")


def test_the_limit_bounds_every_shipped_plan() -> None:
    # Grown blocks pay page padding once per larger block; the limit counts
    # pages without padding, so it stays a bound (DeepSeek-V4-Flash at 128k;
    # its 150 GiB of weights need two H200s).
    doc = plan_json(
        "deepseek-v4-flash", "--gpu", "h200", "--tp", "2", "--context", "64K,128K"
    )
    for row in doc["capacity"]:
        assert row["concurrency"] <= row["physical_limit_requests"]
        assert row["ratio"] <= 1.0


def test_a_dtype_no_layer_takes_is_not_claimed() -> None:
    doc = plan_json("deepseek-v4-flash", "--kv-cache-dtype", "fp8")
    assert "fp8" not in doc["verdict"]
    assert any("keep their own dtype" in note for note in doc["notes"])


#: Commands whose output a closed pipe cuts short.
CLOSED_PIPE_COMMANDS = ["plan --json", "plan", "simulate --requests 8"]


@pytest.mark.parametrize("command", CLOSED_PIPE_COMMANDS)
def test_a_closed_pipe_exits_quietly_in_process(command: str) -> None:
    # Nothing reads the pipe: the first write fails (EPIPE), and kvcore
    # exits 0 saying nothing, as under ``| head -c 1`` below.
    read, write = os.pipe()
    os.close(read)
    err = io.StringIO()
    with (
        open(write, "w") as out,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = main(command.split())
    assert code == 0
    assert err.getvalue() == ""


@pytest.mark.parametrize(
    "command",
    [
        "plan --json",
        # The others in process above; through the script in the slow run.
        *(pytest.param(c, marks=pytest.mark.slow) for c in CLOSED_PIPE_COMMANDS[1:]),
    ],
)
def test_a_closed_pipe_exits_quietly(command: str) -> None:
    script = f"{' '.join(_kvcore())} {command} | head -c 1"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert len(proc.stdout) == 1
    assert proc.stderr == ""
    assert proc.returncode == 0


# -- in-process: kinds, plugins and a plan error ------------------------------


def test_kinds_lists_every_builtin_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kinds", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["kind"] for r in rows} >= {
        "full_attention",
        "mla",
        "sliding_window",
        "sliding_window_mla",
        "mamba",
        "circular_buffer",
        "hisparse_hot",
        "chunked_local_attention",
        "cross_attention",
    }
    assert {r["plugin"] for r in rows if r["kind"] == "sliding_window_mla"} == {
        "sliding_window"
    }
    assert {r["plugin"] for r in rows if r["kind"] == "chunked_local_attention"} == {
        "chunked_local"
    }


def test_kinds_text_columns_fit_the_longest_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["kinds"]) == 0
    lines = capsys.readouterr().out.splitlines()
    chunked = next(line for line in lines if line.startswith("chunked_local_attention"))
    assert chunked.split() == [
        "chunked_local_attention",
        "ChunkedLocalAttentionSpec",
        "chunked_local",
    ]
    # Every row's spec and plugin start in the same columns.
    starts = {
        (line.index(line.split()[1]), line.rindex(line.split()[2])) for line in lines
    }
    assert len(starts) == 1


def test_llama_4_plans_with_nothing_else_installed() -> None:
    # Llama-4-Scout: 36 chunked-local (8192-token chunks) and 12 NoPE global
    # layers, 8 KV heads x 128, bf16.  Its chunked-local attention is a
    # built-in kind: no plugin is named and no entry point is loaded.
    env = {"KVCORE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = run("plan", "llama-4-scout-17b-16e", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    groups = json.loads(proc.stdout)["summary"]["groups"]
    assert sorted(next(iter(g["kinds"])) for g in groups) == [
        "chunked_local_attention"
    ] * 3 + ["full_attention"]


def test_the_example_plugin_loads_through_its_entry_point() -> None:
    # Installed beside kvcore (an entry point in group kvcore), the example
    # third-party kind is listed and its model file plans: Llama-3.1-8B with
    # 4 sinks and a 2048-token window holds 1 sink block and the 128 blocks
    # of the window at any length (2048 blocks of 16 cover 32k tokens; the
    # window of token 32767 starts at token 30720, block 1920).
    from example_plugin import EXAMPLE, example_installed

    with example_installed() as metadata_dir:
        path = os.pathsep.join(
            p
            for p in (str(EXAMPLE), str(metadata_dir), os.environ.get("PYTHONPATH"))
            if p
        )
        env = {"PYTHONPATH": path, "KVCORE_DISABLE_PLUGIN_AUTOLOAD": "0"}
        kinds = run("kinds", "--json", env=env)
        plan = run(
            "plan",
            str(EXAMPLE / "streaming-llama-3-1-8b.json"),
            "--memory",
            "8GiB",
            "--context",
            "32K,128K",
            "--json",
            env=env,
        )
    assert kinds.returncode == 0, kinds.stderr
    rows = {r["kind"]: r["plugin"] for r in json.loads(kinds.stdout)}
    assert rows["attention_sinks"] == "attention_sinks"
    assert rows["chunked_local_attention"] == "chunked_local"
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    assert [r["blocks_per_request"] for r in doc["capacity"]] == [129, 129]


def test_plugins_lists_hooks_and_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["mamba"]["kinds"] == ["mamba"]
    assert rows["mamba"]["hooks"] == ["kvcore_register_kinds"]


def test_seed_policy_groups_gemma_in_thirteens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 52 sliding-window and 10 full layers, all 131072-byte pages: groups of
    # 13 pad the fewest layer slots (52 = 4 * 13; 10 -> 13 pads 3).
    args = ["plan", "gemma-3-27b", "--memory", "1GiB", "--policy", "seed", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert [len(g["layer_names"]) for g in plan["kv_cache_groups"]] == [13] * 4 + [10]
    assert plan["bytes_per_block"] == 13 * 131072
    assert plan["num_blocks"] == GIB // (13 * 131072)


def test_plan_error_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "qwen3-next-80b-a3b", "--layout", "LBNHC"]) == 2
    assert "cannot express this model's mixed page sizes" in capsys.readouterr().err


def test_contexts_in_k_and_plain_tokens_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "gemma-3-27b", "--context", "32K,4096", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["target_context"] == 32768
    assert [c["context"] for c in doc["capacity"]] == [32768, 4096]
    assert all(0 < c["ratio"] <= 1 for c in doc["capacity"])


def test_a_narrow_terminal_gets_groups_as_lines() -> None:
    env_run = run("plan", "jamba-1-5-mini", "--context", "4K", env={"COLUMNS": "80"})
    assert env_run.returncode == 0, env_run.stderr
    lines = env_run.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert "  6  full_attention x4: 96 tok, 1.5 MiB, 100.0% full, cacheable" in lines
    assert "     model.layers.{4,12,...,28}.self_attn" in lines


def test_a_kind_that_blocks_every_hit_is_reported() -> None:
    # Jamba's Mamba layers in mode none keep no state of a prefix, so no
    # request can start from a hit; Llama has no such kind.  By default
    # (auto) they are checkpointed and the plan says so.
    jamba = plan_json(
        "jamba-1-5-mini", "--memory", "8GiB", "--mamba-cache-mode", "none"
    )
    assert any(
        n.startswith("no prefix hits for this model: mamba") for n in jamba["notes"]
    )
    default = plan_json("jamba-1-5-mini", "--memory", "8GiB")
    assert not any(n.startswith("no prefix hits") for n in default["notes"])
    assert any(
        n.startswith("mamba states are checkpointed for prefix hits (policy turns)")
        for n in default["notes"]
    )
    llama = plan_json("llama-3-1-8b", "--memory", "8GiB")
    assert not any(n.startswith("no prefix hits") for n in llama["notes"])
    off = plan_json("jamba-1-5-mini", "--memory", "8GiB", "--no-prefix-caching")
    assert not any(n.startswith("no prefix hits") for n in off["notes"])


def test_mamba_cache_mode_turns_hits_back_on() -> None:
    # Mode align keeps a state at block boundaries, so Jamba's prefix hits
    # come back and the report stops saying there are none.
    doc = plan_json("jamba-1-5-mini", "--memory", "8GiB", "--mamba-cache-mode", "align")
    assert not any(n.startswith("no prefix hits") for n in doc["notes"])
    assert "state cache mode align on 28 layers" in doc["notes"]
    specs = [
        s
        for g in doc["plan"]["kv_cache_groups"]
        for s in (
            g["kv_cache_spec"].get("kv_cache_specs") or {"_": g["kv_cache_spec"]}
        ).values()
        if s["kind"] == "mamba"
    ]
    assert {s["mamba_cache_mode"] for s in specs} == {"align"}


def test_a_closed_stdout_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvcore plan >&-``: Python starts with ``sys.stdout`` None."""
    from kvcore.tools.cli import main

    monkeypatch.setattr(sys, "stdout", None)
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvcore: error: standard output is closed; redirect it to a file or "
        "/dev/null instead\n"
    )


def test_an_overridden_kind_is_named_in_the_plan(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """KVCORE_OVERRIDE_KINDS lets a plugin replace a built-in kind; the plan
    then says whose kind it used, in text and JSON."""
    from kvcore.tools.cli import main

    (tmp_path / "kvcore_override_demo.py").write_text(
        "from kvcore import hookimpl\n"
        "from kvcore_full_attention import FullAttention\n\n\n"
        "@hookimpl\n"
        "def kvcore_register_kinds():\n"
        "    return [FullAttention()]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "kvcore_override_demo")
    monkeypatch.setenv("KVCORE_OVERRIDE_KINDS", "full_attention")
    note = (
        "kind 'full_attention' is overridden: plugin 'kvcore_override_demo' (no "
        "distribution: registered by hand or from source) replaces plugin "
        "'full_attention'"
    )
    assert main(["plan", "llama-3-1-8b", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any(n.startswith(note) for n in doc["notes"])
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plan", "llama-3-1-8b"]) == 0
    assert note in capsys.readouterr().out
