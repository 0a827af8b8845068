"""Run GPyTorch's own example tests (``test/examples/``) that build a variational strategy, as
GPyTorch ships them and with only ``VariationalStrategy`` / ``UnwhitenedVariationalStrategy``
replaced by :class:`pyro_cvi.contrib.gpytorch.CVIVariationalStrategy`.

GPyTorch's files are read from a git checkout of GPyTorch (``--repo``, at ``--tag``, the installed
version by default) into a temporary directory, never into this repository; the swap is a
``conftest.py`` written next to them that rebinds the two names in ``gpytorch.variational`` before
the test modules import them. GPyTorch's assertions are untouched. Prints one line per test and
writes ``results/gpytorch_examples.json``::

    python scripts/run_gpytorch_examples.py --repo /path/to/gpytorch            # both runs
    python scripts/run_gpytorch_examples.py --repo /path/to/gpytorch --only cvi -k pyro
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import gpytorch

ROOT = Path(__file__).resolve().parents[1]
#: the example files that build a VariationalStrategy or UnwhitenedVariationalStrategy
FILES = [
    "test_batch_svgp_gp_regression.py",
    "test_decoupled_svgp_regression.py",
    "test_dspp_regression.py",
    "test_lmc_svgp_regression.py",
    "test_missing_data.py",
    "test_pyro_integration.py",
    "test_simple_gp_classification.py",
    "test_svgp_gp_classification.py",
    "test_svgp_gp_regression.py",
    "test_unwhitened_svgp_regression.py",
]
#: data files the tests read
DATA = ["old_variational_strategy_model.pth", "__init__.py"]

SWAP = """
import gpytorch.variational as _v
from pyro_cvi.contrib.gpytorch import CVIVariationalStrategy as _CVI

_v.VariationalStrategy = _CVI
_v.UnwhitenedVariationalStrategy = _CVI
"""


def extract(repo: Path, tag: str, dest: Path) -> None:
    for name in FILES + DATA:
        blob = subprocess.run(
            ["git", "--git-dir", str(repo), "show", f"{tag}:test/examples/{name}"],
            check=True,
            capture_output=True,
        ).stdout
        (dest / name).write_bytes(blob)


def run(dest: Path, swap: bool, keyword: str | None, timeout: int) -> dict:
    """Each file in its own pytest process (a file past ``timeout`` seconds is reported as such)."""
    (dest / "conftest.py").write_text(SWAP if swap else "")
    env = dict(os.environ)  # this checkout's pyro_cvi, not an installed one
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = {}
    for name in FILES:
        xml = dest / f"{name}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
        cmd += ["-n", "0", f"--junitxml={xml}", "-o", "junit_family=xunit1"]
        cmd += ["--rootdir", str(dest)] + (["-k", keyword] if keyword else []) + [name]
        try:
            subprocess.run(cmd, cwd=dest, timeout=timeout, capture_output=True, env=env)
        except subprocess.TimeoutExpired:
            out[f"{name}::*"] = {"status": "timeout", "why": f"over {timeout} s"}
            continue
        for case in ET.parse(xml).getroot().iter("testcase"):
            test = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
            status, why = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    status = "skipped" if tag == "skipped" else "failed"
                    why = ((el.get("message") or "").splitlines() or [""])[0][:200]
            out[test] = {"status": status, "why": why}
        print(f"[{'cvi' if swap else 'gpytorch'}] {name} done", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, required=True, help="GPyTorch's git directory")
    ap.add_argument("--tag", default=f"v{gpytorch.__version__}")
    ap.add_argument("--only", choices=["gpytorch", "cvi"], default=None)
    ap.add_argument("-k", dest="keyword", default=None)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per file")
    ap.add_argument("--out", type=Path, default=Path("results/gpytorch_examples.json"))
    args = ap.parse_args()
    repo = args.repo / ".git" if (args.repo / ".git").exists() else args.repo
    runs = {"gpytorch": False, "cvi": True}
    if args.only:
        runs = {args.only: runs[args.only]}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp)
        extract(repo, args.tag, dest)
        for label, swap in runs.items():
            results[label] = run(dest, swap, args.keyword, args.timeout)
    names = sorted({n for r in results.values() for n in r})
    print(f"{'test':78s} " + " ".join(f"{k:>8s}" for k in results))
    for n in names:
        row = [results[k].get(n, {"status": "-"})["status"] for k in results]
        print(f"{n[:78]:78s} " + " ".join(f"{s:>8s}" for s in row))
    for k, r in results.items():
        passed = sum(v["status"] == "passed" for v in r.values())
        print(f"{k}: {passed}/{len(r)} passed")
        for n, v in r.items():
            if v["status"] == "failed":
                print(f"  FAIL {n}: {v['why']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tag": args.tag, "results": results}, indent=1))


if __name__ == "__main__":
    main()
