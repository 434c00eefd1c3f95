"""Every fenced code block of README.md and docs/*.md runs, so that none can
rot (docs/README.md, "Every code block runs").

A `python` block is a whole program: it runs in a fresh Python process
(sys.executable), in a fresh working directory holding a copy of configs/
whose Redis model tags are unique to the run (the run's Redis keys are
deleted afterwards).  A `bash` block runs with bash in such a directory, the
test environment's `tfde` and `python` first on the PATH.  Any other block
needs a marker on the lines just above its fence:

  <!-- docs-test: covered-by tests/FILE.py::TEST -->   that test runs it; checked to exist
  <!-- docs-test: as RUNNER -->                        run by RUNNERS[RUNNER] below
  <!-- docs-test: name NAME -->                        names the block, for `after`
  <!-- docs-test: after NAME -->                       runs where block NAME of the page ran, after it
  <!-- docs-test: argv WORD ... -->                    the program's arguments ({ops_library}: tfde's op library)

The README opens with its two commands unchanged, so those two are named
here (README_COMMANDS) rather than by markers.  A block with no way to run,
or a marker this file does not know, fails test_every_block_has_a_way_to_run.
Links between the pages, anchors included, are checked as well."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tfde.distributed.launch import free_ports

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
TIMEOUT_S = 300  # one program; the slowest (a two-worker demo) takes ~40 s on 2 cores
# The demo on data small enough for a test, yet big enough to beat the
# most-popular baseline (`tfde train` exits 1 when it does not): ~14 s.
QUICK_DEMO = "--interactions 60000 --users 3000 --items 1500 --epochs 1"

README_COMMANDS = {
    'python3 -m venv .venv && .venv/bin/pip install ".[cpu]" && .venv/bin/tfde train\n': "install",
    "bash scripts/test.sh\n": "self",
}

FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!-- docs-test: (\S+)(?: (.*?))? -->$")
KINDS = ("covered-by", "as", "name", "after", "argv")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    markers: dict = field(default_factory=dict)  # kind -> argument string

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> list:
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        markers, j = {}, i - 1
        while j >= 0 and MARKER.match(lines[j]):
            kind, arg = MARKER.match(lines[j]).groups()
            markers[kind] = arg or ""
            j -= 1
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{page.relative_to(ROOT)}:{i + 1}: a code block that never closes"
        text = "\n".join(lines[i + 1 : end]) + "\n"
        block = Block(page, i + 1, match.group(1), text, markers)
        if page.name == "README.md" and page.parent == ROOT and text in README_COMMANDS:
            block.markers.setdefault("as", README_COMMANDS[text])
        out.append(block)
        i = end + 1
    return out


BLOCKS = [b for page in PAGES for b in parse(page)]


def _named(block: Block, name: str) -> Block:
    found = [b for b in BLOCKS if b.page == block.page and b.markers.get("name") == name]
    assert len(found) == 1, f"{block.id}: `after {name}` needs one block named {name} on its page, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------
# Running a block

_TAG = f"tfde-docs-{uuid.uuid4().hex[:8]}"


def _workdir(path: Path) -> Path:
    """A fresh working directory with configs/, its Redis tags this run's."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "configs", path / "configs")
    config = path / "configs" / "redis.json"
    data = json.loads(config.read_text())
    data.update(model_tag_runtime=_TAG, model_tag_import=f"{_TAG}-import")
    config.write_text(json.dumps(data))
    return path


def _delete_redis_keys():
    try:
        import redis

        client = redis.Redis(port=6379, socket_connect_timeout=1)
        for key in client.scan_iter(match=f"{_TAG}*", count=1000):
            client.delete(key)
    except Exception:  # no server: nothing was written there
        pass


def _env(python: str = sys.executable, **extra) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _check(proc, what: str) -> str:
    out = (proc.stdout or "") + (proc.stderr or "")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out[-5000:]}"
    return out


def _run(args, cwd: Path, env: dict, what: str, timeout: int = TIMEOUT_S) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return _check(proc, what)


def _argv(block: Block) -> list:
    words = block.markers.get("argv", "").split()
    if "{ops_library}" in words:
        from tfde import _native

        words = [str(_native.build()) if w == "{ops_library}" else w for w in words]
    return words


def run_python(block: Block, cwd: Path, python: str = sys.executable, **env) -> str:
    program = cwd / f"block_{block.line}.py"
    program.write_text(block.text)
    return _run([python, str(program), *_argv(block)], cwd, _env(python, **env), block.id)


def run_bash(block: Block, cwd: Path, text=None) -> str:
    return _run(["bash", "-euo", "pipefail", "-c", text or block.text], cwd, _env(), block.id)


