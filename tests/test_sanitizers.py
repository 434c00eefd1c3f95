"""The cuckoo core's stress test (backends/cuckoo/stress_test.cc: threads on
disjoint and on shared keys, mixed upserts, accumulations, removes, finds,
exports and clears, every answer checked against shadow state) built and run
under ThreadSanitizer and under AddressSanitizer + UndefinedBehaviorSanitizer
(LeakSanitizer included).  Any sanitizer report fails the run: the runtimes
halt on the first error and exit non-zero, and the output is searched for
reports as well.

The sanitizer runtimes ship with g++ (libtsan, libasan, libubsan);
scripts/test.sh installs them when a compiler lacks them.  Replay a failure
with TFDE_STRESS_SEED=<the seed printed>.
"""

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tfde import _native

SRC = _native.source_dir() / "cuckoo"
SEED = int(os.environ.get("TFDE_STRESS_SEED") or random.SystemRandom().randrange(1 << 30))

# What makes a sanitizer stop at its first report with exit status 66, and
# the text its reports start with.
SANITIZERS = {
    # detect_deadlocks=0: TSan's lock-order checker follows at most 64 mutexes
    # held by one thread and aborts beyond that ("CHECK failed:
    # sanitizer_deadlock_detector.h"), and CuckooTable::WithRows holds a
    # table's 64 shard locks while it holds the next table's (the fused
    # apply's row and slot tables).  Every table's locks are taken in one
    # order (docs/cuckoo.md); data races are still reported.
    "thread": dict(
        flags=["-fsanitize=thread"],
        env={"TSAN_OPTIONS": "halt_on_error=1:exitcode=66:detect_deadlocks=0"},
    ),
    "address,undefined": dict(
        flags=["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
        env={
            "ASAN_OPTIONS": "halt_on_error=1:exitcode=66:detect_leaks=1:detect_stack_use_after_return=1:"
            "check_initialization_order=1:strict_init_order=1",
            "UBSAN_OPTIONS": "halt_on_error=1:exitcode=66:print_stacktrace=1",
        },
    ),
}
REPORT_MARKERS = (
    "WARNING: ThreadSanitizer",
    "ERROR: AddressSanitizer",
    "ERROR: LeakSanitizer",
    "runtime error:",
    "SUMMARY: UndefinedBehaviorSanitizer",
)

# Threads, ops per thread, rows of the bulk insert: each run takes ~10-25 s
# on 2 cores under either sanitizer (they slow the core 5-15x).
WORKLOAD = (4, 600, 50_000)


def _compile(sanitizer: str, source: Path, out: Path) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "no C++ compiler: install g++ (scripts/test.sh does)"
    cmd = [cxx, "-std=c++17", "-O1", "-g1", "-pthread", *SANITIZERS[sanitizer]["flags"], str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"building {source.name} with -fsanitize={sanitizer} failed; the sanitizer runtime may be missing "
        f"(Debian/Ubuntu: apt-get install libtsan2 libasan8 libubsan1, or run scripts/test.sh, which does).\n"
        f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"
    )
    return out


def _run(sanitizer: str, binary: Path, *args, timeout=240):
    env = dict(os.environ, **SANITIZERS[sanitizer]["env"])
    start = time.monotonic()
    proc = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
    output = proc.stdout + proc.stderr
    reports = [m for m in REPORT_MARKERS if m in output]
    return proc, output, reports, time.monotonic() - start


@pytest.fixture(scope="module", params=sorted(SANITIZERS))
def sanitized_stress_test(request, tmp_path_factory):
    sanitizer = request.param
    out = tmp_path_factory.mktemp("sanitized") / f"stress_test_{sanitizer.replace(',', '_')}"
    return sanitizer, _compile(sanitizer, SRC / "stress_test.cc", out)


def test_stress_test_has_no_sanitizer_reports(sanitized_stress_test):
    sanitizer, binary = sanitized_stress_test
    proc, output, reports, seconds = _run(sanitizer, binary, SEED, *WORKLOAD)
    print(f"-fsanitize={sanitizer}: seed {SEED}, threads/ops/bulk {WORKLOAD}, {seconds:.1f} s\n{output}")
    replay = f"replay: TFDE_STRESS_SEED={SEED} pytest tests/test_sanitizers.py"
    assert not reports, f"-fsanitize={sanitizer} reported {reports} ({replay}):\n{output[-6000:]}"
    assert proc.returncode == 0, (
        f"stress test exited {proc.returncode} under -fsanitize={sanitizer} ({replay}):\n{output[-6000:]}"
    )
    assert f"seed {SEED}" in proc.stdout and "PASS" in proc.stdout
    for keys in ("int64", "int32", "string"):
        for phase in ("disjoint keys", "shared keys", "bulk insert"):
            assert f"{keys} keys: {phase}" in proc.stdout, (keys, phase)


# Each sanitizer must catch a planted bug of its kind, under the same flags
# and options: otherwise a run "without reports" would prove nothing.
PLANTED = {
    "thread": """
        #include <thread>
        int counter = 0;
        int main() {
          std::thread a([] { for (int i = 0; i < 100000; ++i) ++counter; });
          std::thread b([] { for (int i = 0; i < 100000; ++i) ++counter; });
          a.join(); b.join();
          return counter == 0;
        }""",
    "address,undefined": """
        #include <cstdlib>
        #include <vector>
        int main(int argc, char**) {
          std::vector<int> v(4);
          return v.data()[argc + 3];  // reads one past the end
        }""",
    "undefined": """
        #include <climits>
        int main(int argc, char**) {
          int x = INT_MAX - 1 + argc;
          return x + argc > 0;  // signed overflow
        }""",
    "leak": """
        #include <cstdlib>
        void* volatile kept;
        int main() {
          kept = std::malloc(1000);
          kept = nullptr;  // lost
          return 0;
        }""",
}


@pytest.mark.parametrize(
    "bug,sanitizer",
    [
        ("thread", "thread"),
        ("address,undefined", "address,undefined"),
        ("undefined", "address,undefined"),
        ("leak", "address,undefined"),
    ],
)
def test_planted_bugs_are_reported(bug, sanitizer, tmp_path):
    source = tmp_path / "planted.cc"
    source.write_text(PLANTED[bug])
    binary = _compile(sanitizer, source, tmp_path / "planted")
    proc, output, reports, _ = _run(sanitizer, binary, timeout=60)
    assert reports and proc.returncode != 0, f"-fsanitize={sanitizer} missed a planted {bug} bug:\n{output}"
