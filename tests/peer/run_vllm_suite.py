"""vLLM's own scheduler tests as a peer suite: plain vLLM against vLLM with
kvcore plugged in.

Run by ``.ci/vllm-peer`` (and so by ``.ci/run``), never by the default pytest
run: it needs the network (PyPI) and vLLM.  The stage

1. makes a virtual environment with vLLM |VLLM| for CPU (``torch==2.13.0``,
   then ``--no-deps -r tests/peer/vllm-requirements.txt``, the pinned list of
   vLLM |VLLM|'s CPU dependencies), or, with ``--base-venv``, a
   thin one layered over an existing vLLM environment; installs kvcore into
   it (editable, so its ``vllm.general_plugins`` entry point is registered)
   and the one package vLLM's test ``conftest.py`` needs besides (tblib);
2. downloads vLLM |VLLM|'s source distribution with pip and unpacks its
   ``tests/`` and ``pyproject.toml`` under the work folder (vLLM's tests are
   never copied into this repository);
3. writes the model files those tests name (``facebook/opt-125m``'s and
   ``opt-350m``'s ``config.json``; no hub is reachable, and the scheduler
   reads nothing else of the model) into a local Hugging Face cache;
4. runs the test files twice, plain and with ``KVCORE_VLLM=1`` (the setting
   that switches a vLLM process onto kvcore; the pytest plugin
   ``kvcore_vllm_peer`` refuses to run if the scheduler is not on kvcore
   then), each in its own interpreter;
5. prints, per file, the tests passing on both, only on plain vLLM and only
   with kvcore, and the excluded tests with why;
6. runs ``vllm_plan_peer.py``: kvcore's plans, turned into vLLM's
   ``KVCacheConfig``, allocated and bound by vLLM's own worker code;
7. runs kvcore's own tests under vLLM (``KVCORE_TEST_FILES``: kvcore's
   contract driven through vLLM's own scheduler) with ``KVCORE_VLLM=1``.

The exit status is 0 when every test that passes on plain vLLM passes with
kvcore, except the excluded ones and those listed in ``vllm_known_gaps.txt``
(each with the gap that fails it), and every test of ``vllm_plan_peer.py``
and of kvcore's own tests under vLLM passes; a listed test that now passes
fails the stage too, so the list only shrinks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

VLLM = "0.33.0"
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

#: The test files of vLLM's source distribution the stage runs.
TEST_FILES = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
)

#: Tests that read vLLM's private bookkeeping rather than the manager's
#: contract (test id prefix -> why).  At most 7.
EXCLUDED: dict[str, str] = {
    "tests/v1/core/test_deferred_block_free.py::"
    "test_cow_retentions_deferred_until_copy_step_processed": (
        "injects a block copy into vLLM's private "
        "single_type_managers[0]._pending_cow_copies list; kvcore hands its "
        "copy-on-write copies out through the KVCacheBlocks a step returns"
    ),
}

KNOWN_GAPS = HERE / "vllm_known_gaps.txt"

#: kvcore's own tests under vLLM: kvcore's files (not named ``test_*.py``,
#: so the default pytest run leaves them out), run in the peer environment
#: with kvcore plugged in; every test must pass.
KVCORE_TEST_FILES = (
    # kvcore's engine contract under vLLM's AsyncScheduler: no block a step
    # in flight reads is released, no unwritten Mamba state restored.
    HERE / "vllm_contract.py",
)

#: facebook/opt-125m's public config.json: the model file most of the
#: chosen tests read (the scheduler needs the layer count, heads, lengths,
#: dtype; no weights, no tokenizer).
OPT_125M_CONFIG = {
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


def _run(cmd: list[str], **kw: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"{venv} holds no lib/python3*/site-packages")
    return found[0]


def ensure_venv(venv: Path, base: Path | None, requirements: Path) -> Path:
    """The peer environment's interpreter: vLLM, kvcore and tblib in it."""
    python = venv / "bin" / "python"
    if not python.exists() and base is None and not requirements.exists():
        raise SystemExit(
            f"{requirements} is missing: pass --requirements (the pinned "
            "vLLM 0.33 CPU dependency list) or --base-venv"
        )
    if not python.exists():
        maker = str(base / "bin" / "python") if base else sys.executable
        _run([maker, "-m", "venv", str(venv)])
        if base is not None:
            # A thin layer: the base's packages come after this venv's own.
            pth = _site_packages(venv) / "_kvcore_peer_base.pth"
            pth.write_text(f"{_site_packages(base)}\n")
        else:
            pip = [str(python), "-m", "pip", "install", "--quiet"]
            _run([*pip, "torch==2.13.0"])
            _run([*pip, "--no-deps", "-r", str(requirements)])
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    _run([*pip, "tblib"])
    # kvcore with its entry points; vLLM is there already (no [vllm] extra,
    # which would resolve vLLM's own dependencies again).
    _run([*pip, "-e", str(REPO)])
    version = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if version != VLLM:
        raise SystemExit(f"{venv} has vLLM {version}; the peer suite needs {VLLM}")
    return python


