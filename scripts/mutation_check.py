#!/usr/bin/env python3
"""Mutation testing of the pure-Python modules with mutmut: kill rate per module, and the surviving mutants.

Each module is mutated alone and checked against the test files that cover it (MODULES below), in a scratch
copy of the package (``--work``, default ``build/mutmut``) that also holds the installed package's native files,
so mutmut's copy (``mutants/``) imports like the installed package. It needs a regular (non-editable) install
in the interpreter that runs it, with the ``[test,server]`` extras and ``mutmut``: ``scripts/mutation_check.sh``
makes one. Mutants listed in ``tests/mutation_equivalent.txt`` (name, then the reason no behaviour can tell them
apart from the original) are reported as equivalent and left out of the rate.

    python scripts/mutation_check.py [module ...] [--json OUT]     e.g. stats sampling

Prints per module: mutants, killed, survived, equivalent, timeouts, kill rate = killed / (all - equivalent -
not checked), then every surviving mutant's name and diff (``--no-diffs`` for names only). Exit status 1 when a
module is below ``--min-rate`` (default 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module (under pyllama_dspark/) -> the test files that cover it
MODULES: dict[str, list[str]] = {
    "draft_length": ["tests/test_draft_length.py", "tests/test_cost_table.py", "tests/test_chooser.py",
                     "tests/test_hybrid.py"],
    "stats": ["tests/test_stats.py"],
    "sampling": ["tests/test_sampling.py", "tests/test_rejection.py"],
    "verify": ["tests/test_verify.py", "tests/test_rejection.py", "tests/test_speculative.py"],
    "checks": ["tests/test_checks.py", "tests/test_api.py", "tests/test_errors.py"],
    "chat": ["tests/test_chat.py"],
    # the facade's and the server's OpenAI-shaped dicts
    "completions": ["tests/test_completions.py", "tests/test_protocol.py", "tests/test_api.py"],
    "gguf_header": ["tests/test_gguf_header.py"],
    "server/protocol": ["tests/test_protocol.py"],  # test_server.py runs the same over HTTP: minutes per mutant
    "tools": ["tests/test_tools.py", "tests/test_completions.py", "tests/test_protocol.py"],
    # the facade's plumbing against fakes; test_api.py (tiny models, the loop) would take minutes per mutant
    "api": ["tests/test_api_plumbing.py"],
}
EQUIVALENT = ROOT / "tests" / "mutation_equivalent.txt"


def installed_package() -> Path:
    import pyllama_dspark._native as native

    folder = Path(native.__file__).resolve().parent
    if folder == (ROOT / "pyllama_dspark").resolve() or "site-packages" not in str(folder):
        sys.exit(f"mutation_check: {folder} is not a regular install (mutmut's copy must shadow it): run "
                 "scripts/mutation_check.sh, which makes one")
    import pyllama_dspark

    if Path(pyllama_dspark.__file__).resolve().parent != folder:
        sys.exit("mutation_check: the package is an editable install (its sources would shadow mutmut's copy): "
                 "run scripts/mutation_check.sh, which makes a regular one")
    return folder


def prepare(work: Path, module: str, tests: list[str], installed: Path) -> None:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shutil.copytree(ROOT / "pyllama_dspark", work / "pyllama_dspark",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_config.py"))
    for built in installed.iterdir():  # the native files and what the build generated, from the install
        if built.suffix == ".so" or built.name in ("lib", "bin", "data", "_build_config.py"):
            target = work / "pyllama_dspark" / built.name
            (shutil.copytree if built.is_dir() else shutil.copy2)(built, target)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = re.sub(r"\n\[tool\.mutmut\].*?(?=\n\[|\Z)", "", pyproject, flags=re.S)
    pyproject += "\n[tool.mutmut]\n" + "\n".join([
        'source_paths = ["pyllama_dspark"]',
        f'only_mutate = ["pyllama_dspark/{module}.py"]',
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        # the slow tests (chi-square runs of thousands of generations) would make a run take hours; a mutant
        # only they would kill counts as a survivor here, so the rate errs low, never high
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-m", "not slow"]',
        'process_isolation = "forkserver"',
        "use_git_change_detection = false",
        "track_dependencies = false",
    ]) + "\n"
    (work / "pyproject.toml").write_text(pyproject)


def equivalents() -> dict[str, str]:
    out = {}
    if EQUIVALENT.exists():
        for line in EQUIVALENT.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, reason = line.partition(" ")
                out[name] = reason.strip()
    return out


def run_module(module: str, tests: list[str], work: Path, installed: Path, max_children: int,
               diffs: bool) -> dict:
    prepare(work, module, [t for t in tests if (ROOT / t).exists()], installed)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               PYLLAMA_DSPARK_TEST_MODEL_DIR=str(work.parent / "tiny-models"))  # built once, not per mutant
    (work.parent / "tiny-models").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)], cwd=work,
                         env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    meta = work / "mutants" / "pyllama_dspark" / f"{module}.py.meta"
    if run.returncode != 0 or not meta.exists():
        return {"module": module, "error": (run.stdout + run.stderr)[-3000:], "seconds": seconds}
    from mutmut.stats import status_by_exit_code

    exit_codes = json.loads(meta.read_text())["exit_code_by_key"]
    known = equivalents()
    counts = {"mutants": len(exit_codes), "killed": 0, "survived": 0, "equivalent": 0, "timeout": 0,
              "not_checked": 0}
    survivors = []
    for name, code in sorted(exit_codes.items()):
        status = status_by_exit_code[code]
        if status in ("survived", "no tests") and name in known:
            counts["equivalent"] += 1
        elif status in ("survived", "no tests"):  # no test runs the mutated code: nothing would catch it
            counts["survived"] += 1
            survivors.append(name if status == "survived" else f"{name} (no test runs it)")
        elif status in ("killed", "segfault", "caught by type check"):
            counts["killed"] += 1
        elif status == "timeout":  # the mutant never let its tests finish: caught
            counts["timeout"] += 1
            counts["killed"] += 1
        else:  # skipped, interrupted, suspicious: not judged
            counts["not_checked"] += 1
            survivors.append(f"{name} ({status}, not judged)")
    judged = counts["mutants"] - counts["equivalent"] - counts["not_checked"]
    rate = counts["killed"] / judged if judged else 1.0
    shown = {}
    if diffs:
        for name in survivors[:200]:
            plain = name.split(" ")[0]
            show = subprocess.run([sys.executable, "-m", "mutmut", "show", plain], cwd=work, env=env,
                                  capture_output=True, text=True)
            shown[plain] = show.stdout.strip()
    return {"module": module, "tests": tests, **counts, "kill_rate": rate, "survivors": survivors,
            "equivalent_names": sorted(n for n in exit_codes if n in known), "diffs": shown, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"modules to check (default: all of {', '.join(MODULES)})")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "mutmut", help="scratch folder")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--min-rate", type=float, default=0.9)
    parser.add_argument("--no-diffs", action="store_true")
    parser.add_argument("--json", help="write the per-module figures here")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown modules {unknown} (choose from {list(MODULES)})")
    installed = installed_package()
    reports, status = [], 0
    for module in args.modules or list(MODULES):
        report = run_module(module, MODULES[module], args.work / module.replace("/", "-"), installed,
                            args.max_children, not args.no_diffs)
        reports.append(report)
        if "error" in report:
            print(f"{module}: mutmut failed after {report['seconds']:.0f} s:\n{report['error']}", flush=True)
            status = 1
            continue
        print(f"{module:<16} {report['mutants']:4d} mutants  {report['killed']:4d} killed  {report['survived']:3d} "
              f"survived  {report['equivalent']:3d} equivalent  {report['timeout']:3d} timeouts  "
              f"{report['not_checked']:3d} not checked  kill rate {report['kill_rate']:.1%}  "
              f"({report['seconds']:.0f} s)", flush=True)
        for name in report["survivors"]:
            print(f"    survived: {name}")
            if report["diffs"].get(name):
                print("        " + report["diffs"][name].replace("\n", "\n        "))
        if report["kill_rate"] < args.min_rate:
            status = 1
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