def _quick(text: str) -> str:
    """Each `tfde train` command of `text` on QUICK_DEMO's data."""
    out = []
    for line in text.splitlines():
        command, hash_, comment = line.partition("  #")
        if re.search(r"\btfde train\b", command) and not command.rstrip().endswith("\\"):
            command = f"{command.rstrip()} {QUICK_DEMO}"
        out.append(command + (f"  #{comment}" if hash_ else ""))
    return "\n".join(out) + "\n"


def _needed(variable: str, what: str) -> str:
    path = os.environ.get(variable, "")
    if not path or not Path(path).exists():
        pytest.fail(f"${variable} does not name {what} ({path!r}); scripts/test.sh builds it and sets it")
    return path


def runner_install(block: Block, cwd: Path):
    """The README's first command.  The install is checked in pyproject.toml
    (the `cpu` extra, the `tfde` command), not repeated; the demo it starts
    runs, from the test environment, on QUICK_DEMO's data."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'(?m)^cpu = \["tensorflow-cpu', pyproject), "pyproject.toml has no `cpu` extra"
    assert re.search(r'(?m)^tfde = "', pyproject), "pyproject.toml has no `tfde` command"
    train = block.text.rsplit("&& ", 1)[-1].replace(".venv/bin/tfde", "tfde")
    out = run_bash(block, cwd, _quick(train))
    assert "held-out recall@100" in out and "examples/s" in out, out[-2000:]


def runner_self(block: Block, cwd: Path):
    """`bash scripts/test.sh` is the command that runs this test: checked,
    not run (bash -n; it runs pytest over tests/, which holds this file)."""
    script = block.text.split()[-1]
    _run(["bash", "-n", script], ROOT, _env(), f"bash -n {script}")
    assert "-m pytest" in (ROOT / script).read_text()
    assert 'testpaths = ["tests"]' in (ROOT / "pyproject.toml").read_text()


def runner_quick_demo(block: Block, cwd: Path):
    """Every `tfde train` of the block, on QUICK_DEMO's data."""
    run_bash(block, cwd, _quick(block.text))