def ensure_tests(python: Path, work: Path) -> Path:
    """vLLM's source tree (tests and pyproject.toml only), unpacked."""
    sdist = work / f"vllm-{VLLM}.tar.gz"
    if not sdist.exists():
        # --no-binary vllm (not :all:): vLLM's build dependencies may come as
        # wheels, else pip would build cmake and ninja from source.
        _run(
            [
                str(python),
                "-m",
                "pip",
                "download",
                f"vllm=={VLLM}",
                "--no-binary",
                "vllm",
                "--no-deps",
                "-d",
                str(work),
            ]
        )
    root = work / f"vllm-{VLLM}"
    if not (root / TEST_FILES[0]).exists():
        prefix = f"vllm-{VLLM}/"
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix + "tests/")
                or m.name == prefix + "pyproject.toml"
            ]
            tar.extractall(work, members=members, filter="data")
    return root


#: facebook/opt-350m's, which differs in size and in its projection.
OPT_350M_CONFIG = {
    **OPT_125M_CONFIG,
    "do_layer_norm_before": False,
    "ffn_dim": 4096,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "word_embed_proj_dim": 512,
}

#: The model files written into the local Hugging Face cache.  Tests that
#: name other models (multimodal ones, which need processor and tokenizer
#: files) fail the same way on both sides and are counted on neither.
MODEL_FILES = {
    "facebook/opt-125m": OPT_125M_CONFIG,
    "facebook/opt-350m": OPT_350M_CONFIG,
}


def write_model_files(work: Path) -> Path:
    home = work / "hf"
    rev = "0" * 40
    for name, config in MODEL_FILES.items():
        repo = home / "hub" / f"models--{name.replace('/', '--')}"
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
        (snap / "config.json").write_text(json.dumps(config, indent=1))
    return home


def _env(hf_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_LOGGING_LEVEL="ERROR",
    )
    env.pop("KVCORE_VLLM", None)
    return env


def run_bench(python: Path, root: Path, hf_home: Path, extra: list[str]) -> int:
    """scheduler_bench.py: vLLM's scheduler per step on both managers."""
    env = _env(hf_home)
    env["PYTHONPATH"] = os.pathsep.join((str(root), str(HERE)))
    cmd = [str(python), str(HERE / "scheduler_bench.py"), *extra]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=root, env=env, check=False).returncode


def run_plan_peer(python: Path, hf_home: Path) -> int:
    """vllm_plan_peer.py: kvcore's plan allocated and bound by vLLM's own
    worker code (0 when every test passes)."""
    env = _env(hf_home)
    env["PYTHONPATH"] = os.pathsep.join((str(REPO), str(REPO / "plugins"), str(HERE)))
    cmd = [str(python), "-m", "pytest", str(HERE / "vllm_plan_peer.py"), "-q"]
    cmd += ["-p", "no:cacheprovider", "-p", "no:warnings", f"--confcutdir={HERE}"]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode


def run_suite(
    python: Path,
    root: Path,
    hf_home: Path,
    out: Path,
    *,
    kvcore: bool,
    extra: list[str],
) -> dict[str, str]:
    """Each test id's outcome: passed, failed, error or skipped."""
    env = _env(hf_home)
    cmd = [str(python), "-m", "pytest", *TEST_FILES, "-q", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={out}", *extra]
    if kvcore:
        env["KVCORE_VLLM"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE), env.get("PYTHONPATH", "")) if p
        )
        cmd += ["-p", "kvcore_vllm_peer"]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=root, env=env, check=False)
    if done.returncode not in (0, 1) or not out.exists():
        raise SystemExit(f"pytest could not run the suite (exit {done.returncode})")
    return outcomes(out)


def run_kvcore_tests(python: Path, root: Path, hf_home: Path) -> int:
    """kvcore's own tests under vLLM (``KVCORE_TEST_FILES``); pytest's exit
    status.  They run in vLLM's source tree, as vLLM's tests do, without
    kvcore's pytest configuration (``-c`` an empty file; its conftest and
    its warnings-as-errors are for the default run), and print what they
    checked (``-s``)."""
    env = _env(hf_home)
    env["KVCORE_VLLM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), env.get("PYTHONPATH", "")) if p
    )
    cmd = [str(python), "-m", "pytest", *map(str, KVCORE_TEST_FILES)]
    cmd += ["-q", "-s", "-p", "no:cacheprovider", "-p", "kvcore_vllm_peer"]
    cmd += ["-c", os.devnull, "--rootdir", str(HERE), "--confcutdir", str(HERE)]
    print("\nkvcore's own tests under vLLM (all must pass)", flush=True)
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=root, env=env, check=False).returncode


def outcomes(junit: Path) -> dict[str, str]:
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        module, _, cls = path.partition("/Test")
        name = f"{module}.py::{'Test' + cls + '::' if cls else ''}{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                # A teardown error after a pass still fails the test.
                outcome = "failed"
                break
            if child.tag == "skipped":
                outcome = "skipped"
        result[name] = outcome
    return result


