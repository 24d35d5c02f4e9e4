"""Run a pytest selection in K processes at once (each takes every K-th collected test), then the
tests marked `big` alone, then the shards' failures again one by one with the whole GPU (a shard has
1/K of its memory: a full-size test that ran out of memory there is judged by its serial rerun), and
with them the tests a shard stopped by --timeout did not finish (from the one it was in). With
several GPUs the shards spread over them, one GPU each; the `big` tests then see every GPU. On the GPU machines the suite's time is mostly cuTile compiles, which run
on the CPU (16 cores there): shards share one compile cache on disk (CUTILE_NORMS_CACHE_DIR, which
holds cuTile's cache too unless CUDA_TILE_CACHE_DIR is set).

    python tests/run_sharded.py --shards 8 --logs $OUT -- -m gpu tests/

Prints each shard's summary line and the failures; exits 1 if any shard failed.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (nvidia-smi, so that this process
    does not initialise CUDA before its children)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in out.splitlines() if ln.strip().isdigit()]


def unfinished(log_path: str, collect: list[str], env: dict) -> list[str]:
    """The tests of a shard stopped by the timeout that did not finish: its collected tests (`collect`,
    run with the shard's `env`: the same seed and share) from the last one its -v log names on."""
    out = subprocess.run(collect, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    ids = [ln.strip() for ln in out.splitlines() if "::" in ln and not ln.startswith((" ", "="))]
    where = {t: n for n, t in enumerate(ids)}
    last = 0
    for ln in open(log_path).read().splitlines():
        n = where.get(ln.split(" ", 1)[0])
        if n is not None:
            last = max(last, n)
    return ids[last:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--logs", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--timeout", type=float, default=480, help="seconds per shard before it is killed (a hang)")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args(argv)
    os.makedirs(args.logs, exist_ok=True)
    # one compile cache on disk for every shard (cuTile's and CuTe's compiles shared), removed at the end
    if "CUTILE_NORMS_CACHE_DIR" not in os.environ:
        os.environ["CUTILE_NORMS_CACHE_DIR"] = tempfile.mkdtemp(prefix="cutile_norms_shards_cache_")
        atexit.register(shutil.rmtree, os.environ["CUTILE_NORMS_CACHE_DIR"], ignore_errors=True)
    # one fuzz seed for every shard (tests/test_fuzz.py draws its cases from it at collection)
    os.environ.setdefault("CUTILE_NORMS_FUZZ_SEED", str(int.from_bytes(os.urandom(4), "little") >> 1))
    print(f"CUTILE_NORMS_FUZZ_SEED={os.environ['CUTILE_NORMS_FUZZ_SEED']}", flush=True)
    sel = list(args.pytest_args) or ["tests/"]
    marker = next((sel[i + 1] for i, a in enumerate(sel[:-1]) if a == "-m"), None)
    rest = [a for i, a in enumerate(sel) if a != "-m" and (i == 0 or sel[i - 1] != "-m")]
    # -v: a shard killed by the timeout shows the test it was in as its log's last line; each test's
    # time on its line (pytest >= 8.4), so a slow shard's log says which tests (compiles) took it
    base = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rf",
            "-o", "console_output_style=times"]
    shard_m = f"({marker}) and not big" if marker else "not big"  # a shard's selection
    runs, envs = [], []
    t0 = time.time()
    gpus = visible_gpus()
    print(f"{len(gpus)} GPU(s): {','.join(gpus)}", flush=True)
    for i in range(args.shards):
        env = dict(os.environ, CUTILE_NORMS_TEST_SHARD=f"{i}/{args.shards}")
        if len(gpus) > 1:  # the shards spread over the GPUs, one each
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        envs.append(env)
        log = open(os.path.join(args.logs, f"pytest_shard{i}.log"), "w")
        runs.append((f"shard {i}", subprocess.Popen(base + ["-m", shard_m] + rest, cwd=ROOT, env=env, stdout=log,
                                                     stderr=subprocess.STDOUT), log))
    codes = []
    for name, proc, log in runs:
        try:
            codes.append(proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.write(f"\nTIMEOUT: killed after {args.timeout:.0f} s (the test above did not finish)\n")
            codes.append(-1)
        log.close()
    m = f"({marker}) and big" if marker else "big"
    with open(os.path.join(args.logs, "pytest_big.log"), "w") as log:
        failed = subprocess.call(base + ["-m", m] + rest, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) not in (0, 5)
    retry = []
    for i, code in enumerate(codes):
        shard_log = os.path.join(args.logs, f"pytest_shard{i}.log")
        shard_fails = [ln.split()[1] for ln in open(shard_log).read().splitlines()
                       if ln.startswith(("FAILED ", "ERROR "))]
        if code == -1:  # stopped by the timeout: its failures so far and what it did not finish run again
            collect = base[:3] + ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", shard_m] + rest
            shard_fails += unfinished(shard_log, collect, envs[i])
        retry += shard_fails
        # 0: passed, 5: nothing selected, 1: tests failed; -1: the timeout (judged by the rerun); else a crash
        failed |= code not in (-1, 0, 1, 5) or (code in (-1, 1) and not shard_fails)
    names = [f"shard{i}" for i in range(args.shards)] + ["big"]
    retry = list(dict.fromkeys(retry))
    if retry:
        names.append("rerun")
        with open(os.path.join(args.logs, "pytest_rerun.log"), "w") as log:
            failed |= subprocess.call(base + retry, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) != 0
    for name in names:
        lines = open(os.path.join(args.logs, f"pytest_{name}.log")).read().splitlines()
        fails = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "TIMEOUT"))]
        if lines and lines[-1].startswith("TIMEOUT") and len(lines) > 2:
            fails.insert(0, "last started: " + lines[-3])
        print(f"{name}: {lines[-1] if lines else '(no output)'}")
        for ln in fails[:20]:
            print("   ", ln[:300])
    print(f"{time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