def runner_loopback(block: Block, cwd: Path):
    """A multi-host launch, one `# on HOST:` section a machine: every
    section runs at once on this machine, each HOST:PORT a loopback port,
    each `tfde train` on QUICK_DEMO's data."""
    sections = re.split(r"(?m)^# on [\w.-]+:\n", block.text)[1:]
    assert len(sections) >= 2, f"{block.id}: no `# on HOST:` sections"
    hosts = sorted(set(re.findall(r"\b([a-z][\w-]*):(\d+)\b", block.text)))
    ports = dict(zip(hosts, free_ports(len(hosts))))
    procs = []
    try:
        for i, section in enumerate(sections):
            for (host, port), free in ports.items():
                section = section.replace(f"{host}:{port}", f"localhost:{free}")
            log = open(cwd / f"host{i}.log", "w")
            command = ["bash", "-euo", "pipefail", "-c", _quick(section)]
            proc = subprocess.Popen(command, cwd=cwd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
            procs.append((proc, log))
        for i, (proc, log) in enumerate(procs):
            proc.wait(timeout=TIMEOUT_S)
            log.close()
            assert proc.returncode == 0, f"host {i} failed:\n{(cwd / f'host{i}.log').read_text()[-4000:]}"
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert "held-out recall@100" in (cwd / "host0.log").read_text()


def runner_horovod(block: Block, cwd: Path):
    """A Horovod program, in the Horovod environment (TFDE_HOROVOD_PYTHON,
    set by scripts/test.sh), as a job of one worker; jobs of several:
    tests/horovod/."""
    python = _needed("TFDE_HOROVOD_PYTHON", "the Horovod environment's python")
    run_python(block, cwd, python, TF_USE_LEGACY_KERAS="1")


def runner_tfra(block: Block, cwd: Path):
    """A TFRA program, in the TFRA reference venv (TFRA_PYTHON, set by
    scripts/test.sh from benchmarks/setup-tfra.sh)."""
    python = _needed("TFRA_PYTHON", "the TFRA venv's python")
    run_python(block, cwd, python, TF_USE_LEGACY_KERAS="1")


# An entry: a path, then two spaces (one after a directory) and its description.
ENTRY = re.compile(r"^( *)([\w.-]+(?:/[\w.-]+)*/?)(?:(?:  +|(?<=/) )(.*))?$")
NAMED_FILE = re.compile(r"[\w./-]+\.(?:py|h|cc|sh|md|json)\b")


def runner_tree(block: Block, cwd: Path):
    """A tree of the repository (docs/layout.md): every entry exists where
    the indentation puts it, and every file its description names exists
    under the entry's top-level directory."""
    stack, top, missing = [], ROOT, []
    for line in block.text.splitlines():
        entry = ENTRY.match(line)
        rest = line
        if entry:
            indent, name, rest = len(entry.group(1)), entry.group(2), entry.group(3) or ""
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = (stack[-1][1] if stack else ROOT) / name
            if not path.exists():
                missing.append(str(path.relative_to(ROOT)))
            if not stack:
                top = path if path.is_dir() else ROOT
            if name.endswith("/"):
                stack.append((indent, path))
        for named in NAMED_FILE.findall(rest):
            if "/" in named:
                ok = (ROOT / named).exists()
            else:
                ok = any(top.rglob(named))
            if not ok:
                missing.append(f"{named} (named on the line {line.strip()!r})")
    assert not missing, f"{block.id}: the tree names paths that do not exist: {missing}"


RUNNERS = {
    "install": runner_install,
    "self": runner_self,
    "quick-demo": runner_quick_demo,
    "loopback": runner_loopback,
    "horovod": runner_horovod,
    "tfra": runner_tfra,
    "tree": runner_tree,
}


def _how(block: Block):
    """How `block` runs: ("covered-by", tests), ("runner", fn) or ("plain", lang); None: no way."""
    if "covered-by" in block.markers:
        return "covered-by", block.markers["covered-by"].split()
    if "as" in block.markers:
        return "runner", RUNNERS.get(block.markers["as"])
    if block.lang in ("python", "bash"):
        return "plain", block.lang
    return None


_RAN = {}  # Block.id of a named block -> the working directory it left behind


def _run_block(block: Block, cwd: Path):
    if "after" in block.markers:
        first = _named(block, block.markers["after"])
        if first.id in _RAN:  # it ran already in this session: start from what it left
            shutil.copytree(_RAN[first.id], cwd, dirs_exist_ok=True)
        else:
            _run_block(first, cwd)
    kind, how = _how(block)
    if kind == "runner":
        how(block, cwd)
    elif how == "python":
        run_python(block, cwd)
    else:
        run_bash(block, cwd)
    if "name" in block.markers:
        _RAN[block.id] = cwd


# ---------------------------------------------------------------------------
# The tests


def test_every_block_has_a_way_to_run():
    problems = []
    for block in BLOCKS:
        unknown = set(block.markers) - set(KINDS)
        if unknown:
            problems.append(f"{block.id}: unknown marker {sorted(unknown)} (known: {KINDS})")
        how = _how(block)
        if how is None:
            problems.append(f"{block.id}: a ```{block.lang} block with no way to run: give it a marker")
        elif how == ("runner", None):
            problems.append(f"{block.id}: unknown runner {block.markers['as']!r} (known: {sorted(RUNNERS)})")
        if "after" in block.markers:
            names = [b for b in BLOCKS if b.page == block.page and b.markers.get("name") == block.markers["after"]]
            if len(names) != 1:
                problems.append(f"{block.id}: `after {block.markers['after']}` names {len(names)} blocks")
    assert not problems, "\n".join(problems)
    assert len(BLOCKS) > 20, f"only {len(BLOCKS)} code blocks found"


def _defines_test(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(tree))


COVERED = [b for b in BLOCKS if "covered-by" in b.markers]


@pytest.mark.parametrize("block", COVERED, ids=[b.id for b in COVERED])
def test_a_covered_block_names_an_existing_test(block):
    for test in block.markers["covered-by"].split():
        file, _, name = test.partition("::")
        path = ROOT / file
        assert path.exists() and name, f"{block.id}: covered-by {test}: no such file (or no ::test)"
        assert _defines_test(path, name), f"{block.id}: covered-by {test}: {file} defines no {name}"


RUNNABLE = [b for b in BLOCKS if _how(b) is not None and _how(b)[0] != "covered-by" and _how(b) != ("runner", None)]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs(block, tmp_path):
    """Runs `block` as a user would: a fresh Python (sys.executable, or the
    runner's interpreter) or bash in a subprocess, in a fresh directory."""
    try:
        _run_block(block, _workdir(tmp_path / "work"))
    finally:
        _delete_redis_keys()


def test_readme_starts_with_its_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    opening = "".join(f"```bash\n{command}```\n" for command in README_COMMANDS)
    assert text.split("\n", 2)[2].startswith(opening), "README.md must open with its two commands, unchanged"
    assert len(text.splitlines()) < 200, "the README is the front door: the rest belongs in docs/"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, mailto:
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {path.name})")
    assert not broken, "\n".join(broken)