def excluded_reason(test: str) -> str | None:
    for prefix, why in EXCLUDED.items():
        if test.startswith(prefix):
            return why
    return None


def read_known_gaps() -> dict[str, str]:
    gaps: dict[str, str] = {}
    if not KNOWN_GAPS.exists():
        return gaps
    for line in KNOWN_GAPS.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        test, _, why = line.partition("  # ")
        gaps[test.strip()] = why.strip()
    return gaps


def compare(plain: dict[str, str], plugged: dict[str, str]) -> int:
    """Print the comparison; the stage's exit status."""
    rows: dict[str, Counter[str]] = {}
    only_plain: list[str] = []
    only_kvcore: list[str] = []
    excluded: list[str] = []
    for test in sorted(set(plain) | set(plugged)):
        file = test.split("::")[0].rsplit("/", 1)[-1]
        row = rows.setdefault(file, Counter())
        row["collected"] += 1
        a = plain.get(test) == "passed"
        b = plugged.get(test) == "passed"
        row["plain"] += a
        row["kvcore"] += b
        if excluded_reason(test) is not None:
            row["excluded"] += 1
            excluded.append(test)
        elif a and b:
            row["both"] += 1
        elif a:
            row["only plain"] += 1
            only_plain.append(test)
        elif b:
            row["only kvcore"] += 1
            only_kvcore.append(test)
    cols = ("collected", "plain", "kvcore", "both", "only plain", "only kvcore")
    cols += ("excluded",)
    width = max(len(f) for f in rows) + 2
    print(f"\nvLLM {VLLM} scheduler tests: plain vLLM vs vLLM on kvcore")
    print("file".ljust(width) + "".join(c.rjust(12) for c in cols))
    total: Counter[str] = Counter()
    for file, row in rows.items():
        total.update(row)
        print(file.ljust(width) + "".join(str(row[c]).rjust(12) for c in cols))
    print("total".ljust(width) + "".join(str(total[c]).rjust(12) for c in cols))
    for test in excluded:
        print(f"excluded: {test}: {excluded_reason(test)}")
    for test in only_kvcore:
        print(f"only with kvcore: {test}")
    gaps = read_known_gaps()
    new = [t for t in only_plain if t not in gaps]
    closed = [t for t in gaps if t not in only_plain]
    for test in only_plain:
        print(f"only on plain vLLM: {test}  [{gaps.get(test, 'NEW')}]")
    if new:
        print(f"\n{len(new)} tests pass on plain vLLM but fail on kvcore, unlisted")
    if closed:
        print(
            f"\n{len(closed)} tests listed in {KNOWN_GAPS.name} no longer fail "
            "only on kvcore; remove them from the list:"
        )
        for test in closed:
            print(f"  {test}")
    return 1 if new or closed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO / ".peer")
    parser.add_argument("--venv", type=Path, default=None)
    parser.add_argument(
        "--base-venv",
        type=Path,
        default=None,
        help="an existing vLLM environment to layer over (no install of vLLM)",
    )
    parser.add_argument(
        "--requirements",
        type=Path,
        default=HERE / "vllm-requirements.txt",
    )
    parser.add_argument(
        "--only",
        choices=("both", "plain", "kvcore", "own"),
        default="both",
        help="run one side only (reuses the other side's last results); "
        "own: only kvcore's own tests under vLLM",
    )
    parser.add_argument(
        "--bench",
        action="store_true",
        help="time the scheduler per step on vLLM's manager and on kvcore's "
        "(scheduler_bench.py) instead of running the tests",
    )
    parser.add_argument(
        "pytest_args", nargs="*", help="passed on to pytest (or the benchmark)"
    )
    args = parser.parse_args(argv)
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    venv = (args.venv or work / "venv").resolve()
    python = ensure_venv(venv, args.base_venv, args.requirements)
    root = ensure_tests(python, work)
    hf_home = write_model_files(work)
    if args.bench:
        return run_bench(python, root, hf_home, args.pytest_args)
    own = 0
    if args.only in ("both", "kvcore", "own"):
        own = run_kvcore_tests(python, root, hf_home)
        if args.only == "own":
            return own
    results = {}
    for side in ("plain", "kvcore"):
        junit = work / f"{side}.xml"
        if args.only in ("both", side):
            junit.unlink(missing_ok=True)
            results[side] = run_suite(
                python,
                root,
                hf_home,
                junit,
                kvcore=side == "kvcore",
                extra=args.pytest_args,
            )
        elif junit.exists():
            results[side] = outcomes(junit)
        else:
            raise SystemExit(f"no earlier {side} run in {work}; run both sides")
    status = compare(results["plain"], results["kvcore"])
    if own:
        print(f"\nkvcore's own tests under vLLM failed (pytest exit {own})")
    return run_plan_peer(python, hf_home) or status or int(bool(own))


if __name__ == "__main__":
    sys.exit(main())
